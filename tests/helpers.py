"""What the tests share: tiny configs and models, checkpoint checks, pretrain runs, and the toy
model and batches of the parallel tests.

Rank functions live in modules of their own (tests/_ddp_ranks.py, _sharded_ranks.py,
_state_ranks.py, _launch_ranks.py, _muon_ranks.py), not in the test files, because mp.spawn pickles
a function by its module path and the spawned process imports it from there. Each rank function
asserts inside the rank (a failed assertion fails the job, so `launch` raises RankFailedError with
the assertion's traceback) and then writes a small result file that the test reads, so a test also
fails if the checks never ran.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from _faults import fault_env
from torch import nn

from tinylm.checkpoint import FORMAT, CheckpointReader, Manifest, map_tensors, read_manifest
from tinylm.io import sha256_file
from tinylm.model import Transformer
from tinylm.optim import AdamW
from tinylm.pretrain.publish import publish
from tinylm.pretrain.state import commit
from tinylm.pretrain.steps import CHECKPOINT, committed_steps, step_dir
from tinylm.tokenizer import Tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]


def assert_same(a, b, where=""):
    """Nested dicts, lists and tuples of tensors and plain values are equal: every tensor of the
    same dtype and torch.equal, every key and length the same. `where` names the entry that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# ------------------------------------------------------------------------------------------------
# Checkpoint files


def whole_file_entry(path: Path) -> dict:
    """A manifest entry for `path` that lists no tensors: one byte range, the whole file."""
    size = path.stat().st_size
    return {"bytes": size, "records": [], "other": [[0, size, sha256_file(path)]]}


def manifest_for(path: Path, **keys) -> dict:
    """A committed manifest (this format) describing the single file `path`."""
    return {"format": FORMAT, **keys, "files": {path.name: whole_file_entry(path)}}


def read_checked(path: Path) -> tuple[dict, Manifest]:
    """(payload, manifest) of a committed file, every tensor read through CheckpointReader.

    The manifest is `step_N.json` beside a published `step_N.pt`, else manifest.json in its folder.
    """
    path = Path(path)
    manifest_path = (
        path.parent / "manifest.json"
        if path.name in ("checkpoint.pt", "weights.pt")
        else path.with_suffix(".json")
    )
    manifest = read_manifest(manifest_path)
    return read_all(path, manifest.files[path.name]), manifest


def read_all(path: Path, entry: dict) -> dict:
    """Every tensor of the file `path`, each read and checked against its manifest `entry`."""
    with CheckpointReader(path, entry) as reader:
        return map_tensors(reader.structure, lambda _, meta: reader.read(meta))


SMALL_MODEL = dict(vocab_size=40, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)


