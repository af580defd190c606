"""Optimizer state sharding (ZeRO stage 1): each rank keeps optimizer state for its share only.

    opt = ShardedOptimizer(model.parameters(), AdamW, lr=1e-3, weight_decay=0.1)
    ddp = DDP(model, reduce_to=opt.owner)     # each gradient is reduced to its owner only
    ...; ddp.finish_gradient_sync(); opt.clip_grad_norm_(model.parameters(), 1.0); opt.step(); ddp.zero_grad()

Every rank holds all parameters. Each needs the averaged gradients of the parameters it owns only:
with `DDP(reduce_to=opt.owner)` each gradient bucket is reduced to the owners of its parameters,
so a step sends what one all-reduce would (reduce to the owners, then parameters out to
everyone), not an all-reduce plus the parameters. Used on its own, on gradients that every rank
already holds averaged, it works the same (it reads only its own). The parameters are
split into disjoint shares balanced by element count: largest first, each to the rank with the
fewest elements so far (ties to the lower rank), so every rank owns within one parameter's size
of 1/world_size of the elements. Each rank runs a local `optimizer_cls` over its own share only,
so its optimizer state (AdamW's two moments) is about 1/world_size of the whole.

Parameters live in flat buffers, one per owner rank (and dtype and device): each parameter's data
is a view into its owner's buffer, in global parameter order, every view aligned to 64 bytes.
`step()` updates the owned share in place, then every owner's buffer travels in pieces of at most
`bucket_size_mb` MiB, all broadcasts started asynchronously and waited on once: at most
ceil(owner bytes / bucket bytes) collectives per owner, none per parameter. No copy is made: the
broadcasts read and write the parameters themselves.

`param_groups` are the full groups, as with any optimizer: a schedule that writes
`group["lr"]` into every group reaches the local optimizer, because the hyperparameters of each
group are copied into the matching local group before every step. `add_param_group` shares the
new parameters out the same way (and lays the buffers out again).

State dicts use torch's format, with state keyed by the global parameter index (counted through
`param_groups` in order), so they load into a plain AdamW and come from one:

- `sharded_state_dict()` (a collective on metadata only) is that dict with this rank's own state
  tensors and, for every other rank's, a tensor on the "meta" device of the right shape and
  dtype. Checkpoints are written from it (tinylm/pretrain/state.py), so the whole state never exists on one
  rank.
- `state_dict()` (a collective) consolidates the real tensors on every rank, tensor by tensor:
  the whole optimizer state on every rank, meant for small models and tests.
- `load_state_dict(d)` takes a full dict or any part of one (from any world size, or from a plain
  optimizer) on every rank and keeps the state of the parameters it owns.

Without an initialised process group this is a world of one: rank 0 owns everything and nothing
is communicated or laid out again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tinylm.nn_utils import gradient_clip, scale_to_norm, squared_norms

_ALIGN_BYTES = 64


class ShardedOptimizer(torch.optim.Optimizer):
    """Run `optimizer_cls(owned params, **kwargs)` on this rank's share and broadcast the results."""

    def __init__(
        self, params, optimizer_cls: type[torch.optim.Optimizer], bucket_size_mb: float = 25.0, **kwargs: Any
    ):
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.optimizer_cls = optimizer_cls
        self.bucket_size_mb = bucket_size_mb
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.owner: dict[nn.Parameter, int] = {}
        self._elements_per_rank = [0] * self.world_size
        self._flat: list[tuple[int, torch.Tensor]] = []  # (owner rank, flat buffer of its parameters)
        self.local_optimizer: torch.optim.Optimizer | None = None
        # Optimizer.__init__ calls self.add_param_group for each group, which builds the local optimizer.
        super().__init__(params, defaults=kwargs)
        self.state = self.local_optimizer.state  # this rank's share of the state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (with its hyperparameters), shared out among the ranks."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._assign_owners(group["params"])
        local_group = self._hyperparameters(group)
        local_group["params"] = [p for p in group["params"] if self.owner[p] == self.rank]
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local_group], **self.defaults)
        else:
            self.local_optimizer.add_param_group(local_group)
        if self.world_size > 1:
            self._lay_out_buffers()

    def _assign_owners(self, params: list[nn.Parameter]) -> None:
        ranks = assign_owners([p.numel() for p in params], self._elements_per_rank)
        self.owner.update(zip(params, ranks, strict=True))

    @torch.no_grad()
    def _lay_out_buffers(self) -> None:
        """Move every parameter into its owner's flat buffer (one per owner, dtype and device)."""
        runs: dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in self._params():
            runs.setdefault((self.owner[p], p.dtype, p.device), []).append(p)
        self._flat = []
        for (owner, dtype, device), params in runs.items():  # the same order on every rank
            align = max(1, _ALIGN_BYTES // params[0].element_size())
            offsets, numel = [], 0
            for p in params:
                offsets.append(numel)
                numel += -(-p.numel() // align) * align
            flat = torch.zeros(numel, dtype=dtype, device=device)
            for p, offset in zip(params, offsets, strict=True):
                view = flat[offset : offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
            self._flat.append((owner, flat))

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in group.items() if key != "params"}

    def _params(self) -> list[nn.Parameter]:
        """Every parameter, in global index order."""
        return [p for group in self.param_groups for p in group["params"]]

    def owned_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank steps (and whose averaged gradients it needs), in global order."""
        return [p for p in self._params() if self.owner[p] == self.rank]

    @torch.no_grad()
    def clip_grad_norm_(self, parameters, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """Collective: clip by the global gradient norm exactly as `nn_utils.gradient_clip(parameters, ...)`
        does, each gradient read on its owner only; returns the norm before clipping (the same on every rank).

        Each rank writes the squared norms of the gradients it owns into a vector over `parameters`
        (zeros elsewhere, and for parameters without a gradient); one all-reduce of it (4 bytes per
        parameter tensor) gives every rank the vector gradient_clip sums (x + 0 = x), so the norm is
        bit for bit the unsharded one at any world size. No index is built and nothing is read on
        the host: no device sync.
        """
        params = list(parameters)
        mine = [p.grad if self.owner.get(p) == self.rank else None for p in params]
        summed = squared_norms(mine, params[0].device)
        if self.world_size > 1:
            dist.all_reduce(summed)
        total_norm = summed.sum().sqrt()
        owned = [g for g in mine if g is not None]
        if owned:
            scale_to_norm(owned, total_norm, max_norm, eps)
        return total_norm

    @torch.no_grad()
    def step(self, closure=None):
        """Update the owned parameters, then broadcast every owner's buffer in buckets.

        A closure, if given, is evaluated by the local optimizer (on every rank).
        """
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local_group.update(self._hyperparameters(group))
        loss = self.local_optimizer.step(closure)
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Collective: give every rank its owners' current parameter values (what `step()` ends with)."""
        handles = []
        for owner, flat in self._flat:
            bucket = max(1, int(self.bucket_size_mb * 2**20) // flat.element_size())
            for start in range(0, flat.numel(), bucket):
                handles.append(dist.broadcast(flat[start : start + bucket], src=owner, async_op=True))
        for handle in handles:
            handle.wait()

    def sharded_state_dict(self) -> dict[str, Any]:
        """Collective (metadata only): torch's state dict format, real tensors for this rank's state.

        {"state": {global index: {name: value}}, "param_groups": [{..., "params": [global indices]}]},
        exactly as `torch.optim.Optimizer.state_dict` numbers them. State of another rank's parameter
        is a tensor on the meta device with the real shape and dtype; every rank sees the same
        structure. This rank's tensors are the live state (not copies).
        """
        index = {p: i for i, p in enumerate(self._params())}
        local = {index[p]: state for p, state in self.local_optimizer.state.items()}
        described = {
            i: {name: _describe(value) for name, value in state.items()} for i, state in local.items()
        }
        if self.world_size > 1:
            gathered: list[dict] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, described)  # names, shapes, dtypes: no tensor data
        else:
            gathered = [described]
        state = {}
        for rank, rank_state in enumerate(gathered):
            for i, names in rank_state.items():
                state[i] = (
                    dict(local[i])
                    if rank == self.rank
                    else {name: _placeholder(d) for name, d in names.items()}
                )
        param_groups = []
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            full_group = {**self._hyperparameters(local_group), **self._hyperparameters(group)}
            full_group["params"] = [index[p] for p in group["params"]]
            param_groups.append(full_group)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """Collective: the consolidated state on every rank, torch's format, CPU tensors.

        Each state tensor is broadcast from its owner in turn, so the whole optimizer state ends up
        on every rank: meant for small models and tests. Checkpoints use `sharded_state_dict()`.
        """
        sharded = self.sharded_state_dict()
        params = self._params()
        for i, entry in sharded["state"].items():
            device = params[i].device  # nccl broadcasts device tensors, so "step" travels there too
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.device.type == "meta":
                    buffer = torch.empty(value.shape, dtype=value.dtype, device=device)
                else:
                    buffer = value.detach().to(device, copy=True)
                if self.world_size > 1:
                    dist.broadcast(buffer, src=self.owner[params[i]])
                entry[name] = buffer.cpu()
        return sharded

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from `state_dict()` or any plain optimizer of the same class).

        Every rank passes the dict (or just the entries of the parameters it owns) and keeps the
        state of its own parameters; group hyperparameters are restored on every group. Not a
        collective.
        """
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, optimizer has {len(groups)}")
        for i, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"param group {i}: state dict has {len(saved['params'])} parameters, "
                    f"optimizer has {len(group['params'])}"
                )

        local_groups, local_state = [], {}
        local_index = 0
        for group, saved in zip(groups, saved_groups, strict=True):
            group.update(self._hyperparameters(saved))
            local_params = []
            for p, saved_index in zip(group["params"], saved["params"], strict=True):
                if self.owner[p] != self.rank:
                    continue
                if saved_index in state_dict["state"]:
                    local_state[local_index] = state_dict["state"][saved_index]
                local_params.append(local_index)
                local_index += 1
            local_groups.append({**self._hyperparameters(saved), "params": local_params})
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local_optimizer.state


def _describe(value: Any) -> Any:
    """What another rank needs to know of a state value: (shape, dtype name) for a tensor, else itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return ("value", value)


def _placeholder(description: tuple) -> Any:
    if description[0] == "tensor":
        _, shape, dtype = description
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    return description[1]


def assign_owners(sizes: list[int], elements_per_rank: list[int]) -> list[int]:
    """The owning rank of each of a group's parameters (`sizes`: their element counts): largest
    first, each to the rank with the fewest elements so far (ties to the lower rank); deterministic.
    `elements_per_rank` (one entry per rank, the groups before this one) is updated in place."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(len(elements_per_rank)), key=lambda r: (elements_per_rank[r], r))
        owners[i] = rank
        elements_per_rank[rank] += sizes[i]
    return owners


# A run's optimizer is a ShardedOptimizer or a plain one; these answer for both, so that no caller
# has to tell them apart.


def parameter_owners(optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, int] | None:
    """{parameter: the rank that steps it} of a ShardedOptimizer (DDP's `reduce_to`); None for a
    plain optimizer, which every rank runs over every parameter."""
    return optimizer.owner if isinstance(optimizer, ShardedOptimizer) else None


def held_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters this rank steps, and so whose averaged gradients and state it holds, in global order."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.owned_parameters()
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_grad_norm_(optimizer: torch.optim.Optimizer, parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients this rank holds by the global norm over `parameters`; returns that norm.

    A collective for a ShardedOptimizer (see `ShardedOptimizer.clip_grad_norm_`); the same value
    as `nn_utils.gradient_clip(parameters, max_norm)` either way.
    """
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.clip_grad_norm_(parameters, max_norm)
    return gradient_clip(parameters, max_norm)


def full_or_sharded_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict in torch's format: this rank's share of a ShardedOptimizer's state
    (the rest on the meta device, see `sharded_state_dict`), or a plain optimizer's whole state."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.sharded_state_dict()
    return optimizer.state_dict()
