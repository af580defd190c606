"""AdamW against torch.optim.AdamW, and the learning-rate schedule."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.optim import AdamW, cos_lr_scheduler, param_groups

CONFIG = dict(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)


def _train(model, optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["context_length"] + 1), generator=g)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _param_groups(model, lr: float):
    """Two groups with their own settings: weight matrices decayed, gains not, at another lr."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    gains = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": gains, "weight_decay": 0.0, "lr": lr / 3},
    ]


def _assert_params_close(a, b, rtol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        scale = q.detach().abs().max().clamp_min(1e-12)
        err = (p.detach() - q.detach()).abs().max() / scale
        assert err <= rtol, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("foreach", [True, False], ids=["torch-foreach", "torch-for-loop"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1},
    ],
)
def test_adamw_matches_torch_adamw_for_100_steps(kwargs, foreach):
    torch.manual_seed(0)
    ours_model = Transformer(**CONFIG)
    torch_model = copy.deepcopy(ours_model)
    ours = AdamW(ours_model.parameters(), **kwargs)
    theirs = torch.optim.AdamW(torch_model.parameters(), foreach=foreach, **kwargs)
    _train(ours_model, ours, steps=100, seed=1)
    _train(torch_model, theirs, steps=100, seed=1)
    _assert_params_close(ours_model, torch_model)
    # The parameters did move, so the comparison above means something.
    assert not torch.allclose(ours_model.lm_head.weight, Transformer(**CONFIG).lm_head.weight)


def test_adamw_param_groups_match_torch():
    torch.manual_seed(0)
    ours_model = Transformer(**CONFIG)
    torch_model = copy.deepcopy(ours_model)
    ours = AdamW(_param_groups(ours_model, 1e-2), lr=1e-2)
    theirs = torch.optim.AdamW(_param_groups(torch_model, 1e-2), lr=1e-2)
    _train(ours_model, ours, steps=30, seed=2)
    _train(torch_model, theirs, steps=30, seed=2)
    _assert_params_close(ours_model, torch_model)


def test_param_groups_decay_matrices_only_and_train_like_torch():
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    decayed, plain = param_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    norms = {id(p) for name, p in model.named_parameters() if "ln" in name}
    assert {id(p) for p in plain["params"]} == norms  # every RMSNorm gain, nothing else
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    torch_model = copy.deepcopy(model)
    ours = AdamW(param_groups(model, 0.1), lr=1e-2)
    theirs = torch.optim.AdamW(param_groups(torch_model, 0.1), lr=1e-2, foreach=True)
    _train(model, ours, steps=20, seed=5)
    _train(torch_model, theirs, steps=20, seed=5)
    _assert_params_close(model, torch_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_adamw_is_ours_up_to_rounding(dtype):
    """AdamW(fused=True), torch's fused kernel (the default on CUDA; tests/test_cuda.py checks it
    there), against our multi-tensor update, both given the same gradients for 20 steps of two
    groups at a warmup-then-cosine learning rate, and against ours in float64 on those gradients.

    float32: parameters and both moments within 1e-5 of ours (float32 rounding), the step counters
    the same and still on the CPU. bf16 parameters and state round at every line of ours and once
    per step in the kernel: there each is within its distance to float64 of the other, and the
    kernel no farther from float64 than ours (it rounds less)."""
    torch.manual_seed(0)
    model = Transformer(**CONFIG).to(dtype)
    nets = [model, copy.deepcopy(model), copy.deepcopy(model).double()]  # fused, ours, ours in float64
    opts = [
        AdamW(_param_groups(net, 1e-2), lr=1e-2, betas=(0.9, 0.95), fused=fused)
        for net, fused in zip(nets, (True, False, False), strict=True)
    ]
    g = torch.Generator().manual_seed(3)
    for it in range(20):
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["context_length"] + 1), generator=g)
        lr = cos_lr_scheduler(it, 4, 20, 1e-3, 1e-2)
        for opt in opts:
            for group, scale in zip(opt.param_groups, (1.0, 1 / 3), strict=True):
                group["lr"] = lr * scale
        model.zero_grad(set_to_none=True)
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        for p, q, r in zip(*(net.parameters() for net in nets), strict=True):
            q.grad, r.grad = p.grad.clone(), p.grad.double()
        for opt in opts:
            opt.step()

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    fused, ours, exact = opts
    for p, q, r in zip(*(net.parameters() for net in nets), strict=True):
        assert fused.state[p]["step"].device.type == "cpu"
        assert fused.state[p]["step"].item() == ours.state[q]["step"].item() == 20
        for mine, theirs, truth in (
            (p, q, r),
            *((fused.state[p][k], ours.state[q][k], exact.state[r][k]) for k in ("exp_avg", "exp_avg_sq")),
        ):
            assert mine.dtype == theirs.dtype == dtype
            if dtype == torch.float32:
                assert distance(mine, theirs) <= 1e-5
            else:
                assert distance(mine, theirs) <= distance(mine, truth) + distance(theirs, truth)
                assert distance(mine, truth) <= 1.05 * distance(theirs, truth) + 1e-3
    assert not torch.allclose(model.lm_head.weight.float(), Transformer(**CONFIG).lm_head.weight)


