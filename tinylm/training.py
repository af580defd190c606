"""Pretraining: `train()` checks everything and launches one `_train` per rank.

Per step and rank: a batch of `batch_size // world_size` windows (a pure function of seed, step and
rank), forward, our cross-entropy, backward (our DDP all-reduces gradient buckets while backward
runs), `finish_gradient_sync()`, one global gradient clip, then the (sharded) AdamW step with the
cosine learning rate written into every param group. Gradients are clipped after they are
averaged, so every rank clips by the same global norm.

Rank 0 logs progress, writes TensorBoard scalars, runs validation and writes committed checkpoints
into the state folder (see tinylm/state.py), which are then published into the checkpoint folder.
A killed run resumes from the newest committed step and continues bit-identically.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinylm import state as state_lib
from tinylm.config import Config, config_hash, weight_config
from tinylm.data import get_batch, load_tokens
from tinylm.io import sha256_file
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import AdamW, cos_lr_scheduler
from tinylm.parallel import DDP, ShardedOptimizer, launch
from tinylm.parallel.launch import maybe_inject_fault
from tinylm.tokenizer import Tokenizer


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the update."""


def structural_hash(model_config: dict[str, Any]) -> str:
    """What a checkpoint's tensors depend on for their shapes."""
    return config_hash(model_config)


def model_config_of(cfg: Config, vocab_size: int) -> dict[str, Any]:
    return {"vocab_size": vocab_size, **asdict(cfg.model)}


