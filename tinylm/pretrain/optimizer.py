"""The optimizer of a pretraining run: its parameter groups, and the learning rate of every step.

`build_optimizer` turns the train section into AdamW or Muon over the model's parameters, under a
ShardedOptimizer (sharded across the ranks with `train.shard_optimizer`), every group named and
carrying the top of its schedule ("peak_lr"); `set_learning_rates` writes the learning rate of one
update into every group.
"""

from __future__ import annotations

from typing import Any

import torch

from tinylm.config import TrainConfig
from tinylm.model import Transformer
from tinylm.muon import Muon
from tinylm.optim import AdamW, cos_lr_scheduler, param_groups, wsd_lr_scheduler
from tinylm.parallel import ShardedOptimizer
from tinylm.parallel.shard_layout import ParamSpec


def build_optimizer(model: Transformer, train: TrainConfig, world_size: int) -> ShardedOptimizer:
    """The run's optimizer: `optimizer_groups` under a ShardedOptimizer, sharded across the ranks
    with world_size > 1 and train.shard_optimizer (whole parameters for Muon's matrices, so each
    owner orthogonalises whole matrices), else holding every parameter on every rank."""
    groups, optimizer_cls, kwargs = optimizer_groups(model, train)
    shard = world_size > 1 and train.shard_optimizer
    return ShardedOptimizer(groups, optimizer_cls, bucket_size_mb=train.bucket_size_mb, shard=shard, **kwargs)


def optimizer_groups(
    model: Transformer, train: TrainConfig
) -> tuple[list[dict[str, Any]], type[torch.optim.Optimizer], dict[str, Any]]:
    """The parameter groups of `train.optimizer` over `model`'s trainable parameters, its class
    and its defaults.

    - "adamw": `AdamW`, groups "matrices" (every parameter of >= 2 dims, weight_decay) and "gains"
      (the 1-D ones, no decay), both at lr_max.
    - "muon": `tinylm.muon.Muon`, see `muon_groups`.

    Every group carries its "name", "peak_lr" (the top of its schedule, see `set_learning_rates`)
    and "lr" (set to it).
    """
    adamw = dict(betas=(train.beta1, train.beta2), eps=train.eps)
    if train.optimizer == "adamw":
        names = ("matrices", "gains")
        groups = [
            {**group, "name": name, "peak_lr": train.lr_max}
            for group, name in zip(param_groups(model, train.weight_decay), names, strict=True)
        ]
        optimizer_cls = AdamW
    elif train.optimizer == "muon":
        groups, optimizer_cls = muon_groups(model, train), Muon
    else:
        raise ValueError(f"train.optimizer: {train.optimizer!r} is not one of ['adamw', 'muon']")
    for group in groups:
        group["lr"] = group["peak_lr"]
    return groups, optimizer_cls, dict(lr=train.lr_max, **adamw)


def muon_groups(model: Transformer, train: TrainConfig) -> list[dict[str, Any]]:
    """Muon's groups: "matrices" (Muon: the 2-D weights of the Transformer blocks, muon_lr,
    muon_momentum, muon_weight_decay, muon_ns_steps, muon_adjust_lr), and AdamW for "embedding" (the
    token embedding and any value-embedding tables, embedding_lr or lr_max, weight_decay), "head"
    (the output head, head_lr or lr_max, weight_decay; none when it is tied to the embedding) and
    "gains" (every parameter of fewer than 2 dims, lr_max, no decay)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    head = model.lm_head.weight
    # Lookup tables (the token embedding, value embeddings) are trained by AdamW, not Muon.
    tables = [p for name, p in named if ".value_embedding." in name]
    block_matrices = [
        p
        for name, p in named
        if name.startswith("layers.") and p.dim() == 2 and ".value_embedding." not in name
    ]
    adamw_group = dict(use_muon=False, weight_decay=train.weight_decay)
    groups = [
        {
            "name": "matrices",
            "params": block_matrices,
            "use_muon": True,
            "peak_lr": train.muon_lr,
            "momentum": train.muon_momentum,
            "weight_decay": train.muon_weight_decay,
            "ns_steps": train.muon_ns_steps,
            "adjust_lr_fn": train.muon_adjust_lr,
        },
        {
            "name": "embedding",
            "params": [model.token_embeddings.weight, *tables],
            **adamw_group,
            "peak_lr": train.lr_max if train.embedding_lr is None else train.embedding_lr,
        },
        {
            "name": "head",
            "params": [head],
            **adamw_group,
            "peak_lr": train.lr_max if train.head_lr is None else train.head_lr,
        },
        {
            "name": "gains",
            "params": [p for _, p in named if p.dim() < 2],
            "use_muon": False,
            "weight_decay": 0.0,
            "peak_lr": train.lr_max,
        },
    ]
    if head is model.token_embeddings.weight:  # tie_embeddings: the embedding group trains it
        groups = [group for group in groups if group["name"] != "head"]
    grouped = [id(p) for group in groups for p in group["params"]]
    if sorted(grouped) != sorted(id(p) for _, p in named) or len(set(grouped)) != len(grouped):
        raise ValueError("build_optimizer: the Muon groups must hold every trainable parameter exactly once")
    return groups


def parameter_specs(model: Transformer, train: TrainConfig) -> list[ParamSpec]:
    """What the shard layout needs of each of the run's trainable parameters (in the optimizer's
    global order, float32), for the memory and communication plans; `model` may be on "meta"."""
    groups, _, _ = optimizer_groups(model, train)
    whole = Muon.needs_whole_parameters if train.optimizer == "muon" else (lambda group: False)
    return [
        ParamSpec(p.numel(), tuple(p.shape), 4, "float32", g, whole(group))
        for g, group in enumerate(groups)
        for p in group["params"]
    ]


def set_learning_rates(optimizer: torch.optim.Optimizer, step: int, train: TrainConfig) -> dict[str, float]:
    """Write the learning rate of update `step` (1-based) into every param group; {group name: lr}.

    Every group follows the same warmup and `train.schedule`, scaled to its own "peak_lr" (lr_max
    where a group has none): from 0 up to peak_lr, then down to peak_lr * lr_min / lr_max. A group
    at peak_lr == lr_max gets exactly cos_lr_scheduler (or wsd_lr_scheduler) of lr_min and lr_max.
    Groups without a "name" are reported as "group<i>".
    """
    lrs = {}
    for i, group in enumerate(optimizer.param_groups):
        peak = group.get("peak_lr", train.lr_max)
        group["lr"] = learning_rate(step, train, peak)
        lrs[group.get("name", f"group{i}")] = group["lr"]
    return lrs


def learning_rate(step: int, train: TrainConfig, peak: float) -> float:
    """The learning rate of update `step` for a group whose schedule tops out at `peak`."""
    lr_min = train.lr_min * (peak / train.lr_max)
    if train.schedule == "wsd":
        return wsd_lr_scheduler(step, train.warmup_iters, train.decay_iters, train.max_iters, lr_min, peak)
    return cos_lr_scheduler(step, train.warmup_iters, train.cos_cycle, lr_min, peak)
