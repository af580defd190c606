"""Data parallelism: every rank holds the whole model, and gradients are averaged across ranks.

    ddp = DDP(model, bucket_size_mb=25.0)
    ddp.zero_grad()                 # zeroes the gradient buckets in place
    loss = loss_fn(ddp(x), y); loss.backward()
    ddp.finish_gradient_sync()      # now every p.grad is the average over ranks
    optimizer.step()

On wrapping, DDP copies rank 0's parameters and buffers to every rank and groups the trainable
parameters into buckets of about `bucket_size_mb` MiB, in reverse registration order (backward
produces the last layers' gradients first). Each bucket is one flat buffer and each `.grad` a
view into it (torch's `gradient_as_bucket_view`): gradients are held once and never copied, and
`zero_grad()` zeroes the buffers in place. A hook on each parameter runs once autograd has
accumulated its gradient; when a bucket is complete its collective starts asynchronously and
overlaps the rest of backward. `finish_gradient_sync()` starts the buckets still waiting and
waits for all: NCCL averages in the collective (ReduceOp.AVG), gloo sums and divides. Buckets
start in the same order on every rank, so the collectives match even when gradients are ready in
different orders.

A bucket is all-reduced, or with a sharded optimizer's buckets (`shards=`, ZeRO-1) reduce-scattered
into its slots: rank r then holds the averaged gradients of slot r only (the rest of a `.grad` is
a partial sum that must not be read), and sends half an all-reduce's bytes; the optimizer's
all-gather of the parameters is the other half. Each part of the module (each child, each block
of a ModuleList) waits for the all-gathers of its own parameters before its forward, so later
gathers overlap earlier blocks.

A tied parameter is reduced once; frozen ones are left alone. A gradient whose hook did not run on
this rank enters the sum as zeros; one that ran on no rank ends as `.grad = None`, as in one
process (one small all-reduce per step counts the ranks that produced each gradient). Inside
`with ddp.no_sync():` backward only accumulates (gradient accumulation); the next backward outside
it reduces the sum.

Compile the blocks, not the whole model (`block.compile()`): a compiled module's backward is one
autograd node, so a whole compiled model would start its first bucket only at the end of backward.
Save `ddp.module.state_dict()`. Without an initialised process group DDP is a world of one and
communicates nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tinylm.parallel.sharded import ShardBucket, reduce_scatter


class _Bucket:
    """A flat buffer holding the gradients of some parameters.

    views[i] is params[i]'s gradient, shaped like the parameter, at offsets[i] in the buffer.
    slot: None to all-reduce the whole buffer; else this rank's slice of it, into which the buffer
    is reduce-scattered (a sharded optimizer's bucket, tinylm/parallel/shard_layout.py).
    """

    def __init__(self, params: list[nn.Parameter], offsets: list[int], numel: int, slot: slice | None):
        self.params, self.slot = params, slot
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views = [
            self.buffer[offset : offset + p.numel()].view_as(p)
            for p, offset in zip(params, offsets, strict=True)
        ]
        self.got = [False] * len(params)  # its hook ran since the last sync
        self.ready = [False] * len(params)  # its hook ran outside no_sync in this sync round
        self.num_ready = 0
        self.handle = None

    def adopt(self, i: int) -> None:
        """Make params[i].grad the bucket's view, copying in a gradient that autograd made fresh."""
        p, view = self.params[i], self.views[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def start(self, op: dist.ReduceOp) -> None:
        """Zero the gradients whose hook did not run on this rank, then start the reduction (`op`:
        SUM, or AVG where the backend averages in the collective)."""
        for i, got in enumerate(self.got):
            if not got:
                self.views[i].zero_()
        if self.slot is None:
            self.handle = dist.all_reduce(self.buffer, op=op, async_op=True)
        else:
            self.handle = reduce_scatter(self.buffer[self.slot], self.buffer, op=op, async_op=True)

    def finish(self, divide_by: int) -> None:
        """Wait for the reduction and divide what this rank holds (all, or its slot) by `divide_by`
        (1: the collective averaged already)."""
        self.handle.wait()
        if divide_by != 1:
            self.buffer.div_(divide_by) if self.slot is None else self.buffer[self.slot].div_(divide_by)

    def reset(self) -> None:
        self.got = [False] * len(self.params)
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.handle = None


class DDP(nn.Module):
    """Wrap `module` for data-parallel training over the default process group; see module docs.

    shards: a ShardedOptimizer's buckets (`ShardedOptimizer.buckets`); when given, the gradient
    buckets take their layout and each is reduce-scattered into this rank's slot, and the
    module's parts wait for their buckets' parameter all-gathers before their forward
    (`units_and_their_buckets`). Read once, at wrap time.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        shards: Sequence[ShardBucket] | None = None,
    ):
        super().__init__()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.module = module
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._sync_enabled = True
        self._next_bucket = 0  # buckets are started strictly in order; this one is next
        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}  # param -> (bucket index, slot)
        self._flags: torch.Tensor | None = None  # per trainable parameter: the ranks that produced it
        self._flags_handle = None
        self._shards: list[ShardBucket] = []
        if self.world_size == 1:
            return
        # NCCL averages inside the collective (one pass less over every gradient); gloo has no
        # AVG, so the CPU sums and divides, as it always did (its bits unchanged).
        self._average_in_collective = dist.get_backend() == "nccl"
        self._reduce_op = dist.ReduceOp.AVG if self._average_in_collective else dist.ReduceOp.SUM

        self._broadcast_from_rank0()
        # module.parameters() yields each parameter once even when it is tied to several modules.
        trainable = [p for p in module.parameters() if p.requires_grad]
        if shards is None:
            for params in _split_into_buckets(trainable[::-1], bucket_size_mb):
                offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
                self._buckets.append(_Bucket(params, offsets, sum(p.numel() for p in params), None))
        else:
            sharded = {p for bucket in shards for p in bucket.params}
            missing = [i for i, p in enumerate(trainable) if p not in sharded]
            if missing:
                raise ValueError(f"shards hold no bucket for trainable parameters {missing[:5]}")
            for bucket in shards:
                self._buckets.append(_Bucket(bucket.params, bucket.offsets, bucket.layout.numel, bucket.slot))
                bucket.awaited_by_forward = True
            self._shards = list(shards)
            for unit, buckets in units_and_their_buckets(module, self._shards):
                unit.register_forward_pre_hook(_waits_for(buckets))
        self._params = [p for bucket in self._buckets for p in bucket.params]
        self._flags = torch.zeros(len(self._params), dtype=torch.float32, device=self._params[0].device)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
                bucket.adopt(i)  # a gradient that exists already moves into the bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every bucket in place (one fill each), keeping the `.grad` views into them; drop
        every other `.grad` (a world of one has no buckets: its next backward writes fresh gradients,
        with no fill pass before it).

        set_to_none=True drops the bucketed `.grad`s too, as nn.Module.zero_grad does (the next
        backward then allocates fresh gradients, which DDP copies into its buckets).
        """
        if set_to_none:
            self.module.zero_grad(set_to_none=True)
            return
        for bucket in self._buckets:
            bucket.buffer.zero_()
        for p in self.module.parameters():
            if p not in self._where:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward accumulates gradients locally and starts no communication."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(tensor.data, src=0)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Autograd hook: param.grad is final for this backward; keep it in its bucket."""
        b, i = self._where[param]
        bucket = self._buckets[b]
        bucket.adopt(i)
        bucket.got[i] = True
        if not self._sync_enabled:  # accumulate in the bucket, communicate nothing
            return
        if bucket.ready[i] or b < self._next_bucket:
            raise RuntimeError(
                "a parameter's gradient became ready twice before finish_gradient_sync(); call "
                "finish_gradient_sync() after each backward, or use no_sync() for accumulation steps"
            )
        bucket.ready[i] = True
        bucket.num_ready += 1
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        """Start the communication of every complete bucket, in order, up to the first incomplete one;
        after the last, the flags that say which ranks produced each gradient."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.num_ready < len(bucket.params):
                return
            bucket.start(self._reduce_op)
            self._next_bucket += 1
        if self._flags_handle is None:
            got = [float(got) for bucket in self._buckets for got in bucket.got]
            self._flags.copy_(torch.tensor(got), non_blocking=True)
            self._flags_handle = dist.all_reduce(self._flags, async_op=True)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Complete the gradient reduction of this step; afterwards each `.grad` is the rank average
        (with `shards`: in this rank's slot of its bucket; the rest of `.grad` must not be read).

        Parameters whose hook did not fire on this rank since the last sync contribute zeros; those
        whose hook fired on no rank end with `.grad = None`. Must be called by every rank after
        every backward outside `no_sync()`; inside `no_sync()` it does nothing.
        """
        if not self._sync_enabled or not self._buckets:
            return
        for bucket in self._buckets[self._next_bucket :]:
            bucket.num_ready = len(bucket.params)
        self._start_ready_buckets()
        for bucket in self._buckets:
            bucket.finish(1 if self._average_in_collective else self.world_size)
        self._flags_handle.wait()
        # When this rank produced every gradient, every count is at least 1 and need not be read:
        # no device-to-host copy, no host sync, in the usual step. Otherwise one copy for all.
        everything = all(got for bucket in self._buckets for got in bucket.got)
        counts = [1.0] * len(self._params) if everything else self._flags.tolist()
        for p, count in zip(self._params, counts, strict=True):
            b, i = self._where[p]
            p.grad = self._buckets[b].views[i] if count > 0 else None  # no rank produced one: None
        for bucket in self._buckets:
            bucket.reset()
        self._next_bucket = 0
        self._flags_handle = None


def units_and_their_buckets(
    module: nn.Module, shards: Sequence[ShardBucket]
) -> list[tuple[nn.Module, list[ShardBucket]]]:
    """The parts of `module` that wait for their parameters' all-gathers, each with the buckets
    holding any of its parameters: `module` itself for its own parameters, each child, and each
    element of a child ModuleList (a Transformer's blocks) in place of the list. A bucket shared by
    several parts is waited for by the first that runs; the others find it done."""
    units = [module]
    for child in module.children():
        units.extend(child if isinstance(child, nn.ModuleList) else [child])
    holder = {p: bucket for bucket in shards for p in bucket.params}
    out = []
    for unit in units:
        params = unit.parameters(recurse=unit is not module)
        buckets = list({id(holder[p]): holder[p] for p in params if p in holder}.values())
        if buckets:
            out.append((unit, buckets))
    return out


def _waits_for(buckets: list[ShardBucket]):
    """A forward pre-hook that waits for `buckets`' pending all-gathers. It runs eagerly also where
    the part is compiled (a graph break before the part's graph): Dynamo cannot trace a wait."""

    @torch.compiler.disable
    def wait(module: nn.Module, args) -> None:
        for bucket in buckets:
            bucket.wait()

    return wait


def _split_into_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Cut `params` (in order) into runs of at most `bucket_size_mb` MiB each, one dtype and device per run.

    A parameter larger than the limit gets a bucket of its own.
    """
    limit = bucket_size_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        fits = buckets and size + nbytes <= limit
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if fits and same_kind:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets
