"""The pretrain stage: it learns, a killed run resumes bit-identically, faults end the job cleanly."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _tiny_config import write_tiny_config

from tinylm.state import committed_steps, load_verified

ROOT = Path(__file__).resolve().parents[1]

def pretrain(data: dict, config: Path, state_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TINYLM_FAULT"}
    if fault:
        env["TINYLM_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "tinylm", "pretrain", "--config", str(config), "--tokenizer", str(data["tokenizer"]),
         "--train-tokens", str(data["train"]), "--valid-tokens", str(data["valid"]), "--state-dir", str(state_dir),
         "--checkpoint-dir", str(state_dir.parent / (state_dir.name + "_ckpt")), "--tensorboard-dir",
         str(state_dir.parent / (state_dir.name + "_tb"))],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )


def logged_losses(stderr: str) -> dict[int, str]:
    """step -> the loss exactly as printed."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ loss (\S+)", stderr)}


def final_payload(state_dir: Path) -> dict:
    step = committed_steps(state_dir)[-1]
    payload, _ = load_verified(state_dir / f"step_{step:07d}" / "checkpoint.pt")
    return payload


def assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("full")
    config = write_tiny_config(folder / "config.yaml")
    proc = pretrain(tiny_data, config, folder / "state")
    assert proc.returncode == 0, proc.stderr
    return {"config": config, "state": folder / "state", "stderr": proc.stderr}


@pytest.mark.slow
def test_training_learns_and_publishes_every_checkpoint(uninterrupted):
    losses = logged_losses(uninterrupted["stderr"])
    assert sorted(losses) == list(range(1, 13))
    assert float(losses[12]) < float(losses[1]) - 0.5
    published = sorted(p.name for p in (uninterrupted["state"].parent / "state_ckpt").glob("*.pt"))
    assert published == ["step_12.pt", "step_4.pt", "step_8.pt"]
    assert committed_steps(uninterrupted["state"]) == [8, 12]  # keep_checkpoints = 2
    payload = final_payload(uninterrupted["state"])
    assert payload["iteration"] == 12 and len(payload["rng"]) == 2
    # The consolidated optimizer state covers every parameter and loads into a plain AdamW.
    from tinylm.model import Transformer
    from tinylm.optim import AdamW

    model = Transformer(**payload["model_config"])
    model.load_state_dict(payload["model"])
    opt = AdamW(model.parameters())
    opt.load_state_dict(payload["optimizer"])
    assert len(opt.state) == len(list(model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("action", ["kill", "raise"])
def test_killed_run_resumes_bit_identically(tiny_data, uninterrupted, tmp_path, action):
    config = uninterrupted["config"]
    state = tmp_path / "state"
    crashed = pretrain(tiny_data, config, state, fault=f"rank=1,step=9,action={action}")
    assert crashed.returncode != 0
    assert "rank 1" in crashed.stderr
    if action == "kill":
        assert "SIGKILL" in crashed.stderr
    assert committed_steps(state) == [4, 8]  # the steps since the last checkpoint are lost, nothing else

    resumed = pretrain(tiny_data, config, state)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 8" in resumed.stderr
    full, again = logged_losses(uninterrupted["stderr"]), logged_losses(resumed.stderr)
    assert sorted(again) == [9, 10, 11, 12]
    assert all(again[s] == full[s] for s in again)
    a, b = final_payload(uninterrupted["state"]), final_payload(state)
    assert_same_tensors(a["model"], b["model"], "model")
    assert_same_tensors(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_resume_with_another_world_size_or_shape_is_refused(tiny_data, uninterrupted, tmp_path):
    for key, value, section in [("world_size", 1, "train"), ("d_ff", 96, "model")]:
        cfg = yaml.safe_load(uninterrupted["config"].read_text())
        cfg[section][key] = value
        cfg["train"]["max_iters"] = 20
        other = tmp_path / f"{key}.yaml"
        other.write_text(yaml.safe_dump(cfg))
        proc = pretrain(tiny_data, other, uninterrupted["state"])
        assert proc.returncode == 1
        expected = "world_size differs" if key == "world_size" else "structural_hash differs"
        assert expected in proc.stderr, proc.stderr
    assert committed_steps(uninterrupted["state"]) == [8, 12]
    # Housekeeping keys may change: the finished run is resumed at its last step, nothing retrains.
    cfg = yaml.safe_load(uninterrupted["config"].read_text())
    cfg["train"].update(log_interval=3, val_interval=5, timeout_s=20.0)
    other = tmp_path / "housekeeping.yaml"
    other.write_text(yaml.safe_dump(cfg))
    proc = pretrain(tiny_data, other, uninterrupted["state"])
    assert proc.returncode == 0, proc.stderr
    assert "resuming from step 12" in proc.stderr and "loss" not in proc.stderr
    assert committed_steps(uninterrupted["state"]) == [8, 12]


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "config.yaml", train={"timeout_s": 5.0})
    start = time.monotonic()
    proc = pretrain(tiny_data, config, tmp_path / "state", fault="rank=1,step=2,action=hang")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "rank" in proc.stderr and "failed" in proc.stderr
    assert elapsed < 60, elapsed


@pytest.mark.slow
def test_non_finite_loss_stops_before_the_update(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "config.yaml")
    state = tmp_path / "state"
    proc = pretrain(tiny_data, config, state, fault="rank=0,step=6,action=nan")
    assert proc.returncode == 1
    assert "step 7: loss nan" in proc.stderr and "not finite" in proc.stderr
    assert committed_steps(state) == [4]
    assert torch.isfinite(final_payload(state)["model"]["lm_head.weight"]).all()



@pytest.mark.slow
def test_two_torchrun_agents_equal_mp_spawn(tiny_data, uninterrupted, tmp_path):
    """Multi-node on one machine: two torchrun agents (one per "node", one rank each) meet through
    a c10d rendezvous on 127.0.0.1; each rank runs `pretrain` in place, into one shared state folder."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tinylm-test",
               "-m", "tinylm", "pretrain", "--config", str(uninterrupted["config"]),
               "--tokenizer", str(tiny_data["tokenizer"]), "--train-tokens", str(tiny_data["train"]),
               "--valid-tokens", str(tiny_data["valid"]), "--state-dir", str(tmp_path / "state"),
               "--checkpoint-dir", str(out), "--tensorboard-dir", str(tmp_path / "tb")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
              for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    spawned = uninterrupted["state"].parent / "state_ckpt"
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in spawned.glob("*.pt"))
    for step in (4, 8, 12):
        assert (out / f"step_{step}.pt").read_bytes() == (spawned / f"step_{step}.pt").read_bytes(), step