def test_adamw_groups_tensors_of_several_dtypes_and_keeps_step_counters_on_the_cpu():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2, dtype=dtype)) for dtype in (torch.float32, torch.float64)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = AdamW(params, lr=0.1), torch.optim.AdamW(twins, lr=0.1, foreach=False)
    for _ in range(5):
        for ps, opt in ((params, ours), (twins, theirs)):
            for p in ps:
                p.grad = torch.sin(p.detach() * 3)
            opt.step()
    for p, q in zip(params, twins, strict=True):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        state = ours.state[p]
        assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
        assert state["exp_avg"].dtype == p.dtype


def test_adamw_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(2))]
    ours = AdamW(p).defaults
    theirs = torch.optim.AdamW(p).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert ours[key] == theirs[key], key


def test_adamw_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    optimizer = AdamW(_param_groups(model, 1e-2), lr=1e-2)
    _train(model, optimizer, steps=5, seed=3)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = Transformer(**CONFIG)
    resumed_model.load_state_dict(saved["model"])
    resumed = AdamW(_param_groups(resumed_model, 1e-2), lr=1e-2)
    resumed.load_state_dict(saved["optimizer"])

    _train(model, optimizer, steps=5, seed=4)
    _train(resumed_model, resumed, steps=5, seed=4)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    state = resumed.state[resumed_model.lm_head.weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].item() == 10


def test_adamw_on_a_subset_of_parameters_skips_the_rest_and_missing_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = copy.deepcopy(model)
    optimizer = AdamW(model[1].parameters(), lr=0.1)  # as a sharded wrapper would build it
    model(torch.randn(3, 4)).sum().backward()
    model[1].bias.grad = None
    optimizer.step()
    torch.testing.assert_close(model[0].weight, before[0].weight)
    torch.testing.assert_close(model[1].bias, before[1].bias)
    assert not torch.allclose(model[1].weight, before[1].weight)
    assert model[1].bias not in optimizer.state


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            AdamW(p, **kwargs)


# ---------------------------------------------------------------- schedule

SCHEDULE = dict(warmup_iters=10, cos_cycle_iters=110, lr_min=1e-4, lr_max=1e-3)


def test_schedule_hits_its_endpoints():
    lr = [cos_lr_scheduler(it, **SCHEDULE) for it in range(200)]
    assert lr[0] == 0.0
    assert lr[5] == pytest.approx(0.5e-3)
    assert lr[10] == pytest.approx(1e-3)
    assert lr[60] == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr[110] == pytest.approx(1e-4)
    assert all(x == 1e-4 for x in lr[111:])
    assert max(lr) == pytest.approx(1e-3)


