"""One rank's training loop, and what it needs to run: the RunSpec every rank is sent.

One update (step s, 1-based), on every rank r of world_size, with A = train.grad_accum_steps:

    batch       the global batch of batch_size windows is a function of (data seed, s) only; rank r
                takes its A micro-batches of batch_size / (world_size * A) (tinylm/data.py)
    forward     autocast to train.dtype (parameters stay float32), our cross-entropy in float32,
                divided by A; backward inside ddp.no_sync() for all micro-batches but the last
    sync        finish_gradient_sync(): every gradient a rank holds is the average over ranks (our
                DDP reduces gradient buckets while the last backward runs; with a sharded
                optimizer each bucket is reduce-scattered into the ranks' equal slices)
    clip        one clip by the global gradient norm, the same on every rank
    update      the optimizer (AdamW or Muon, sharded or not) at the learning rates of update s;
                with float16 the loss is scaled and an update whose gradients overflow is skipped;
                sharded, each rank steps its slices and all-gathers them, waited for before the
                next forward

So the same config at any world size or accumulation trains on the same tokens and, up to float
rounding, to the same weights; a run may be resumed at another world size. The losses and gradient
norms stay on the device until a log line, a validation estimate or a commit needs them: then one
host sync reads all of them since the last read, for the log, TensorBoard and the non-finite
check (float16 reads each step's norm before its update). The next step's batch is copied to the
device while the current step's gradients are reduced.
Rank 0 logs (tinylm/pretrain/log.py) and runs validation estimates; every rank joins each commit
of a checkpoint (tinylm/pretrain/state.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinylm.checkpoint import Manifest
from tinylm.config import Config
from tinylm.config.lineage import mixture_order
from tinylm.data import TrainBatches, batch_generator, get_batch, load_tokens, micro_batch_size
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.parallel import DDP, RankContext
from tinylm.parallel.launch import limit_compile_threads, ranks_on_this_machine
from tinylm.precision import DTYPES, LossScaler, autocast, choose_attention_backend, configure_kernels
from tinylm.pretrain.init import Init, load_init_state
from tinylm.pretrain.log import TrainingLog, log_line, set_run_name
from tinylm.pretrain.optimizer import build_optimizer, set_learning_rates
from tinylm.pretrain.resume import restore_run, save_step_of_run, seed_everything
from tinylm.pretrain.steps import committed_steps


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the update."""


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to train one run; sent to every rank, so plain and picklable."""

    cfg: Config
    model_config: dict[str, Any]  # Transformer(**model_config)
    identity: Manifest  # what a resume must match and how the run executes: every manifest's start
    train_tokens: list[str]  # one file, or train.mixture's files by run name (mixture_order)
    valid_tokens: str
    state_dir: str
    tensorboard_dir: str | None
    seconds_before: float  # training wall time of the attempts this run resumes
    run_name: str | None  # a sweep's run, on every log line
    init: Init | None = None  # the checkpoint a fresh start takes its weights from (train.init_from)


def train_rank(ctx: RankContext, spec: RunSpec) -> None:
    """One rank's training loop; the order of one update is in the module docs."""
    set_run_name(spec.run_name)
    train, device, accum = spec.cfg.train, ctx.device, spec.cfg.train.grad_accum_steps
    dtype = DTYPES[spec.identity.dtype]  # the forward pass's autocast dtype, resolved by the launcher
    set_up_kernels(ctx, spec, dtype)
    seed_everything(train.seed + ctx.rank)
    context_length = spec.model_config["context_length"]
    batches = TrainBatches(
        [load_tokens(path) for path in spec.train_tokens],
        [weight for _, weight in mixture_order(train.mixture)] or [1.0],
        train.data_order_seed,
        train.batch_size,
        context_length,
        ctx.rank,
        ctx.world_size,
        accum,
        device,
    )
    valid_tokens = load_tokens(spec.valid_tokens)

    model = Transformer(**spec.model_config, device=device)  # float32 parameters and optimizer state
    model.set_activation_checkpointing(train.activation_checkpointing)
    optimizer = build_optimizer(model, train, ctx.world_size)  # train.optimizer, sharded when asked
    if train.compile:
        compile_model(model, ctx.world_size, device)
    # A sharded optimizer (ZeRO-1) lays the parameters out in buckets of equal slices: DDP then
    # reduce-scatters each gradient bucket into the slices, and each rank unscales and clips its own.
    ddp = DDP(model, bucket_size_mb=train.bucket_size_mb, shards=optimizer.gradient_shards())
    scaler = LossScaler(enabled=dtype == torch.float16)  # float16's loss scaling; else it does nothing
    start = restore_run(ctx, spec.state_dir, model, optimizer, scaler)
    if start == 0 and spec.init is not None:  # a fresh branch: the parent's weights, at its step
        load_init_state(spec.init, model, optimizer if train.init_optimizer else None)
        start = spec.init.step
    log = TrainingLog(
        ctx, train, model, dtype, start, spec.state_dir, spec.tensorboard_dir, spec.seconds_before
    )

    model.train()
    unread: list[tuple[int, torch.Tensor, dict]] = []  # (step, [loss, grad norm] on the device, lrs)
    for step in range(start + 1, train.max_iters + 1):
        log.step_begins()
        lrs = set_learning_rates(optimizer, step, train)  # {group name: lr} of update `step`
        ddp.zero_grad()  # the gradient buckets, in place: backward accumulates straight into them
        loss = torch.zeros((), device=device)
        for micro_step in range(accum):
            x, y = batches.get(step, micro_step)
            with ddp.no_sync() if micro_step < accum - 1 else contextlib.nullcontext():
                with autocast(device, dtype):
                    micro_loss = ddp(x, targets=y) / accum  # float32; summed: the mean's gradient
                (micro_loss * scaler.scale).backward()
            loss += micro_loss.detach()
        if step < train.max_iters:
            batches.prefetch(step + 1)  # its copy to the device overlaps this step's work
        ddp.finish_gradient_sync()
        if ctx.world_size > 1:
            dist.all_reduce(loss)
            loss /= ctx.world_size
        scaler.unscale_(optimizer.held_gradients())
        grad_norm = optimizer.clip_grad_norm_(model.parameters(), train.grad_clip)
        unread.append((step, torch.stack([loss, grad_norm.to(device)]), lrs))
        overflow = False
        if scaler.enabled:  # float16: gradients that overflowed skip the update and lower the scale
            overflow = not math.isfinite(grad_norm.item())
        if not overflow:
            optimizer.step()
        scaler.update(overflow)
        log.step_done(step, scaler, overflow)
        if scaler.enabled or reads_values(step, train):
            log_unread(unread, step, scaler, log, spec.state_dir)

        if ctx.is_main and (step % train.val_interval == 0 or step == train.max_iters):
            generator = batch_generator(train.data_order_seed, step, stream=1)
            micro_batch = micro_batch_size(train.batch_size, ctx.world_size, accum)
            val_loss = estimate_loss(
                model, valid_tokens, micro_batch, context_length, train.val_batches, device, generator, dtype
            )
            log.validation(step, val_loss)
        if step % train.checkpoint_interval == 0 or step == train.max_iters:
            commit(ctx, spec, step, model, optimizer, scaler, log)
    log.finish()


