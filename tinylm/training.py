"""Pretraining: `train()` checks everything and launches one `_train` per rank.

One update (step s, 0-based), on every rank r of world_size, with A = train.grad_accum_steps:

    global batch    batch_size window starts drawn from a generator seeded by (seed, s) only
    micro-batches   rank r takes slices r*A .. r*A + A - 1 of it, batch_size / (world_size * A) each
    forward         autocast to train.dtype (parameters stay float32), our cross-entropy in float32,
                    divided by A; backward inside ddp.no_sync() for all micro-batches but the last
    sync            finish_gradient_sync(): every .grad is the average over ranks (our DDP
                    all-reduces gradient buckets while the last backward runs)
    clip            one global gradient-norm clip after the sync, so every rank clips alike
    update          (sharded) AdamW with the cosine learning rate of update s + 1; with float16 a
                    GradScaler scales the loss and skips the update when gradients overflow

So the same config at any world size or accumulation trains on the same tokens and, up to float
rounding, to the same weights; a run may be resumed at another world size. Each step costs one
host sync (the loss and gradient norm, read together for the log and the non-finite check).

Rank 0 logs progress (loss, lr, tokens/s, MFU, peak memory), writes TensorBoard scalars, runs
validation and writes committed checkpoints into the state folder (see tinylm/state.py), which are
then published into the checkpoint folder. A killed run resumes from the newest committed step and,
at the same world size, continues bit-identically.
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
from tinylm.data import get_batch, get_windows, load_tokens, num_window_starts
from tinylm.faults import install_fault_hooks
from tinylm.io import sha256_file
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import build_optimizer, set_learning_rates
from tinylm.parallel import DDP, ShardedOptimizer, launch
from tinylm.precision import LossScaler, autocast, resolve_dtype
from tinylm.throughput import StepMeter, flops_per_token, peak_flops
from tinylm.tokenizer import Tokenizer


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the update."""


def structural_hash(model_config: dict[str, Any]) -> str:
    """What a checkpoint's tensors depend on for their shapes."""
    return config_hash(model_config)


def model_config_of(cfg: Config, vocab_size: int) -> dict[str, Any]:
    return {"vocab_size": vocab_size, **asdict(cfg.model)}


def batch_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator that depends only on (seed, step, stream): batches survive a resume.

    stream 0 draws the training batches, stream 1 the validation estimates.
    """
    mixed = np.random.SeedSequence([seed, step, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


def train(
    cfg: Config,
    tokenizer_path: str | os.PathLike,
    train_tokens: str | os.PathLike,
    valid_tokens: str | os.PathLike,
    state_dir: str | os.PathLike,
    checkpoint_dir: str | os.PathLike,
    tensorboard_dir: str | os.PathLike | None = None,
    *,
    param_dtype: torch.dtype = torch.float32,
    run_name: str | None = None,
) -> list[Path]:
    """Train (or resume) and publish the checkpoints into `checkpoint_dir`; returns their paths.

    Every check that can fail before training runs here, in the launching process, so that a bad
    file or value is one clear error rather than one per rank. `param_dtype` is the dtype of the
    parameters and optimizer state (float32; float64 for exactness tests). `run_name` (a sweep's
    run) labels every log line: `[pretrain <name>] ...`. A run whose state already holds its last
    step is finished: it says so, trains nothing and publishes its checkpoints again.
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
    with state_lib.StateLock(state_dir) if is_rank0 else contextlib.nullcontext():
        steps = state_lib.committed_steps(state_dir)
        train_seconds = 0.0  # wall time of training so far, over every resume (for comparisons)
        if steps:
            manifest = state_lib.read_manifest(state_lib.step_dir(state_dir, steps[-1]) / state_lib.MANIFEST)
            train_seconds = float(manifest.get("train_seconds", 0.0))
            state_lib.check_resumable(manifest, run, state_dir)
            note = ""
            if manifest.get("world_size") != t.world_size:
                note = (
                    f" (written at world size {manifest.get('world_size')}, continued at {t.world_size}: the "
                    f"same batches, equal to an uninterrupted run within float rounding, not bit for bit)"
                )
            if steps[-1] >= t.max_iters:
                _log(
                    is_rank0,
                    f"the run is finished: step {steps[-1]}/{t.max_iters} is committed in {state_dir}; "
                    f"nothing to train, publishing its checkpoints again to {checkpoint_dir}",
                )
            else:
                _log(is_rank0, f"resuming from step {steps[-1]} in {state_dir}{note}")
        if not steps or steps[-1] < t.max_iters:
            args = (
                cfg,
                model_config,
                run,
                str(train_tokens),
                str(valid_tokens),
                str(state_dir),
                None if tensorboard_dir is None else str(tensorboard_dir),
                param_dtype,
                train_seconds,
                run_name,
            )
            launch(
                _train,
                args=args,
                world_size=t.world_size,
                backend=backend,
                threads_per_rank=t.threads_per_rank,
                timeout_s=t.timeout_s,
            )
        if not is_rank0:
            return []
        published = state_lib.publish(state_dir, checkpoint_dir)
        steps = [p.stem.removeprefix("step_") for p in published]
        listed = (
            ", ".join(steps) if len(steps) <= 6 else f"{', '.join(steps[:2])}, ..., {', '.join(steps[-2:])}"
        )
        _log(
            True,
            f"{len(steps)} checkpoints (steps {listed}) published to {checkpoint_dir} (resume state: "
            f"{state_dir})",
        )
        return published


