"""Rank 0's account of a training run: log lines on stderr and TensorBoard scalars.

Every line starts with `[pretrain]`, or `[pretrain NAME]` for a sweep's run (`set_run_name`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

import torch

from tinylm.parallel import RankContext
from tinylm.throughput import StepMeter, flops_per_token, peak_flops

if TYPE_CHECKING:
    from tinylm.model import Transformer
    from tinylm.training import RunSpec

_log_label = "[pretrain]"


def set_run_name(name: str | None) -> None:
    """Label this process's log lines with the run's name (`[pretrain NAME]`); None: `[pretrain]`."""
    global _log_label
    _log_label = f"[pretrain {name}]" if name else "[pretrain]"


def log_line(enabled: bool, message: str) -> None:
    if enabled:
        print(f"{_log_label} {message}", file=sys.stderr, flush=True)


class TrainingLog:
    """Rank 0's account of a run: a header, a line every log_interval steps (the mean loss since
    the previous line, learning rate, throughput), validation and commit times, TensorBoard scalars
    and a closing summary. On the other ranks it only keeps time."""

    def __init__(self, ctx: RankContext, spec: RunSpec, model: Transformer, dtype: torch.dtype, start: int):
        t = self.t = spec.cfg.train
        self.enabled, self.spec, self.start = ctx.is_main, spec, start
        self.tokens_per_step = t.batch_size * spec.model_config["context_length"]
        peak = peak_flops(ctx.device, dtype, tf32=not t.deterministic, override=t.peak_flops)
        self.meter = StepMeter(
            self.tokens_per_step, flops_per_token(spec.model_config), peak, ctx.world_size, ctx.device
        )
        self.writer = None
        if self.enabled and spec.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=spec.tensorboard_dir, purge_step=start)
        self._header(ctx, model, dtype)
        self.loss_sum, self.loss_steps, self.val_loss = 0.0, 0, math.nan
        self.started = self._step_started = self._mark = time.perf_counter()

    def _header(self, ctx: RankContext, model: Transformer, dtype: torch.dtype) -> None:
        t, m = self.t, self.spec.cfg.model
        parameters = sum(p.numel() for p in model.parameters())
        param_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.print(
            f"model: {parameters:,} parameters (vocab {model.vocab_size}, d_model {m.d_model}, "
            f"{m.num_layers} layers, {m.num_heads} heads, d_ff {m.d_ff}, context {m.context_length}); "
            f"{t.max_iters} steps of {self.tokens_per_step:,} tokens (batch {t.batch_size} x context "
            f"{m.context_length}), lr {t.lr_max:g} -> {t.lr_min:g}, weight decay {t.weight_decay:g}, "
            f"seed {t.seed}"
        )
        self.print(
            f"world size {ctx.world_size}, backend {ctx.backend or 'none'}, "
            f"device {ctx.device.type}, autocast {str(dtype).removeprefix('torch.')} (parameters "
            f"{param_dtype}), grad_accum_steps {t.grad_accum_steps}; state {self.spec.state_dir}; "
            + (f"resumed at step {self.start}" if self.start else "fresh start")
            + f"; the loss printed is the mean over the steps since the previous line (every "
            f"{t.log_interval} steps)"
        )

    def print(self, message: str) -> None:
        log_line(self.enabled, message)

    def train_seconds(self) -> float:
        """Training wall time so far, over every attempt of this run."""
        return round(self.spec.seconds_before + time.perf_counter() - self.started, 3)

    def step_begins(self) -> None:
        self._step_started = time.perf_counter()

    def step_done(self, step: int, loss: float, grad_norm: float, lrs: dict, scaler, overflow: bool) -> None:
        t = self.t
        self.meter.add_step(time.perf_counter() - self._step_started)
        self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
        if step == self.start + 1 and t.compile:
            self.print(
                f"torch.compile: the first step took {self.meter.last_step_s:.1f} s (compilation included)"
            )
            self.meter.restart()
        if step % t.log_interval == 0 or step == t.max_iters:
            mean_of = f"mean of {self.loss_steps} steps" if self.loss_steps > 1 else "1 step"
            lr = next(iter(lrs.values()))  # the first group's ("matrices")
            mean_loss = self.loss_sum / self.loss_steps
            self.print(
                f"step {step}/{t.max_iters} loss {mean_loss:.4f} ({mean_of}) lr {lr:.2e} "
                f"{self.meter.report(t.max_iters - step)}"
                + (f" loss scale {scaler.scale:g}" if scaler.enabled else "")
            )
            self.loss_sum, self.loss_steps = 0.0, 0
        if overflow:
            self.print(
                f"step {step}: float16 gradients overflowed; update skipped, loss scale now {scaler.scale:g}"
            )
        if self.writer is not None:
            self.writer.add_scalar("loss_train", loss, step)
            for name, group_lr in lrs.items():
                self.writer.add_scalar(f"lr/{name}", group_lr, step)
            self.writer.add_scalar("grad_norm", grad_norm, step)
        self._mark = time.perf_counter()

    def validation(self, step: int, val_loss: float) -> None:
        """Log the validation estimate of `step`, computed since the step (or the last line) ended."""
        self.val_loss = val_loss
        self.print(f"step {step} val_loss {val_loss:.4f} ({self._since_mark():.1f} s)")
        if self.writer is not None:
            self.writer.add_scalar("val_loss", val_loss, step)

    def committed(self, step: int) -> None:
        """Log the commit of `step`, written since the step (or the last line) ended."""
        self.print(f"step {step} committed to {self.spec.state_dir} ({self._since_mark():.1f} s)")

    def _since_mark(self) -> float:
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        return seconds

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
        t, wall = self.t, time.perf_counter() - self.started
        self.print(
            f"done: steps {self.start + 1}-{t.max_iters} of {t.max_iters} trained in {wall:.1f} s "
            f"({(t.max_iters - self.start) * self.tokens_per_step / max(wall, 1e-9):,.0f} tokens/s over the "
            f"wall time, validation and checkpoints included); final val_loss estimate {self.val_loss:.4f} "
            f"({t.val_batches} batches; `evaluate` computes the exact loss); committed steps in "
            f"{self.spec.state_dir}"
        )
