"""Pretraining: `train()` checks everything and launches one `_train` per rank.

One update (step s, 1-based), on every rank r of world_size, with A = train.grad_accum_steps:

    batch       the global batch of batch_size windows is a function of (seed, s) only; rank r
                takes its A micro-batches of batch_size / (world_size * A) (tinylm/data.py)
    forward     autocast to train.dtype (parameters stay float32), our cross-entropy in float32,
                divided by A; backward inside ddp.no_sync() for all micro-batches but the last
    sync        finish_gradient_sync(): every gradient a rank holds is the average over ranks (our
                DDP reduces gradient buckets while the last backward runs; with a sharded
                optimizer each bucket goes only to the rank that owns its parameters)
    clip        one clip by the global gradient norm, the same on every rank
    update      the optimizer (AdamW or Muon, sharded or not) at the learning rates of update s;
                with float16 the loss is scaled and an update whose gradients overflow is skipped

So the same config at any world size or accumulation trains on the same tokens and, up to float
rounding, to the same weights; a run may be resumed at another world size. Each step costs one
host sync (the loss and gradient norm, read together for the log and the non-finite check).

Rank 0 logs (tinylm/train_log.py) and runs validation estimates; every rank joins each commit of a
checkpoint (tinylm/state.py). A killed run resumes from its newest committed step, bit-identically
at the same world size.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinylm import published as published_lib
from tinylm import state as state_lib
from tinylm.checkpoint import CheckpointError
from tinylm.config import Config, config_hash, default_weight_config, weight_config
from tinylm.data import TrainBatches, batch_generator, get_batch, load_tokens
from tinylm.io import StateLock, sha256_file
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import build_optimizer, set_learning_rates
from tinylm.parallel import DDP, RankContext, launch
from tinylm.parallel.launch import limit_compile_threads, ranks_on_this_machine, resolve_backend
from tinylm.precision import LossScaler, autocast, configure_kernels, resolve_dtype
from tinylm.tokenizer import Tokenizer
from tinylm.train_log import TrainingLog, log_line, set_run_name


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the update."""


def structural_hash(model_config: dict[str, Any]) -> str:
    """What a checkpoint's tensors depend on for their shapes."""
    return config_hash(model_config)


def model_config_of(cfg: Config, vocab_size: int) -> dict[str, Any]:
    return {"vocab_size": vocab_size, **asdict(cfg.model)}


# Keys of the manifest that must match for a resume, checked in this order; then every key of the
# training config ("config": {section: {key: value}}) must match too. The world size, threads and
# accumulation may differ: every step's global batch is the same at any of them.
RESUME_KEYS = ("format", "seed", "structural_hash", "tokenizer_sha256")


