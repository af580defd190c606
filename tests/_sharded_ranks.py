"""Rank functions of tests/test_sharded.py: ShardedOptimizer against plain AdamW, and its balance.

They live in a module because mp.spawn pickles a function by its module path (see
tests/helpers.py).
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import assert_params_close, global_batch, lm_loss, make_toy, param_groups, write_result
from torch import nn

from tinylm.checkpoint import Manifest
from tinylm.parallel import ShardedOptimizer


def optimizer_class(name: str):
    if name == "torch":
        return torch.optim.AdamW
    from tinylm.optim import AdamW

    return AdamW


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

    Every rank computes the same full gradients (no DDP), so each reads only its pieces. The
    parameters live in the buckets' flat buffers, and a step all-gathers each bucket once (the
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
    opt = ShardedOptimizer(param_groups(model), cls, bucket_size_mb=bucket_mb, lr=1e-2, betas=(0.9, 0.95))
    ref_opt = cls(param_groups(reference), lr=1e-2, betas=(0.9, 0.95))
    for step in range(10):
        _train(model, extra, opt, [step], add_extra_at=4)
        _train(reference, ref_extra, ref_opt, [step], add_extra_at=4)
        assert_params_close(model, reference, 1e-6, f"step {step}")
        assert (extra - ref_extra).abs().max().item() <= 1e-6
    all_params = [p for group in opt.param_groups for p in group["params"]]

    # Communication: the parameters are views into the buckets' flat buffers, and a step
    # all-gathers each bucket once, none per parameter.
    buffers = {bucket.data.untyped_storage().data_ptr() for bucket in opt.buckets}
    assert all(p.untyped_storage().data_ptr() in buffers for p in all_params)
    gathers = []
    original = dist.all_gather_single

    def counting_all_gather(output, *args, **kwargs):
        gathers.append(output.numel() * output.element_size())
        return original(output, *args, **kwargs)

    dist.all_gather_single = counting_all_gather
    try:
        _train(model, extra, opt, [10])
    finally:
        dist.all_gather_single = original
    _train(reference, ref_extra, ref_opt, [10])
    assert_params_close(model, reference, 1e-6, "step 10")

    # Sharding: the ranks' ranges of each parameter tile it; state only for what a rank holds.
    ranges = opt.held_ranges()
    shares: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(shares, ranges)
    for i, p in enumerate(all_params):
        spans = sorted(share[i] for share in shares if i in share)
        assert spans[0][0] == 0 and spans[-1][1] == p.numel(), f"parameter {i}: {spans}"
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), f"parameter {i}: {spans}"
    held_elements = sum(stop - start for start, stop in ranges.values())
    # Only parameters that ever had a gradient have state (not `unused`, not `extra` of the model).
    ref_params = [p for group in ref_opt.param_groups for p in group["params"]]
    stateful = [i for i in ranges if ref_params[i] in ref_opt.state]
    state = opt.local_state()
    state_elements = sum(
        v.numel() for s in state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
    )
    assert state_elements == 2 * sum(ranges[i][1] - ranges[i][0] for i in stateful)

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
    plain_opt = cls([*param_groups(plain_model), {"params": [plain_extra]}], lr=0.0)
    plain_opt.load_state_dict(copy.deepcopy(full))  # load_state_dict may alias the tensors
    resharded_model, resharded_extra = copy.deepcopy(model), nn.Parameter(extra.detach().clone())
    resharded_opt = ShardedOptimizer(
        [*param_groups(resharded_model), {"params": [resharded_extra]}], cls, lr=0.0, betas=(0.5, 0.5)
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
            "held_elements": held_elements,
            "total_elements": sum(p.numel() for p in all_params),
            "gathers": gathers,
            "buckets": len(opt.buckets),
            "split": sum(0 < b - a < all_params[i].numel() for i, (a, b) in ranges.items()),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in all_params),
            "num_parameters": len(all_params),
        },
    )


def sharded_balances(ctx, out_dir: str, shape: dict, train_keys: dict) -> None:
    """A Transformer's run optimizer sharded over this world: the elements and the optimizer state
    bytes this rank holds after one step (every gradient set), for the memory plan's check."""
    from tinylm.config import TrainConfig
    from tinylm.model import Transformer
    from tinylm.pretrain.optimizer import build_optimizer

    torch.manual_seed(0)
    model = Transformer(**shape)
    train = TrainConfig(**train_keys)
    opt = build_optimizer(model, train, ctx.world_size)
    assert isinstance(opt, ShardedOptimizer)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.local_state().values()
        for name, v in s.items()
        if isinstance(v, torch.Tensor) and name != "step"
    )
    held = sum(stop - start for start, stop in opt.held_ranges().values())
    write_result(out_dir, ctx.rank, {"elements": held, "state_bytes": state_bytes})