def resolve_backend(backend: str, world_size: int) -> str:
    """The process-group backend for `train.backend`, checked against this machine's CUDA devices.

    nccl needs one CUDA device per rank on this machine (under torchrun: per rank started here).
    "auto" is nccl when there are enough devices and gloo on the CPU otherwise, said in one line when
    GPUs exist but are too few, so that the default config runs (and reproduces its figures) anywhere.
    A forced "nccl" with too few devices is refused before any process starts.
    """
    if backend == "gloo":
        return "gloo"
    count = torch.cuda.device_count()
    ranks_here = ranks_on_this_machine(world_size)
    if backend == "nccl":
        if count == 0:
            raise ValueError(
                "train.backend: 'nccl' needs CUDA devices, and none is available here "
                "(use 'auto' or 'gloo' on a CPU machine)"
            )
        if ranks_here > count:
            raise ValueError(
                f"train.world_size: {ranks_here} ranks on this machine with train.backend 'nccl' "
                f"need {ranks_here} CUDA devices, but it has {count} (set train.world_size to "
                f"{count} or fewer, or use backend 'gloo')"
            )
        return "nccl"
    if count == 0:
        return "gloo"
    if ranks_here > count:
        _log(
            int(os.environ.get("RANK", "0")) == 0,
            f"train.world_size {ranks_here} is more ranks than this machine's {count} CUDA devices: "
            f"training on the CPU with gloo (set train.world_size: {count} to use the GPUs)",
        )
        return "gloo"
    return "nccl"


def ranks_on_this_machine(world_size: int) -> int:
    """Ranks sharing this machine: LOCAL_WORLD_SIZE under torchrun, else all (mp.spawn starts them here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def limit_compile_threads(ranks_here: int) -> int:
    """Give this rank's torch.compile workers its share of the machine: cores // ranks_here, at least 1.

    Inductor sizes its pool of compile workers to the whole machine in every process, so 8 ranks
    on a node would start 8 pools of that size. TORCHINDUCTOR_COMPILE_THREADS, if set, wins. Call
    before anything compiles; returns the thread count.
    """
    import torch._inductor.config as inductor_config

    threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", 0)) or max(
        1, len(os.sched_getaffinity(0)) // max(1, ranks_here)
    )
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    inductor_config.compile_threads = threads
    return threads


_log_label = "[pretrain]"


def set_run_name(name: str | None) -> None:
    """Label this process's log lines with the run's name (`[pretrain NAME]`); None: `[pretrain]`."""
    global _log_label
    _log_label = f"[pretrain {name}]" if name else "[pretrain]"


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"{_log_label} {message}", file=sys.stderr, flush=True)


def configure_kernels(device: torch.device, deterministic: bool) -> None:
    """Deterministic kernels (bit-identical reruns on one machine) or the fastest ones.

    Deterministic: torch.use_deterministic_algorithms(True), so an op without a deterministic
    kernel is an error rather than a warning; the flash and memory-efficient attention backward then
    run their deterministic variants, cuDNN attention (not covered by that switch) is turned off,
    cuBLAS gets a fixed workspace, and float32 matmuls stay in full float32 (no TF32).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS is first used
    torch.use_deterministic_algorithms(deterministic)
    torch.set_float32_matmul_precision("highest" if deterministic else "high")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = not deterministic
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cuda.enable_cudnn_sdp(not deterministic)


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