def small_checkpoint(step: int) -> dict:
    """A real full checkpoint: a small model after `step` AdamW updates, with two ranks' RNG states."""
    torch.manual_seed(0)
    model = Transformer(**SMALL_MODEL)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(step)
    for _ in range(step // 10):
        tokens = torch.randint(0, SMALL_MODEL["vocab_size"], (2, 9), generator=g)
        model(tokens[:, :-1]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iteration": step,
        "tokens_seen": 16 * step,
        "model_config": SMALL_MODEL,
        "rng": [{"torch": torch.get_rng_state(), "python": [3, [1, 2], None]}, {"torch": torch.zeros(4)}],
    }


IDENTITY = Manifest(  # a run identity for commit()
    world_size=2,
    threads_per_rank=1,
    seed=0,
    structural_hash="abc",
    tokenizer_sha256="t" * 64,
    config={"train": {"max_iters": 10, "lr_max": 0.1}},
)


# ------------------------------------------------------------------------------------------------
# Pretrain runs on the `tiny_data` fixture (see conftest.py)


def write_tiny_config(path: Path, **sections: dict) -> Path:
    """The shipped config shrunk for `tiny_data` (vocab 300, context 16, 12 steps); `sections`
    override keys."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["tokenizer"]["vocab_size"] = 300
    cfg["model"].update(context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    cfg["train"].update(
        batch_size=8,
        max_iters=12,
        warmup_iters=2,
        lr_max=1e-2,
        lr_min=1e-3,
        log_interval=1,
        val_interval=6,
        val_batches=2,
        checkpoint_interval=4,
        timeout_s=30.0,
        weight_decay=0.1,
        dtype="float32",
    )  # the tests compare float32 runs to 1e-4 and float64 ones to 1e-10
    cfg["generate"].update(max_new_tokens=5)
    for section, values in sections.items():
        cfg[section].update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


def pretrain(
    data: dict,
    config: Path,
    state_dir: Path,
    fault: str | None = None,
    checkpoint_dir: Path | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`python -m tinylm pretrain` on `data`, outside torchrun; checkpoints beside the state folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    checkpoint_dir = checkpoint_dir or state_dir.parent / (state_dir.name + "_ckpt")
    command = [
        *(sys.executable, "-m", "tinylm", "pretrain", "--config", str(config)),
        *("--tokenizer", str(data["tokenizer"]), "--train-tokens", str(data["train"])),
        *("--valid-tokens", str(data["valid"]), "--state-dir", str(state_dir)),
        *("--checkpoint-dir", str(checkpoint_dir)),
        *("--tensorboard-dir", str(state_dir.parent / (state_dir.name + "_tb")), *extra),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, env=fault_env(env, fault), cwd=ROOT, timeout=timeout
    )


def pretrain_ok(data: dict, config: Path, state_dir: Path, fault: str | None = None) -> str:
    proc = pretrain(data, config, state_dir, fault)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


LAYOUTS = [(1, 1), (2, 1), (2, 2), (1, 4)]  # (world_size, grad_accum_steps) at batch_size 8


def train_float64_layouts(
    data: dict, folder: Path, layouts=LAYOUTS, model: dict | None = None, train: dict | None = None
) -> list[dict]:
    """The final checkpoint of the tiny config (with `model` and `train` keys over it) trained for 6
    steps at each (world_size, grad_accum_steps) layout, with float64 parameters and optimizer state
    (tests/_faults.py); in layout order. One subprocess trains them all in turn: train() in-process
    sets torch's global switches."""
    configs = []
    for world_size, accum in layouts:
        path = write_tiny_config(
            folder / f"ws{world_size}_a{accum}.yaml",
            model=model or {},
            train={**(train or {}), "world_size": world_size, "grad_accum_steps": accum, "max_iters": 6},
        )
        configs.append((str(path), str(folder / f"state_{world_size}_{accum}")))
    script = textwrap.dedent(f"""
        from tinylm.config import load_config
        from tinylm.pretrain import train
        data = {json.dumps({k: str(v) for k, v in data.items()})}
        for config, state in {configs!r}:
            train(load_config(config), data["tokenizer"], data["train"], data["valid"], state,
                  state + "_ckpt")
    """)
    env = fault_env(dict(os.environ), param_dtype="float64")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return [final_payload(Path(state)) for _, state in configs]


def assert_layouts_agree(finals: list[dict], layouts=LAYOUTS, tolerance: float = 1e-10) -> None:
    """Every layout's weights equal the first layout's to `tolerance` (float64: rounding is negligible)."""
    reference = finals[0]["model"]
    assert reference["lm_head.weight"].dtype == torch.float64
    for (world_size, accum), final in zip(layouts[1:], finals[1:], strict=True):
        for name, tensor in final["model"].items():
            diff = (tensor - reference[name]).abs().max().item()
            assert diff < tolerance, (
                f"world_size={world_size}, grad_accum_steps={accum}: {name} differs by {diff:.1e}"
            )


def logged_losses(stderr: str) -> dict[int, str]:
    """step -> the loss exactly as printed."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ loss (\S+)", stderr)}


def final_payload(state_dir: Path, step: int | None = None) -> dict:
    step = committed_steps(state_dir)[-1] if step is None else step
    payload = torch.load(step_dir(state_dir, step) / CHECKPOINT, map_location="cpu", weights_only=True)
    return payload


def copy_state_up_to(src: Path, dst: Path, last_step: int) -> Path:
    """A copy of a state folder as if the run had been stopped right after committing `last_step`."""
    shutil.copytree(src, dst)
    for step in committed_steps(dst):
        if step > last_step:
            shutil.rmtree(step_dir(dst, step))
    return dst


# ------------------------------------------------------------------------------------------------
# A tiny language model trained on generated multi-script text, published as a checkpoint (used by
# the generation, sampling and export tests: trained enough that greedy decoding does not just
# repeat one token)


SPECIALS = ["<|endoftext|>", "<|pad|>"]
WORDS = (
    "the king said that we shall go to sea and the queen spoke of love at night, "
    "but it's late: you'll hear 42 ships"
).split()
OTHER_SCRIPTS = [
    "日本語",
    "東京",
    "привет",
    "мир",
    "ελληνικά",
    "العربية",
    "हिन्दी",
    "한국어",
    "naïve",
    "Straße",
    "café",
    "e\u0301",
]
EMOJI = ["🙂", "👍🏽", "🇫🇷", "🚀", "❤️", "👨‍👩‍👧"]
SPACES = [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "\u00a0", " \t "]
# vocab_size 320 with the byte tokens and these special tokens; rope_theta away from the default, so
# an export that lost it would show.
MODEL = dict(
    vocab_size=320, context_length=64, d_model=16, num_layers=2, num_heads=2, d_ff=40, rope_theta=500.0
)


def mixed_text(rng: random.Random, num_pieces: int) -> str:
    """English words, other scripts, emoji, numbers, punctuation and whitespace runs, with special tokens."""
    out = []
    for _ in range(num_pieces):
        r = rng.random()
        if r < 0.6:
            piece = rng.choice(WORDS)
        elif r < 0.75:
            piece = rng.choice(OTHER_SCRIPTS)
        elif r < 0.85:
            piece = rng.choice(EMOJI)
        elif r < 0.9:
            piece = str(rng.randint(0, 99999))
        elif r < 0.97:
            piece = rng.choice([".", ",", "!?", "--", "(", ")", "'", '"', "—", "…"])
        else:
            piece = rng.choice(SPECIALS)
        out.append(piece + rng.choice(SPACES))
    return "".join(out)


def build_tiny_lm(folder: Path, steps: int = 150) -> dict:
    """Train tokenizer and model in `folder`; publish the model as step `steps` in folder/ckpt."""
    text = mixed_text(random.Random(0), 6000)
    (folder / "train.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(
        folder / "train.txt", MODEL["vocab_size"], SPECIALS, num_workers=1, progress=False
    )
    tokenizer = Tokenizer(vocab, merges, SPECIALS)
    tokenizer.save(folder / "tokenizer.json")

    data = torch.tensor(tokenizer.encode(text))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread, whatever else runs
    torch.manual_seed(0)
    model = Transformer(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    T = MODEL["context_length"]
    for _ in range(steps):
        starts = torch.randint(len(data) - T - 1, (16,), generator=generator)
        x = torch.stack([data[s : s + T] for s in starts])
        y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    payload = {"model": model.state_dict(), "optimizer": {}, "iteration": steps, "model_config": dict(MODEL)}
    manifest = Manifest(
        world_size=1,
        tokens_seen=steps * 16 * MODEL["context_length"],
        model_config=dict(MODEL),
        tokenizer_sha256=sha256_file(folder / "tokenizer.json"),
        tokenizer_path=str(folder / "tokenizer.json"),
    )
    commit(folder / "state", steps, payload, manifest)
    publish(folder / "state", folder / "ckpt")
    return {
        "tokenizer": folder / "tokenizer.json",
        "checkpoints": folder / "ckpt",
        "step": steps,
        "text": text,
    }


# ------------------------------------------------------------------------------------------------
# The toy model, batches and checks of the parallel tests


VOCAB = 13
DIM = 8
SEQ = 5


class ToyModel(nn.Module):
    """Tied embedding/head, a frozen parameter, a buffer, a branch-only layer and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen_scale = nn.Parameter(torch.rand(DIM) + 0.5, requires_grad=False)
        self.extra = nn.Linear(DIM, DIM)  # used only when forward(use_extra=True)
        self.unused = nn.Parameter(torch.randn(3))  # never used: its grad must stay None
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(DIM))

    def forward(self, ids, use_extra=False):
        h = self.embed(ids) + self.shift
        h = torch.tanh(self.hidden(h)) * self.frozen_scale
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def make_toy(seed: int) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel().double()


