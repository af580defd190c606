"""Optimizer state sharding (ZeRO stage 1) over equal flat slices of parameter buckets.

    opt = ShardedOptimizer(model.parameters(), AdamW, bucket_size_mb=25.0, lr=1e-3)
    ddp = DDP(model, shards=opt.gradient_shards())   # gradients reduce-scattered into the slots
    ...; ddp.finish_gradient_sync(); opt.clip_grad_norm_(model.parameters(), 1.0); opt.step()

Each parameter's data is a view into a flat bucket (tinylm/parallel/shard_layout.py says which
parameter sits where and which rank holds which slot). Every rank holds all parameters and steps
only its slot of each bucket, with one local `optimizer_cls` per bucket: AdamW's elements split
anywhere, Muon's matrices whole (an optimizer class says which groups need whole parameters with
`needs_whole_parameters(group)`). `step()` steps the buckets first layers first and starts each
bucket's all-gather of the updated parameters at once; DDP's parts wait for their own before
their forward, `wait_for_parameters()` for anything else. Per step a rank sends what one
all-reduce would. Without an initialised process group, or with `shard=False`, each rank is a
world of one: it holds every slot (one bucket per kind), communicates nothing, and DDP
all-reduces (`gradient_shards()` is None). A run's optimizer is always one of these, so the
training loop and checkpoints have one interface at any world size, sharded or not.

The optimizer class states its state's contract (`state_contract`; torch's own are in
TORCH_STATE): `elementwise_state`, the entries shaped like the parameter (split with it: AdamW's
moments), and `per_parameter_state`, those held once per parameter (AdamW's `step`, kept by the
holder of the parameter's first element). State dicts, pieces and checkpoints follow it.

`param_groups` are the full groups; their hyperparameters are copied into the local optimizers
before each step, so a schedule writes `group["lr"]` as for any optimizer. State dicts use torch's
format, keyed by global parameter index, each tensor of its parameter's full shape, so they load
into a plain optimizer and come from one: `sharded_state_dict()` (metadata only: tensors on
"meta") with `state_pieces()` (this rank's parts, each element in exactly one rank's) is what
checkpoints are written from, so the whole state never exists on one rank; `state_dict()`
consolidates it on every rank (small models, tests); `load_state_dict(d)` takes a full dict or
any part of one, from any world size, and keeps what this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tinylm.nn_utils import scale_to_norm, squared_norms
from tinylm.parallel.shard_layout import BucketLayout, ParamSpec, Piece, plan_shards


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False
):
    """Reduce `input` over the ranks by `op` and give rank r its r-th equal part in `output`."""
    # torch 2.13 renamed the flat collectives; older versions have only the old names.
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, op=op, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """Concatenate every rank's `input` into `output` (rank r's at its r-th equal part)."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, input, async_op=async_op)


@dataclass(frozen=True)
class StateContract:
    """Names of an optimizer's per-parameter state entries: those shaped like the parameter, and
    those held once per parameter."""

    elementwise: frozenset[str]
    per_parameter: frozenset[str]

    def is_elementwise(self, name: str) -> bool:
        """Whether the entry `name` is shaped like its parameter; a ValueError for an undeclared name."""
        if name in self.elementwise:
            return True
        if name in self.per_parameter:
            return False
        raise ValueError(
            f"optimizer state entry {name!r} is not declared: the optimizer's elementwise_state "
            f"{sorted(self.elementwise)} and per_parameter_state {sorted(self.per_parameter)} must name it"
        )


