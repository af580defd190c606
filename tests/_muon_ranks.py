"""Rank functions and small helpers for tests/test_muon.py (a module, so that mp.spawn can import them)."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tinylm.model import Transformer
from tinylm.muon import Muon
from tinylm.nn_utils import cross_entropy
from tinylm.parallel import ShardedOptimizer

CONFIG = dict(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24)


def split_params(model: Transformer) -> tuple[list, list]:
    """(the 2-D weights of the Transformer blocks, every other parameter), in registration order."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
    others = [p for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    return matrices, others


def muon_groups(model: Transformer) -> list[dict]:
    """Muon for the block matrices; AdamW (with decay) for embedding and head, without for the gains."""
    matrices, others = split_params(model)
    return [
        {"params": matrices, "weight_decay": 0.01},
        {"params": [p for p in others if p.dim() == 2], "use_muon": False, "lr": 3e-3, "weight_decay": 0.1},
        {"params": [p for p in others if p.dim() < 2], "use_muon": False, "lr": 3e-3, "weight_decay": 0.0},
    ]


def read_results(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _steps(model, optimizer, steps) -> None:
    """Full-batch steps (the same on every rank), the learning rates a function of the step."""
    for step in steps:
        for group, base in zip(optimizer.param_groups, (0.02, 3e-3, 3e-3), strict=True):
            group["lr"] = base * (1 + step) / 10
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["context_length"] + 1), generator=g)
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _worst(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def sharded_muon_matches_muon(ctx, out_dir: str) -> None:
    """ShardedOptimizer(Muon) equals Muon for 10 steps; each rank keeps whole matrices' momentum
    for its share only; the consolidated state equals the plain optimizer's, survives
    torch.save/torch.load(weights_only=True), and loads into a plain Muon and a fresh
    ShardedOptimizer that continue identically."""
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    reference = copy.deepcopy(model)
    opt = ShardedOptimizer(muon_groups(model), Muon, bucket_size_mb=1e-3, lr=0.02)
    ref_opt = Muon(muon_groups(reference), lr=0.02)
    worst = 0.0
    for step in range(10):
        _steps(model, opt, [step])
        _steps(reference, ref_opt, [step])
        worst = max(worst, _worst(model, reference))
        assert worst <= 1e-6, f"step {step}: {worst}"

    params = [p for group in opt.param_groups for p in group["params"]]
    ranges = opt.held_ranges()
    owned = sorted(ranges)
    matrices = set(opt.param_groups[0]["params"])
    for i, (start, stop) in ranges.items():
        if params[i] in matrices:
            assert (start, stop) == (0, params[i].numel()), f"matrix {i} split: {start}..{stop}"
    state = opt.local_state()
    assert len(state) == len(ranges)  # state for this rank's pieces only
    for p in matrices:
        if p in state:  # held whole: the local optimizer steps the matrix itself
            assert set(state[p]) == {"momentum_buffer"} and state[p]["momentum_buffer"].shape == p.shape

    full = opt.state_dict()
    expected = ref_opt.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert full["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert full["state"][i].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(full["state"][i][name], value, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(full, buffer)
    buffer.seek(0)
    full = torch.load(buffer, weights_only=True)

    plain_model = copy.deepcopy(model)
    plain_opt = Muon(muon_groups(plain_model), lr=0.5)
    plain_opt.load_state_dict(copy.deepcopy(full))
    resharded_model = copy.deepcopy(model)
    resharded_opt = ShardedOptimizer(muon_groups(resharded_model), Muon, lr=0.5, momentum=0.5)
    resharded_opt.load_state_dict(copy.deepcopy(full))
    for step in range(10, 13):
        for m, o in (
            (model, opt),
            (plain_model, plain_opt),
            (resharded_model, resharded_opt),
            (reference, ref_opt),
        ):
            _steps(m, o, [step])
        for other in (plain_model, resharded_model, reference):
            worst = max(worst, _worst(other, model))
        assert worst <= 1e-6, f"after loading, step {step}: {worst}"
    dist.barrier()
    Path(out_dir, f"rank{ctx.rank}.json").write_text(
        json.dumps(
            {
                "owned": owned,
                "elements": {i: stop - start for i, (start, stop) in ranges.items()},
                "numel": [p.numel() for p in params],
                "num_parameters": len(params),
                "worst": worst,
                "owned_matrices": sum(1 for i in owned if params[i] in matrices),
            }
        )
    )
