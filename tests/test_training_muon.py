"""The pretrain stage with `train.optimizer: muon`: it learns, a killed run resumes bit-identically,
every world size and accumulation trains the same float64 weights, a resume that changes the
optimizer is refused, bf16 autocast with torch.compile trains, and TensorBoard gets each group's lr."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_layouts_agree,
    assert_same,
    final_payload,
    logged_losses,
    pretrain,
    pretrain_ok,
    reference_lr,
    train_float64_layouts,
    write_tiny_config,
)

from tinylm.pretrain.steps import committed_steps

ROOT = Path(__file__).resolve().parents[1]
MUON = {"optimizer": "muon", "muon_lr": 0.02, "muon_weight_decay": 0.01, "embedding_lr": 0.02}
GROUPS = ["matrices", "embedding", "head", "gains"]


@pytest.fixture(scope="module")
def muon_run(tiny_data, tmp_path_factory):
    """The tiny config with Muon at world size 2 (sharded), 12 steps, a checkpoint every 4."""
    folder = tmp_path_factory.mktemp("muon")
    config = write_tiny_config(folder / "config.yaml", train=MUON)
    return {
        "config": config,
        "state": folder / "state",
        "stderr": pretrain_ok(tiny_data, config, folder / "state"),
    }


@pytest.mark.slow
def test_muon_training_learns_and_checkpoints_its_momentum(muon_run):
    losses = logged_losses(muon_run["stderr"])
    assert sorted(losses) == list(range(1, 13))
    assert float(losses[12]) < float(losses[1]) - 0.5
    payload = final_payload(muon_run["state"])  # loaded with weights_only=True
    from tinylm.config import load_config
    from tinylm.model import Transformer
    from tinylm.muon import Muon
    from tinylm.pretrain.optimizer import build_optimizer

    groups = payload["optimizer"]["param_groups"]
    assert [g["name"] for g in groups] == GROUPS
    assert [g["use_muon"] for g in groups] == [True, False, False, False]
    model = Transformer(**payload["model_config"])
    model.load_state_dict(payload["model"])
    optimizer = build_optimizer(model, load_config(muon_run["config"]).train, world_size=1)
    assert optimizer.optimizer_cls is Muon
    optimizer.load_state_dict(payload["optimizer"])  # the consolidated state of both ranks
    state = optimizer.local_state()  # at world size 1 every parameter's, held whole
    assert len(state) == len(list(model.parameters()))
    for p in optimizer.param_groups[0]["params"]:
        assert state[p]["momentum_buffer"].shape == p.shape
        assert state[p]["momentum_buffer"].abs().sum() > 0


@pytest.mark.slow
def test_tensorboard_gets_one_learning_rate_per_group(muon_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tinylm.config import load_config

    (run_folder,) = (muon_run["state"].parent / "state_tb").iterdir()  # the run's own folder
    events = EventAccumulator(str(run_folder))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {f"lr/{name}" for name in GROUPS} <= set(tags)
    t = load_config(muon_run["config"]).train
    peaks = {"matrices": t.muon_lr, "embedding": t.embedding_lr, "head": t.lr_max, "gains": t.lr_max}
    for name, peak in peaks.items():
        logged = {e.step: e.value for e in events.Scalars(f"lr/{name}")}
        assert sorted(logged) == list(range(1, 13))
        for step, value in logged.items():
            assert value == pytest.approx(reference_lr(step, t, peak), rel=1e-6), (name, step)


@pytest.mark.slow
def test_killed_muon_run_resumes_bit_identically(tiny_data, muon_run, tmp_path):
    state = tmp_path / "state"
    crashed = pretrain(tiny_data, muon_run["config"], state, fault="rank=1,step=9,action=kill")
    assert crashed.returncode != 0 and "rank 1" in crashed.stderr
    assert committed_steps(state) == [4, 8]
    resumed = pretrain_ok(tiny_data, muon_run["config"], state)
    assert "resuming from step 8" in resumed
    full, again = logged_losses(muon_run["stderr"]), logged_losses(resumed)
    assert sorted(again) == [9, 10, 11, 12]
    assert all(again[s] == full[s] for s in again)
    a, b = final_payload(muon_run["state"]), final_payload(state)
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_a_resume_that_changes_the_optimizer_is_refused(tiny_data, muon_run, tmp_path):
    for train, expected in [
        (
            {"optimizer": "adamw", "embedding_lr": None},
            "train.optimizer differs (state has 'muon', this run has 'adamw')",
        ),
        ({"muon_lr": 0.03}, "train.muon_lr differs (state has 0.02, this run has 0.03)"),
    ]:
        cfg = yaml.safe_load(muon_run["config"].read_text())
        cfg["train"].update(train)
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump(cfg))
        proc = pretrain(tiny_data, other, muon_run["state"])
        assert proc.returncode == 1
        assert expected in proc.stderr, proc.stderr
    assert committed_steps(muon_run["state"]) == [8, 12]


@pytest.mark.slow
def test_every_world_size_and_accumulation_trains_the_same_float64_weights_with_muon(tiny_data, tmp_path):
    """Float64 parameters and state (Muon's Newton-Schulz itself runs in bfloat16, as torch's does:
    equal inputs give equal bits, so the layouts agree as AdamW's do)."""
    finals = train_float64_layouts(tiny_data, tmp_path, train=MUON)
    reference = finals[0]["model"]
    assert finals[0]["optimizer"]["state"][2]["momentum_buffer"].dtype == torch.float64
    early = final_payload(tmp_path / "state_1_1", 4)["model"]
    matrix = next(
        name for name, tensor in reference.items() if name.startswith("layers.0.") and tensor.dim() == 2
    )
    assert (reference[matrix] - early[matrix]).abs().max() > 1e-3  # a Muon matrix moved after step 4
    assert_layouts_agree(finals)


@pytest.mark.slow
def test_muon_with_bfloat16_and_compile_trains(tiny_data, muon_run, tmp_path):
    config = write_tiny_config(
        tmp_path / "config.yaml", train={**MUON, "world_size": 1, "dtype": "bfloat16", "compile": True}
    )
    stderr = pretrain_ok(tiny_data, config, tmp_path / "state")
    assert len(re.findall(r"torch.compile: the first step took [\d.]+ s", stderr)) == 1
    payload = final_payload(tmp_path / "state")
    assert all(t.dtype == torch.float32 for t in payload["model"].values())
    # bf16 rounds, but it trains on the same tokens as the float32 run and stays close to it.
    ours, reference = logged_losses(stderr), logged_losses(muon_run["stderr"])
    assert sorted(ours) == sorted(reference) == list(range(1, 13))
    assert all(abs(float(ours[s]) - float(reference[s])) < 0.05 for s in reference)
    assert float(ours[12]) < float(ours[1]) - 0.5