def global_batch_starts(seed: int, step: int, batch_size: int, num_starts: int) -> torch.Tensor:
    """Window starts of the global batch of update `step` (0-based): [batch_size], a function of (seed, step).

    Rank r takes micro-batches r * grad_accum_steps ... (r + 1) * grad_accum_steps - 1 of it, each a
    contiguous slice (see micro_batch_starts), so every world size and accumulation trains on the
    very same tokens in every step.
    """
    return torch.randint(0, num_starts, (batch_size,), generator=batch_generator(seed, step))


def micro_batch_starts(
    starts: torch.Tensor, rank: int, micro_step: int, world_size: int, grad_accum_steps: int
) -> torch.Tensor:
    """Rank `rank`'s micro-batch `micro_step` of the global batch `starts`."""
    micro = len(starts) // (world_size * grad_accum_steps)
    index = rank * grad_accum_steps + micro_step
    return starts[index * micro : (index + 1) * micro]


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


def _train(
    ctx,
    cfg: Config,
    model_config: dict[str, Any],
    run: dict[str, Any],
    train_path: str,
    valid_path: str,
    state_dir: str,
    tensorboard_dir: str | None,
    param_dtype: torch.dtype,
    seconds_before: float,
    run_name: str | None = None,
) -> None:
    """One rank's training loop."""
    set_run_name(run_name)
    t = cfg.train
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    configure_kernels(device, t.deterministic)
    np_rng = _seed_everything(t.seed + rank)
    dtype = resolve_dtype(t.dtype, device)  # the autocast dtype of the forward pass

    train_tokens = load_tokens(train_path)
    valid_tokens = load_tokens(valid_path)
    context_length = model_config["context_length"]
    num_starts = num_window_starts(train_tokens, context_length)
    accum = t.grad_accum_steps
    micro_batch = t.batch_size // (world_size * accum)

    # The parameters and AdamW state stay in param_dtype (float32); autocast lowers the forward only.
    model = Transformer(**model_config, device=device, dtype=param_dtype)
    optimizer = build_optimizer(model, t, world_size)  # train.optimizer, sharded when asked
    sharded = isinstance(optimizer, ShardedOptimizer)
    if sharded:  # ZeRO-1: each rank steps its share; DDP reduces each gradient to its owner only
        held = optimizer.owned_parameters()
    else:
        held = [p for p in model.parameters() if p.requires_grad]
    if t.compile:
        # Block by block, so that each block's backward is one autograd node and DDP's buckets
        # start while earlier blocks are still in backward (a whole-model graph would start none
        # before its backward ends). State dict names stay plain.
        limit_compile_threads(ranks_on_this_machine(world_size))
        for block in model.layers:
            block.compile()
    ddp = DDP(model, bucket_size_mb=t.bucket_size_mb, reduce_to=optimizer.owner if sharded else None)
    # float16 needs loss scaling (its range is too small for small gradients); disabled it does nothing.
    scaler = LossScaler(enabled=dtype == torch.float16)

    start = 0
    # On the CPU first, then beside each parameter (see state.restore_step): RNG states stay CPU
    # tensors and AdamW's step counters stay on the CPU. Each rank reads only its own share.
    restored = state_lib.restore_step(ctx, state_dir, model, optimizer)
    if restored is not None:
        scaler.load_state_dict(restored.get("grad_scaler") or {})
        if len(restored["rng"]) == world_size:  # RNG streams are per rank: only the same world size
            _set_rng_state(restored["rng"][rank], np_rng, device)
        start = int(restored["iteration"])
    install_fault_hooks(ddp, rank, start, accum)  # test-only, does nothing unless TINYLM_FAULT is set

    writer = None
    if ctx.is_main and tensorboard_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=start)
    log = ctx.is_main
    tokens_per_step = t.batch_size * context_length
    _log_header(log, cfg, model, ctx, dtype, tokens_per_step, state_dir, start)
    meter = StepMeter(
        tokens_per_step,
        flops_per_token(model_config),
        peak_flops(device, dtype, tf32=not t.deterministic, override=t.peak_flops),
        world_size,
        device,
    )
    started = time.perf_counter()
    loss_sum, loss_steps = 0.0, 0  # the printed loss: the mean over the steps since the previous line
    val = math.nan
    model.train()
    for it in range(start, t.max_iters):
        step_started = time.perf_counter()
        # The schedule is indexed by the number of the update being made (1-based), so the first
        # update already has a non-zero learning rate and update max_iters reaches lr_min.
        lrs = set_learning_rates(optimizer, it + 1, t)  # {group name: lr}, each group to its own peak
        lr = next(iter(lrs.values()))  # the log shows the first group's ("matrices")

        # Forward and backward over this rank's micro-batches; each micro-loss is divided by their
        # number, so that the summed gradients are those of the mean loss over the rank's share.
        starts = global_batch_starts(t.seed, it, t.batch_size, num_starts)
        ddp.zero_grad()  # the gradient buckets, in place: backward accumulates straight into them
        loss = torch.zeros((), device=device)
        for m in range(accum):
            x, y = get_windows(
                train_tokens, micro_batch_starts(starts, rank, m, world_size, accum), context_length, device
            )
            with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                with autocast(device, dtype):
                    logits = ddp(x)
                micro_loss = cross_entropy(logits, y) / accum  # computed in float32
                (micro_loss * scaler.scale).backward()
            loss += micro_loss.detach()
        ddp.finish_gradient_sync()  # each rank now holds the rank average of the gradients in `held`
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        scaler.unscale_([p.grad for p in held if p.grad is not None])
        if sharded:
            grad_norm = optimizer.clip_grad_norm_(model.parameters(), t.grad_clip)
        else:
            grad_norm = gradient_clip(held, t.grad_clip)
        # The one host sync of the step. Every rank holds the same loss and norm, so all agree.
        loss_value, norm_value = torch.stack([loss, grad_norm.to(loss.device)]).tolist()
        overflow = not math.isfinite(norm_value)  # with float16: skip the update, lower the scale
        if not math.isfinite(loss_value) or (overflow and not scaler.enabled):
            raise NonFiniteLossError(
                f"step {it + 1}: loss {loss_value} / gradient norm {norm_value} is not finite; "
                f"stopped before the update (last committed step: {(state_lib.committed_steps(state_dir) or [0])[-1]})"
            )
        if not overflow:
            optimizer.step()
        scaler.update(overflow)
        step = it + 1
        meter.add_step(time.perf_counter() - step_started)
        loss_sum, loss_steps = loss_sum + loss_value, loss_steps + 1

        if it == start and t.compile:
            _log(log, f"torch.compile: the first step took {meter.last_step_s:.1f} s (compilation included)")
            meter.restart()
        if step % t.log_interval == 0 or step == t.max_iters:
            mean_of = f"mean of {loss_steps} steps" if loss_steps > 1 else "1 step"
            _log(
                log,
                f"step {step}/{t.max_iters} loss {loss_sum / loss_steps:.4f} ({mean_of}) lr {lr:.2e} "
                f"{meter.report(t.max_iters - step)}"
                + (f" loss scale {scaler.scale:g}" if scaler.enabled else ""),
            )
            loss_sum, loss_steps = 0.0, 0
        if overflow:
            _log(
                log,
                f"step {step}: float16 gradients overflowed; update skipped, loss scale now {scaler.scale:g}",
            )
        if writer is not None:
            writer.add_scalar("loss_train", loss_value, step)
            for name, group_lr in lrs.items():
                writer.add_scalar(f"lr/{name}", group_lr, step)
            writer.add_scalar("grad_norm", norm_value, step)
        if ctx.is_main and (step % t.val_interval == 0 or step == t.max_iters):
            began = time.perf_counter()
            val = estimate_loss(
                model,
                valid_tokens,
                micro_batch,
                context_length,
                t.val_batches,
                device,
                batch_generator(t.seed, step, stream=1),
                dtype,
            )
            _log(log, f"step {step} val_loss {val:.4f} ({time.perf_counter() - began:.1f} s)")
            if writer is not None:
                writer.add_scalar("val_loss", val, step)

        if step % t.checkpoint_interval == 0 or step == t.max_iters:
            began = time.perf_counter()
            # The manifest (not the checkpoint, which stays byte-identical) records rank 0's wall time.
            timing = {"train_seconds": round(seconds_before + began - started, 3)}
            _commit(
                ctx,
                model,
                optimizer,
                scaler,
                step,
                tokens_per_step,
                np_rng,
                model_config,
                {**run, **timing},
                state_dir,
                t.keep_checkpoints,
            )
            _log(log, f"step {step} committed to {state_dir} ({time.perf_counter() - began:.1f} s)")
    if writer is not None:
        writer.close()
    wall = time.perf_counter() - started
    _log(
        log,
        f"done: steps {start + 1}-{t.max_iters} of {t.max_iters} trained in {wall:.1f} s "
        f"({(t.max_iters - start) * tokens_per_step / max(wall, 1e-9):,.0f} tokens/s over the wall time, "
        f"validation and checkpoints included); final val_loss estimate {val:.4f} ({t.val_batches} batches; "
        f"`evaluate` computes the exact loss); committed steps in {state_dir}",
    )


