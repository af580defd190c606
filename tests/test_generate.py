"""Sampling: top-p keeps exactly the nucleus, temperature 0 is argmax, generation is seeded, the KV-cache
path gives the reference's ids, streamed text never splits a character."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.__main__ import main
from tinylm.checkpoint import load_model
from tinylm.config import GenerateConfig
from tinylm.generate import (
    generate,
    generate_reference,
    nucleus,
    sample,
    sample_next,
    stream_generate,
    stream_text,
)
from tinylm.model import Transformer
from tinylm.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def nucleus_by_loop(probs: list[float], top_p: float) -> list[int]:
    """Reference: walk all tokens from most to least likely (ties: lower id first) until the kept
    mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return kept


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.001, 1.0), min_size=2, max_size=30, unique=True),
    st.floats(0.05, 0.999),
)
def test_top_p_keeps_the_nucleus(weights, top_p):
    probs = torch.tensor(weights, dtype=torch.float64)
    probs /= probs.sum()
    ids, kept = nucleus(probs, top_p)
    assert ids.tolist() == nucleus_by_loop(probs.tolist(), top_p)
    assert torch.equal(kept, probs[ids])  # their own probabilities, most likely first


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0, 30.0])
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_top_p_over_a_large_vocabulary_with_ties(temperature, top_p):
    """Peaked distributions stay inside the first candidates, flat ones do not; both match the loop."""
    g = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(10_000, generator=g, dtype=torch.float64).mul(4).round()  # many equal logits
    probs = torch.softmax(logits / temperature, dim=-1)
    ids, kept = nucleus(probs, top_p)
    assert ids.tolist() == nucleus_by_loop(probs.tolist(), top_p)
    assert torch.equal(kept, probs[ids])


def test_top_p_one_is_everything_and_tiny_top_p_is_argmax():
    probs = torch.softmax(torch.randn(500, generator=torch.Generator().manual_seed(0)), dim=-1)
    ids, kept = nucleus(probs, 1.0)
    assert torch.equal(ids, torch.arange(500)) and torch.equal(kept, probs)
    ids, kept = nucleus(probs, 1e-9)
    assert ids.tolist() == [int(probs.argmax())]


def test_sampling_with_top_p_follows_the_renormalized_nucleus():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 1.5])
    probs = torch.softmax(logits.double(), -1)
    keep = nucleus_by_loop(probs.tolist(), 0.8)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[keep] = probs[keep] / probs[keep].sum()
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_next(logits, 1.0, 0.8, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    assert torch.allclose(freq, expected, atol=0.03)


def test_temperature_zero_is_greedy_and_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    assert sample_next(logits, 0.0, 1.0, None) == 1
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_next(logits, 1.0, 1.0, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.03)


def test_generate_is_seeded_crops_context_and_stops_at_eos():
    torch.manual_seed(0)
    model = Transformer(vocab_size=40, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)

    def run(seed):
        return generate(model, [1, 2, 3], 30, 8, 1.0, 1.0, None, torch.Generator().manual_seed(seed))

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c and len(a) == 30  # 33 ids in all: the context was cropped to 8
    eos = a[4]
    stopped = generate(model, [1, 2, 3], 30, 8, 1.0, 1.0, eos, torch.Generator().manual_seed(0))
    assert stopped == a[: a.index(eos) + 1]


# ---------------------------------------------------------------- the KV-cache path


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 0.8), (1.5, 1.0)])
@pytest.mark.parametrize("prompt_len", [1, 5, 20])
def test_cached_generation_gives_the_reference_ids(temperature, top_p, prompt_len):
    """Same seed, same ids, through prefill, single steps and past context_length (and a prompt longer
    than the context)."""
    torch.manual_seed(0)
    model = Transformer(
        vocab_size=40, context_length=12, d_model=16, num_layers=2, num_heads=2, d_ff=32, rope_theta=100.0
    )
    prompt = torch.randint(40, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    reference = generate_reference(
        model, prompt, 30, 12, temperature, top_p, None, torch.Generator().manual_seed(3)
    )
    cached = generate(model, prompt, 30, 12, temperature, top_p, None, torch.Generator().manual_seed(3))
    assert cached == reference and len(cached) == 30  # prompt + 30 > 12: crossed the context


def test_cached_generation_of_a_trained_model_and_eos(tiny_lm):
    model, _ = load_model(tiny_lm["checkpoints"])
    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    prompt = tokenizer.encode("the king said 日本語 ")
    for eos, seed in ((None, 0), (tokenizer.special_ids["<|endoftext|>"], 15)):
        args = (model, prompt, 90, model.context_length, 0.9, 0.95, eos)
        reference = generate_reference(*args, torch.Generator().manual_seed(seed))
        assert list(stream_generate(*args, torch.Generator().manual_seed(seed))) == reference
        assert len(set(reference)) > 10  # the model does more than repeat itself
    assert reference[-1] == eos and len(prompt) + len(reference) > 64  # stopped at eos, past the context


# ---------------------------------------------------------------- streaming text


def byte_tokenizer() -> Tokenizer:
    """Every byte its own token, no merges: each character of more than one byte spans tokens."""
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


def test_stream_text_yields_whole_characters_as_soon_as_they_are_complete():
    tokenizer = byte_tokenizer()
    text = "naïve 日本語 🙂👍🏽!"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one id per byte
    seen: list[tuple[int, str]] = []  # (number of ids consumed, text yielded then)
    consumed = 0

    def counting():
        nonlocal consumed
        for i in ids:
            consumed += 1
            yield i

    for piece in stream_text(tokenizer, counting()):
        seen.append((consumed, piece))
    # one piece per character, each yielded with the id holding its last byte
    assert [piece for _, piece in seen] == list(text)
    ends = [len(text[: k + 1].encode("utf-8")) for k in range(len(text))]
    assert [n for n, _ in seen] == ends


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 256), max_size=40))
def test_stream_text_joined_is_decode_even_for_invalid_utf8(ids):
    tokenizer = byte_tokenizer()
    assert "".join(stream_text(tokenizer, ids)) == tokenizer.decode(ids)


