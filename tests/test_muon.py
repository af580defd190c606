"""Muon against torch.optim.Muon and a float64 SVD; build_optimizer and the per-group schedule."""

from __future__ import annotations

import copy
import dataclasses
import io

import _muon_ranks as muon_ranks
import pytest
import torch
from helpers import reference_lr

from tinylm.config import TrainConfig
from tinylm.model import Transformer
from tinylm.muon import NS_COEFFICIENTS, Muon, adjusted_lr, newton_schulz
from tinylm.nn_utils import cross_entropy
from tinylm.optim import AdamW, param_groups
from tinylm.parallel import ShardedOptimizer, launch
from tinylm.pretrain.optimizer import build_optimizer, set_learning_rates

CONFIG = muon_ranks.CONFIG


def _train(model, optimizers, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["context_length"] + 1), generator=g)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()


def _assert_params_close(a, b, rtol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        scale = q.detach().abs().max().clamp_min(1e-12)
        err = (p.detach() - q.detach()).abs().max() / scale
        assert err <= rtol, f"{name}: relative difference {err:.2e}"


MUON_SETTINGS = [
    {},  # torch's defaults
    {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.9},
    {"lr": 0.01, "weight_decay": 0.1, "nesterov": False, "ns_steps": 4},
    {"lr": 3e-3, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw"},
]


@pytest.mark.parametrize("kwargs", MUON_SETTINGS, ids=["defaults", "lr0.02", "plain-momentum", "match-rms"])
def test_muon_matches_torch_muon_and_adamw_for_100_steps(kwargs):
    """Our one optimizer (Muon for the block matrices, AdamW beside it) against torch's two."""
    torch.manual_seed(0)
    ours_model = Transformer(**CONFIG)
    torch_model = copy.deepcopy(ours_model)
    adamw = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    theirs_kwargs = {("eps" if k == "ns_eps" else k): v for k, v in kwargs.items()}
    matrices, others = muon_ranks.split_params(ours_model)
    ours = Muon([{"params": matrices}, {"params": others, "use_muon": False, **adamw}], **kwargs)
    torch_matrices, torch_others = muon_ranks.split_params(torch_model)
    theirs = [torch.optim.Muon(torch_matrices, **theirs_kwargs), torch.optim.AdamW(torch_others, **adamw)]
    _train(ours_model, [ours], steps=100, seed=1)
    _train(torch_model, theirs, steps=100, seed=1)
    _assert_params_close(ours_model, torch_model)
    # The matrices did move, so the comparison above means something.
    torch.manual_seed(0)
    fresh = Transformer(**CONFIG)
    assert not torch.allclose(ours_model.layers[0].ffn.w1.weight, fresh.layers[0].ffn.w1.weight, atol=1e-3)


def test_muon_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    ours, theirs = Muon(p).defaults, torch.optim.Muon(p).defaults
    for key in ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "ns_steps"):
        assert ours[key] == theirs[key], key
    assert ours["ns_eps"] == theirs["eps"]
    assert ours["adjust_lr_fn"] == (theirs["adjust_lr_fn"] or "original")
    assert (ours["betas"], ours["eps"]) == (
        torch.optim.AdamW(p).defaults["betas"],
        torch.optim.AdamW(p).defaults["eps"],
    )


def test_muon_refuses_other_than_matrices_and_bad_values():
    with pytest.raises(ValueError, match="2-D parameters only"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": False}])  # AdamW takes any shape
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="nonsense")
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], momentum=1.0)


def test_adjusted_lr_is_torchs_shape_scale():
    from torch.optim._muon import _adjust_lr

    for shape in [(48, 16), (16, 48), (16, 16), (344, 128), (128, 344)]:
        for fn in ("original", "match_rms_adamw"):
            assert adjusted_lr(0.02, torch.Size(shape), fn) == _adjust_lr(0.02, fn, torch.Size(shape)), (
                shape,
                fn,
            )
    assert adjusted_lr(0.02, (48, 16), "original") > adjusted_lr(0.02, (16, 48), "original") == 0.02


