"""Rank functions for the parallel tests. They live in a module, not in the test files, because
mp.spawn pickles a function by its module path and the spawned process imports it from here.

Each rank function asserts inside the rank (a failed assertion fails the job, so `launch` raises
RankFailedError with the assertion's traceback) and then writes a small result file that the test
reads, so a test also fails if the checks never ran.

Run as a script, `python tests/_parallel_helpers.py OUT` trains a tiny model on two ranks and
writes its final parameters to OUT: under torchrun it is one rank, otherwise it spawns both.
"""

from __future__ import annotations

import copy
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _faults import maybe_inject_fault
from torch import nn

from tinylm.parallel import DDP, ShardedOptimizer, launch

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


def assert_grads_close(actual: nn.Module, expected: nn.Module, what: str) -> None:
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters(), strict=True):
        if e.grad is None:
            assert a.grad is None, f"{what}: {name} should have no gradient"
            continue
        assert a.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-9, atol=1e-12, msg=f"{what}: grad of {name}")


def assert_grads_in_buckets(ddp: DDP, what: str) -> None:
    """Every gradient is a view into a bucket of `ddp`, and the buckets hold each gradient once."""
    buffers = {bucket.buffer.untyped_storage().data_ptr() for bucket in ddp._buckets}
    trainable = [p for p in ddp.module.parameters() if p.requires_grad]
    for p in trainable:
        if p.grad is not None:
            assert p.grad.untyped_storage().data_ptr() in buffers, f"{what}: a gradient outside the buckets"
    held = sum(grads.numel() for bucket in ddp._buckets for _, _, grads in bucket.runs)
    assert held == sum(p.numel() for p in trainable), f"{what}: buckets hold {held} gradient elements"


def write_result(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# DDP


def ddp_matches_single_process(ctx, out_dir: str, bucket_sizes_mb: list[float]) -> None:
    """For each bucket size: DDP + AdamW for 5 steps equals single-process AdamW on the global batch.

    Rank r starts from its own random init; DDP must replace it with rank 0's. The reference starts
    from rank 0's init and trains on the whole global batch; gradients are compared each step,
    parameters after every step. A second pass lets only rank 1 use the `extra` layer (a parameter
    with no gradient on some ranks); its reference averages the per-rank losses.
    """
    world, rank = ctx.world_size, ctx.rank
    batch = 2 * world
    worst = 0.0
    for bucket_mb in bucket_sizes_mb:
        for branch in (False, True):
            ddp = DDP(make_toy(seed=1000 + rank), bucket_size_mb=bucket_mb)
            reference = make_toy(seed=1000)
            assert_params_close(ddp.module, reference, 0.0, "after wrapping")
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
            for step in range(5):
                x, y = global_batch(step, batch)
                use_extra = branch and rank == 1
                lm_loss(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world), use_extra).backward()
                ddp.finish_gradient_sync()
                if branch:
                    losses = [
                        lm_loss(reference, rank_slice(x, r, world), rank_slice(y, r, world), r == 1)
                        for r in range(world)
                    ]
                    (sum(losses) / world).backward()
                else:
                    lm_loss(reference, x, y).backward()
                what = f"bucket {bucket_mb} MB, branch={branch}, step {step}"
                assert_grads_close(ddp.module, reference, what)
                assert_grads_in_buckets(ddp, what)
                opt.step()
                ref_opt.step()
                opt.zero_grad()
                ref_opt.zero_grad()
                worst = max(worst, assert_params_close(ddp.module, reference, 1e-6, what))
            assert ddp.module.unused.grad is None
    write_result(out_dir, rank, {"worst": worst, "buckets": bucket_sizes_mb})


