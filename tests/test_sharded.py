"""ShardedOptimizer against plain AdamW (gloo, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import _sharded_ranks
import pytest
import torch
from helpers import assert_params_close, global_batch, job_results, launch_each, lm_loss, make_toy

from tinylm.parallel import ShardedOptimizer, launch


def read_results(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


# torch's AdamW with 25 MB buckets (one per owner); ours with 200-byte buckets (several per owner),
# both in one launch (see helpers.run_each).
CASES = [("torch", 25.0), ("tinylm", 2e-4)]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    jobs = [(f"{name}-{mb}", _sharded_ranks.sharded_matches_adamw, (name, mb)) for name, mb in CASES]
    return folder, launch_each(folder, jobs, world_size=2)


@pytest.mark.parametrize(("optimizer_name", "bucket_mb"), CASES)
def test_sharded_equals_adamw_and_consolidates(sharded_runs, optimizer_name, bucket_mb):
    folder, error = sharded_runs
    results = job_results(folder, f"{optimizer_name}-{bucket_mb}", 2, error)
    total = results[0]["total_elements"]
    assert sum(r["owned_elements"] for r in results) == total
    for r in results:
        assert abs(r["owned_elements"] - total / 2) <= r["largest"]
        assert 0 < r["owned_elements"] < total
        # At most world_size x ceil(parameter bytes / bucket bytes) collectives, none per parameter.
        bucket_bytes = bucket_mb * 2**20
        assert len(r["broadcasts"]) <= 2 * math.ceil(r["parameter_bytes"] / bucket_bytes)
        assert max(r["broadcasts"]) <= bucket_bytes
        if bucket_mb == 25.0:
            assert len(r["broadcasts"]) == 2 < r["num_parameters"]  # one bucket per owner


def test_sharding_is_balanced_and_disjoint_on_three_ranks(tmp_path):
    sizes = [100, 7, 60, 55, 3, 40, 40, 1]
    launch(_sharded_ranks.sharded_balances, args=(str(tmp_path), sizes), world_size=3, timeout_s=60)
    results = read_results(tmp_path, 3)
    owned = sorted(i for r in results for i in r["owned"])
    assert owned == list(range(len(sizes)))
    for r in results:
        assert abs(r["elements"] - sum(sizes) / 3) <= max(sizes)
    # largest first to the least-loaded rank (ties to the lower rank):
    # 100 -> r0, 60 -> r1, 55 -> r2, 40 -> r2, 40 -> r1, 7 -> r2, 3 -> r0, 1 -> r1
    assert [r["owned"] for r in results] == [[0, 4], [2, 6, 7], [1, 3, 5]]


def test_world_of_one_equals_adamw():
    model, reference = make_toy(seed=2), make_toy(seed=2)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(step, 2)
        for m, o in ((model, opt), (reference, ref_opt)):
            lm_loss(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_params_close(model, reference, 0.0, "world of one")
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


def test_load_state_dict_refuses_other_structure():
    model = make_toy(seed=2)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    with pytest.raises(ValueError, match="parameters"):
        opt.load_state_dict(other.state_dict())