def global_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def lm_loss(model, x, y, use_extra=False):
    logits = model(x, use_extra=use_extra)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def assert_params_close(actual: nn.Module, expected: nn.Module, atol: float, what: str) -> float:
    """Assert parameters (and buffers) agree within atol; return the largest difference."""
    worst = 0.0
    a_all = dict(actual.named_parameters()) | dict(actual.named_buffers())
    e_all = dict(expected.named_parameters()) | dict(expected.named_buffers())
    assert a_all.keys() == e_all.keys(), what
    for name, a in a_all.items():
        diff = (a.detach() - e_all[name].detach()).abs().max().item()
        worst = max(worst, diff)
        assert diff <= atol, f"{what}: {name} differs by {diff:.3g} (> {atol})"
    return worst


def write_result(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def param_groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def run_each(ctx, out_dir: str, jobs: list[tuple[str, Callable, tuple]]) -> None:
    """Run several rank functions in one launch: each (name, fn, args) as fn(ctx, out_dir/name, *args),
    a barrier after each. (Every launch starts processes that import torch, seconds each.)"""
    for name, fn, args in jobs:
        folder = Path(out_dir, name)
        folder.mkdir(exist_ok=True)
        fn(ctx, str(folder), *args)
        dist.barrier()


def launch_each(folder: Path, jobs: list[tuple[str, Callable, tuple]], world_size: int) -> Exception | None:
    """`run_each` in one launch of `world_size` ranks; the launch's error, or None."""
    from tinylm.parallel import RankFailedError, launch

    try:
        launch(run_each, args=(str(folder), jobs), world_size=world_size, timeout_s=60)
    except RankFailedError as error:
        return error
    return None


def job_results(folder: Path, name: str, world_size: int, error: Exception | None) -> list[dict]:
    """Every rank's results of the job `name` of a `launch_each`; a test failure with the launch's
    error where some rank did not finish it (it failed, or a job before it did)."""
    paths = [folder / name / f"rank{r}.json" for r in range(world_size)]
    if not all(path.exists() for path in paths):
        raise AssertionError(f"{name} did not finish at world size {world_size}: {error}")
    return [json.loads(path.read_text()) for path in paths]


# ------------------------------------------------------------------------------------------------
# Learning-rate schedules by PyTorch's own schedulers (the oracle of our schedules)


def _closed_form(scheduler_cls, base_lr: float, epoch: int, **kwargs) -> float:
    """torch's closed-form learning rate of `scheduler_cls` at `epoch`, for one group at `base_lr`."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = scheduler_cls(optimizer, **kwargs)
    scheduler.last_epoch = epoch
    return scheduler._get_closed_form_lr()[0]


def reference_lr(step: int, train, peak: float) -> float:
    """The learning rate of update `step` for a group peaking at `peak` under `train`'s schedule,
    after a linear warmup from 0: the cosine is torch's CosineAnnealingLR (T_max = cycle - warmup,
    eta_min = lr_min scaled to the peak), the WSD decay torch's LinearLR over the last steps."""
    lr_min = train.lr_min * peak / train.lr_max
    if step < train.warmup_iters:
        return peak * step / train.warmup_iters
    if train.schedule == "cosine":
        cycle = train.max_iters if train.cos_cycle_iters is None else train.cos_cycle_iters
        if step >= cycle:
            return lr_min
        t_max = cycle - train.warmup_iters
        return _closed_form(
            torch.optim.lr_scheduler.CosineAnnealingLR,
            peak,
            step - train.warmup_iters,
            T_max=t_max,
            eta_min=lr_min,
        )
    decay = max(1, round(train.decay_fraction * train.max_iters))
    into_decay = max(0, step - (train.max_iters - decay))
    return _closed_form(
        torch.optim.lr_scheduler.LinearLR,
        peak,
        into_decay,
        start_factor=1.0,
        end_factor=lr_min / peak,
        total_iters=decay,
    )