def ddp_matches_torch_ddp(ctx, out_dir: str) -> None:
    """Our DDP and torch's DistributedDataParallel, same init and data, agree for 5 AdamW steps."""
    world, rank = ctx.world_size, ctx.rank
    ours = DDP(make_toy(seed=7 + rank))
    theirs = nn.parallel.DistributedDataParallel(make_toy(seed=7 + rank), find_unused_parameters=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(5):
        x, y = global_batch(step, 2 * world)
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        lm_loss(ours, x, y).backward()
        ours.finish_gradient_sync()
        lm_loss(theirs, x, y).backward()
        opt.step()
        their_opt.step()
        opt.zero_grad()
        their_opt.zero_grad()
        worst = max(worst, assert_params_close(ours.module, theirs.module, 1e-6, f"step {step}"))
    write_result(out_dir, rank, {"worst": worst})


def ddp_overlaps_backward(ctx, out_dir: str) -> None:
    """Record the order of gradient hooks and all-reduce launches during one backward.

    A deep stack with one parameter per bucket: the all-reduces of the last layers must start
    while earlier layers' gradients are still being computed.
    """
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    events: list[str] = []
    original_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append("all_reduce")
        return original_all_reduce(tensor, *args, **kwargs)

    # Registered before DDP's hooks, so "grad" is recorded before DDP reacts to that gradient.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    ddp = DDP(model, bucket_size_mb=1e-9)
    dist.all_reduce = recording_all_reduce
    try:
        ddp(torch.randn(4, 16)).square().sum().backward()
        events.append("backward returned")
        ddp.finish_gradient_sync()
    finally:
        dist.all_reduce = original_all_reduce
    last_grad = max(i for i, e in enumerate(events) if e == "grad")
    early = events[:last_grad].count("all_reduce")
    write_result(
        out_dir,
        ctx.rank,
        {"events": events, "early_all_reduces": early, "buckets": len(list(model.parameters()))},
    )


def ddp_no_sync_accumulates(ctx, out_dir: str) -> None:
    """Two no_sync micro-steps and one synced micro-step equal one step on the whole global batch.

    Twice, with optimizer.zero_grad(set_to_none=True) before each step as a training loop does;
    the accumulation happens in the buckets, and no_sync starts no communication.
    """
    world, rank = ctx.world_size, ctx.rank
    micro = 3
    ddp = DDP(make_toy(seed=3 + rank), bucket_size_mb=1e-4)
    reference = make_toy(seed=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    calls = []
    original_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(1)
        return original_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            x, y = global_batch(step, 2 * world * micro)
            chunks = list(zip(x.chunk(micro), y.chunk(micro), strict=True))
            before = len(calls)
            for i, (xc, yc) in enumerate(chunks):
                loss = lm_loss(ddp, rank_slice(xc, rank, world), rank_slice(yc, rank, world)) / micro
                if i < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                        ddp.finish_gradient_sync()  # a no-op inside no_sync
                    assert len(calls) == before, "no_sync must not communicate"
                    assert_grads_in_buckets(ddp, f"step {step}, micro-step {i}")
                else:
                    loss.backward()
                    ddp.finish_gradient_sync()
            lm_loss(reference, x, y).backward()
            assert_grads_close(ddp.module, reference, f"accumulated, step {step}")
            assert_grads_in_buckets(ddp, f"step {step}")
            opt.step()
            ref_opt.step()
    finally:
        dist.all_reduce = original_all_reduce
    write_result(out_dir, rank, {"all_reduces": len(calls)})


def ddp_of_compiled_model(ctx, out_dir: str) -> None:
    """DDP around torch.compile(model), with a ShardedOptimizer, trains as DDP around the model.

    The gradients land in the buckets, and the parameters (views into the optimizer's flat
    buffers, laid out before the first forward) stay what compiled code reads and the optimizer
    writes.
    """
    world, rank = ctx.world_size, ctx.rank
    model = make_toy(seed=9 + rank)
    plain = DDP(make_toy(seed=9 + rank), bucket_size_mb=1e-4)
    compiled = DDP(torch.compile(model), bucket_size_mb=1e-4)
    optimizers = [ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2) for ddp in (plain, compiled)]
    for step in range(3):
        for ddp, optimizer in zip((plain, compiled), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            x, y = global_batch(step, 2 * world)
            lm_loss(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            ddp.finish_gradient_sync()
        assert_grads_close(model, plain.module, f"step {step}")
        assert_grads_in_buckets(compiled, f"compiled, step {step}")
        for optimizer in optimizers:
            optimizer.step()
        assert_params_close(model, plain.module, 1e-9, f"after step {step}")
    write_result(out_dir, rank, {"checked": True})


# ---------------------------------------------------------------------------------------------
# ShardedOptimizer


def optimizer_class(name: str):
    if name == "torch":
        return torch.optim.AdamW
    from tinylm.optim import AdamW

    return AdamW


def _param_groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(model, extra, opt, steps, add_extra_at=None):
    """Every rank computes the same loss; the lr changes every step; `extra` joins the optimizer late."""
    for step in steps:
        if step == add_extra_at:
            opt.add_param_group({"params": [extra], "weight_decay": 0.05})
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 + step) / 10
        x, y = global_batch(step, 4)
        (lm_loss(model, x, y) + 0.01 * extra.square().sum()).backward()
        opt.step()
        opt.zero_grad()


def sharded_matches_adamw(ctx, out_dir: str, optimizer_name: str, bucket_mb: float) -> None:
    """ShardedOptimizer(AdamW) equals AdamW for 11 steps; its state is sharded and consolidates.

    The parameters live in the owners' flat buffers, and a step broadcasts those in buckets (the
    11th step counts them). Then the consolidated state dict must equal the plain optimizer's,
    survive torch.save/torch.load with weights_only=True, load into a plain AdamW and into a fresh
    ShardedOptimizer, and all three must continue training identically.
    """
    cls = optimizer_class(optimizer_name)
    world, rank = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    extra = nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
    model, reference = make_toy(seed=5), make_toy(seed=5)
    ref_extra = nn.Parameter(extra.detach().clone())
    opt = ShardedOptimizer(_param_groups(model), cls, bucket_size_mb=bucket_mb, lr=1e-2, betas=(0.9, 0.95))
    ref_opt = cls(_param_groups(reference), lr=1e-2, betas=(0.9, 0.95))
    for step in range(10):
        _train(model, extra, opt, [step], add_extra_at=4)
        _train(reference, ref_extra, ref_opt, [step], add_extra_at=4)
        assert_params_close(model, reference, 1e-6, f"step {step}")
        assert (extra - ref_extra).abs().max().item() <= 1e-6
    all_params = [p for group in opt.param_groups for p in group["params"]]

    # Communication: the parameters are views into the owners' flat buffers, which a step
    # broadcasts in buckets of at most bucket_mb, one collective per bucket.
    flats = {flat.untyped_storage().data_ptr() for _, flat in opt._flat}
    assert all(p.untyped_storage().data_ptr() in flats for p in all_params)
    broadcasts = []
    original_broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        broadcasts.append(tensor.numel() * tensor.element_size())
        return original_broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting_broadcast
    try:
        _train(model, extra, opt, [10])
    finally:
        dist.broadcast = original_broadcast
    _train(reference, ref_extra, ref_opt, [10])
    assert_params_close(model, reference, 1e-6, "step 10")

    # Sharding: disjoint shares that cover everything, balanced by elements, state only for the share.
    index = {p: i for i, p in enumerate(all_params)}
    owned = sorted(index[p] for group in opt.local_optimizer.param_groups for p in group["params"])
    shares: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(shares, owned)
    assert sorted(i for share in shares for i in share) == list(range(len(all_params)))
    owned_elements = sum(all_params[i].numel() for i in owned)
    # Only parameters that ever had a gradient have state (not `unused`, not `extra` of the model).
    ref_params = [p for group in ref_opt.param_groups for p in group["params"]]
    stateful = [i for i in owned if ref_params[i] in ref_opt.state]
    assert set(opt.state) == {all_params[i] for i in stateful}
    state_elements = sum(
        v.numel() for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")
    )
    assert state_elements == 2 * sum(all_params[i].numel() for i in stateful)

    # Consolidated state: the plain optimizer's format and values, loadable with weights_only=True.
    full = opt.state_dict()
    expected = ref_opt.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert full["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert full["state"][i].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(full["state"][i][name], value, rtol=0, atol=1e-12)
    buffer = io.BytesIO()
    torch.save(full, buffer)
    buffer.seek(0)
    full = torch.load(buffer, weights_only=True)

    plain_model, plain_extra = copy.deepcopy(model), nn.Parameter(extra.detach().clone())
    plain_opt = cls([*_param_groups(plain_model), {"params": [plain_extra]}], lr=0.0)
    plain_opt.load_state_dict(copy.deepcopy(full))  # load_state_dict may alias the tensors
    resharded_model, resharded_extra = copy.deepcopy(model), nn.Parameter(extra.detach().clone())
    resharded_opt = ShardedOptimizer(
        [*_param_groups(resharded_model), {"params": [resharded_extra]}], cls, lr=0.0, betas=(0.5, 0.5)
    )
    resharded_opt.load_state_dict(copy.deepcopy(full))
    for step in range(11, 14):
        _train(model, extra, opt, [step])
        _train(plain_model, plain_extra, plain_opt, [step])
        _train(resharded_model, resharded_extra, resharded_opt, [step])
        assert_params_close(plain_model, model, 1e-6, f"plain after load, step {step}")
        assert_params_close(resharded_model, model, 1e-6, f"resharded after load, step {step}")
        assert (plain_extra - extra).abs().max().item() <= 1e-6
        assert (resharded_extra - extra).abs().max().item() <= 1e-6
    write_result(
        out_dir,
        rank,
        {
            "owned_elements": owned_elements,
            "state_elements": state_elements,
            "total_elements": sum(p.numel() for p in all_params),
            "largest": max(p.numel() for p in all_params),
            "broadcasts": broadcasts,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in all_params),
            "num_parameters": len(all_params),
        },
    )


def sharded_balances(ctx, out_dir: str, sizes: list[int]) -> None:
    """Report how many elements this rank owns among parameters of the given sizes."""
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)
    owned = [i for i, p in enumerate(params) if opt.owner[p] == ctx.rank]
    local = [p for group in opt.local_optimizer.param_groups for p in group["params"]]
    assert [params[i] for i in owned] == local
    write_result(out_dir, ctx.rank, {"owned": owned, "elements": sum(sizes[i] for i in owned)})


# ---------------------------------------------------------------------------------------------
# Committed states: save_step / restore_step across world sizes, and waits that are not collectives


def make_trained(steps, seed: int = 21, sharded: bool = True):
    """The toy model and its optimizer (two groups, AdamW) after `steps` full-batch steps."""
    model = make_toy(seed=seed)
    groups = _param_groups(model)
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
    """(bytes of the parameters this rank owns, bytes of its optimizer state)."""
    params = [p for p in model.parameters() if optimizer.owner.get(p) == rank]
    return sum(p.numel() * p.element_size() for p in params), _tensor_bytes(dict(optimizer.state))


def save_sharded(ctx, state_dir: str, out_dir: str, steps: int) -> None:
    """Train `steps` steps with ShardedOptimizer, then save_step; report what each rank wrote."""
    from tinylm.state import save_step

    model, optimizer = make_trained(range(steps))
    counter = _ByteCounter()
    save_step(
        ctx,
        state_dir,
        steps,
        model,
        optimizer,
        manifest={"run": "toy"},
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
    from tinylm.state import restore_step

    model, optimizer = make_trained([], seed=99 + ctx.rank)  # a restore must overwrite all of it
    counter = _ByteCounter()
    rest = restore_step(ctx, state_dir, model, optimizer)
    read = counter.read
    assert rest["iteration"] == steps and rest["tokens_seen"] == 20 * steps
    assert [entry["rank"] for entry in rest["rng"]] == [0, 1]  # saved by two ranks
    assert all(state["step"].device.type == "cpu" for state in optimizer.state.values())
    owned_params, owned_state = own_share(model, optimizer, ctx.rank)
    train_toy(model, optimizer, range(steps, steps + more))
    if ctx.is_main:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out_dir, "params.pt"))
    write_result(out_dir, ctx.rank, {"read": read, "owned_params": owned_params, "owned_state": owned_state})


