"""ShardedOptimizer against plain AdamW (gloo, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import _sharded_ranks
import pytest
import torch
from helpers import assert_params_close, global_batch, job_results, launch_each, lm_loss, make_toy

from tinylm.model import Transformer
from tinylm.parallel import ShardedOptimizer, launch
from tinylm.parallel.shard_layout import ParamSpec, held_elements, newton_schulz_work, plan_shards


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
    assert sum(r["held_elements"] for r in results) == total
    for r in results:
        # Equal slices: each rank within one alignment (8 float64s) per bucket of half.
        assert abs(r["held_elements"] - total / 2) <= 8 * r["buckets"]
        # One all-gather per bucket, of at most the bucket's bytes (or one parameter's), none per parameter.
        assert len(r["gathers"]) == r["buckets"]
        bucket_bytes = bucket_mb * 2**20
        assert r["buckets"] <= math.ceil(r["parameter_bytes"] / bucket_bytes) + r["num_parameters"]
        if bucket_mb == 25.0:
            assert r["buckets"] == 1 < r["num_parameters"]
        else:
            assert r["split"] > 0  # small buckets: some parameter is split between the ranks


SHAPE = dict(vocab_size=1000, context_length=16, d_model=64, num_layers=2, num_heads=4, d_ff=96)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_three_ranks_hold_equal_slices_and_the_memory_plan_counts_the_largest(tmp_path, optimizer):
    from tinylm.config import TrainConfig
    from tinylm.pretrain.memory import plan_memory

    keys = dict(world_size=3, batch_size=3, shard_optimizer=True, optimizer=optimizer, bucket_size_mb=0.05)
    launch(_sharded_ranks.sharded_balances, args=(str(tmp_path), SHAPE, keys), world_size=3, timeout_s=120)
    results = read_results(tmp_path, 3)
    model = Transformer(**SHAPE)
    total = sum(p.numel() for p in model.parameters())
    assert sum(r["elements"] for r in results) == total
    plan = plan_memory(SHAPE, TrainConfig(**keys), 3)
    assert plan.parts["optimizer"] == max(r["state_bytes"] for r in results)
    mean = sum(r["state_bytes"] for r in results) / 3
    if optimizer == "adamw":
        assert max(r["state_bytes"] for r in results) <= 1.05 * mean


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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_odd_sizes_state_dict_equals_torch_adamw_and_resumes_at_another_world_size(tmp_path, world_size):
    """Pieces of one element, parameters smaller than the world size, sizes off the alignment: the
    consolidated state dict is torch.optim.AdamW's in every key, shape, dtype and value (AdamW's
    `step` a scalar per parameter, its moments of the parameter's shape), and the step committed at
    this world size resumes at the next one bit for bit."""
    from tinylm.parallel import RankFailedError

    steps, more = 3, 2
    saved = tmp_path / "saved"
    saved.mkdir()
    launch(_sharded_ranks.odd_sizes_save, args=(str(saved), steps), world_size=world_size, timeout_s=60)
    results = read_results(saved, world_size)
    assert results[0]["problems"] == [], results[0]["problems"]
    if world_size > 1:
        assert sum(r["split"] for r in results) > 0  # some parameter is split between the ranks
    other = world_size % 4 + 1
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    try:
        launch(
            _sharded_ranks.odd_sizes_resume,
            args=(str(resumed), str(saved / "state"), steps, more),
            world_size=other,
            timeout_s=60,
        )
    except RankFailedError as error:
        raise AssertionError(f"resume at world size {other}: {error}") from None
    model = _sharded_ranks.OddSizes()
    plain = torch.optim.AdamW(model.parameters(), lr=0.05)
    _sharded_ranks.train_odd(model, plain, range(steps + more))
    got = torch.load(resumed / "resumed.pt", weights_only=True)
    assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
    assert _sharded_ranks.state_dict_problems(got["optimizer"], plain.state_dict()) == []


def test_an_optimizer_that_does_not_declare_its_state_is_refused():
    from tinylm.parallel.sharded import state_contract

    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    with pytest.raises(TypeError, match="Plain does not declare its state"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(4))], Plain)
    assert state_contract(torch.optim.AdamW).is_elementwise("exp_avg")
    assert not state_contract(torch.optim.AdamW).is_elementwise("step")
    with pytest.raises(ValueError, match="'mystery' is not declared"):
        state_contract(torch.optim.AdamW).is_elementwise("mystery")


def test_load_state_dict_refuses_other_structure():
    model = make_toy(seed=2)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    with pytest.raises(ValueError, match="parameters"):
        opt.load_state_dict(other.state_dict())


# ------------------------------------------------------------------------------------------------
# The layout alone (tinylm/parallel/shard_layout.py), at world sizes this machine cannot launch

GPT2_SMALL = dict(vocab_size=50304, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048)


def _specs(shape: dict, optimizer: str) -> list[ParamSpec]:
    from tinylm.config import TrainConfig
    from tinylm.pretrain.optimizer import build_optimizer

    with torch.device("meta"):
        model = Transformer(**shape)
    groups = build_optimizer(model, TrainConfig(optimizer=optimizer), world_size=1).param_groups
    return [
        ParamSpec(p.numel(), tuple(p.shape), 4, "float32", g, bool(group.get("use_muon")))
        for g, group in enumerate(groups)
        for p in group["params"]
    ]


def _coverage(buckets, specs, world_size) -> dict[int, list[tuple[int, int, int]]]:
    """{parameter: sorted (start, stop, rank)} of every piece, from every rank's pieces."""
    covered: dict[int, list] = {}
    for bucket in buckets:
        for rank in range(world_size):
            for piece in bucket.pieces(rank):
                covered.setdefault(piece.index, []).append((piece.start, piece.stop, rank))
    return {i: sorted(spans) for i, spans in covered.items()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 16, 64])
