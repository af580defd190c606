"""Optimizer state sharding (ZeRO stage 1): each rank keeps optimizer state for its share only.

    opt = ShardedOptimizer(model.parameters(), AdamW, lr=1e-3, weight_decay=0.1)
    ...; ddp.finish_gradient_sync(); opt.step(); opt.zero_grad()

Every rank holds all parameters and (after DDP) the same averaged gradients. The parameters are
split into disjoint shares balanced by element count: largest first, each to the rank with the
fewest elements so far (ties to the lower rank), so every rank owns within one parameter's size
of 1/world_size of the elements. Each rank runs a local `optimizer_cls` over its own share only,
so its optimizer state (AdamW's two moments) is about 1/world_size of the whole. `step()` updates
the owned share, then every parameter is broadcast from its owner so all ranks agree again.

`param_groups` are the full groups, as with any optimizer: a schedule that writes
`group["lr"]` into every group reaches the local optimizer, because the hyperparameters of each
group are copied into the matching local group before every step. `add_param_group` shares the
new parameters out the same way.

Checkpoints: `state_dict()` is a collective (every rank must call it) and returns on every rank the
consolidated state in the ordinary torch format, with state keyed by the global parameter index,
so it loads into a plain AdamW. `load_state_dict()` takes such a full dict (from any world size, or
from a plain optimizer) on every rank and keeps the state of the owned parameters.

Without an initialised process group this is a world of one: rank 0 owns everything.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class ShardedOptimizer(torch.optim.Optimizer):
    """Run `optimizer_cls(owned params, **kwargs)` on this rank's share and broadcast the results."""

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        self.optimizer_cls = optimizer_cls
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.owner: dict[nn.Parameter, int] = {}
        self._elements_per_rank = [0] * self.world_size
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

    def _assign_owners(self, params: list[nn.Parameter]) -> None:
        """Give each parameter to the least-loaded rank, largest parameters first (deterministic)."""
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        for i in order:
            rank = min(range(self.world_size), key=lambda r: (self._elements_per_rank[r], r))
            self.owner[params[i]] = rank
            self._elements_per_rank[rank] += params[i].numel()

    @staticmethod
    def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in group.items() if key != "params"}

    @torch.no_grad()
    def step(self, closure=None):
        """Update the owned parameters, then broadcast every parameter from its owner.

        A closure, if given, is evaluated by the local optimizer (on every rank).
        """
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local_group.update(self._hyperparameters(group))
        loss = self.local_optimizer.step(closure)
        if self.world_size > 1:
            handles = [
                dist.broadcast(p.detach(), src=self.owner[p], async_op=True)
                for group in self.param_groups
                for p in group["params"]
            ]
            for handle in handles:
                handle.wait()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Collective: every rank must call it. Returns the full state on every rank, torch's format.

        {"state": {global index: {name: value}}, "param_groups": [{..., "params": [global indices]}]},
        indices counted through `param_groups` in order, exactly as `torch.optim.Optimizer.state_dict`
        numbers them. State tensors are CPU copies.
        """
        index = self._global_index()
        local_state = {
            index[p]: {name: _to_cpu(value) for name, value in state.items()}
            for p, state in self.local_optimizer.state.items()
        }
        if self.world_size > 1:
            gathered: list[dict] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, local_state)
        else:
            gathered = [local_state]
        state = {}
        for rank_state in gathered:
            state.update(rank_state)
        param_groups = []
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            full_group = {**self._hyperparameters(local_group), **self._hyperparameters(group)}
            full_group["params"] = [index[p] for p in group["params"]]
            param_groups.append(full_group)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from `state_dict()` or any plain optimizer of the same class).

        Every rank passes the same full dict and keeps the state of the parameters it owns; group
        hyperparameters are restored on every group. Not a collective.
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

    def _global_index(self) -> dict[nn.Parameter, int]:
        params = [p for group in self.param_groups for p in group["params"]]
        return {p: i for i, p in enumerate(params)}


def _to_cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
