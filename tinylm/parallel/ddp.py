"""Data parallelism: every rank holds the whole model, and gradients are averaged across ranks.

    ddp = DDP(model, bucket_size_mb=25.0)
    loss = loss_fn(ddp(x), y); loss.backward()
    ddp.finish_gradient_sync()      # now every p.grad is the average over ranks
    optimizer.step()

When it wraps, DDP copies rank 0's parameters and buffers to every rank. It then groups the
trainable parameters into buckets of about `bucket_size_mb` megabytes (2**20 bytes), in reverse
registration order, since backward produces the gradients of the last layers first. Each bucket
is one flat buffer, and each parameter's `.grad` is a view into it (as torch's
`gradient_as_bucket_view`), so gradient memory is held once. A hook on each parameter runs as soon
as autograd has accumulated its gradient: if autograd made a fresh `.grad` (the first backward
after `zero_grad(set_to_none=True)`), the hook copies it into the bucket and points `.grad` at the
bucket's view, after which autograd accumulates into the bucket in place. Once every gradient of a
bucket is in, an asynchronous all-reduce of that buffer starts, so communication overlaps the rest
of backward. `finish_gradient_sync()` starts the buckets still waiting, waits for all of them and
divides each buffer by the world size in place: the views are then the rank averages.

Buckets are always started in bucket order, on every rank, so the sequence of collectives is the
same everywhere even when gradients become ready in different orders on different ranks.

A parameter shared by two modules (tied weights) is one parameter and is reduced once; frozen
parameters (requires_grad=False) are left alone. A parameter that got no gradient on this rank in
a step enters the sum as zeros; one that got no gradient on any rank keeps `.grad = None`, as in
single-process training. For that, each bucket carries one extra element per parameter that
counts the ranks that produced its gradient.

Inside `with ddp.no_sync():` backward only accumulates local gradients (gradient accumulation
micro-steps), already in the buckets; the next backward outside it reduces the accumulated sum.

The module may be wrapped in torch.compile before DDP: the hooks sit on the parameters
(post-accumulate-grad hooks), which compiled code leaves to eager autograd. `ddp.module` is the
wrapped model: save `ddp.module.state_dict()` so checkpoints have no wrapper prefix. Without an
initialised process group DDP is a world of one and communicates nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    """A flat buffer holding the gradients of some parameters, plus one "has a gradient" flag each.

    Layout: [grad of params[0] | grad of params[1] | ... | flag 0 | flag 1 | ...]; `views[i]` is
    params[i]'s slice, shaped like the parameter, and is what `params[i].grad` points at.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
        self.grads = self.buffer[:numel]
        self.flags = self.buffer[numel:]
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.grads[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.num_missing = 0  # parameters without a gradient on this rank in this step
        self.handle = None

    def adopt(self, i: int) -> bool:
        """Make params[i].grad the bucket's view (copying a fresh gradient in); False if it has none."""
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            return False
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        return True

    def put(self, i: int) -> None:
        """Mark params[i] ready: its gradient in the bucket (zeros and flag 0 when it has none)."""
        if self.adopt(i):
            self.flags[i].fill_(1)
        else:
            self.views[i].zero_()
            self.flags[i].fill_(0)
            self.num_missing += 1
        self.ready[i] = True
        self.num_ready += 1

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.num_missing = 0
        self.handle = None


class DDP(nn.Module):
    """Wrap `module` for data-parallel training over the default process group; see module docs."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.module = module
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._sync_enabled = True
        self._next_bucket = 0  # buckets are started strictly in order; this one is next
        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}  # param -> (bucket index, slot)
        if self.world_size == 1:
            return

        self._broadcast_from_rank0()
        # module.parameters() yields each parameter once even when it is tied to several modules.
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [_Bucket(params) for params in _split_into_buckets(trainable[::-1], bucket_size_mb)]
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
                bucket.adopt(i)  # a gradient that exists already moves into the bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
        if not self._sync_enabled:
            bucket.adopt(i)  # accumulate in the bucket, communicate nothing
            return
        if bucket.ready[i]:
            raise RuntimeError(
                "a parameter's gradient became ready twice before finish_gradient_sync(); call "
                "finish_gradient_sync() after each backward, or use no_sync() for accumulation steps"
            )
        bucket.put(i)
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        """Start the all-reduce of every complete bucket, in bucket order, up to the first incomplete one."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.num_ready < len(bucket.params):
                return
            bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)
            self._next_bucket += 1

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Complete the gradient all-reduce of this step; afterwards each `.grad` is the rank average.

        Parameters whose hook did not fire in this backward contribute their current `.grad` (or
        zeros). Must be called by every rank after every backward outside `no_sync()`; inside
        `no_sync()` it does nothing.
        """
        if not self._sync_enabled or not self._buckets:
            return
        for bucket in self._buckets[self._next_bucket :]:
            for i in range(len(bucket.params)):
                if not bucket.ready[i]:
                    bucket.put(i)
        self._start_ready_buckets()

        for bucket in self._buckets:
            bucket.handle.wait()
            bucket.grads.div_(self.world_size)
        # How many ranks produced each parameter's gradient. When this rank produced all of them,
        # every count is at least 1 and need not be read: no device-to-host copy, no host sync, in
        # the usual step. Otherwise one copy for all flags.
        if any(bucket.num_missing for bucket in self._buckets):
            ranks_with_grad = torch.cat([bucket.flags for bucket in self._buckets]).tolist()
        else:
            ranks_with_grad = [1] * sum(len(bucket.params) for bucket in self._buckets)
        slot = 0
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if ranks_with_grad[slot] > 0:  # else no rank produced one: .grad stays None
                    p.grad = view
                slot += 1
            bucket.reset()
        self._next_bucket = 0


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