def check_resumable(manifest: dict[str, Any], expected: dict[str, Any], where: str | os.PathLike) -> None:
    """Refuse a resume whose manifest differs from this run in a key of RESUME_KEYS."""
    expected = {"format": state_lib.FORMAT, **expected}
    differences = [
        (key, manifest.get(key), expected[key])
        for key in RESUME_KEYS
        if key in expected and manifest.get(key) != expected[key]
    ]
    # A weight key that one side leaves out (see tinylm.config.weight_config) is at its default there:
    # an AdamW state has no train.optimizer, and a Muon run is still refused on it, and the reverse.
    # Keys are checked in the config's order (train.optimizer before the keys that depend on it).
    saved_config, config = manifest.get("config", {}), expected.get("config", {})
    defaults = default_weight_config()
    for section in dict.fromkeys([*config, *saved_config]):
        saved_values, values = saved_config.get(section, {}), config.get(section, {})
        section_defaults = defaults.get(section, {})
        known = [k for k in section_defaults if k in values or k in saved_values]
        for key in dict.fromkeys([*known, *values]):
            saved = saved_values.get(key, section_defaults.get(key))
            wanted = values.get(key, section_defaults.get(key))
            if saved != wanted:
                differences.append((f"{section}.{key}", saved, wanted))
    if differences:
        key, saved, wanted = differences[0]
        raise CheckpointError(
            f"{where}: cannot resume: {key} differs (state has {saved!r}, this run has {wanted!r}); "
            f"use another --state-dir or delete this one to start afresh"
        )


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to train one run; sent to every rank, so plain and picklable."""

    cfg: Config
    model_config: dict[str, Any]  # Transformer(**model_config)
    identity: dict[str, Any]  # what a resume must match, written into every manifest
    train_tokens: str
    valid_tokens: str
    state_dir: str
    tensorboard_dir: str | None
    seconds_before: float  # training wall time of the attempts this run resumes
    run_name: str | None  # a sweep's run, on every log line


def train(
    cfg: Config,
    tokenizer_path: str | os.PathLike,
    train_tokens: str | os.PathLike,
    valid_tokens: str | os.PathLike,
    state_dir: str | os.PathLike,
    checkpoint_dir: str | os.PathLike,
    tensorboard_dir: str | os.PathLike | None = None,
    *,
    run_name: str | None = None,
) -> list[Path]:
    """Train (or resume) and publish the checkpoints into `checkpoint_dir`; returns their paths.

    Every check that can fail before training runs here, in the launching process, so that a bad
    file or value is one clear error rather than one per rank. `run_name` (a sweep's run) labels
    every log line. A run whose state holds its last step is finished: it says so, trains nothing
    and publishes its checkpoints again.
    """
    set_run_name(run_name)
    tokenizer = Tokenizer.load(tokenizer_path)
    vocab_size = len(tokenizer.vocab)
    context_length = cfg.model.context_length
    # Under torchrun every process runs this function; only global rank 0 scans the token files for
    # their largest id (one pass over each file), locks and publishes.
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    for path in (train_tokens, valid_tokens):  # dtype, shape and largest id, then the length
        num_tokens = len(load_tokens(path, vocab_size if is_rank0 else None))
        if num_tokens < context_length + 1:
            raise ValueError(
                f"{path}: holds {num_tokens} tokens, fewer than the {context_length + 1} needed "
                f"(model.context_length + 1)"
            )

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
    backend = resolve_backend(t.backend, t.world_size)
    with StateLock(state_dir) if is_rank0 else contextlib.nullcontext():
        steps = state_lib.committed_steps(state_dir)
        train_seconds = 0.0  # wall time of training so far, over every resume (for comparisons)
        if steps:
            manifest = state_lib.read_manifest(state_lib.step_dir(state_dir, steps[-1]) / state_lib.MANIFEST)
            train_seconds = float(manifest.get("train_seconds", 0.0))
            check_resumable(manifest, run, state_dir)
            note = ""
            if manifest.get("world_size") != t.world_size:
                note = (
                    f" (written at world size {manifest.get('world_size')}, continued at {t.world_size}: the "
                    f"same batches, equal to an uninterrupted run within float rounding, not bit for bit)"
                )
            if steps[-1] >= t.max_iters:
                log_line(
                    is_rank0,
                    f"the run is finished: step {steps[-1]}/{t.max_iters} is committed in {state_dir}; "
                    f"nothing to train, publishing its checkpoints again to {checkpoint_dir}",
                )
            else:
                log_line(is_rank0, f"resuming from step {steps[-1]} in {state_dir}{note}")
        if not steps or steps[-1] < t.max_iters:
            spec = RunSpec(
                cfg=cfg,
                model_config=model_config,
                identity=run,
                train_tokens=str(train_tokens),
                valid_tokens=str(valid_tokens),
                state_dir=str(state_dir),
                tensorboard_dir=None if tensorboard_dir is None else str(tensorboard_dir),
                seconds_before=train_seconds,
                run_name=run_name,
            )
            launch(
                _train,
                args=(spec,),
                world_size=t.world_size,
                backend=backend,
                threads_per_rank=t.threads_per_rank,
                timeout_s=t.timeout_s,
            )
        if not is_rank0:
            return []
        published = published_lib.publish(state_dir, checkpoint_dir)
        steps = [p.stem.removeprefix("step_") for p in published]
        listed = ", ".join(steps if len(steps) <= 6 else [*steps[:2], "...", *steps[-2:]])
        log_line(
            True,
            f"{len(steps)} checkpoints (steps {listed}) published to {checkpoint_dir} "
            f"(resume state: {state_dir})",
        )
        return published


def _train(ctx: RankContext, spec: RunSpec) -> None:
    """One rank's training loop; the order of one update is in the module docs."""
    set_run_name(spec.run_name)
    t, device, accum = spec.cfg.train, ctx.device, spec.cfg.train.grad_accum_steps
    configure_kernels(device, t.deterministic)
    rng = _seed_everything(t.seed + ctx.rank)
    dtype = resolve_dtype(t.dtype, device)  # the forward pass's autocast dtype
    context_length = spec.model_config["context_length"]
    batches = TrainBatches(
        load_tokens(spec.train_tokens),
        t.seed,
        t.batch_size,
        context_length,
        ctx.rank,
        ctx.world_size,
        accum,
        device,
    )
    valid_tokens = load_tokens(spec.valid_tokens)

    model = Transformer(**spec.model_config, device=device)  # float32 parameters and optimizer state
    optimizer = build_optimizer(model, t, ctx.world_size)  # train.optimizer, sharded when asked
    if t.compile:
        compile_blocks(model, ctx.world_size)
    # A sharded optimizer (ZeRO-1) names each parameter's owner: DDP then reduces each gradient to
    # its owner only, and each rank unscales and clips the gradients it holds.
    owner = getattr(optimizer, "owner", None)
    ddp = DDP(model, bucket_size_mb=t.bucket_size_mb, reduce_to=owner)
    held = optimizer.owned_parameters() if owner else list(model.parameters())
    clip_grad_norm = optimizer.clip_grad_norm_ if owner else gradient_clip
    scaler = LossScaler(enabled=dtype == torch.float16)  # float16's loss scaling; else it does nothing
    start = _restore(ctx, spec, model, optimizer, scaler, rng)
    log = TrainingLog(ctx, spec, model, dtype, start)

    model.train()
    for step in range(start + 1, t.max_iters + 1):
        log.step_begins()
        lrs = set_learning_rates(optimizer, step, t)  # {group name: lr} of update `step`
        ddp.zero_grad()  # the gradient buckets, in place: backward accumulates straight into them
        loss = torch.zeros((), device=device)
        for micro_step in range(accum):
            x, y = batches.get(step, micro_step)
            with ddp.no_sync() if micro_step < accum - 1 else contextlib.nullcontext():
                with autocast(device, dtype):
                    logits = ddp(x)
                micro_loss = cross_entropy(logits, y) / accum  # float32; summed: the mean's gradient
                (micro_loss * scaler.scale).backward()
            loss += micro_loss.detach()
        ddp.finish_gradient_sync()
        if ctx.world_size > 1:
            dist.all_reduce(loss)
            loss /= ctx.world_size
        scaler.unscale_([p.grad for p in held if p.grad is not None])
        grad_norm = clip_grad_norm(model.parameters(), t.grad_clip)
        # The step's one host sync. Every rank holds the same loss and norm, so all decide alike.
        loss_value, norm_value = torch.stack([loss, grad_norm.to(device)]).tolist()
        overflow = scaler.enabled and not math.isfinite(norm_value)  # float16: skip, lower the scale
        if not math.isfinite(loss_value) or not (math.isfinite(norm_value) or overflow):
            committed = (state_lib.committed_steps(spec.state_dir) or [0])[-1]
            raise NonFiniteLossError(
                f"step {step}: loss {loss_value} / gradient norm {norm_value} is not finite; stopped "
                f"before the update (last committed step: {committed})"
            )
        if not overflow:
            optimizer.step()
        scaler.update(overflow)
        log.step_done(step, loss_value, norm_value, lrs, scaler, overflow)

        if ctx.is_main and (step % t.val_interval == 0 or step == t.max_iters):
            generator = batch_generator(t.seed, step, stream=1)
            micro_batch = t.batch_size // (ctx.world_size * accum)
            val_loss = estimate_loss(
                model, valid_tokens, micro_batch, context_length, t.val_batches, device, generator, dtype
            )
            log.validation(step, val_loss)
        if step % t.checkpoint_interval == 0 or step == t.max_iters:
            _save(ctx, spec, step, model, optimizer, scaler, rng, log.train_seconds())
            log.committed(step)
    log.finish()


def compile_blocks(model: Transformer, world_size: int) -> None:
    """torch.compile each Transformer block on its own (train.compile).

    Block by block, so that each block's backward is one autograd node and DDP's buckets start
    while earlier blocks are still in backward (a whole-model graph would start none before its
    backward ends); one graph serves every block, and state-dict names stay plain.
    """
    limit_compile_threads(ranks_on_this_machine(world_size))
    for block in model.layers:
        block.compile()


def _restore(ctx: RankContext, spec: RunSpec, model, optimizer, scaler: LossScaler, rng) -> int:
    """Load the newest committed step into the model, optimizer, scaler and RNGs; its step, or 0.

    Each rank reads the model and its own share of the optimizer state (see state.restore_step).
    """
    restored = state_lib.restore_step(ctx, spec.state_dir, model, optimizer)
    if restored is None:
        return 0
    scaler.load_state_dict(restored.get("grad_scaler") or {})
    if len(restored["rng"]) == ctx.world_size:  # RNG streams are per rank: only at the same world size
        _set_rng_state(restored["rng"][ctx.rank], rng, ctx.device)
    return int(restored["iteration"])


def _save(ctx: RankContext, spec: RunSpec, step: int, model, optimizer, scaler, rng, seconds: float) -> None:
    """Collective: every rank writes its part of step `step` (see tinylm/state.py); rank 0 commits it."""
    tokens_seen = step * spec.cfg.train.batch_size * spec.model_config["context_length"]
    state_lib.save_step(
        ctx,
        spec.state_dir,
        step,
        model,
        optimizer,
        # The manifest, not the checkpoint (which stays byte-identical), records rank 0's wall time.
        manifest={
            **spec.identity,
            "train_seconds": seconds,
            "tokens_seen": tokens_seen,
            "model_config": spec.model_config,
        },
        entries={
            "tokens_seen": tokens_seen,
            "model_config": spec.model_config,
            "grad_scaler": scaler.state_dict(),
        },
        per_rank={"rng": _rng_state(rng, ctx.device)},
        keep=spec.cfg.train.keep_checkpoints,
    )


def _seed_everything(seed: int) -> np.random.Generator:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return np.random.default_rng(seed)


def _rng_state(np_rng: np.random.Generator, device: torch.device) -> dict[str, Any]:
    """Every RNG of this rank as plain types and CPU tensors (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": np_rng.bit_generator.state,
        "python": [version, list(internal), gauss],
    }


def _set_rng_state(saved: dict[str, Any], np_rng: np.random.Generator, device: torch.device) -> None:
    """Restore what _rng_state saved (the tensors must be on the CPU, as checkpoints are loaded)."""
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
    np_rng.bit_generator.state = saved["numpy"]
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    tokens: np.ndarray,
    batch_size: int,
    context_length: int,
    num_batches: int,
    device: torch.device,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Mean loss over `num_batches` random batches (a quick estimate; `evaluate` is the exact one)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for _ in range(num_batches):
        x, y = get_batch(tokens, batch_size, context_length, device, generator=generator)
        with autocast(device, dtype):
            logits = model(x)
        total += cross_entropy(logits, y)
    model.train(was_training)
    return total.item() / num_batches
