"""What carries a run across a restart: its identity check, and the state saved at every commit.

A run's identity (seed, model shape, tokenizer, every key that decides the weights) is written
into every manifest; `check_resumable` refuses a resume that would change it, naming the key.
`save_step_of_run` / `restore_run` write and read, besides the model and optimizer, what a resume
needs to continue bit for bit at the same world size: the float16 loss scaler and every rank's
random number generators.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tinylm.checkpoint import FORMAT, CheckpointError
from tinylm.checkpoint.manifest import Manifest, identity_differences
from tinylm.parallel import RankContext
from tinylm.precision import LossScaler, machine
from tinylm.pretrain.state import restore_step, save_step


def check_resumable(manifest: Manifest, expected: Manifest, where: str | os.PathLike) -> None:
    """Refuse a resume whose manifest differs from this run in its format or its identity (see
    `tinylm.checkpoint.manifest.identity_differences`), naming the first key that differs. The world
    size, threads and accumulation may differ: every step's global batch is the same at any of them."""
    differences = identity_differences(manifest, expected)
    if manifest.format != FORMAT:
        differences.insert(0, ("format", manifest.format, FORMAT))
    if manifest.dtype is not None and manifest.dtype != expected.dtype:
        differences.append(("the autocast dtype (train.dtype resolved here)", manifest.dtype, expected.dtype))
    if differences:
        key, saved, wanted = differences[0]
        raise CheckpointError(
            f"{where}: cannot resume: {key} differs (state has {saved!r}, this run has {wanted!r}); "
            f"use another --state-dir or delete this one to start afresh"
        )


def seed_everything(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators with `seed`."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def save_step_of_run(
    ctx: RankContext,
    state_dir: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    described: dict[str, Any],
    manifest: Manifest,
    keep: int,
) -> None:
    """Collective: commit `step` (see tinylm/pretrain/state.py). `described` (plain facts such as
    model_config and tokens_seen) goes into both the checkpoint, so the file alone is enough to use
    it, and its manifest, so readers need not open the file; `manifest`, and rank 0's `machine`
    record (what made the numbers), into the manifest only."""
    save_step(
        ctx,
        state_dir,
        step,
        model,
        optimizer,
        manifest=replace(manifest, **described, machine=machine(ctx.device)),
        entries={**described, "grad_scaler": scaler.state_dict()},
        per_rank={"rng": _rng_state(ctx.device)},
        keep=keep,
    )


def restore_run(
    ctx: RankContext,
    state_dir: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
) -> int:
    """Load the newest committed step into the model, optimizer, scaler and RNGs; its step, or 0.

    Each rank reads the model and its own share of the optimizer state (see tinylm/pretrain/state.py).
    """
    restored = restore_step(ctx, state_dir, model, optimizer)
    if restored is None:
        return 0
    scaler.load_state_dict(restored.get("grad_scaler") or {})
    if len(restored["rng"]) == ctx.world_size:  # RNG streams are per rank: only at the same world size
        _set_rng_state(restored["rng"][ctx.rank], ctx.device)
    return int(restored["iteration"])


def _rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators (torch's and CUDA's, which dropout draws from, and Python's) as plain
    types and CPU tensors (loadable with weights_only=True). numpy's is seeded but not kept: nothing
    in training draws from it."""
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
    }


def _set_rng_state(saved: dict[str, Any], device: torch.device) -> None:
    """Restore what _rng_state saved (the tensors must be on the CPU, as checkpoints are loaded); a
    numpy generator's state in an older checkpoint is ignored: nothing draws from it."""
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
