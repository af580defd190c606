"""Data parallelism: every rank holds the whole model, and gradients are averaged across ranks.

    ddp = DDP(model, bucket_size_mb=25.0)
    ddp.zero_grad()                 # zeroes the gradient buckets in place
    loss = loss_fn(ddp(x), y); loss.backward()
    ddp.finish_gradient_sync()      # now every p.grad is the average over ranks
    optimizer.step()

When it wraps, DDP copies rank 0's parameters and buffers to every rank. It then groups the
trainable parameters into buckets of about `bucket_size_mb` megabytes (2**20 bytes), in reverse
registration order, since backward produces the gradients of the last layers first. Each bucket
is one flat buffer, and each parameter's `.grad` is a view into it (as torch's
`gradient_as_bucket_view`), so gradient memory is held once and never copied: `zero_grad()` zeroes
the buffers in place and autograd accumulates every later gradient straight into its view. (A
`.grad` that autograd made fresh, after someone set it to None, is copied into the bucket once and
replaced by the view.) A hook on each parameter runs as soon as autograd has accumulated its
gradient; once every gradient of a bucket is in, the bucket's communication starts asynchronously,
so it overlaps the rest of backward. `finish_gradient_sync()` starts the buckets still waiting,
waits for all of them and divides by the world size in place.

Two ways to communicate a bucket:
- all-reduce (the default): afterwards every rank holds every averaged gradient;
- reduce to the owner (`reduce_to={param: rank}`, the ownership of a ShardedOptimizer, ZeRO-1):
  within each bucket the gradients are laid out by owner, and each owner's run is reduced to that
  rank only. Afterwards each rank holds the averaged gradients of the parameters it owns; the
  `.grad` of another rank's parameter holds an unspecified partial sum and must not be read. Each
  rank then sends (w - 1) / w of the gradient bytes, as the reduce-scatter half of an all-reduce;
  the optimizer's parameter broadcast is the other half.

Buckets (and the owner runs within them) are always started in the same order on every rank, so
the sequence of collectives is the same everywhere even when gradients become ready in different
orders on different ranks.

A parameter shared by two modules (tied weights) is one parameter and is reduced once; frozen
parameters (requires_grad=False) are left alone. A parameter whose gradient hook did not run on
this rank since the last sync enters the sum as zeros; one whose hook ran on no rank ends with
`.grad = None`, as in single-process training. For that, each bucket carries one extra element
per parameter that counts the ranks that produced its gradient.

Inside `with ddp.no_sync():` backward only accumulates local gradients (gradient accumulation
micro-steps), already in the buckets; the next backward outside it reduces the accumulated sum.

Compile the blocks of the model, not the whole model (`block.compile()` for each Transformer
block): a compiled module's backward is one autograd node, so the hooks of its parameters fire
only when all of its backward is done, and a model compiled whole would start its first bucket at
the end of backward. `ddp.module` is the wrapped model: save `ddp.module.state_dict()`. Without an
initialised process group DDP is a world of one and communicates nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    """A flat buffer holding the gradients of some parameters, plus one "has a gradient" flag each.

    The buffer is cut into runs, one per owner rank (a single run with owner None when every rank
    gets everything): [grads of the run's params | their flags] for each run in turn. `views[i]` is
    params[i]'s gradient slice, shaped like the parameter; `flags[i]` its flag element.
    """

    def __init__(self, params: list[nn.Parameter], owners: list[int | None]):
        order = sorted(range(len(params)), key=lambda i: (-1 if owners[i] is None else owners[i], i))
        self.params = [params[i] for i in order]
        self.owners = [owners[i] for i in order]
        numel = sum(p.numel() for p in params) + len(params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = [None] * len(self.params)
        self.flags: list[torch.Tensor] = [None] * len(self.params)
        self.runs: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []  # (owner, run, its grads)
        self.all_flags: list[torch.Tensor] = []  # the flags of each run
        offset = 0
        for owner in dict.fromkeys(self.owners):
            members = [i for i, o in enumerate(self.owners) if o == owner]
            start = offset
            for i in members:
                self.views[i] = self.buffer[offset : offset + self.params[i].numel()].view_as(self.params[i])
                offset += self.params[i].numel()
            grads_end = offset
            for i in members:
                self.flags[i] = self.buffer[offset]
                offset += 1
            self.runs.append((owner, self.buffer[start:offset], self.buffer[start:grads_end]))
            self.all_flags.append(self.buffer[grads_end:offset])
        self.got = [False] * len(self.params)  # its hook ran since the last sync
        self.ready = [False] * len(self.params)  # its hook ran outside no_sync in this sync round
        self.num_ready = 0
        self.handles: list = []

    def adopt(self, i: int) -> None:
        """Make params[i].grad the bucket's view, copying in a gradient that autograd made fresh."""
        p, view = self.params[i], self.views[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def close(self) -> None:
        """Set the flags for this sync: 1 where the hook ran on this rank, else 0 (gradient zeroed)."""
        for flags in self.all_flags:
            flags.fill_(1)
        for i, got in enumerate(self.got):
            if not got:
                self.views[i].zero_()
                self.flags[i].fill_(0)

    def reset(self) -> None:
        self.got = [False] * len(self.params)
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.handles = []


class DDP(nn.Module):
    """Wrap `module` for data-parallel training over the default process group; see module docs.

    reduce_to: the owner rank of each trainable parameter (`ShardedOptimizer.owner`); when given,
    each gradient is reduced to its owner only. Read once, at wrap time.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        reduce_to: Mapping[nn.Parameter, int] | None = None,
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
        if self.world_size == 1:
            return

        self._broadcast_from_rank0()
        # module.parameters() yields each parameter once even when it is tied to several modules.
        trainable = [p for p in module.parameters() if p.requires_grad]
        if reduce_to is not None:
            unowned = [i for i, p in enumerate(trainable) if p not in reduce_to]
            if unowned:
                raise ValueError(f"reduce_to names no owner for trainable parameters {unowned[:5]}")
        for params in _split_into_buckets(trainable[::-1], bucket_size_mb):
            owners = [None if reduce_to is None else reduce_to[p] for p in params]
            self._buckets.append(_Bucket(params, owners))
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
                bucket.adopt(i)  # a gradient that exists already moves into the bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient in place (the buckets, one fill each), keeping `.grad` storage.

        set_to_none=True drops the `.grad`s instead, as nn.Module.zero_grad does (the next backward
        then allocates fresh gradients, which DDP copies into its buckets).
        """
        if set_to_none:
            self.module.zero_grad(set_to_none=True)
            return
        for bucket in self._buckets:
            bucket.buffer.zero_()
        loose = [p.grad for p in self.module.parameters() if p.grad is not None and p not in self._where]
        if loose:  # a world of one keeps autograd's own gradients
            torch._foreach_zero_(loose)

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
        """Start the communication of every complete bucket, in order, up to the first incomplete one."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.num_ready < len(bucket.params):
                return
            self._start(bucket)
            self._next_bucket += 1

    def _start(self, bucket: _Bucket) -> None:
        bucket.close()
        for owner, run, _ in bucket.runs:
            if owner is None:
                bucket.handles.append(dist.all_reduce(run, async_op=True))
            else:
                bucket.handles.append(dist.reduce(run, dst=owner, async_op=True))

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Complete the gradient reduction of this step; afterwards each `.grad` is the rank average
        (with `reduce_to`: on the parameter's owner).

        Parameters whose hook did not fire on this rank since the last sync contribute zeros. Must
        be called by every rank after every backward outside `no_sync()`; inside `no_sync()` it does
        nothing.
        """
        if not self._sync_enabled or not self._buckets:
            return
        for bucket in self._buckets[self._next_bucket :]:
            bucket.num_ready = len(bucket.params)
        self._start_ready_buckets()

        mine = []  # (bucket, slot) of the gradients this rank holds the average of
        for bucket in self._buckets:
            for handle in bucket.handles:
                handle.wait()
            for owner, _, grads in bucket.runs:
                if owner is None or owner == self.rank:
                    grads.div_(self.world_size)
            mine += [
                (bucket, i) for i, owner in enumerate(bucket.owners) if owner is None or owner == self.rank
            ]
        # How many ranks produced each gradient. When this rank produced all of its own, every
        # count is at least 1 and need not be read: no device-to-host copy, no host sync, in the
        # usual step. Otherwise one copy for all flags.
        if all(bucket.got[i] for bucket, i in mine):
            counts = [1] * len(mine)
        else:
            counts = torch.stack([bucket.flags[i] for bucket, i in mine]).tolist()
        for (bucket, i), count in zip(mine, counts, strict=True):
            p = bucket.params[i]
            p.grad = bucket.views[i] if count > 0 else None  # no rank produced one: None
        for bucket in self._buckets:
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