def checkpoint_with_a_slow_or_hung_rank(
    ctx, state_dir: str, out_dir: str, rank_to_slow: int, delay_s: float
) -> None:
    """save_step while `rank_to_slow` sleeps `delay_s` before each piece it writes (forever if < 0).

    Afterwards the group must still work (an all-reduce) and the step must restore.
    """
    from tinylm.state import restore_step, save_step

    model, optimizer = make_trained(range(2))
    if ctx.rank == rank_to_slow:
        real_pwrite = os.pwrite

        def slow_pwrite(fd, data, offset):
            time.sleep(delay_s if delay_s >= 0 else 3600)
            return real_pwrite(fd, data, offset)

        os.pwrite = slow_pwrite
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    start = time.monotonic()
    save_step(ctx, state_dir, 2, model, optimizer, manifest={"run": "toy"})
    seconds = time.monotonic() - start
    total = torch.ones(1)
    dist.all_reduce(total)
    fresh, fresh_optimizer = make_trained([], seed=99 + ctx.rank)
    restore_step(ctx, state_dir, fresh, fresh_optimizer)
    assert_params_close(fresh, model, 0.0, "restored")
    write_result(out_dir, ctx.rank, {"save_s": seconds, "sum": total.item()})


# ---------------------------------------------------------------------------------------------
# launch


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
