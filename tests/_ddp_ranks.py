"""Rank functions of tests/test_ddp.py: DDP against single-process training and torch's DDP,
no_sync, overlap with backward, compiled models, ZeRO-1 traffic and gradient storage.

They live in a module because mp.spawn pickles a function by its module path (see
tests/helpers.py). Each asserts inside the rank and then writes a small result file that
the test reads.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from helpers import (
    assert_params_close,
    global_batch,
    lm_loss,
    make_toy,
    param_groups,
    rank_slice,
    write_result,
)
from torch import nn

from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import AdamW
from tinylm.parallel import DDP, ShardedOptimizer


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
    held = sum(bucket.buffer.numel() for bucket in ddp._buckets)
    assert held == sum(p.numel() for p in trainable), f"{what}: buckets hold {held} gradient elements"


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
# ZeRO-1: reduce to the owner, traffic, overlap


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


class ByteCounter:
    """Wraps torch.distributed's collectives and sums the bytes this rank sends, by kind.

    Bytes sent per call, for a tensor of n bytes in a world of w (ring algorithms): all_reduce
    2 (w - 1) / w * n; reduce_scatter (n: the input) and all_gather (n: the output) (w - 1) / w * n;
    reduce: n unless this rank is the destination; broadcast: n if this rank is the source. (At
    w = 2 these are exact for every algorithm.)
    """

    def __init__(self):
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._originals = {}

    def __enter__(self) -> ByteCounter:
        rank, w = dist.get_rank(), dist.get_world_size()

        def wrap(kind, original):
            def counted(tensor, *args, **kwargs):
                if kind == "reduce_scatter":  # (output, input): the input is what is reduced
                    n = args[0].numel() * args[0].element_size()
                else:
                    n = tensor.numel() * tensor.element_size()
                if kind == "all_reduce":
                    sent = 2 * (w - 1) / w * n
                elif kind in ("reduce_scatter", "all_gather"):
                    sent = (w - 1) / w * n
                elif kind == "reduce":
                    sent = 0 if kwargs.get("dst", args[0] if args else None) == rank else n
                else:  # broadcast
                    sent = n if kwargs.get("src", args[0] if args else None) == rank else 0
                self.sent[kind] = self.sent.get(kind, 0) + sent
                self.calls[kind] = self.calls.get(kind, 0) + 1
                return original(tensor, *args, **kwargs)

            return counted

        names = {"all_reduce": "all_reduce", "reduce": "reduce", "broadcast": "broadcast"}
        names["reduce_scatter"] = (
            "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        )
        names["all_gather"] = (
            "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        )
        for kind, name in names.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(kind, self._originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    @property
    def total(self) -> float:
        return sum(self.sent.values())


def zero1_matches_single_process(ctx, out_dir: str) -> None:
    """DDP(shards) + ShardedOptimizer(AdamW) + its global clip equals single-process AdamW.

    The loop zeroes the buckets (ddp.zero_grad()), so from the first step on every `.grad` keeps
    its storage; each rank's slices of the gradients equal the reference's; the clipped norm is the
    reference's (to float rounding: split tensors are summed in parts); the parameters agree after
    every step. Rank 1 alone uses the `extra` layer in some steps (a gradient missing on one
    rank), and `unused` never gets a gradient. The buckets are small, so parameters are split
    between ranks.
    """
    world, rank = ctx.world_size, ctx.rank
    model, reference = make_toy(seed=40 + rank), make_toy(seed=40)
    optimizer = ShardedOptimizer(param_groups(model), AdamW, bucket_size_mb=3e-4, lr=1e-2)
    ref_optimizer = AdamW(param_groups(reference), lr=1e-2)
    ddp = DDP(model, shards=optimizer.buckets)
    # ShardedOptimizer laid the parameters out before DDP copied rank 0's into them.
    assert_params_close(model, reference, 0.0, "after wrapping")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ranges = optimizer.held_ranges()
    split = sum(0 < stop - start < params[i].numel() for i, (start, stop) in ranges.items())
    ref_params = {id(p): r for p, r in zip(model.parameters(), reference.parameters(), strict=True)}
    storage = {}
    worst = 0.0
    for step in range(6):
        use_extra = step % 2 == 1
        ddp.zero_grad()
        x, y = global_batch(step, 2 * world)
        lm_loss(
            ddp, rank_slice(x, rank, world), rank_slice(y, rank, world), use_extra and rank == 1
        ).backward()
        ddp.finish_gradient_sync()
        losses = [
            lm_loss(reference, rank_slice(x, r, world), rank_slice(y, r, world), use_extra and r == 1)
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        for i, (start, stop) in ranges.items():
            p, ref = params[i], ref_params[id(params[i])]
            if ref.grad is None:
                assert p.grad is None, f"step {step}: parameter {i} should have no gradient"
                continue
            torch.testing.assert_close(
                p.grad.reshape(-1)[start:stop],
                ref.grad.reshape(-1)[start:stop],
                rtol=1e-6,
                atol=1e-7,  # float64, but the clip's factor is float32: the runs drift at ~1e-8
                msg=f"step {step}: gradient of parameter {i}, elements {start}..{stop}",
            )
        for name, p in model.named_parameters():
            if p.grad is not None:
                if name in storage:
                    assert p.grad.data_ptr() == storage[name], f"step {step}: the gradient of {name} moved"
                storage[name] = p.grad.data_ptr()
        norm = optimizer.clip_grad_norm_(model.parameters(), 0.05)
        ref_norm = gradient_clip(reference.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0.0)
        optimizer.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.wait_for_parameters()  # the next forward would wait for the all-gathers; we read now
        worst = max(worst, assert_params_close(model, reference, 1e-6, f"step {step}"))
    assert model.unused.grad is None
    write_result(out_dir, rank, {"worst": worst, "grads_kept": len(storage), "split": split})


def _small_transformer(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=256, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=128)


def traffic_of_one_step(ctx, out_dir: str, bucket_mb: float) -> None:
    """Bytes each rank sends in one training step, as the training loop makes it (the loss averaged
    over ranks): DDP + AdamW, and DDP(shards) + ShardedOptimizer, with buckets of `bucket_mb`."""
    world, rank = ctx.world_size, ctx.rank
    result = {}
    for name in ("ddp", "ddp+sharded"):
        model = _small_transformer(seed=3)
        if name == "ddp":
            optimizer, ddp = AdamW(model.parameters(), lr=1e-3), DDP(model, bucket_mb)
        else:
            optimizer = ShardedOptimizer(model.parameters(), AdamW, bucket_size_mb=bucket_mb, lr=1e-3)
            ddp = DDP(model, bucket_mb, shards=optimizer.buckets)
        ids = torch.randint(0, 256, (2 * world, 33), generator=torch.Generator().manual_seed(0))
        x, y = rank_slice(ids[:, :-1], rank, world), rank_slice(ids[:, 1:], rank, world)
        with ByteCounter() as counter:
            ddp.zero_grad()
            loss = cross_entropy(ddp(x), y)
            loss.backward()
            ddp.finish_gradient_sync()
            dist.all_reduce(loss.detach())
            if name == "ddp":
                gradient_clip(model.parameters(), 1.0)
            else:
                optimizer.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        result[name] = {"sent": counter.sent, "calls": counter.calls, "total": counter.total}
    result["gradient_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    write_result(out_dir, rank, result)


def overlap_in_backward(ctx, out_dir: str, compile_blocks: bool) -> None:
    """How many gradients backward had produced when the first bucket's all-reduce was called.

    An ordering, not a timing (the timing is bench/ddp.py's): each parameter gets a hook that
    counts it once its gradient is accumulated, registered after DDP's own, and a wrapped
    all_reduce records the count at its first call. Overlap means the first all-reduce is called
    while most gradients are still to come; a DDP that only reduced after backward would see all
    of them. Two warm-up steps (compilation) first. Also checks that the compiled model trains
    like the eager one.
    """
    world, rank = ctx.world_size, ctx.rank
    model = _small_transformer(seed=11)
    eager = copy.deepcopy(model)
    if compile_blocks:
        for block in model.layers:
            block.compile()
    ddp = DDP(model, bucket_size_mb=0.05)  # the output head alone is more than one bucket
    eager_ddp = DDP(eager, bucket_size_mb=0.05)
    ready = []
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda p: ready.append(p))
    total = sum(1 for _ in model.parameters())
    optimizer, eager_optimizer = AdamW(model.parameters(), lr=1e-3), AdamW(eager.parameters(), lr=1e-3)
    original = dist.all_reduce
    fractions = []
    for step in range(5):
        ids = torch.randint(0, 256, (8 * world, 33), generator=torch.Generator().manual_seed(step))
        x, y = rank_slice(ids[:, :-1], rank, world), rank_slice(ids[:, 1:], rank, world)
        for d, opt in ((ddp, optimizer), (eager_ddp, eager_optimizer)):
            d.zero_grad()
            loss = cross_entropy(d(x), y)
            ready.clear()
            first = []

            def counted_all_reduce(tensor, *args, first=first, **kwargs):
                if not first:
                    first.append(len(ready))
                return original(tensor, *args, **kwargs)

            dist.all_reduce = counted_all_reduce
            try:
                loss.backward()
            finally:
                dist.all_reduce = original
            d.finish_gradient_sync()
            opt.step()
            if d is ddp and step >= 2:
                fractions.append(first[0] / total if first else 1.0)
                assert len(ready) == total, (len(ready), total)
        assert_params_close(model, eager, 1e-4, f"compiled against eager, step {step}")
    write_result(out_dir, rank, {"fractions": fractions})


def gathers_waited_where_used(ctx, out_dir: str, compiled: bool) -> None:
    """Under ZeRO-1 each part of the model waits for the all-gathers of its own parameters only.

    Every ShardBucket's wait records when it finds a gather pending, and a forward pre-hook on each
    block (after DDP's) records when the block runs. Checked per step after the first: each pending
    bucket is waited for before the first part using it runs, and the head's bucket (the last one
    gathered) only after the first block has run: the later gathers overlap the forward. Compiled as
    train.compile compiles a model on GPUs under DDP (each block, and the loss region), the model
    trains as the eager one under the same waits.
    """
    from tinylm.pretrain.loop import compile_model

    world, rank = ctx.world_size, ctx.rank
    models = {"eager": _small_transformer(seed=12), "compiled": _small_transformer(seed=12)}
    if compiled:
        compile_model(models["compiled"], world, torch.device("cuda"))  # the GPU's DDP plan, run here
    events: list[tuple[str, object]] = []
    runs = {}
    for name, model in models.items():
        optimizer = ShardedOptimizer(model.parameters(), AdamW, bucket_size_mb=0.02, lr=1e-2)
        ddp = DDP(model, shards=optimizer.buckets)
        runs[name] = (ddp, optimizer)
    model = models["compiled"]
    optimizer = runs["compiled"][1]
    for index, bucket in enumerate(optimizer.buckets):
        original = bucket.wait

        def recorded(index=index, bucket=bucket, original=original):
            if bucket._gather is not None:
                events.append(("wait", index))
            original()

        bucket.wait = recorded
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: events.append(("block", i)))
    holder = {p: index for index, bucket in enumerate(optimizer.buckets) for p in bucket.params}
    head_bucket = holder[model.lm_head.weight]
    block_buckets = [{holder[p] for p in block.parameters()} for block in model.layers]
    assert len(optimizer.buckets) > 3 and head_bucket not in block_buckets[0]
    for step in range(4):
        ids = torch.randint(0, 256, (4 * world, 33), generator=torch.Generator().manual_seed(step))
        x, y = rank_slice(ids[:, :-1], rank, world), rank_slice(ids[:, 1:], rank, world)
        events.clear()
        losses = []
        for ddp, opt in runs.values():
            loss = ddp(x, targets=y)  # as the training loop calls it: the loss region
            loss.backward()
            ddp.finish_gradient_sync()
            opt.step()  # its gathers stay pending until the next forward
            ddp.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
        if step >= 1:  # the gathers of the step before are pending now
            order = {event: k for k, event in enumerate(events)}
            assert ("wait", head_bucket) in order, events
            assert order[("block", 0)] < order[("wait", head_bucket)], events
            for i, buckets in enumerate(block_buckets):
                for index in buckets:
                    assert order.get(("wait", index), -1) < order[("block", i)], (i, index, events)
    for _, opt in runs.values():
        opt.wait_for_parameters()
    assert_params_close(models["compiled"], models["eager"], 1e-4, f"{compiled=}")
    write_result(out_dir, rank, {"checked": True})
