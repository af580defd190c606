"""Rank functions of tests/test_launch.py: what a rank sees, faults, hangs, and a tiny training run.

They live in a module because mp.spawn pickles a function by its module path (see
tests/helpers.py).

Run as a script, `python tests/_launch_ranks.py OUT` trains a tiny model on two ranks and writes its
final parameters to OUT: under torchrun it is one rank, otherwise it spawns both.
`python tests/_launch_ranks.py --wait OUT` starts two ranks that wait until they are killed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _faults import maybe_inject_fault
from helpers import global_batch, lm_loss, make_toy, rank_slice, write_result

from tinylm.parallel import DDP, ShardedOptimizer, launch


def report_context(ctx, out_dir: str) -> None:
    """Write what this rank sees; check the group works with one all-reduce."""
    total = torch.tensor([ctx.rank + 1.0])
    if ctx.backend is not None:
        dist.all_reduce(total)
    result = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "is_main": ctx.is_main,
        "threads": torch.get_num_threads(),
        "sum_of_ranks_plus_one": total.item(),
        "group_initialized": dist.is_initialized(),
    }
    write_result(out_dir, ctx.rank, result)


def steps_with_fault(ctx, out_dir: str) -> None:
    """Write this rank's pid, then run 5 steps of one all-reduce each, calling maybe_inject_fault."""
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    for step in range(5):
        maybe_inject_fault(ctx.rank, step)
        dist.all_reduce(torch.ones(1))


def sleep_forever_on_rank1(ctx, out_dir: str) -> None:
    """Rank 1 hangs outside any collective; rank 0 waits for it in a barrier."""
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    if ctx.rank == 1:
        while True:
            time.sleep(3600)
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# A tiny end-to-end training run, used by the torchrun and concurrent-launch tests.


def train_tiny(ctx, out_path: str) -> None:
    """DDP + ShardedOptimizer for 3 steps on the toy model; rank 0 saves the parameters."""
    model = DDP(make_toy(seed=11 + ctx.rank), bucket_size_mb=1e-4)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        x, y = global_batch(step, 2 * ctx.world_size)
        lm_loss(
            model, rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        ).backward()
        model.finish_gradient_sync()
        opt.step()
        opt.zero_grad()
    if ctx.is_main:
        torch.save(model.module.state_dict(), out_path)


def wait_in_a_barrier(ctx, out_dir: str) -> None:
    """Write this rank's pid and wait at a barrier that only ends with the collective timeout."""
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(3600)
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wait"]:  # ranks that wait for a long time, for the tests that kill the launcher
        launch(wait_in_a_barrier, args=(sys.argv[2],), world_size=2, backend="gloo", timeout_s=600.0)
    else:
        launch(train_tiny, args=(sys.argv[1],), world_size=2, backend="gloo", timeout_s=60.0)
