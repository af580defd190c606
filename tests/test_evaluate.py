"""The evaluation against brute force: every predicted token exactly once, the short last window,
loss, count, bytes and bits per byte per position; max_tokens; the cache of scored checkpoints;
eval.csv a plain CSV with its notes beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from tinylm import evaluate as evaluation
from tinylm.checkpoint import Manifest
from tinylm.checkpoint import published as checkpoint_published
from tinylm.eval_table import notes_path_for, read_eval, write_eval
from tinylm.evaluate import evaluate_checkpoints, score_tokens
from tinylm.model import Transformer
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish as publish_run
from tinylm.tokenizer import Tokenizer

EOT = "<|endoftext|>"
CONFIG = dict(
    vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24, rope_theta=10000.0
)


def tiny_tokenizer() -> Tokenizer:
    """256 bytes, <|endoftext|> (id 256) and 43 two-letter merges: 300 tokens of 1, 0 and 2 bytes."""
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = EOT.encode()
    letters = [bytes([c]) for c in b"abcdefg"]
    merges = [(a, b) for a in letters for b in letters][:43]
    for a, b in merges:
        vocab[len(vocab)] = a + b
    return Tokenizer(vocab, merges, [EOT])


def valid_tokens(n: int, seed: int = 0) -> np.ndarray:
    """Random ids of the tiny vocabulary with <|endoftext|> every few tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 300, n).astype(np.uint16)
    tokens[rng.random(n) < 0.1] = 256
    return tokens


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**CONFIG).eval()


def brute_force(model, tokens: np.ndarray, context_length: int, special: set[int]) -> list[tuple[int, float]]:
    """(target id, loss) of every predicted position, each from its own forward pass over exactly the
    context its window gives (window of i: tokens from ((i - 1) // T) * T up to i - 1), with
    PyTorch's cross-entropy."""
    out = []
    with torch.no_grad():
        for i in range(1, len(tokens)):
            start = (i - 1) // context_length * context_length
            context = torch.tensor(tokens[start:i], dtype=torch.int64)[None]
            target = torch.tensor([int(tokens[i])])
            out.append((int(tokens[i]), F.cross_entropy(model(context)[0, -1:], target).item()))
    return out