# torch's optimizers, whose classes do not declare their state (ours do: tinylm.optim.AdamW, Muon).
TORCH_STATE = {
    torch.optim.AdamW: (("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ("step",)),
    torch.optim.Adam: (("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ("step",)),
    torch.optim.SGD: (("momentum_buffer",), ()),
}


def state_contract(optimizer: torch.optim.Optimizer | type) -> StateContract:
    """The state contract of an optimizer or optimizer class: its `elementwise_state` and
    `per_parameter_state`, or TORCH_STATE's entry; a TypeError for a class that declares neither."""
    declared = (
        getattr(optimizer, "elementwise_state", None),
        getattr(optimizer, "per_parameter_state", None),
    )
    if declared[0] is None or declared[1] is None:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        declared = next((TORCH_STATE[c] for c in cls.__mro__ if c in TORCH_STATE), (None, None))
        if declared[0] is None:
            raise TypeError(
                f"{cls.__name__} does not declare its state: give the class `elementwise_state` (the "
                f"entries shaped like the parameter) and `per_parameter_state` (one value per parameter)"
            )
    return StateContract(frozenset(declared[0]), frozenset(declared[1]))


class ShardBucket:
    """A bucket of parameters: the layout, the flat parameter buffer, and its pending all-gather.

    layout: where each member sits; params: the members (layout order); data: [layout.numel], the
    parameters' storage (each `p.data` a view); rank: this rank (its slot is `data[slot]`).
    DDP allocates the matching gradient buffer (same offsets) and reduce-scatters into it.
    """

    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], rank: int):
        self.layout, self.params, self.rank = layout, params, rank
        self.offsets = list(layout.offsets)
        first = params[0]
        self.data = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(params, self.offsets, strict=True):
                view = self.data[offset : offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
        low, high = layout.slot(rank)
        self.slot = slice(low, high)
        self.awaited_by_forward = False  # set by DDP, whose module's parts wait before their forward
        self._gather = None

    def start_all_gather(self) -> None:
        """Give every rank this rank's slot of the parameters (asynchronously)."""
        self._gather = all_gather(self.data, self.data[self.slot], async_op=True)

    def wait(self) -> None:
        """Wait for the bucket's pending all-gather, if any: the parameters are then current."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None


class _Held:
    """A rank's piece of a parameter, as its local optimizer sees it.

    tensor: what the local optimizer steps (the parameter itself when held whole, else a 1-D
    view of its elements [start, stop) in the bucket); its `.grad` is the matching part of
    `param.grad`, refreshed before every step.
    """

    def __init__(self, piece: Piece, param: nn.Parameter, bucket: ShardBucket):
        self.piece, self.param = piece, param
        self.whole = piece.start == 0 and piece.stop == param.numel()
        self.tensor = param if self.whole else bucket.data[piece.offset : piece.offset + piece.numel]

    def gradient(self) -> torch.Tensor | None:
        """This piece of `param.grad` (a view), or None when the parameter has no gradient."""
        grad = self.param.grad
        if grad is None or self.whole:
            return grad
        if not grad.is_contiguous():
            raise RuntimeError("ShardedOptimizer needs contiguous gradients")
        return grad.view(-1)[self.piece.start : self.piece.stop]


class ShardedOptimizer(torch.optim.Optimizer):
    """Run `optimizer_cls` over this rank's slots of the parameter buckets; see the module docs."""

    def __init__(
        self,
        params,
        optimizer_cls: type[torch.optim.Optimizer],
        bucket_size_mb: float = 25.0,
        shard: bool = True,
        **kwargs: Any,
    ):
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.optimizer_cls = optimizer_cls
        self.contract = state_contract(optimizer_cls)
        self.bucket_size_mb = bucket_size_mb
        # shard=False: every rank is a world of one, holding every slot (see the module docs).
        self.process_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() and shard else 1
        self.rank = self.process_rank if self.world_size > 1 else 0
        self.buckets: list[ShardBucket] = []
        self.local_optimizers: list[torch.optim.Optimizer] = []  # one per bucket
        self._held: list[list[_Held]] = []  # per bucket, this rank's pieces
        self._laid_out = False
        # Optimizer.__init__ calls self.add_param_group for each group; the layout waits for all.
        super().__init__(params, defaults=kwargs)
        self._lay_out()

    @property
    def elementwise_state(self) -> frozenset[str]:
        """Its optimizer class's contract (see `state_contract`)."""
        return self.contract.elementwise

    @property
    def per_parameter_state(self) -> frozenset[str]:
        return self.contract.per_parameter

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (with its hyperparameters); every parameter is laid out again."""
        super().add_param_group(param_group)
        if self._laid_out:
            self._lay_out()

    def _params(self) -> list[nn.Parameter]:
        """Every parameter, in global index order."""
        return [p for group in self.param_groups for p in group["params"]]

    def _lay_out(self) -> None:
        """Plan the buckets, move the parameters into them, build the local optimizers (state kept)."""
        kept = self._consolidated_state() if self._laid_out else None
        self.wait_for_parameters()
        params = self._params()
        whole = getattr(self.optimizer_cls, "needs_whole_parameters", lambda group: False)
        specs = [
            ParamSpec(p.numel(), tuple(p.shape), p.element_size(), (p.dtype, p.device), g, bool(whole(group)))
            for g, group in enumerate(self.param_groups)
            for p in group["params"]
        ]
        # Buckets exist for the collectives; a world of one communicates nothing: one bucket per kind.
        everything = sum(spec.numel * spec.element_size for spec in specs) or 1
        bucket_bytes = self.bucket_size_mb * 2**20 if self.world_size > 1 else everything
        layouts = plan_shards(specs, self.world_size, bucket_bytes)
        self.buckets, self.local_optimizers, self._held = [], [], []
        for layout in layouts:
            bucket = ShardBucket(layout, [params[i] for i in layout.members], self.rank)
            held = [_Held(piece, params[piece.index], bucket) for piece in layout.pieces(self.rank)]
            local_groups = [
                {
                    **self._hyperparameters(group),
                    "params": [h.tensor for h in held if specs[h.piece.index].group == g],
                }
                for g, group in enumerate(self.param_groups)
            ]
            self.buckets.append(bucket)
            self._held.append(held)
            self.local_optimizers.append(self.optimizer_cls(local_groups, **self.defaults))
        self._laid_out = True
        if kept is not None:
            self._load_state(kept)

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in group.items() if key != "params"}

    def _all_held(self) -> list[tuple[_Held, torch.optim.Optimizer]]:
        return [
            (h, local) for held, local in zip(self._held, self.local_optimizers, strict=True) for h in held
        ]

    def gradient_shards(self) -> list[ShardBucket] | None:
        """The buckets DDP reduce-scatters the gradients into (`DDP(shards=...)`), or None when this
        rank holds every slot (a world of one, or shard=False: DDP then all-reduces them)."""
        return self.buckets if self.world_size > 1 else None

    def held_ranges(self) -> dict[int, tuple[int, int]]:
        """{global parameter index: [start, stop) of its elements this rank holds}."""
        return {h.piece.index: (h.piece.start, h.piece.stop) for h, _ in self._all_held()}

    def parameter_writers(self) -> dict[nn.Parameter, int]:
        """{parameter: the rank that writes its weights into a checkpoint}: the rank holding its
        first element, so that the writing is shared out (rank 0 when every rank holds every slot)."""
        params = self._params()
        return {
            params[piece.index]: rank
            for bucket in self.buckets
            for rank in range(self.world_size)
            for piece in bucket.layout.pieces(rank)
            if piece.start == 0
        }

    def local_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """{piece tensor: its state} of every local optimizer (this rank's share of the state)."""
        return {t: s for local in self.local_optimizers for t, s in local.state.items()}

    def held_gradients(self) -> list[torch.Tensor]:
        """The gradients this rank holds averaged (its pieces of them), as views; for unscaling."""
        return [g for h, _ in self._all_held() if (g := h.gradient()) is not None]

    def wait_for_parameters(self) -> None:
        """Wait for every pending all-gather: afterwards every rank's parameters are current."""
        for bucket in self.buckets:
            bucket.wait()

    @torch.no_grad()
    def clip_grad_norm_(self, parameters, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """Collective: clip by the global gradient norm as `nn_utils.gradient_clip(parameters, ...)`
        does, each rank reading its pieces only; returns the norm before clipping (the same on every
        rank).

        Each rank adds the squared norms of its pieces into a vector over `parameters` (zeros for
        parameters it holds nothing of, or without a gradient); one all-reduce of it (4 bytes per
        parameter tensor) gives every rank the squared norm of each tensor. A tensor split between
        ranks is summed in parts, so the norm equals gradient_clip's up to float rounding. Nothing
        is read on the host: no device sync.
        """
        params = list(parameters)
        position = {p: i for i, p in enumerate(params)}
        held = [(position[h.param], h.gradient()) for h, _ in self._all_held() if h.param in position]
        device = params[0].device
        summed = torch.zeros(len(params), dtype=torch.float32, device=device)
        if held:
            # Copied without waiting (non_blocking): a plain copy to a GPU would sync with the host.
            index = torch.tensor([i for i, _ in held]).to(device, non_blocking=True)
            summed.index_add_(0, index, squared_norms([g for _, g in held], device))
        if self.world_size > 1:
            dist.all_reduce(summed)
        total_norm = summed.sum().sqrt()
        grads = [g for _, g in held if g is not None]
        if grads:
            scale_to_norm(grads, total_norm, max_norm, eps)
        return total_norm

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's slot of every bucket, first layers first, starting each bucket's
        all-gather as soon as its slot is stepped. A closure, if given, is evaluated once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_for_parameters()
        for bucket, held, local in reversed(
            list(zip(self.buckets, self._held, self.local_optimizers, strict=True))
        ):
            for group, local_group in zip(self.param_groups, local.param_groups, strict=True):
                local_group.update(self._hyperparameters(group))
            for h in held:
                if not h.whole:
                    h.tensor.grad = h.gradient()
            local.step()
            if self.world_size > 1:
                bucket.start_all_gather()
        if not all(bucket.awaited_by_forward for bucket in self.buckets):
            self.wait_for_parameters()
        return loss

    def _described_state(self) -> dict[int, dict[str, Any]]:
        """Collective (metadata only): {global index: {name: ("tensor", full shape, dtype) or
        ("value", v)}} of every parameter with state on any rank."""
        params = self._params()
        described: dict[int, dict[str, Any]] = {}
        for h, local in self._all_held():
            state = local.state.get(h.tensor)
            if not state:
                continue
            described[h.piece.index] = {
                name: self._describe(name, value, params[h.piece.index]) for name, value in state.items()
            }
        if self.world_size == 1:
            return dict(sorted(described.items()))  # torch's order: by global index
        gathered: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, described)
        merged: dict[int, dict[str, Any]] = {}
        for rank_state in gathered:
            merged.update(rank_state)
        return dict(sorted(merged.items()))

    def _full_param_groups(self) -> list[dict[str, Any]]:
        index = {p: i for i, p in enumerate(self._params())}
        groups = []
        for g, group in enumerate(self.param_groups):
            local_group = self.local_optimizers[0].param_groups[g] if self.local_optimizers else {}
            full_group = {**self._hyperparameters(local_group), **self._hyperparameters(group)}
            full_group["params"] = [index[p] for p in group["params"]]
            groups.append(full_group)
        return groups

    def sharded_state_dict(self) -> dict[str, Any]:
        """Collective (metadata only): torch's state dict format, every state tensor on the meta device.

        {"state": {global index: {name: value}}, "param_groups": [{..., "params": [global indices]}]},
        as `torch.optim.Optimizer.state_dict` numbers them; each state tensor is a tensor on the
        meta device of its full shape and dtype (`state_pieces()` gives this rank's parts of them).
        Every rank sees the same structure.
        """
        state = {
            i: {name: _placeholder(description) for name, description in names.items()}
            for i, names in self._described_state().items()
        }
        return {"state": state, "param_groups": self._full_param_groups()}

    def state_pieces(self) -> list[tuple[int, str, int, torch.Tensor]]:
        """(global index, state name, first element, tensor) of every part of the state that this
        rank holds: the elements [first, first + numel) of the full tensor, flattened (first is 0
        for a tensor held whole). Every element of every state tensor is in exactly one rank's
        list: an elementwise entry from every holder of a piece of its parameter, a per-parameter
        one (AdamW's `step`) from the rank holding the parameter's first element. These are the
        live tensors. With shard=False every rank holds the same state, and rank 0 gives it."""
        if self.process_rank != self.rank:
            return []
        pieces = []
        for h, local in self._all_held():
            for name, value in local.state.get(h.tensor, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if self.contract.is_elementwise(name):
                    pieces.append((h.piece.index, name, h.piece.start, value))
                elif h.piece.start == 0:
                    pieces.append((h.piece.index, name, 0, value))
        return pieces

    @torch.no_grad()
    def _consolidated_state(self) -> dict[int, dict[str, Any]]:
        """Collective: {global index: {name: full value on the CPU}}, the same on every rank."""
        params = self._params()
        pieces = {(i, name): (first, value) for i, name, first, value in self.state_pieces()}
        state: dict[int, dict[str, Any]] = {}
        for i, names in self._described_state().items():
            device = params[i].device  # nccl reduces device tensors, so "step" travels there too
            entry = {}
            for name, description in names.items():
                if description[0] == "value":
                    entry[name] = description[1]
                    continue
                _, shape, dtype = description
                full = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                if (i, name) in pieces:
                    first, value = pieces[(i, name)]
                    full.view(-1)[first : first + value.numel()].copy_(value.reshape(-1))
                if self.world_size > 1:
                    dist.all_reduce(full)  # each element held by exactly one rank: the sum is it
                entry[name] = full.cpu()
            state[i] = entry
        return state

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """Collective: the consolidated state on every rank, torch's format, CPU tensors.

        Each state tensor is assembled on every rank from its pieces (one all-reduce each), so the
        whole optimizer state ends up on every rank: for small models and tests. Checkpoints use
        `sharded_state_dict()` and `state_pieces()`.
        """
        return {"state": self._consolidated_state(), "param_groups": self._full_param_groups()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in torch's format (from `state_dict()`, a checkpoint or any plain
        optimizer of the same class); not a collective.

        Every rank passes the dict (or just the entries of the parameters it holds), each tensor
        of its parameter's full shape or exactly the piece this rank holds (`held_ranges()`, as
        `restore_step` reads them); group hyperparameters are restored on every group.
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
        for group, saved in zip(groups, saved_groups, strict=True):
            group.update(self._hyperparameters(saved))
        saved_index = [i for saved in saved_groups for i in saved["params"]]
        by_index = {
            j: state_dict["state"][saved_index[j]]
            for j in range(len(saved_index))
            if saved_index[j] in state_dict["state"]
        }
        self._load_state(by_index)

    def _load_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Load {global index: {name: value}} into the local optimizers, each piece sliced out."""
        params = self._params()
        for held, local in zip(self._held, self.local_optimizers, strict=True):
            by_tensor = {id(h.tensor): h for h in held}
            local_state, local_groups, n = {}, [], 0
            for g, local_group in enumerate(local.param_groups):
                indices = []
                for t in local_group["params"]:
                    h = by_tensor[id(t)]
                    if h.piece.index in state:
                        local_state[n] = {
                            name: self._slice(name, value, h, params[h.piece.index])
                            for name, value in state[h.piece.index].items()
                        }
                    indices.append(n)
                    n += 1
                hyperparameters = {
                    **self._hyperparameters(local_group),
                    **self._hyperparameters(self.param_groups[g]),
                }
                local_groups.append({**hyperparameters, "params": indices})
            local.load_state_dict({"state": local_state, "param_groups": local_groups})

    def _describe(self, name: str, value: Any, param: torch.Tensor) -> Any:
        """What another rank needs to know of a piece's state value: a tensor's full shape (its
        parameter's, when elementwise) and dtype, or the value itself."""
        if not isinstance(value, torch.Tensor):
            return ("value", value)
        shape = tuple(param.shape) if self.contract.is_elementwise(name) else tuple(value.shape)
        return ("tensor", shape, str(value.dtype).removeprefix("torch."))

    def _slice(self, name: str, value: Any, held: _Held, param: torch.Tensor) -> Any:
        """This rank's piece of a state value: an elementwise tensor of the parameter's size is cut
        to the piece (one of the piece's size is the piece already); anything else is kept whole."""
        if not isinstance(value, torch.Tensor) or held.whole or not self.contract.is_elementwise(name):
            return value
        if value.numel() == param.numel():
            return value.reshape(-1)[held.piece.start : held.piece.stop].clone()
        if value.numel() == held.piece.numel:
            return value
        raise ValueError(
            f"state {name!r} of parameter {held.piece.index}: {value.numel()} elements, neither the "
            f"parameter's {param.numel()} nor this rank's piece's {held.piece.numel}"
        )


def _placeholder(description: tuple) -> Any:
    if description[0] == "tensor":
        _, shape, dtype = description
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    return description[1]
