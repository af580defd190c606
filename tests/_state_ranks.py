"""Rank functions of tests/test_state.py: save_step / restore_step across world sizes, and a slow
or hung rank while saving. Also the toy training the tests compare against in the test process.

They live in a module because mp.spawn pickles a function by its module path (see
tests/helpers.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import assert_params_close, global_batch, lm_loss, make_toy, param_groups, write_result

from tinylm.checkpoint import Manifest
from tinylm.parallel import ShardedOptimizer


def make_trained(steps, seed: int = 21, sharded: bool = True):
    """The toy model and its optimizer (two groups, AdamW) after `steps` full-batch steps."""
    model = make_toy(seed=seed)
    groups = param_groups(model)
    optimizer = (
        ShardedOptimizer(groups, torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95))
        if sharded
        else torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    )
    train_toy(model, optimizer, steps)
    return model, optimizer


def train_toy(model, optimizer, steps) -> None:
    """Full-batch steps (the same on every rank) with the learning rate a function of the step."""
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (1 + step) / 10
        x, y = global_batch(step, 4)
        lm_loss(model, x, y, use_extra=True).backward()
        optimizer.step()
        optimizer.zero_grad()


class _ByteCounter:
    """Counts the bytes this process writes with os.pwrite and reads with os.pread / os.preadv."""

    def __init__(self):
        self.written = self.read = 0
        self._pwrite, self._pread, self._preadv = os.pwrite, os.pread, os.preadv
        os.pwrite, os.pread, os.preadv = self.pwrite, self.pread, self.preadv

    def pwrite(self, fd, data, offset):
        n = self._pwrite(fd, data, offset)
        self.written += n
        return n

    def pread(self, fd, n, offset):
        data = self._pread(fd, n, offset)
        self.read += len(data)
        return data

    def preadv(self, fd, buffers, offset):
        n = self._preadv(fd, buffers, offset)
        self.read += n
        return n


def _tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def own_share(model, optimizer, rank):
    """(bytes of the parameters this rank writes, bytes of the optimizer state it writes):
    the parameters whose first element it holds, and its pieces of the state."""

    writers = optimizer.parameter_writers()
    params = [p for p in model.parameters() if writers.get(p) == rank]
    pieces = [tensor for _, _, _, tensor in optimizer.state_pieces()]
    return sum(p.numel() * p.element_size() for p in params), _tensor_bytes(pieces)


def save_sharded(ctx, state_dir: str, out_dir: str, steps: int) -> None:
    """Train `steps` steps with ShardedOptimizer, then save_step; report what each rank wrote."""
    from tinylm.pretrain.state import save_step

    model, optimizer = make_trained(range(steps))
    counter = _ByteCounter()
    save_step(
        ctx,
        state_dir,
        steps,
        model,
        optimizer,
        manifest=Manifest(seed=0),
        entries={"tokens_seen": 20 * steps},
        per_rank={"rng": {"rank": ctx.rank, "torch": torch.get_rng_state()}},
    )
    owned_params, owned_state = own_share(model, optimizer, ctx.rank)
    write_result(
        out_dir,
        ctx.rank,
        {"written": counter.written, "owned_params": owned_params, "owned_state": owned_state},
    )


def restore_sharded_and_continue(ctx, state_dir: str, out_dir: str, steps: int, more: int) -> None:
    """restore_step at this world size, then `more` steps; rank 0 saves the parameters."""
    from tinylm.pretrain.state import restore_step

    model, optimizer = make_trained([], seed=99 + ctx.rank)  # a restore must overwrite all of it
    counter = _ByteCounter()
    rest = restore_step(ctx, state_dir, model, optimizer)
    read = counter.read
    assert rest["iteration"] == steps and rest["tokens_seen"] == 20 * steps
    assert [entry["rank"] for entry in rest["rng"]] == [0, 1]  # saved by two ranks
    assert all(state["step"].device.type == "cpu" for state in optimizer.local_state().values())
    owned_params, _ = own_share(model, optimizer, ctx.rank)
    owned_state = _tensor_bytes(list(optimizer.local_state().values()))
    train_toy(model, optimizer, range(steps, steps + more))
    if ctx.is_main:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out_dir, "params.pt"))
    # Then this world size saves its own step (its state re-sliced), for a resume at another one.
    from tinylm.pretrain.state import save_step

    resaved = Path(out_dir, "state")
    save_step(
        ctx,
        resaved,
        steps + more,
        model,
        optimizer,
        manifest=Manifest(seed=0),
        entries={"tokens_seen": 20 * (steps + more)},
        per_rank={"rng": {"rank": ctx.rank}},
    )
    write_result(out_dir, ctx.rank, {"read": read, "owned_params": owned_params, "owned_state": owned_state})


def checkpoint_with_a_slow_or_hung_rank(
    ctx, state_dir: str, out_dir: str, rank_to_slow: int, delay_s: float
) -> None:
    """save_step while `rank_to_slow` sleeps `delay_s` before each piece it writes (forever if < 0).

    Afterwards the group must still work (an all-reduce) and the step must restore.
    """
    from tinylm.pretrain.state import restore_step, save_step

    model, optimizer = make_trained(range(2))
    if ctx.rank == rank_to_slow:
        real_pwrite = os.pwrite

        def slow_pwrite(fd, data, offset):
            time.sleep(delay_s if delay_s >= 0 else 3600)
            return real_pwrite(fd, data, offset)

        os.pwrite = slow_pwrite
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    start = time.monotonic()
    save_step(ctx, state_dir, 2, model, optimizer, manifest=Manifest(seed=0))
    seconds = time.monotonic() - start
    total = torch.ones(1)
    dist.all_reduce(total)
    fresh, fresh_optimizer = make_trained([], seed=99 + ctx.rank)
    restore_step(ctx, state_dir, fresh, fresh_optimizer)
    assert_params_close(fresh, model, 0.0, "restored")
    write_result(out_dir, ctx.rank, {"save_s": seconds, "sum": total.item()})