def test_adamw_slices_cover_every_element_once_and_are_equal(world_size):
    specs = _specs(GPT2_SMALL, "adamw")
    buckets = plan_shards(specs, world_size, 25 * 2**20)
    covered = _coverage(buckets, specs, world_size)
    assert sorted(covered) == list(range(len(specs)))
    for i, spans in covered.items():  # brute force: the pieces tile each parameter exactly
        assert spans[0][0] == 0 and spans[-1][1] == specs[i].numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    held = held_elements(buckets, world_size)
    assert sum(held) == sum(s.numel for s in specs)
    assert max(held) <= 1.05 * sum(held) / world_size, held  # the bound; in fact much tighter
    for bucket in buckets:  # each bucket's slot is the same for every rank, and its members do not overlap
        ends = sorted(zip(bucket.offsets, bucket.sizes, strict=True))
        assert all(a + n <= b for (a, n), (b, _) in zip(ends, ends[1:], strict=False))
        assert ends[-1][0] + ends[-1][1] <= bucket.numel
        assert bucket.numel - sum(bucket.sizes) < 16 * (len(bucket.sizes) + world_size)  # alignment only


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_muon_matrices_stay_whole_and_their_work_is_balanced(world_size):
    specs = _specs(GPT2_SMALL, "muon")
    buckets = plan_shards(specs, world_size, 25 * 2**20)
    covered = _coverage(buckets, specs, world_size)
    for i, spans in covered.items():
        if specs[i].whole:
            assert spans == [(0, specs[i].numel, spans[0][2])], f"matrix {i} split: {spans}"
    work = newton_schulz_work(buckets, specs, world_size)
    mean = sum(work) / world_size
    assert sum(work) == sum(s.numel * min(s.shape) for s in specs if s.whole)
    assert max(work) <= 1.10 * mean, [w / mean for w in work]
    # Equal shapes travel together: every whole bucket holds one shape, at least world_size of them.
    for bucket in buckets:
        if bucket.whole:
            assert len({specs[i].shape for i in bucket.members}) == 1
            assert len(bucket.members) >= world_size


def test_buckets_are_listed_in_the_order_backward_completes_them():
    specs = [ParamSpec(100, (100,), 4, "float32", i % 2, False) for i in range(10)]
    buckets = plan_shards(specs, 2, 800)  # two parameters per bucket
    assert [sorted(b.members) for b in buckets] == [[8, 9], [6, 7], [4, 5], [2, 3], [0, 1]]
    assert all(specs[b.members[0]].group <= specs[b.members[-1]].group for b in buckets)  # groups in runs


def test_a_tiny_bucket_joins_its_neighbour_and_a_world_larger_than_the_parameters_is_refused():
    specs = [ParamSpec(1000, (1000,), 4, "float32", 0, False), ParamSpec(3, (3,), 4, "float32", 0, False)]
    # 4000 bytes per bucket: the 3-element parameter alone would leave 5 of 8 ranks nothing of its bucket
    buckets = plan_shards(specs, 8, 4000)
    assert [sorted(b.members) for b in buckets] == [[0, 1]]
    with pytest.raises(ValueError, match="world size 2048: a bucket of 1003 elements"):
        plan_shards(specs, 2048, 4000)
