"""The toy model, batches and checks that the rank functions of the parallel tests share.

The rank functions live in modules, not in the test files, because mp.spawn pickles a function by
its module path and the spawned process imports it from there: tests/_ddp_ranks.py,
tests/_sharded_ranks.py, tests/_state_ranks.py and tests/_launch_ranks.py, one per test file.
Each rank function asserts inside the rank (a failed assertion fails the job, so `launch` raises
RankFailedError with the assertion's traceback) and then writes a small result file that the test
reads, so a test also fails if the checks never ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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