class Recorder(torch.nn.Module):
    """A stand-in model: records every input batch and returns logits that are all 0."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.inputs = vocab_size, []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.inputs.append(ids.clone())
        return torch.zeros(*ids.shape, self.vocab_size)


@pytest.mark.parametrize("n", [2, 9, 17, 75])
@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_every_token_after_the_first_is_predicted_exactly_once(n, batch_size):
    # With tokens 0, 1, ..., n-1 an input id names its position, so the targets of each window
    # (position + 1 of each input) can be read off the recorded inputs.
    tokens = np.arange(n, dtype=np.uint16)
    model = Recorder(n + 1)
    scores = score_tokens(model, tokens, 8, batch_size, [], "cpu")
    predicted = sorted(int(t) + 1 for batch in model.inputs for t in batch.flatten())
    assert predicted == list(range(1, n))
    assert scores.count == n - 1
    assert all(batch.shape[1] == 8 for batch in model.inputs[:-1])  # only the last window is short
    assert model.inputs[-1].shape[1] == (n - 2) % 8 + 1
    assert math.isclose(
        scores.loss_sum, (n - 1) * math.log(n + 1), rel_tol=1e-6
    )  # uniform: log V each (float32)


@pytest.mark.parametrize("batch_size", [1, 4, 100])
def test_scores_match_a_brute_force_per_position_sum(batch_size):
    tokens = valid_tokens(75)  # 74 predictions: 9 windows of 8, then a short one of 2
    model = tiny_model()
    expected = brute_force(model, tokens, 8, {256})
    scores = score_tokens(model, tokens, 8, batch_size, [256], "cpu")
    assert scores.count == len(expected) == 74
    assert math.isclose(scores.loss_sum, sum(loss for _, loss in expected), rel_tol=1e-5)
    text = [loss for target, loss in expected if target != 256]
    assert len(text) < len(expected)  # the sample does predict <|endoftext|> somewhere
    assert math.isclose(scores.text_loss_sum, sum(text), rel_tol=1e-5)


def publish(folder: Path, steps, seed: int = 0, dtype: str | None = None) -> Path:
    """Published checkpoints of tiny models (one per step, different weights), as training writes them."""
    for step in steps:
        model = tiny_model(seed + step)
        payload = {
            "model": model.state_dict(),
            "optimizer": {},
            "iteration": step,
            "tokens_seen": step * 64,
            "model_config": CONFIG,
            "rng": [],
        }
        manifest = Manifest(world_size=1, tokens_seen=step * 64)
        if dtype is not None:
            manifest.config = {"train": {"dtype": dtype}}
        state_lib.commit(folder / "state", step, payload, manifest, keep=10)
    publish_run(folder / "state", folder / "ckpt")
    return folder / "ckpt"


def write_tokens(path: Path, tokens: np.ndarray) -> Path:
    np.save(path, tokens)
    return path


def test_evaluation_rows_match_brute_force(tmp_path):
    tokens = valid_tokens(75, seed=1)
    ckpt = publish(tmp_path, [3, 7])
    tokenizer = tiny_tokenizer()
    table = evaluate_checkpoints(ckpt, write_tokens(tmp_path / "valid.npy", tokens), tokenizer, batch_size=4)
    assert list(table.columns) == evaluation.COLUMNS and list(table["step"]) == [3, 7]

    values, counts = np.unique(tokens, return_counts=True)
    p = counts / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    # bytes of the predicted tokens: 1 per byte token, 2 per merge, 0 for <|endoftext|>
    text_bytes = sum(len(tokenizer.vocab[int(t)]) for t in tokens[1:] if t != 256)
    assert text_bytes == sum(1 if t < 256 else 2 for t in tokens[1:] if t != 256)
    for row in table.itertuples():
        per_position = brute_force(tiny_model(row.step), tokens, 8, {256})
        loss = sum(loss for _, loss in per_position) / len(per_position)
        text_bits = sum(loss for target, loss in per_position if target != 256) / math.log(2)
        assert math.isclose(row.val_loss, loss, rel_tol=1e-5)
        assert math.isclose(row.val_ppl, math.exp(loss), rel_tol=1e-5)
        assert math.isclose(row.bits_per_byte, text_bits / text_bytes, rel_tol=1e-5)
        assert math.isclose(row.unigram_entropy, entropy, rel_tol=1e-12)
        assert math.isclose(row.gap_to_unigram, entropy - loss, rel_tol=1e-5)
        assert row.tokens_seen == row.step * 64


def test_checkpoints_scored_in_several_processes_give_the_same_table(tmp_path, monkeypatch):
    """evaluate.processes shares the checkpoints out over spawned processes; each is scored as alone,
    so the table is the same to the last bit, in step order, and matches brute force."""
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(90, seed=3))
    ckpt = publish(tmp_path, [2, 4, 6])
    tokenizer = tiny_tokenizer()
    used = []  # the processes each evaluation scored its checkpoints with
    score_all = evaluation._score_all
    monkeypatch.setattr(evaluation, "_score_all", lambda jobs, n: used.append(n) or score_all(jobs, n))
    alone = evaluate_checkpoints(ckpt, tokens, tokenizer, batch_size=4, processes=2)
    assert used == [1]  # a tiny model scores faster than a process starts: in this process
    monkeypatch.setattr(evaluation, "SPAWN_FLOPS", 0.0)  # spawn even for these tiny models
    shared = evaluate_checkpoints(ckpt, tokens, tokenizer, batch_size=4, processes=2)
    assert used == [1, 2]
    pd.testing.assert_frame_equal(alone, shared, check_exact=True)
    assert list(shared["step"]) == [2, 4, 6]
    per_position = brute_force(tiny_model(6), np.load(tokens), 8, {256})
    assert math.isclose(
        shared["val_loss"].iloc[-1], sum(p for _, p in per_position) / len(per_position), rel_tol=1e-5
    )


def test_max_tokens_scores_a_fixed_prefix(tmp_path):
    tokens = valid_tokens(200, seed=2)
    ckpt = publish(tmp_path, [1])
    tokenizer = tiny_tokenizer()
    prefix = evaluate_checkpoints(ckpt, write_tokens(tmp_path / "all.npy", tokens), tokenizer, max_tokens=61)
    cut = evaluate_checkpoints(ckpt, write_tokens(tmp_path / "cut.npy", tokens[:61]), tokenizer)
    pd.testing.assert_frame_equal(prefix, cut)
    whole = evaluate_checkpoints(ckpt, tmp_path / "all.npy", tokenizer, max_tokens=10**9)
    assert whole["val_loss"].iloc[0] != prefix["val_loss"].iloc[0]


def test_scored_checkpoints_are_read_from_the_cache(tmp_path, monkeypatch):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(90, seed=3))
    tokenizer, cache = tiny_tokenizer(), tmp_path / "eval_cache"
    scored = []
    real_score = evaluation.score_tokens

    def counting_score(model, *args, **kwargs):
        scored.append(model)
        return real_score(model, *args, **kwargs)

    monkeypatch.setattr(evaluation, "score_tokens", counting_score)
    ckpt = publish(tmp_path, [2, 4])
    first = evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=cache)
    assert len(scored) == 2 and len(list(cache.glob("*.json"))) == 2

    ckpt = publish(tmp_path, [2, 4, 6])  # one more checkpoint: only it is scored
    more = evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=cache)
    assert len(scored) == 3
    pd.testing.assert_frame_equal(more.iloc[:2], first)
    fresh = evaluate_checkpoints(ckpt, tokens, tokenizer)  # no cache: everything scored again
    pd.testing.assert_frame_equal(fresh, more)
    assert len(scored) == 6

    # Other settings or other tokens are other entries; a damaged entry is scored again.
    evaluate_checkpoints(ckpt, tokens, tokenizer, batch_size=5, cache_dir=cache)
    evaluate_checkpoints(ckpt, tokens, tokenizer, max_tokens=50, cache_dir=cache)
    assert len(scored) == 12
    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    again = evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=cache)
    assert len(scored) == 15
    pd.testing.assert_frame_equal(again, more)
    rewritten = [p for p in cache.glob("*.json") if p.read_text() != "{not json"]
    assert len(rewritten) == 3 and all(json.loads(p.read_text())["key"]["device"] == "cpu" for p in rewritten)
    assert not [p for p in cache.iterdir() if p.suffix != ".json"]  # no temporary files left


def test_a_checkpoint_with_other_weights_is_scored_again(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(60, seed=4))
    tokenizer, cache = tiny_tokenizer(), tmp_path / "eval_cache"
    before = evaluate_checkpoints(publish(tmp_path / "a", [5], seed=0), tokens, tokenizer, cache_dir=cache)
    after = evaluate_checkpoints(publish(tmp_path / "b", [5], seed=100), tokens, tokenizer, cache_dir=cache)
    assert before["val_loss"].iloc[0] != after["val_loss"].iloc[0]  # same step, other weights
    assert len(list(cache.glob("*.json"))) == 2


def test_the_cpu_evaluates_in_float32_whatever_the_training_dtype(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(60, seed=5))
    tokenizer, cache = tiny_tokenizer(), tmp_path / "eval_cache"
    bf16 = evaluate_checkpoints(
        publish(tmp_path / "a", [1], dtype="bfloat16"), tokens, tokenizer, cache_dir=cache
    )
    fp32 = evaluate_checkpoints(publish(tmp_path / "b", [1]), tokens, tokenizer)
    pd.testing.assert_frame_equal(bf16, fp32)
    (entry,) = cache.glob("*.json")
    assert json.loads(entry.read_text())["key"]["dtype"] == "float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_evaluates_in_the_training_dtype(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(3000, seed=6))
    tokenizer = tiny_tokenizer()
    ckpt = publish(tmp_path, [1], dtype="bfloat16")
    cpu = evaluate_checkpoints(ckpt, tokens, tokenizer)
    cuda = evaluate_checkpoints(ckpt, tokens, tokenizer, device="cuda", cache_dir=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").glob("*.json")
    assert json.loads(entry.read_text())["key"]["dtype"] == "bfloat16"
    assert math.isclose(cuda["val_loss"].iloc[0], cpu["val_loss"].iloc[0], rel_tol=2e-2)


def test_only_special_tokens_is_refused(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", np.full(20, 256, dtype=np.uint16))
    with pytest.raises(ValueError, match="only special tokens"):
        evaluate_checkpoints(publish(tmp_path, [1]), tokens, tiny_tokenizer())


def test_eval_csv_is_plain_csv_and_its_notes_are_beside_it(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(60, seed=7))
    table = evaluate_checkpoints(publish(tmp_path, [1, 2]), tokens, tiny_tokenizer())
    write_eval(table, tmp_path / "eval.csv", None, tmp_path / "eval_columns.md")
    lines = (tmp_path / "eval.csv").read_text().splitlines()
    assert lines[0] == ",".join(evaluation.COLUMNS) and len(lines) == 3  # header, then one row per checkpoint
    back = pd.read_csv(tmp_path / "eval.csv")  # as it is: no comment= or skiprows= needed
    assert list(back.columns) == evaluation.COLUMNS and list(back["step"]) == [1, 2]
    assert np.allclose(back["val_loss"], table["val_loss"], atol=1e-6)
    pd.testing.assert_frame_equal(read_eval(tmp_path / "eval.csv"), back)
    notes = (tmp_path / "eval_columns.md").read_text()
    for column in evaluation.COLUMNS:
        assert f"- {column}: " in notes, column
    assert "0 bytes" in notes and EOT in notes and "59 predicted exactly once" in notes
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary files


def test_notes_and_plot_are_written_only_when_asked(tmp_path):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(60, seed=7))
    table = evaluate_checkpoints(publish(tmp_path, [1]), tokens, tiny_tokenizer())
    write_eval(table, tmp_path / "out" / "eval.csv", None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.csv"]
    assert notes_path_for(tmp_path / "out" / "eval.csv") == tmp_path / "out" / "eval_columns.md"


def test_a_rerun_with_nothing_new_reads_no_checkpoint(tmp_path, monkeypatch):
    tokens = write_tokens(tmp_path / "valid.npy", valid_tokens(60, seed=6))
    tokenizer, cache = tiny_tokenizer(), tmp_path / "eval_cache"
    ckpt = publish(tmp_path, [1, 2])
    first = evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=cache)

    def no_loading(*args, **kwargs):
        raise AssertionError("a checkpoint was read although its scores are cached")

    monkeypatch.setattr(evaluation, "load_model", no_loading)
    monkeypatch.setattr(checkpoint_published, "CheckpointReader", no_loading)
    pd.testing.assert_frame_equal(evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=cache), first)
    with pytest.raises(AssertionError, match="was read"):  # the patch does guard the loading path
        evaluate_checkpoints(ckpt, tokens, tokenizer, cache_dir=tmp_path / "empty_cache")


LARGE = dict(
    vocab_size=32000,
    context_length=64,
    d_model=768,
    num_layers=8,
    num_heads=12,
    d_ff=2048,
    rope_theta=10000.0,
)


@pytest.mark.slow
def test_evaluate_reads_the_weights_only_of_a_100m_parameter_checkpoint(tmp_path):
    """`python -m tinylm evaluate` on two checkpoints of a 106M-parameter model (the newest with its
    AdamW moments, 3x the weights) peaks under the weights' size + 600 MB; a rerun with nothing new
    is served by the cache in under 5 s (the evaluation itself, without the interpreter's start)."""
    import subprocess
    import sys
    import time

    torch.manual_seed(0)
    model = Transformer(**LARGE)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert sum(p.numel() for p in model.parameters()) >= 100e6
    for step in (1, 2):
        state = model.state_dict()
        moments = {  # the newest checkpoint only, as training's state folder keeps them
            i: {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for i, p in enumerate(model.parameters())
            if step == 2
        }
        payload = {
            "model": state,
            "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]},
            "iteration": step,
            "model_config": LARGE,
        }
        state_lib.commit(
            tmp_path / "state", step, payload, Manifest(world_size=1, tokens_seen=step * 64), keep=10
        )
        del moments, payload
    publish_run(tmp_path / "state", tmp_path / "ckpt")
    del model, state

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = EOT.encode()
    merges = [(bytes([a]), bytes([b])) for a in range(256) for b in range(256)][: 32000 - 257]
    for a, b in merges:
        vocab[len(vocab)] = a + b
    Tokenizer(vocab, merges, [EOT]).save(tmp_path / "tokenizer.json")
    tokens = np.random.default_rng(0).integers(0, 32000, 200).astype(np.uint16)
    write_tokens(tmp_path / "valid.npy", tokens)
    (tmp_path / "config.yaml").write_text("evaluate:\n  batch_size: 2\n  threads: 1\n")
    arguments = [
        "evaluate",
        "--config",
        str(tmp_path / "config.yaml"),
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--valid-tokens",
        str(tmp_path / "valid.npy"),
        "--output",
        str(tmp_path / "eval.csv"),
        "--plot",
        str(tmp_path / "eval.png"),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    # The CLI, then the process's own peak resident set (VmHWM: ru_maxrss would count this large
    # pytest process, from which the child was forked).
    script = (
        f"import sys; from tinylm.__main__ import main; code = main({arguments!r})\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0], file=sys.stderr)\n"
        "sys.exit(code)"
    )

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak_mib = int(done.stderr.rsplit("VmHWM:", 1)[1].split()[0]) / 1024
    assert peak_mib < weights_mb + 600, f"peak RSS {peak_mib:.0f} MiB for {weights_mb:.0f} MiB of weights"
    first = read_eval(tmp_path / "eval.csv")
    assert len(first) == 2
    began = time.perf_counter()
    again = evaluate_checkpoints(
        tmp_path / "ckpt",
        tmp_path / "valid.npy",
        Tokenizer.load(tmp_path / "tokenizer.json"),
        batch_size=2,
        cache_dir=tmp_path / "cache",
    )
    seconds = time.perf_counter() - began
    assert seconds < 5, f"a rerun with nothing new took {seconds:.1f} s"
    assert list(again["val_loss"].round(6)) == list(first["val_loss"].round(6))


def test_an_eval_table_without_its_columns_is_refused_naming_them(tmp_path):
    (tmp_path / "eval.csv").write_text("step,val_loss\n1,2.0\n")
    with pytest.raises(
        ValueError, match=r"eval.csv: lacks the columns \['tokens_seen', 'val_ppl', 'bits_per_byte'"
    ):
        read_eval(tmp_path / "eval.csv")