def commit(ctx: RankContext, spec: RunSpec, step: int, model, optimizer, scaler, log: TrainingLog) -> None:
    """Commit `step` to the state folder (every rank writes its share), said in the log."""
    train = spec.cfg.train
    tokens_seen = step * train.batch_size * spec.model_config["context_length"]
    save_step_of_run(
        ctx,
        spec.state_dir,
        step,
        model,
        optimizer,
        scaler,
        described={"tokens_seen": tokens_seen, "model_config": spec.model_config},
        # The manifest, not the checkpoint (which stays byte-identical), records the wall time.
        manifest=replace(spec.identity, train_seconds=log.train_seconds()),
        keep=train.keep_checkpoints,
    )
    log.committed(step)


def log_unread(unread: list, step: int, scaler: LossScaler, log: TrainingLog, state_dir: str) -> None:
    """Read the losses and gradient norms since the last read (one host sync), stop at a non-finite
    one, and log them. Every rank holds the same values, so all stop alike; a read comes before every
    validation and commit, so weights a non-finite step touched are never evaluated or committed."""
    for unread_step, (loss_value, norm_value), lrs in read_values(unread):
        if not math.isfinite(loss_value) or not (math.isfinite(norm_value) or scaler.enabled):
            committed = (committed_steps(state_dir) or [0])[-1]
            raise NonFiniteLossError(
                f"step {unread_step}: loss {loss_value} / gradient norm {norm_value} is not finite; "
                f"stopped at step {step} (last committed step: {committed})"
            )
        log.values(unread_step, loss_value, norm_value, lrs, scaler)


