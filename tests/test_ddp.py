"""DDP against single-process training and against torch's DistributedDataParallel (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import _ddp_ranks
import pytest
import torch
from helpers import global_batch, job_results, launch_each, lm_loss, make_toy
from torch import nn

from tinylm.parallel import DDP, launch
from tinylm.parallel.ddp import _split_into_buckets


def read_results(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


# The rank functions that need no launch of their own run in one launch per world size (see
# helpers.run_each); each test reads its function's results, or fails with the launch's error.
BUCKETS = {2: [1e-9, 25.0, 2e-3], 3: [1e-9, 25.0]}  # one parameter per bucket, one bucket, a few
TRAFFIC_BUCKET_MB = 0.02  # several buckets of the small Transformer (0.13 MB of float32 gradients)
JOBS = {
    2: [
        ("ddp_matches_single_process", _ddp_ranks.ddp_matches_single_process, (BUCKETS[2],)),
        ("ddp_matches_torch_ddp", _ddp_ranks.ddp_matches_torch_ddp, ()),
        ("ddp_overlaps_backward", _ddp_ranks.ddp_overlaps_backward, ()),
        ("ddp_no_sync_accumulates", _ddp_ranks.ddp_no_sync_accumulates, ()),
        ("zero1_matches_single_process", _ddp_ranks.zero1_matches_single_process, ()),
        ("traffic_of_one_step", _ddp_ranks.traffic_of_one_step, (TRAFFIC_BUCKET_MB,)),
    ],
    3: [
        ("ddp_matches_single_process", _ddp_ranks.ddp_matches_single_process, (BUCKETS[3],)),
        ("zero1_matches_single_process", _ddp_ranks.zero1_matches_single_process, ()),
        ("traffic_of_one_step", _ddp_ranks.traffic_of_one_step, (TRAFFIC_BUCKET_MB,)),
    ],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """world size -> (folder, the launch's error or None), launched once per world size when asked."""
    done = {}

    def at(world_size: int) -> tuple[Path, Exception | None]:
        if world_size not in done:
            folder = tmp_path_factory.mktemp(f"world{world_size}")
            done[world_size] = folder, launch_each(folder, JOBS[world_size], world_size)
        return done[world_size]

    return at


def results_of(launched, name: str, world_size: int = 2) -> list[dict]:
    folder, error = launched(world_size)
    return job_results(folder, name, world_size, error)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_single_process_on_global_batch(launched, world_size):
    for result in results_of(launched, "ddp_matches_single_process", world_size):
        assert result["buckets"] == BUCKETS[world_size]
        assert result["worst"] <= 1e-6


def test_ddp_equals_torch_ddp(launched):
    for result in results_of(launched, "ddp_matches_torch_ddp"):
        assert result["worst"] <= 1e-6


def test_all_reduces_start_during_backward(launched):
    for result in results_of(launched, "ddp_overlaps_backward"):
        events = result["events"]
        # one per bucket (one parameter each), and the flags of who produced each gradient
        assert events.count("all_reduce") == result["buckets"] + 1
        assert events.index("all_reduce") < events.index("backward returned")
        # All but the bucket of the first layer's parameters can start before the last gradient
        # hook (the first layer's weight and bias become ready in either order).
        assert result["early_all_reduces"] >= result["buckets"] - 2


def test_no_sync_skips_communication_and_accumulates(launched):
    for result in results_of(launched, "ddp_no_sync_accumulates"):
        assert result["all_reduces"] > 0  # the synced micro-steps did communicate


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch when dynamo loads
def test_ddp_of_a_compiled_model_with_a_sharded_optimizer_trains_like_the_plain_one(tmp_path):
    launch(_ddp_ranks.ddp_of_compiled_model, args=(str(tmp_path),), world_size=2, timeout_s=120)
    assert all(r["checked"] for r in read_results(tmp_path, 2))


def test_module_is_the_unwrapped_model_and_world_of_one_is_a_no_op():
    model = make_toy(seed=0)
    ddp = DDP(model)
    assert ddp.module is model
    assert ddp.module.state_dict().keys() == model.state_dict().keys()
    x, y = global_batch(0, 2)
    lm_loss(ddp, x, y).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    ddp.finish_gradient_sync()
    for name, p in model.named_parameters():
        if name in grads:
            assert torch.equal(p.grad, grads[name])


def test_buckets_follow_reverse_order_and_size_limit():
    params = [nn.Parameter(torch.zeros(n)) for n in (256, 256, 512, 64)]  # 1, 1, 2, 0.25 KiB
    limit_mb = 2048 / 2**20
    buckets = _split_into_buckets(params[::-1], limit_mb)
    assert buckets == [[params[3]], [params[2]], [params[1], params[0]]]
    assert _split_into_buckets(params[::-1], 25.0) == [params[::-1]]
    mixed = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert len(_split_into_buckets(mixed, 25.0)) == 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_with_a_sharded_optimizer_equals_single_process(launched, world_size):
    for result in results_of(launched, "zero1_matches_single_process", world_size):
        assert result["worst"] <= 1e-6
        assert result["grads_kept"] > 0
        assert result["split"] > 0  # some parameter is split between ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_step_sends_what_ddp_sends_and_what_the_plan_says(launched, world_size):
    from tinylm.parallel.comm_plan import plan_communication
    from tinylm.parallel.shard_layout import ParamSpec

    model = _ddp_ranks._small_transformer(seed=3)
    specs = [ParamSpec(p.numel(), tuple(p.shape), 4, "float32", 0, False) for p in model.parameters()]
    for result in results_of(launched, "traffic_of_one_step", world_size):
        ddp, sharded = result["ddp"], result["ddp+sharded"]
        assert set(ddp["sent"]) == {"all_reduce"}
        # Each bucket one reduce-scatter and one all-gather, and three small all-reduces: the flags
        # of which ranks produced each gradient, the loss, and the clip's squared norms.
        assert sharded["calls"]["reduce_scatter"] == sharded["calls"]["all_gather"] > 1
        assert sharded["calls"]["all_reduce"] == 3
        assert sharded["sent"]["all_reduce"] < 0.01 * result["gradient_bytes"]
        assert sharded["total"] <= 1.01 * ddp["total"], (sharded, ddp)  # slot padding only
        for name, counted in (("ddp", ddp), ("ddp+sharded", sharded)):
            plan = plan_communication(specs, world_size, TRAFFIC_BUCKET_MB * 2**20, name == "ddp+sharded")
            for kind, calls in counted["calls"].items():
                assert plan.calls(kind) == calls, (name, kind)
                assert plan.sent_bytes_of(kind) == pytest.approx(counted["sent"][kind], rel=1e-12), (
                    name,
                    kind,
                )
            assert plan.sent_bytes() == pytest.approx(counted["total"], rel=1e-12)


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled-as-on-gpus"]
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch when dynamo loads
def test_each_part_waits_for_its_own_parameter_gathers_under_zero1(tmp_path, compiled):
    launch(_ddp_ranks.gathers_waited_where_used, args=(str(tmp_path), compiled), world_size=2, timeout_s=300)
    assert all(result["checked"] for result in read_results(tmp_path, 2))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch when dynamo loads
@pytest.mark.parametrize("compile_blocks", [False, True], ids=["eager", "compiled-blocks"])
def test_first_all_reduce_starts_early_in_backward(tmp_path, compile_blocks):
    launch(_ddp_ranks.overlap_in_backward, args=(str(tmp_path), compile_blocks), world_size=2, timeout_s=300)
    for result in read_results(tmp_path, 2):
        assert len(result["fractions"]) == 3
        assert all(fraction < 0.5 for fraction in result["fractions"]), result["fractions"]
