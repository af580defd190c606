"""Fault injection into training runs, for the tests: TINYLM_FAULT="rank=R,step=S,action=A".

`maybe_inject_fault(rank, step)` fails on purpose when TINYLM_FAULT names this rank and step:
action=raise raises a RuntimeError, exit ends the process with FAULT_EXIT_CODE without cleanup,
kill sends it SIGKILL, hang sleeps forever; nan and overflow return their name (the caller poisons
the step). Rank functions of the launcher tests call it directly.

`install()` patches tinylm.pretrain.loop and the cross-entropy of the model's loss region
(tinylm.model.transformer) so that a real run fails where TINYLM_FAULT says (each name it replaces
is checked to be the object it was written for, so a rename there fails loudly rather than
disarming the patch): the first
micro-batch of update S + 1 (0-based step S) on rank R calls `maybe_inject_fault`, and for nan the
loss of that update's training forwards becomes NaN, for overflow their gradient is multiplied by
2**100 in backward (finite in float32, an overflow in float16). TINYLM_PARAM_DTYPE=float64 makes
the run's parameters and optimizer state float64 (exactness tests). Ranks started by mp.spawn get
the same patches through tests/fault_injection/sitecustomize.py: put that folder on PYTHONPATH
(`fault_env`).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import torch

FAULT_ENV = "TINYLM_FAULT"
DTYPE_ENV = "TINYLM_PARAM_DTYPE"
FAULT_ACTIONS = ("raise", "exit", "kill", "hang", "nan", "overflow")
FAULT_EXIT_CODE = 17
OVERFLOW_FACTOR = 2.0**100
SITE_DIR = Path(__file__).resolve().parent / "fault_injection"


def fault_env(
    env: dict[str, str], fault: str | None = None, param_dtype: str | None = None
) -> dict[str, str]:
    """`env` with TINYLM_FAULT / TINYLM_PARAM_DTYPE set (or removed) and the patches on PYTHONPATH."""
    env = {k: v for k, v in env.items() if k not in (FAULT_ENV, DTYPE_ENV)}
    if fault:
        env[FAULT_ENV] = fault
    if param_dtype:
        env[DTYPE_ENV] = param_dtype
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE_DIR), env.get("PYTHONPATH")]))
    return env


def parse_fault(spec: str) -> tuple[int, int, str]:
    """Parse 'rank=R,step=S,action=A' into (R, S, A)."""
    fields = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected key=value items, got {item!r}")
        fields[key.strip()] = value.strip()
    if set(fields) != {"rank", "step", "action"}:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected exactly the keys rank, step, action")
    if fields["action"] not in FAULT_ACTIONS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: action must be one of {', '.join(FAULT_ACTIONS)}")
    return int(fields["rank"]), int(fields["step"]), fields["action"]


def maybe_inject_fault(rank: int, step: int) -> str | None:
    """Fail as TINYLM_FAULT says if it names this rank and step; see the module docs."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault_rank, fault_step, action = parse_fault(spec)
    if (rank, step) != (fault_rank, fault_step):
        return None
    if action == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec}) on rank {rank} at step {step}")
    if action == "exit":
        os._exit(FAULT_EXIT_CODE)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        while True:
            time.sleep(3600)
    return action


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _original(owner, name: str, expected):
    """`owner.name`, checked to be `expected` (the object the patch is written for). A patch set on a
    name that the module no longer has, or no longer uses for that object, would change nothing and
    let a fault test pass for the wrong reason: a rename there fails here instead."""
    value = getattr(owner, name, None)
    if value is not expected:
        raise RuntimeError(
            f"tests/_faults.py: {getattr(owner, '__name__', owner)}.{name} is not {expected!r} any more; "
            "follow the rename here, or the fault injection would be disarmed"
        )
    return value


def install() -> None:
    """Patch tinylm.pretrain.loop as TINYLM_FAULT and TINYLM_PARAM_DTYPE say (nothing if neither is set)."""
    import tinylm.model.transformer as model_module
    import tinylm.pretrain.loop as training
    from tinylm.data import TrainBatches
    from tinylm.model import Transformer
    from tinylm.nn_utils import cross_entropy as ours

    if os.environ.get(DTYPE_ENV):
        dtype = getattr(torch, os.environ[DTYPE_ENV])
        training.Transformer = functools.partial(_original(training, "Transformer", Transformer), dtype=dtype)
    if not os.environ.get(FAULT_ENV):
        return
    poison: dict[str, str | None] = {"action": None}  # the action of the update in progress
    _original(training, "TrainBatches", TrainBatches)
    # The training loss is Transformer.output_loss's (model(x, targets=y)).
    get_batch, cross_entropy = TrainBatches.get, _original(model_module, "cross_entropy", ours)

    def get(self, step: int, micro_step: int):
        if micro_step == 0:
            poison["action"] = maybe_inject_fault(self.rank, step - 1)
        return get_batch(self, step, micro_step)

    def poisoned_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and poison["action"] == "nan":  # training forwards only
            logits = logits * float("nan")
        elif torch.is_grad_enabled() and poison["action"] == "overflow":
            logits = _ScaleGradient.apply(logits, OVERFLOW_FACTOR)
        return cross_entropy(logits, targets)

    training.TrainBatches.get = get
    model_module.cross_entropy = poisoned_cross_entropy