def batch_generator(seed: int, step: int, rank: int, stream: int = 0) -> torch.Generator:
    """A generator that depends only on (seed, step, rank, stream): batches survive a resume."""
    mixed = np.random.SeedSequence([seed, step, rank, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


def train(cfg: Config, tokenizer_path: str | os.PathLike, train_tokens: str | os.PathLike,
          valid_tokens: str | os.PathLike, state_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike,
          tensorboard_dir: str | os.PathLike | None = None) -> list[Path]:
    """Train (or resume) and publish the checkpoints into `checkpoint_dir`; returns their paths.

    Every check that can fail before training runs here, in the launching process, so that a bad
    file or value is one clear error rather than one per rank.
    """
    tokenizer = Tokenizer.load(tokenizer_path)
    vocab_size = len(tokenizer.vocab)
    context_length = cfg.model.context_length
    for path in (train_tokens, valid_tokens):  # dtype, shape and largest id, then the length
        num_tokens = len(load_tokens(path, vocab_size))
        if num_tokens < context_length + 1:
            raise ValueError(f"{path}: holds {num_tokens} tokens, fewer than the {context_length + 1} needed "
                             f"(model.context_length + 1)")

    state_dir = Path(state_dir)
    model_config = model_config_of(cfg, vocab_size)
    run = {
        "world_size": cfg.train.world_size,
        "threads_per_rank": cfg.train.threads_per_rank,
        "seed": cfg.train.seed,
        "structural_hash": structural_hash(model_config),
        "tokenizer_sha256": sha256_file(tokenizer_path),
        "config": weight_config(cfg),
    }
    t = cfg.train
    check_devices(t.backend, t.world_size)
    # Under torchrun every process runs this function; only global rank 0 locks and publishes.
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    with state_lib.StateLock(state_dir) if is_rank0 else contextlib.nullcontext():
        steps = state_lib.committed_steps(state_dir)
        if steps:
            manifest = state_lib.read_manifest(state_lib.step_dir(state_dir, steps[-1]) / state_lib.MANIFEST)
            state_lib.check_resumable(manifest, run, state_dir)
            print(f"[pretrain] resuming from step {steps[-1]} in {state_dir}", file=sys.stderr)
        args = (cfg, model_config, run, str(train_tokens), str(valid_tokens), str(state_dir),
                None if tensorboard_dir is None else str(tensorboard_dir))
        launch(_train, args=args, world_size=t.world_size, backend=None if t.backend == "auto" else t.backend,
               threads_per_rank=t.threads_per_rank, timeout_s=t.timeout_s)
        return state_lib.publish(state_dir, checkpoint_dir) if is_rank0 else []


def check_devices(backend: str, world_size: int) -> None:
    """With nccl forced, one CUDA device per rank on this machine (torchrun spreads ranks itself)."""
    if backend != "nccl" or "WORLD_SIZE" in os.environ:
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("train.backend: 'nccl' needs CUDA devices, and none is available here "
                         "(use 'auto' or 'gloo' on a CPU machine)")
    if world_size > count:
        raise ValueError(f"train.world_size: {world_size} ranks with train.backend 'nccl' need {world_size} "
                         f"CUDA devices, but this machine has {count}")


def _seed_everything(seed: int) -> np.random.Generator:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return np.random.default_rng(seed)


def _rng_state(np_rng: np.random.Generator) -> dict[str, Any]:
    """Every RNG of this rank as plain types and tensors (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np_rng.bit_generator.state,
        "python": [version, list(internal), gauss],
    }


def _set_rng_state(saved: dict[str, Any], np_rng: np.random.Generator) -> None:
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    np_rng.bit_generator.state = saved["numpy"]
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, tokens: np.ndarray, batch_size: int, context_length: int,
                  num_batches: int, device: torch.device, generator: torch.Generator) -> float:
    """Mean loss over `num_batches` random batches (a quick estimate; `evaluate` is the exact one)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(num_batches):
        x, y = get_batch(tokens, batch_size, context_length, device, generator=generator)
        total += cross_entropy(model(x), y).item()
    model.train(was_training)
    return total / num_batches


def _train(ctx, cfg: Config, model_config: dict[str, Any], run: dict[str, Any], train_path: str,
           valid_path: str, state_dir: str, tensorboard_dir: str | None) -> None:
    """One rank's training loop."""
    t = cfg.train
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    distributed = world_size > 1
    np_rng = _seed_everything(t.seed + rank)
    # Deterministic kernels; cuBLAS needs a fixed workspace for that, set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)

    train_tokens = load_tokens(train_path)
    valid_tokens = load_tokens(valid_path)
    context_length = model_config["context_length"]
    local_batch = t.batch_size // world_size

    model = Transformer(**model_config, device=device)
    opt_kwargs = dict(lr=t.lr_max, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    if distributed:
        ddp = DDP(model, bucket_size_mb=t.bucket_size_mb)
        optimizer = ShardedOptimizer(model.parameters(), AdamW, **opt_kwargs) if t.shard_optimizer \
            else AdamW(model.parameters(), **opt_kwargs)
    else:
        ddp = None
        optimizer = AdamW(model.parameters(), **opt_kwargs)

    start = 0
    restored = state_lib.restore_step(ctx, state_dir, model, optimizer)
    if restored is not None:
        _set_rng_state(restored["rng"][rank], np_rng)
        start = int(restored["iteration"])

    writer = None
    if ctx.is_main and tensorboard_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=start)

    tokens_per_step = t.batch_size * context_length
    t0, last_log_time, last_log_step = time.perf_counter(), time.perf_counter(), start
    model.train()
    for it in range(start, t.max_iters):
        poison = maybe_inject_fault(rank, it)  # test-only switch, see tinylm/parallel/launch.py
        # The schedule is indexed by the number of the update being made (1-based), so the first
        # update already has a non-zero learning rate and update max_iters reaches lr_min.
        lr = cos_lr_scheduler(it + 1, t.warmup_iters, t.cos_cycle, t.lr_min, t.lr_max)
        for group in optimizer.param_groups:
            group["lr"] = lr

        x, y = get_batch(train_tokens, local_batch, context_length, device, generator=batch_generator(t.seed, it, rank))
        loss = cross_entropy(model(x), y)
        if poison:
            loss = loss * float("nan")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        global_loss = loss.detach().clone()
        if distributed:
            ddp.finish_gradient_sync()
            dist.all_reduce(global_loss)
            global_loss /= world_size
        grad_norm = gradient_clip(model.parameters(), t.grad_clip)
        # After the all-reduces every rank holds the same loss and gradients, so all ranks agree.
        if not (math.isfinite(global_loss.item()) and math.isfinite(float(grad_norm))):
            raise NonFiniteLossError(
                f"step {it + 1}: loss {global_loss.item()} / gradient norm {float(grad_norm)} is not finite; "
                f"stopped before the update (last committed step: {(state_lib.committed_steps(state_dir) or [0])[-1]})"
            )
        optimizer.step()
        step = it + 1

        if ctx.is_main and (step % t.log_interval == 0 or step == t.max_iters):
            now = time.perf_counter()
            tok_s = (step - last_log_step) * tokens_per_step / max(now - last_log_time, 1e-9)
            eta = (t.max_iters - step) * (now - t0) / (step - start)
            print(f"[pretrain] step {step}/{t.max_iters} loss {global_loss.item():.4f} lr {lr:.2e} "
                  f"{tok_s:,.0f} tok/s ETA {eta:.0f}s", file=sys.stderr, flush=True)
            last_log_time, last_log_step = now, step
        if writer is not None:
            writer.add_scalar("loss_train", global_loss.item(), step)
            writer.add_scalar("lr", lr, step)
        if ctx.is_main and (step % t.val_interval == 0 or step == t.max_iters):
            val = estimate_loss(model, valid_tokens, local_batch, context_length, t.val_batches, device,
                                batch_generator(t.seed, step, 0, stream=1))
            print(f"[pretrain] step {step} val_loss {val:.4f}", file=sys.stderr, flush=True)
            if writer is not None:
                writer.add_scalar("val_loss", val, step)

        if step % t.checkpoint_interval == 0 or step == t.max_iters:
            _commit(ctx, model, optimizer, step, tokens_per_step, np_rng, model_config, run, state_dir, t.keep_checkpoints)
    if writer is not None:
        writer.close()


def _commit(ctx, model, optimizer, step: int, tokens_per_step: int, np_rng, model_config, run, state_dir,
            keep: int) -> None:
    """Collective: every rank writes its part of step `step` (see tinylm/state.py); rank 0 commits it."""
    state_lib.save_step(ctx, state_dir, step, model, optimizer, manifest=run, keep=keep,
                        entries={"tokens_seen": step * tokens_per_step, "model_config": model_config},
                        per_rank={"rng": _rng_state(np_rng)})
