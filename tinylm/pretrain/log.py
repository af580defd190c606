"""Rank 0's account of a training run: log lines on stderr and TensorBoard scalars.

Every line starts with `[pretrain]`, or `[pretrain NAME]` for a sweep's run (`set_run_name`).
"""

from __future__ import annotations

import math
import sys
import time

import torch

from tinylm.config import TrainConfig
from tinylm.flops import flops_per_token
from tinylm.model import Transformer
from tinylm.parallel import RankContext
from tinylm.progress import ProgressClock
from tinylm.throughput import StepMeter, peak_flops

STAGE = "pretrain"
_label = f"[{STAGE}]"


def set_run_name(name: str | None) -> None:
    """Label this process's log lines with the run's name (`[pretrain NAME]`); None: `[pretrain]`."""
    global _label
    _label = f"[{STAGE} {name}]" if name else f"[{STAGE}]"


def log_line(enabled: bool, message: str) -> None:
    """Print `message` on stderr under this process's label, when `enabled` (rank 0)."""
    if enabled:
        print(f"{_label} {message}", file=sys.stderr, flush=True)


class TrainingLog:
    """Rank 0's account of a run: a header, a line every log_interval steps (the mean loss since
    the previous line, learning rate, throughput), validation and commit times, TensorBoard scalars
    and a closing summary. On the other ranks it only keeps time.

    ctx: the rank; train: the train section; model: the model being trained (its shape is printed
    from model.config); dtype: the autocast dtype; start: the step the run resumes after (0: fresh);
    state_dir: where steps are committed; tensorboard_dir: None for no event files;
    seconds_before: training wall time of the attempts this run resumes.
    """

    def __init__(
        self,
        ctx: RankContext,
        train: TrainConfig,
        model: Transformer,
        dtype: torch.dtype,
        start: int,
        state_dir: str,
        tensorboard_dir: str | None,
        seconds_before: float,
    ):
        self.train, self.enabled, self.start = train, ctx.is_main, start
        self.state_dir, self.seconds_before = state_dir, seconds_before
        self.tokens_per_step = train.batch_size * model.context_length
        peak = peak_flops(ctx.device, dtype, tf32=not train.deterministic, override=train.peak_flops)
        self.meter = StepMeter(
            self.tokens_per_step, flops_per_token(model.config), peak, ctx.world_size, ctx.device
        )
        self.writer = None
        if self.enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=start)
        self._header(ctx, model, dtype)
        self.loss_sum, self.loss_steps, self.val_loss = 0.0, 0, math.nan
        self.started = self._step_started = self._mark = time.perf_counter()
        self.clock = ProgressClock()  # lines by time between those by steps

    def _header(self, ctx: RankContext, model: Transformer, dtype: torch.dtype) -> None:
        train, shape = self.train, model.config
        parameters = sum(p.numel() for p in model.parameters())
        param_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.print(
            f"model: {parameters:,} parameters (vocab {shape['vocab_size']}, d_model {shape['d_model']}, "
            f"{shape['num_layers']} layers, {shape['num_heads']} heads, d_ff {shape['d_ff']}, context "
            f"{shape['context_length']}); {train.max_iters} steps of {self.tokens_per_step:,} tokens (batch "
            f"{train.batch_size} x context {shape['context_length']}), lr {train.lr_max:g} -> "
            f"{train.lr_min:g}, weight decay {train.weight_decay:g}, seed {train.seed}"
        )
        self.print(
            f"world size {ctx.world_size}, backend {ctx.backend or 'none'}, "
            f"device {ctx.device.type}, autocast {str(dtype).removeprefix('torch.')} (parameters "
            f"{param_dtype}), grad_accum_steps {train.grad_accum_steps}, activation checkpointing "
            f"{train.activation_checkpointing}; state {self.state_dir}; "
            + (f"resumed at step {self.start}" if self.start else "fresh start")
            + f"; the loss printed is the mean over the steps since the previous line (every "
            f"{train.log_interval} steps)"
        )

    def print(self, message: str) -> None:
        log_line(self.enabled, message)

    def train_seconds(self) -> float:
        """Training wall time so far, over every attempt of this run."""
        return round(self.seconds_before + time.perf_counter() - self.started, 3)

    def step_begins(self) -> None:
        self._step_started = time.perf_counter()

    def _logs(self, step: int) -> bool:
        return step % self.train.log_interval == 0 or step == self.train.max_iters

    def step_done(self, step: int, scaler, overflow: bool) -> None:
        """Account for the time of `step`, given the loss scaler and whether float16 gradients
        overflowed (the update was skipped); its loss comes later, with `values`."""
        train = self.train
        self.meter.add_step(time.perf_counter() - self._step_started)
        if step == self.start + 1 and train.compile:
            self.print(
                f"torch.compile: the first step took {self.meter.last_step_s:.1f} s (compilation included)"
            )
            self.meter.restart()
            self.clock.restart()  # the first timed line comes after compiled steps
        if not self._logs(step) and self.clock.due():
            # Between the lines by steps: the speed and the time left, so that a slow machine is
            # known within seconds (the loss keeps its log_interval windows).
            self.print(f"step {step}/{train.max_iters} {self.meter.report(train.max_iters - step)}")
            self.clock.printed()
        if overflow:
            self.print(
                f"step {step}: float16 gradients overflowed; update skipped, loss scale now {scaler.scale:g}"
            )
        self._mark = time.perf_counter()

    def values(self, step: int, loss: float, grad_norm: float, lrs: dict, scaler) -> None:
        """Account for the loss and gradient norm of `step` (read after its time, see
        tinylm/pretrain/loop.py) at the learning rates {group name: lr}: the log line of a
        log_interval step, and TensorBoard's scalars."""
        train = self.train
        self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
        if self._logs(step):
            mean_of = f"mean of {self.loss_steps} steps" if self.loss_steps > 1 else "1 step"
            lr = next(iter(lrs.values()))  # the first group's ("matrices")
            mean_loss = self.loss_sum / self.loss_steps
            self.print(
                f"step {step}/{train.max_iters} loss {mean_loss:.4f} ({mean_of}) lr {lr:.2e} "
                f"{self.meter.report(train.max_iters - step)}"
                + (f" loss scale {scaler.scale:g}" if scaler.enabled else "")
            )
            self.loss_sum, self.loss_steps = 0.0, 0
            self.clock.printed()
            self._mark = time.perf_counter()
        if self.writer is not None:
            self.writer.add_scalar("loss_train", loss, step)
            for name, group_lr in lrs.items():
                self.writer.add_scalar(f"lr/{name}", group_lr, step)
            self.writer.add_scalar("grad_norm", grad_norm, step)

    def validation(self, step: int, val_loss: float) -> None:
        """Log the validation estimate of `step`, computed since the step (or the last line) ended."""
        self.val_loss = val_loss
        self.print(f"step {step} val_loss {val_loss:.4f} ({self._since_mark():.1f} s)")
        if self.writer is not None:
            self.writer.add_scalar("val_loss", val_loss, step)

    def committed(self, step: int) -> None:
        """Log the commit of `step`, written since the step (or the last line) ended."""
        self.print(f"step {step} committed to {self.state_dir} ({self._since_mark():.1f} s)")

    def _since_mark(self) -> float:
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        return seconds

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
        train, wall = self.train, time.perf_counter() - self.started
        self.print(
            f"done: steps {self.start + 1}-{train.max_iters} of {train.max_iters} trained in {wall:.1f} s "
            f"({(train.max_iters - self.start) * self.tokens_per_step / max(wall, 1e-9):,.0f} tokens/s over "
            f"the wall time, validation and checkpoints included); final val_loss estimate "
            f"{self.val_loss:.4f} ({train.val_batches} batches; `evaluate` computes the exact loss); "
            f"committed steps in {self.state_dir}"
        )