# Parameters of odd sizes: pieces of one element, parameters smaller than the world size, sizes that
# are not a multiple of the alignment (16 float32s), in buckets of 100 bytes so that most are split.
ODD_SHAPES = [(17,), (1,), (3, 11), (3,), (2,), (5,)]
ODD_BUCKET_MB = 100 / 2**20


class OddSizes(nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(*s, generator=generator)) for s in ODD_SHAPES
        )

    def loss(self) -> torch.Tensor:
        return sum(((i + 1) * p.square() + p.sin()).sum() for i, p in enumerate(self.weights))


def train_odd(model: OddSizes, optimizer, steps) -> None:
    """Full-batch steps, the same on every rank, the learning rate a function of the step."""
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * (1 + step) / 5
        model.loss().backward()
        optimizer.step()
        optimizer.zero_grad()


def state_dict_problems(ours: dict, theirs: dict) -> list[str]:
    """Every way two optimizer state dicts differ: groups, indices, names, shapes, dtypes, values."""
    problems = [] if ours["param_groups"] == theirs["param_groups"] else ["param_groups differ"]
    if ours["state"].keys() != theirs["state"].keys():
        return [*problems, f"indices {sorted(ours['state'])} vs {sorted(theirs['state'])}"]
    for i, state in theirs["state"].items():
        if ours["state"][i].keys() != state.keys():
            problems.append(f"{i}: names {sorted(ours['state'][i])} vs {sorted(state)}")
            continue
        for name, value in state.items():
            mine = ours["state"][i][name]
            if mine.shape != value.shape or mine.dtype != value.dtype:
                problems.append(
                    f"{i}.{name}: {mine.dtype} {tuple(mine.shape)} vs {value.dtype} {tuple(value.shape)}"
                )
            elif not torch.equal(mine, value):
                problems.append(f"{i}.{name}: values differ")
    return problems


def odd_sizes_save(ctx, out_dir: str, steps: int) -> None:
    """ShardedOptimizer(torch.optim.AdamW) over ODD_SHAPES for `steps` steps: its consolidated state
    dict against a plain torch.optim.AdamW's, then the step committed to out_dir/state."""
    from tinylm.pretrain.state import save_step

    model, reference = OddSizes(), OddSizes()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ODD_BUCKET_MB, lr=0.05)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.05)
    train_odd(model, optimizer, range(steps))
    train_odd(reference, plain, range(steps))
    problems = state_dict_problems(optimizer.state_dict(), plain.state_dict())
    ranges = optimizer.held_ranges()
    split = sum(
        0 < ranges[i][1] - ranges[i][0] < p.numel() for i, p in enumerate(model.parameters()) if i in ranges
    )
    save_step(ctx, Path(out_dir, "state"), steps, model, optimizer, manifest=Manifest(seed=0))
    write_result(out_dir, ctx.rank, {"problems": problems, "split": split})


def odd_sizes_resume(ctx, out_dir: str, state_dir: str, steps: int, more: int) -> None:
    """restore_step of a step committed at another world size, then `more` steps; rank 0 saves the
    parameters and the consolidated state."""
    from tinylm.pretrain.state import restore_step

    model = OddSizes()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ODD_BUCKET_MB, lr=0.05)
    restore_step(ctx, state_dir, model, optimizer)
    train_odd(model, optimizer, range(steps, steps + more))
    state = optimizer.state_dict()
    if ctx.is_main:
        torch.save({"model": model.state_dict(), "optimizer": state}, Path(out_dir, "resumed.pt"))
    write_result(out_dir, ctx.rank, {})