def reads_values(step: int, train) -> bool:
    """Whether the loop reads the losses and norms on the host after `step`: before a log line, a
    validation estimate, a commit and the end; the steps between cost no host sync."""
    intervals = (train.log_interval, train.val_interval, train.checkpoint_interval)
    return step == train.max_iters or any(step % interval == 0 for interval in intervals)


def read_values(unread: list[tuple[int, torch.Tensor, dict]]) -> list[tuple[int, list[float], dict]]:
    """The unread steps with their [loss, grad norm] on the host, in one copy; `unread` emptied."""
    values = torch.stack([stats for _, stats, _ in unread]).tolist()
    read = [(step, pair, lrs) for (step, _, lrs), pair in zip(unread, values, strict=True)]
    unread.clear()
    return read


def set_up_kernels(ctx: RankContext, spec: RunSpec, dtype: torch.dtype) -> None:
    """train.deterministic's kernels, and on CUDA the fused attention backend measured fastest at
    the run's shape (said in the log)."""
    train = spec.cfg.train
    configure_kernels(ctx.device, train.deterministic)
    shape = attention_shape(spec, ctx.world_size)
    attention = choose_attention_backend(ctx.device, shape, dtype, train.deterministic)
    if attention is not None:
        log_line(ctx.rank == 0, attention)


def attention_shape(spec: RunSpec, world_size: int) -> tuple[int, int, int, int]:
    """[B, H, T, d_head] of each attention call in training: one micro-batch of full contexts."""
    train, model = spec.cfg.train, spec.model_config
    micro_batch = train.batch_size // (world_size * train.grad_accum_steps)
    heads = model["num_heads"]
    return (micro_batch, heads, model["context_length"], model["d_model"] // heads)


def compile_model(model: Transformer, world_size: int, device: torch.device) -> None:
    """torch.compile the model for training (train.compile): on one GPU, the whole model with its
    loss as one graph; otherwise each Transformer block on its own and, on CUDA, the loss region.

    With no DDP buckets to start (one GPU), one graph lets Inductor fuse across the embedding, the
    blocks and the loss. Otherwise block by block, so that each block's backward is one autograd
    node and DDP's buckets start while earlier blocks are still in backward (a whole-model graph
    would start none before its backward ends); one graph serves every block, and state-dict names
    stay plain. The loss region (`Transformer.output_loss`: ln_final, the head, the soft-cap and the
    cross-entropy) is compiled too, where Inductor fuses the passes over the logits; under ZeRO-1
    the waits for ln_final's and the head's parameter all-gathers (DDP's pre-hooks) run eagerly
    between its graphs, as a block's wait runs before the block's graph. Not on the CPU: there the
    eager chunks already run in a core's cache, and compiling the region costs compile time for no
    measured gain (bench/RESULTS.md, "The GPU step").
    """
    limit_compile_threads(ranks_on_this_machine(world_size))
    if device.type == "cuda" and world_size == 1:
        model.compile()
        return
    for block in model.layers:
        block.compile()
    if device.type == "cuda":
        model.output_loss = torch.compile(model.output_loss)


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