# ---------------------------------------------------------------- `sample`


class RecordingStream(io.StringIO):
    """A text stream that records each write and whether a flush followed it."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []
        self.flushed: list[bool] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        self.flushed.append(False)
        return super().write(text)

    def flush(self) -> None:
        if self.flushed:
            self.flushed[-1] = True


def partial_utf8(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_sample_streams_whole_characters_and_draws_the_generate_ids(tiny_lm):
    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    model, _ = load_model(tiny_lm["checkpoints"])
    eos = tokenizer.special_ids["<|endoftext|>"]
    gen = GenerateConfig(max_new_tokens=60, temperature=1.0, top_p=1.0, seed=0, threads=1)
    prompt = "the king 🙂 "
    out = RecordingStream()
    ids = sample(gen, tiny_lm["checkpoints"], tiny_lm["tokenizer"], prompt, out)
    assert ids == generate(
        model, tokenizer.encode(prompt), 60, 64, 1.0, 1.0, eos, torch.Generator().manual_seed(0)
    )
    text_ids = [i for i in ids if i != eos]
    # Characters split over tokens were drawn, and still came out whole: the output is the one-shot
    # decode (no U+FFFD), written piece by piece as stream_text yields it, each piece flushed.
    assert sum(partial_utf8(tokenizer.vocab[i]) for i in text_ids) >= 3
    assert "\ufffd" not in out.getvalue() and out.getvalue() == tokenizer.decode(text_ids)
    assert out.writes == list(stream_text(tokenizer, text_ids)) and all(out.flushed)
    assert len(out.writes) > 10


def test_sample_cli_prints_the_completion(tiny_lm):
    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    model, _ = load_model(tiny_lm["checkpoints"])
    eos = tokenizer.special_ids["<|endoftext|>"]
    common = ["--tokenizer", tiny_lm["tokenizer"], "--checkpoint-dir", tiny_lm["checkpoints"]]
    proc = tinylm(
        "sample",
        "--prompt",
        "привет мир",
        "--max-new-tokens",
        40,
        "--temperature",
        0.8,
        "--top-p",
        0.9,
        "--seed",
        7,
        *common,
    )
    assert proc.returncode == 0, proc.stderr
    ids = generate(
        model, tokenizer.encode("привет мир"), 40, 64, 0.8, 0.9, eos, torch.Generator().manual_seed(7)
    )
    assert proc.stdout == tokenizer.decode([i for i in ids if i != eos]) + "\n"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--top-p", "0"], "--top-p: 0.0 is out of range"),
        (["--seed", "-1"], "--seed: -1 is out of range"),
        (["--step", "7"], "--step 7: {checkpoints} holds steps "),
        (["--prompt", ""], "--prompt: the prompt is empty"),
    ],
)
def test_sample_cli_refuses_bad_options(tiny_lm, capsys, option, message):
    argv = [
        "sample",
        "--prompt",
        "x",
        *option,
        "--tokenizer",
        str(tiny_lm["tokenizer"]),
        "--checkpoint-dir",
        str(tiny_lm["checkpoints"]),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "tinylm sample: error: " in err and message.format(checkpoints=tiny_lm["checkpoints"]) in err, err
    assert "[sample] step" not in err  # no line about a step that is not read


def tinylm(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", *map(str, args)], capture_output=True, cwd=ROOT, env=env, timeout=300
    )
    # Decoded by hand: text=True would turn a generated "\r\n" into "\n".
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def test_an_empty_configured_prompt_is_named(tiny_lm, tmp_path):
    from tinylm.generate import write_samples

    gen = GenerateConfig(prompts=["the king", ""], max_new_tokens=3, threads=1)
    with pytest.raises(ValueError, match=r"generate.prompts\[1\]: the prompt is empty"):
        write_samples(gen, tiny_lm["checkpoints"], tiny_lm["tokenizer"], tmp_path / "samples.txt")
    assert not (tmp_path / "samples.txt").exists()


def test_a_prompt_longer_than_the_context_is_said_in_one_line(tiny_lm, capsys):
    from tinylm.__main__ import main

    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    model, _ = load_model(tiny_lm["checkpoints"])
    common = ["--tokenizer", str(tiny_lm["tokenizer"]), "--checkpoint-dir", str(tiny_lm["checkpoints"])]
    long_prompt = "the king of the realm " * 40
    num_ids = len(tokenizer.encode(long_prompt))
    assert num_ids > model.context_length
    assert main(["sample", "--prompt", long_prompt, "--max-new-tokens", "3", *common]) == 0
    err = capsys.readouterr().err
    assert (
        f"[sample] --prompt: {num_ids} tokens, longer than the model's context of {model.context_length}: "
        f"the model sees its last {model.context_length} tokens"
    ) in err
    assert main(["sample", "--prompt", "the king", "--max-new-tokens", "3", *common]) == 0
    assert "longer than the model's context" not in capsys.readouterr().err


def test_generate_quotes_the_eval_csv_beside_its_checkpoints_by_default(tiny_lm, tmp_path, capsys):
    """Without --eval, the samples' header quotes the exact loss from the eval.csv the evaluate stage
    wrote beside the checkpoint folder; without one (or an older one), one line says why not."""
    import shutil

    import numpy as np

    from tinylm.__main__ import main
    from tinylm.eval_table import read_eval

    folder = tmp_path / "run" / "checkpoints"
    shutil.copytree(tiny_lm["checkpoints"], folder)
    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    np.save(tmp_path / "valid.npy", np.array(tokenizer.encode(tiny_lm["text"][:2000]), dtype=np.uint16))
    config = tmp_path / "gen.yaml"  # stage keys only: no model to compare with the folder's
    config.write_text("generate:\n  max_new_tokens: 3\n  threads: 1\nevaluate:\n  threads: 1\n")
    common = [
        "--tokenizer",
        str(tiny_lm["tokenizer"]),
        "--checkpoint-dir",
        str(folder),
        "--config",
        str(config),
    ]
    samples = tmp_path / "samples.txt"
    assert main(["generate", *common, "--output", str(samples)]) == 0
    assert (
        f"[generate] no exact-loss line: {folder.parent / 'eval.csv'} does not exist"
        in capsys.readouterr().err
    )
    assert "exact validation loss" not in samples.read_text()

    evaluated = folder.parent / "eval.csv"
    valid = str(tmp_path / "valid.npy")
    assert main(["evaluate", *common, "--valid-tokens", valid, "--output", str(evaluated)]) == 0
    assert main(["generate", *common, "--output", str(samples)]) == 0
    assert "no exact-loss line" not in capsys.readouterr().err
    loss = read_eval(evaluated)["val_loss"].iloc[-1]
    assert f"# exact validation loss {loss:.4f} nats per token" in samples.read_text()

    checkpoint = folder / f"step_{tiny_lm['step']}.pt"
    later = evaluated.stat().st_mtime + 10
    os.utime(checkpoint, (later, later))  # trained again after the evaluation
    assert main(["generate", *common, "--output", str(samples)]) == 0
    assert f"no exact-loss line: {evaluated} is older than {checkpoint}" in capsys.readouterr().err
    assert "exact validation loss" not in samples.read_text()