# ------------------------------------------------------------------------------------------------
# The orthogonalisation against a float64 SVD


def _quintic(s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def _band(lowest: float) -> tuple[float, float]:
    """The exact range of the five-step quintic over singular values in [lowest, 1] (float64, fine grid)."""
    out = _quintic(torch.logspace(torch.log10(torch.tensor(lowest)).item(), 0, 200_001, dtype=torch.float64))
    return out.min().item(), out.max().item()


def _matrix(rows: int, cols: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(rows, cols, dtype=torch.float64, generator=generator)
    # A spread spectrum: singular values from 1 down to 10^-2.5, random singular vectors.
    k = min(rows, cols)
    p, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=generator))
    q, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=generator))
    return p @ torch.diag(torch.logspace(0, -2.5, k, dtype=torch.float64)) @ q.T


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 16), (128, 128), (344, 128)])
@pytest.mark.parametrize("kind", ["gaussian", "spread"])
def test_newton_schulz_against_float64_svd(shape, kind):
    """U = P S Q^T (float64 SVD) must come out as P g(S / ||U||_F) Q^T, g the five-step quintic, and
    along every singular direction with s >= 0.003 ||U||_F the value lies in the quintic's band."""
    u = _matrix(*shape, kind, torch.Generator().manual_seed(sum(shape)))
    o = newton_schulz(u)
    assert o.dtype == torch.bfloat16 and o.shape == u.shape
    o = o.double()
    p, s, qh = torch.linalg.svd(u, full_matrices=False)
    normalised = s / torch.linalg.matrix_norm(u)
    predicted = p @ torch.diag(_quintic(normalised)) @ qh
    # bfloat16 rounding through five iterations: a few percent of the whole, far below the update.
    assert torch.linalg.matrix_norm(o - predicted) <= 0.1 * torch.linalg.matrix_norm(predicted)
    # Along the singular directions of U: Pᵀ O Q is about diagonal, its diagonal in the band.
    along = (p.T @ o @ qh.T).diagonal()
    lo, hi = _band(0.003)
    well = normalised >= 0.003
    assert well.sum() >= 0.75 * len(s)
    assert along[well].min() >= lo - 0.05 and along[well].max() <= hi + 0.05, (
        along.min(),
        along.max(),
        lo,
        hi,
    )
    # Not the identity map: the input had singular values far below the band.
    assert normalised.min() < lo / 2