def test_schedule_shape():
    lr = [cos_lr_scheduler(it, **SCHEDULE) for it in range(120)]
    warmup, cosine = lr[:11], lr[10:111]
    assert all(a < b for a, b in zip(warmup, warmup[1:], strict=False))
    assert all(a > b for a, b in zip(cosine, cosine[1:], strict=False))
    # Half-way through the warmup or the cosine, the value is the linear / cosine mid-point.
    it = 35
    expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * 25 / 100)) * (1e-3 - 1e-4)
    assert cos_lr_scheduler(it, **SCHEDULE) == pytest.approx(expected)


def test_schedule_matches_torch_cosine_annealing_after_warmup():
    # torch's CosineAnnealingLR in closed form is the same curve with T_max = cos_cycle - warmup.
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100, eta_min=1e-4)
    for it in range(10, 111):
        assert cos_lr_scheduler(it, **SCHEDULE) == pytest.approx(scheduler._get_closed_form_lr()[0])
        optimizer.step()
        scheduler.step()


def test_schedule_without_warmup_starts_at_lr_max():
    assert cos_lr_scheduler(0, 0, 100, 0.1, 1.0) == 1.0
    assert cos_lr_scheduler(5, 5, 5, 0.1, 1.0) == 1.0
    assert cos_lr_scheduler(6, 5, 5, 0.1, 1.0) == 0.1


def test_wsd_schedule_is_warmup_then_constant_then_torchs_linear_decay():
    from tinylm.optim import wsd_lr_scheduler

    warmup, decay, total, lr_min, lr_max = 10, 30, 100, 1e-4, 1e-3
    lr = [wsd_lr_scheduler(it, warmup, decay, total, lr_min, lr_max) for it in range(120)]
    assert lr[:warmup] == pytest.approx([lr_max * it / warmup for it in range(warmup)])
    assert lr[warmup : total - decay + 1] == [lr_max] * (total - decay - warmup + 1)
    # The decay is torch's LinearLR from lr_max to lr_min over `decay` steps, stepped by hand.
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr_max)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=lr_min / lr_max, total_iters=decay
    )
    for it in range(total - decay, total + 1):
        assert lr[it] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), it
        optimizer.step()
        scheduler.step()
    assert lr[total:] == [lr_min] * (120 - total)


def test_the_schedule_keys_are_checked():
    from tinylm.config import ConfigError, from_dict

    train = from_dict({"train": {"schedule": "wsd", "decay_fraction": 0.25, "max_iters": 200}}).train
    assert train.decay_iters == 50
    for values, words in [
        ({"schedule": "linear"}, "train.schedule: 'linear' is not one of"),
        ({"decay_fraction": 0.0}, "train.decay_fraction: 0.0 is out of range"),
        ({"decay_fraction": 1.5}, "train.decay_fraction: 1.5 is out of range"),
        (
            {"schedule": "wsd", "decay_fraction": 0.99, "max_iters": 100, "warmup_iters": 10},
            "train.decay_fraction: 0.99 of 100 steps is a decay of 99 steps, which overlaps",
        ),
    ]:
        with pytest.raises(ConfigError, match=words):
            from_dict({"train": values})


def test_the_fused_adamw_step_compiles_as_one_graph_and_is_the_eager_step():
    """AdamW's fused step traced by torch.compile with fullgraph=True (a graph break is an error):
    no break, and the same parameters and state as the same step run eagerly."""
    import torch._dynamo

    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    twin = copy.deepcopy(model)
    compiled_opt = AdamW(param_groups(model, 0.1), lr=1e-2, fused=True)
    eager_opt = AdamW(param_groups(twin, 0.1), lr=1e-2, fused=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(compiled_opt.step, fullgraph=True, backend="eager")
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        step()
        eager_opt.step()
    assert not torch._dynamo.utils.counters["graph_break"]
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(compiled_opt.state[p][name], eager_opt.state[q][name])