def _log_header(
    enabled: bool,
    cfg: Config,
    model: torch.nn.Module,
    ctx,
    dtype: torch.dtype,
    tokens_per_step: int,
    state_dir: str,
    start: int,
) -> None:
    """Two lines that say what this run is and how it runs, before its first step."""
    t, m = cfg.train, cfg.model
    parameters = sum(p.numel() for p in model.parameters())
    _log(
        enabled,
        f"model: {parameters:,} parameters (vocab {model.vocab_size}, d_model {m.d_model}, {m.num_layers} "
        f"layers, {m.num_heads} heads, d_ff {m.d_ff}, context {m.context_length}); {t.max_iters} steps of "
        f"{tokens_per_step:,} tokens (batch {t.batch_size} x context {m.context_length}), lr {t.lr_max:g} "
        f"-> {t.lr_min:g}, weight decay {t.weight_decay:g}, seed {t.seed}",
    )
    param_dtype = next(model.parameters()).dtype
    _log(
        enabled,
        f"world size {ctx.world_size}, backend {dist.get_backend() if dist.is_initialized() else 'none'}, "
        f"device {ctx.device.type}, autocast {str(dtype).removeprefix('torch.')} (parameters "
        f"{str(param_dtype).removeprefix('torch.')}), grad_accum_steps {t.grad_accum_steps}; state "
        f"{state_dir}; "
        + (f"resumed at step {start}" if start else "fresh start")
        + f"; the loss printed is the mean over the steps since the previous line (every "
        f"{t.log_interval} steps)",
    )


def _commit(
    ctx,
    model,
    optimizer,
    scaler,
    step: int,
    tokens_per_step: int,
    np_rng,
    model_config,
    run,
    state_dir,
    keep: int,
) -> None:
    """Collective: every rank writes its part of step `step` (see tinylm/state.py); rank 0 commits it."""
    manifest = {**run, "tokens_seen": step * tokens_per_step, "model_config": model_config}
    state_lib.save_step(
        ctx,
        state_dir,
        step,
        model,
        optimizer,
        manifest=manifest,
        keep=keep,
        entries={
            "tokens_seen": step * tokens_per_step,
            "model_config": model_config,
            "grad_scaler": scaler.state_dict(),
        },
        per_rank={"rng": _rng_state(np_rng, ctx.device)},
    )