def test_newton_schulz_is_torchs_bit_for_bit_and_keeps_zero():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(3)
    for shape in [(24, 16), (16, 24), (16, 16)]:
        for _ in range(20):
            u = torch.randn(*shape, generator=g) * torch.rand((), generator=g)
            assert torch.equal(newton_schulz(u), _zeropower_via_newtonschulz(u, NS_COEFFICIENTS, 5, 1e-7))
    assert torch.equal(newton_schulz(torch.zeros(4, 3)), torch.zeros(4, 3, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# State dicts


def test_muon_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    optimizer = Muon(muon_ranks.muon_groups(model), lr=0.02)
    _train(model, [optimizer], steps=5, seed=3)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = Transformer(**CONFIG)
    resumed_model.load_state_dict(saved["model"])
    resumed = Muon(
        muon_ranks.muon_groups(resumed_model), lr=0.5, momentum=0.5
    )  # the state dict restores them
    resumed.load_state_dict(saved["optimizer"])

    _train(model, [optimizer], steps=5, seed=4)
    _train(resumed_model, [resumed], steps=5, seed=4)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert set(resumed.state[resumed_model.layers[0].ffn.w1.weight]) == {"momentum_buffer"}
    assert set(resumed.state[resumed_model.lm_head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


# ------------------------------------------------------------------------------------------------
# build_optimizer and set_learning_rates


def _train_cfg(**overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), world_size=1, **overrides)


def test_build_optimizer_adamw_is_plain_adamw_over_two_groups():
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    reference = copy.deepcopy(model)
    t = _train_cfg(lr_max=1e-2, lr_min=1e-3, warmup_iters=3, max_iters=20, weight_decay=0.1)
    optimizer = build_optimizer(model, t, world_size=1)  # every parameter held: AdamW's steps, bit for bit
    assert type(optimizer) is ShardedOptimizer and optimizer.optimizer_cls is AdamW
    assert [g["name"] for g in optimizer.param_groups] == ["matrices", "gains"]
    ref_opt = AdamW(param_groups(reference, t.weight_decay), lr=t.lr_max, betas=(t.beta1, t.beta2), eps=t.eps)
    g = torch.Generator().manual_seed(7)
    for it in range(1, 11):
        lrs = set_learning_rates(optimizer, it, t)
        lr = reference_lr(it, t, t.lr_max)
        assert lrs["matrices"] == lrs["gains"] == pytest.approx(lr, rel=1e-12)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["context_length"] + 1), generator=g)
        for m, o in ((model, optimizer), (reference, ref_opt)):
            cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_build_optimizer_muon_groups_and_their_schedules():
    model = Transformer(**CONFIG)
    t = _train_cfg(
        optimizer="muon",
        lr_max=1e-2,
        lr_min=1e-3,
        warmup_iters=3,
        max_iters=20,
        muon_lr=0.05,
        muon_momentum=0.9,
        muon_weight_decay=0.01,
        muon_ns_steps=4,
        muon_adjust_lr="match_rms_adamw",
        head_lr=2e-3,
    )
    optimizer = build_optimizer(model, t, world_size=1)
    assert type(optimizer) is ShardedOptimizer and optimizer.optimizer_cls is Muon
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert list(groups) == ["matrices", "embedding", "head", "gains"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in groups["matrices"]["params"]) == sorted(
        n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2
    )
    assert [names[id(p)] for p in groups["embedding"]["params"]] == ["token_embeddings.weight"]
    assert [names[id(p)] for p in groups["head"]["params"]] == ["lm_head.weight"]
    assert [names[id(p)] for p in groups["gains"]["params"]] == [
        n for n, p in model.named_parameters() if p.dim() < 2
    ]
    m = groups["matrices"]
    assert (m["use_muon"], m["momentum"], m["weight_decay"], m["ns_steps"], m["adjust_lr_fn"]) == (
        True,
        0.9,
        0.01,
        4,
        "match_rms_adamw",
    )
    assert [groups[n]["use_muon"] for n in ("embedding", "head", "gains")] == [False, False, False]
    assert [groups[n]["weight_decay"] for n in ("embedding", "head", "gains")] == [t.weight_decay] * 2 + [0.0]
    assert groups["embedding"]["betas"] == (t.beta1, t.beta2)
    peaks = {"matrices": 0.05, "embedding": 1e-2, "head": 2e-3, "gains": 1e-2}
    for schedule in ("cosine", "wsd"):
        t = dataclasses.replace(t, schedule=schedule)
        for it in (1, 3, 10, 15, 18, 20, 25):
            lrs = set_learning_rates(optimizer, it, t)
            for name, peak in peaks.items():
                assert lrs[name] == pytest.approx(reference_lr(it, t, peak), rel=1e-12), (schedule, it, name)
                assert groups[name]["lr"] == lrs[name]
        assert lrs["gains"] == pytest.approx(t.lr_min, rel=1e-12)
    _train(model, [optimizer], steps=2, seed=0)  # it steps


# ------------------------------------------------------------------------------------------------
# Sharded (gloo, two ranks)


def test_world_of_one_sharded_muon_equals_muon():
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    reference = copy.deepcopy(model)
    opt = ShardedOptimizer(muon_ranks.muon_groups(model), Muon, lr=0.02)
    ref_opt = Muon(muon_ranks.muon_groups(reference), lr=0.02)
    _train(model, [opt], steps=3, seed=2)
    _train(reference, [ref_opt], steps=3, seed=2)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_sharded_muon_equals_unsharded_and_consolidates(tmp_path):
    launch(muon_ranks.sharded_muon_matches_muon, args=(str(tmp_path),), world_size=2, timeout_s=120)
    results = muon_ranks.read_results(tmp_path, 2)
    owned = sorted({i for r in results for i in r["owned"]})
    assert owned == list(range(results[0]["num_parameters"]))  # shares that cover everything
    held = [sum(r["elements"].get(str(i), 0) for r in results) for i in owned]
    assert held == results[0]["numel"]  # every element held by exactly one rank
    assert all(r["owned_matrices"] > 0 for r in results)  # both ranks orthogonalise matrices
    assert max(r["worst"] for r in results) <= 1e-6


# ------------------------------------------------------------------------------------------------
# The config keys and the resume check


def test_muon_keys_count_only_with_muon():
    from tinylm.config import ConfigError, from_dict, run_hash, weight_config

    base = from_dict({})
    assert weight_config(base)["train"]["optimizer"] == "adamw"
    assert not {"muon_lr", "embedding_lr", "head_lr"} & set(weight_config(base)["train"])
    # Under AdamW the Muon keys change nothing: the same run, the same state folder.
    assert run_hash(from_dict({"train": {"muon_lr": 0.05, "muon_momentum": 0.9}})) == run_hash(base)
    muon = from_dict({"train": {"optimizer": "muon"}})
    assert run_hash(muon) != run_hash(base)
    assert weight_config(muon)["train"]["optimizer"] == "muon"
    assert run_hash(from_dict({"train": {"optimizer": "muon", "muon_lr": 0.05}})) != run_hash(muon)
    for train, words in [
        ({"embedding_lr": 0.1}, "train.embedding_lr: applies with train.optimizer 'muon' only"),
        ({"head_lr": 0.1}, "train.head_lr: applies with train.optimizer 'muon' only"),
        ({"optimizer": "muon", "muon_momentum": 1.0}, "train.muon_momentum: 1.0 must be below 1"),
        ({"optimizer": "sgd"}, "train.optimizer: 'sgd' is not one of"),
        ({"optimizer": "muon", "muon_adjust_lr": "x"}, "train.muon_adjust_lr: 'x' is not one of"),
    ]:
        with pytest.raises(ConfigError, match=words):
            from_dict({"train": train})


def test_a_resume_that_changes_the_optimizer_is_refused_by_name():
    from dataclasses import replace

    from tinylm.checkpoint import FORMAT, CheckpointError, Manifest
    from tinylm.config import from_dict, weight_config
    from tinylm.pretrain.resume import check_resumable

    def manifest(train: dict) -> Manifest:
        return Manifest(seed=0, structural_hash="abc", config=weight_config(from_dict({"train": train})))

    adamw, muon = manifest({}), manifest({"optimizer": "muon"})
    saved_adamw, saved_muon = replace(adamw, format=FORMAT), replace(muon, format=FORMAT)
    check_resumable(saved_adamw, adamw, "s")
    check_resumable(saved_muon, muon, "s")
    with pytest.raises(
        CheckpointError, match=r"train\.optimizer differs \(state has 'adamw', this run has 'muon'\)"
    ):
        check_resumable(saved_adamw, muon, "s")
    with pytest.raises(
        CheckpointError, match=r"train\.optimizer differs \(state has 'muon', this run has 'adamw'\)"
    ):
        check_resumable(saved_muon, adamw, "s")
    with pytest.raises(
        CheckpointError, match=r"train\.muon_lr differs \(state has 0\.02, this run has 0\.05\)"
    ):
        check_resumable(saved_muon, manifest({"optimizer": "muon", "muon_lr": 0.05}), "s")
    # An AdamW state holds none of the Muon keys; a state without the key is read as its default.
    assert not {"muon_lr", "embedding_lr"} & set(saved_adamw.config["train"])
    without_optimizer = replace(saved_adamw, config={"train": {}})
    check_resumable(without_optimizer, adamw, "s")
    with pytest.raises(CheckpointError, match=r"train\.optimizer differs \(state has 'adamw'"):
        check_resumable(without_optimizer, muon, "s")
