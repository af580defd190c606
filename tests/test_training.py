"""The pretrain stage: it learns, a killed run resumes bit-identically, faults end the job cleanly,
every world size and accumulation trains on the same tokens, float16 skips overflowing updates, and
bf16 autocast with torch.compile trains."""

import json
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_layouts_agree,
    assert_same,
    copy_state_up_to,
    final_payload,
    logged_losses,
    pretrain,
    pretrain_ok,
    train_float64_layouts,
    write_tiny_config,
)

from tinylm.pretrain.steps import committed_steps

ROOT = Path(__file__).resolve().parents[1]


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
    assert set(payload["rng"][0]) == {"torch", "cuda", "python"}  # the generators training draws from
    # What made the numbers: torch, the device, the CPU's kernels, each rank's threads.
    manifest = json.loads((uninterrupted["state"] / "step_0000012" / "manifest.json").read_text())
    assert manifest["machine"] == {
        "torch": torch.__version__,
        "device": "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": None,
        "threads": 1,
    }
    assert manifest["dtype"] == "float32"  # train.dtype as it resolved (tiny configs set float32)
    # The consolidated optimizer state covers every parameter and loads into a plain AdamW.
    from tinylm.model import Transformer
    from tinylm.optim import AdamW, param_groups

    model = Transformer(**payload["model_config"])
    model.load_state_dict(payload["model"])
    opt = AdamW(param_groups(model, 0.1))
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
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_resume_with_another_shape_or_optimizer_value_is_refused(tiny_data, uninterrupted, tmp_path):
    for key, value, section in [("lr_max", 0.02, "train"), ("d_ff", 96, "model")]:
        cfg = yaml.safe_load(uninterrupted["config"].read_text())
        cfg[section][key] = value
        other = tmp_path / f"{key}.yaml"
        other.write_text(yaml.safe_dump(cfg))
        proc = pretrain(tiny_data, other, uninterrupted["state"])
        assert proc.returncode == 1
        expected = "train.lr_max differs" if key == "lr_max" else "structural_hash differs"
        assert expected in proc.stderr, proc.stderr
    assert committed_steps(uninterrupted["state"]) == [8, 12]
    # Execution keys may change: the finished run says so and publishes again; nothing retrains.
    cfg = yaml.safe_load(uninterrupted["config"].read_text())
    cfg["train"].update(
        log_interval=3, val_interval=5, timeout_s=20.0, world_size=1, grad_accum_steps=2, compile=True
    )
    other = tmp_path / "housekeeping.yaml"
    other.write_text(yaml.safe_dump(cfg))
    proc = pretrain(tiny_data, other, uninterrupted["state"])
    assert proc.returncode == 0, proc.stderr
    assert "the run is finished: step 12/12 is committed in" in proc.stderr and "loss" not in proc.stderr
    assert "resuming" not in proc.stderr and "3 checkpoints (steps 4, 8, 12) published to" in proc.stderr
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
@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="ONEDNN_MAX_CPU_ISA is x86's"
)
def test_auto_dtype_follows_the_cpu_and_an_explicit_bfloat16_without_it_says_its_cost(
    tiny_data, tmp_path, monkeypatch
):
    """With oneDNN limited to AVX2 (a CPU without bfloat16 instructions, on any x86 CPU), `auto` says
    it trains in float32 and trains exactly as float32 does; an explicit bfloat16 says its cost."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    short = {"world_size": 1, "max_iters": 2, "checkpoint_interval": 2}
    runs = {}
    for dtype in ("auto", "float32", "bfloat16"):
        config = write_tiny_config(tmp_path / f"{dtype}.yaml", train={**short, "dtype": dtype})
        runs[dtype] = pretrain_ok(tiny_data, config, tmp_path / dtype)
    assert "train.dtype auto: float32 (the CPU has" in runs["auto"]
    assert "warning:" not in runs["auto"] + runs["float32"]
    manifests = {d: json.loads((tmp_path / d / "step_0000002" / "manifest.json").read_text()) for d in runs}
    assert [manifests[d]["dtype"] for d in runs] == ["float32", "float32", "bfloat16"]
    assert_same(final_payload(tmp_path / "auto")["model"], final_payload(tmp_path / "float32")["model"])
    warning = re.search(
        r"warning: .*bfloat16 runs on torch's reference kernels: .* takes ([\d.]+)x", runs["bfloat16"]
    )
    assert warning and float(warning.group(1)) > 1.0, runs["bfloat16"]


@pytest.mark.slow
def test_non_finite_loss_stops_before_any_commit_of_the_weights_it_touched(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "config.yaml")
    state = tmp_path / "state"
    proc = pretrain(tiny_data, config, state, fault="rank=0,step=6,action=nan")
    assert proc.returncode == 1
    assert "step 7: loss nan" in proc.stderr and "not finite; stopped at step" in proc.stderr
    assert committed_steps(state) == [4]
    assert torch.isfinite(final_payload(state)["model"]["lm_head.weight"]).all()


def test_losses_are_read_on_the_host_only_before_a_log_line_a_validation_or_a_commit(tiny_data, tmp_path):
    """The steps between cost no host sync: the loop reads the losses and norms since the last read
    at each log line, validation and commit (and the end), each step once; TensorBoard and the log
    still get every step's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = {"world_size": 1, "max_iters": 12, "log_interval": 5, "val_interval": 6, "checkpoint_interval": 8}
    config = write_tiny_config(tmp_path / "config.yaml", train=train)
    state = tmp_path / "state"
    script = textwrap.dedent(f"""
        import json
        from tinylm.config import load_config
        from tinylm.pretrain import loop, train
        reads, real = [], loop.read_values
        def counting(unread):
            reads.append([step for step, _, _ in unread])
            return real(unread)
        loop.read_values = counting
        data = {json.dumps({k: str(v) for k, v in tiny_data.items()})}
        train(load_config({str(config)!r}), data["tokenizer"], data["train"], data["valid"], {str(state)!r},
              {str(state) + "_ckpt"!r}, {str(tmp_path / "tb")!r})
        print(json.dumps(reads))
    """)
    command = [sys.executable, "-c", script]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    reads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reads == [[1, 2, 3, 4, 5], [6], [7, 8], [9, 10], [11, 12]]
    assert sorted(logged_losses(proc.stderr)) == [5, 10, 12]
    (events_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(events_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("loss_train")] == list(range(1, 13))


@pytest.mark.slow
def test_two_torchrun_agents_equal_mp_spawn(tiny_data, uninterrupted, tmp_path):
    """Multi-node on one machine: two torchrun agents (one per "node", one rank each) meet through
    a c10d rendezvous on 127.0.0.1; each rank runs `pretrain` in place, into one shared state folder."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ckpt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "tinylm-test",
        "-m",
        "tinylm",
        "pretrain",
        "--config",
        str(uninterrupted["config"]),
        "--tokenizer",
        str(tiny_data["tokenizer"]),
        "--train-tokens",
        str(tiny_data["train"]),
        "--valid-tokens",
        str(tiny_data["valid"]),
        "--state-dir",
        str(tmp_path / "state"),
        "--checkpoint-dir",
        str(out),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    agents = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        for _ in range(2)
    ]
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


# ------------------------------------------------------------------------------------------------
# One global batch per step, whatever the world size and accumulation


@pytest.mark.slow
def test_every_world_size_and_accumulation_trains_the_same_float64_weights(tiny_data, tmp_path):
    """In float64 rounding is negligible, so the four layouts must give the same weights (1e-10)."""
    finals = train_float64_layouts(tiny_data, tmp_path)
    early = final_payload(tmp_path / "state_1_1", 4)["model"]["lm_head.weight"]
    # The weights did change between checkpoints, so agreement means something.
    assert (finals[0]["model"]["lm_head.weight"] - early).abs().max() > 1e-3
    assert_layouts_agree(finals)


@pytest.fixture(scope="module")
def accumulated(tiny_data, tmp_path_factory):
    """The `uninterrupted` run's config at world size 1 with 4 accumulation micro-steps."""
    folder = tmp_path_factory.mktemp("accumulated")
    config = write_tiny_config(folder / "config.yaml", train={"world_size": 1, "grad_accum_steps": 4})
    return {
        "config": config,
        "state": folder / "state",
        "stderr": pretrain_ok(tiny_data, config, folder / "state"),
    }


@pytest.mark.slow
def test_accumulation_logs_the_same_float32_losses_as_more_ranks(uninterrupted, accumulated):
    ranks, accum = logged_losses(uninterrupted["stderr"]), logged_losses(accumulated["stderr"])
    assert sorted(ranks) == sorted(accum) == list(range(1, 13))
    for step in ranks:
        assert abs(float(ranks[step]) - float(accum[step])) < 1e-4, step
    assert float(accum[12]) < float(accum[1]) - 0.5


@pytest.mark.slow
def test_resume_at_another_world_size_continues_the_same_data_stream(tiny_data, uninterrupted, tmp_path):
    state = copy_state_up_to(uninterrupted["state"], tmp_path / "state", last_step=8)
    cfg = yaml.safe_load(uninterrupted["config"].read_text())
    cfg["train"].update(world_size=1, grad_accum_steps=2)
    config = tmp_path / "ws1.yaml"
    config.write_text(yaml.safe_dump(cfg))
    stderr = pretrain_ok(tiny_data, config, state)
    assert "resuming from step 8" in stderr and "written at world size 2, continued at 1" in stderr
    full, again = logged_losses(uninterrupted["stderr"]), logged_losses(stderr)
    assert sorted(again) == [9, 10, 11, 12]
    assert all(abs(float(again[s]) - float(full[s])) < 1e-4 for s in again)
    a, b = final_payload(uninterrupted["state"])["model"], final_payload(state)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------
# float16 with a gradient scaler; bf16 autocast with torch.compile


@pytest.fixture(scope="module")
def float16_run(tiny_data, tmp_path_factory):
    """float16 autocast at world size 2, every step committed; rank 1's step 6 gradients overflow."""
    folder = tmp_path_factory.mktemp("float16")
    config = write_tiny_config(
        folder / "config.yaml",
        train={
            "dtype": "float16",
            "checkpoint_interval": 1,
            "keep_checkpoints": 20,
            "shard_optimizer": False,
        },
    )
    stderr = pretrain_ok(tiny_data, config, folder / "state", fault="rank=1,step=5,action=overflow")
    return {"config": config, "state": folder / "state", "stderr": stderr}


@pytest.mark.slow
def test_float16_overflow_skips_the_update_on_every_rank_and_lowers_the_scale(float16_run):
    assert (
        "step 6: float16 gradients overflowed; update skipped, loss scale now 32768" in float16_run["stderr"]
    )
    before, skipped, after = (final_payload(float16_run["state"], s) for s in (5, 6, 7))
    # Only rank 1 overflowed, yet rank 0 (whose state is saved) skipped too: the decision is global.
    assert_same(before["model"], skipped["model"], "model")
    assert_same(before["optimizer"]["state"], skipped["optimizer"]["state"], "optimizer")
    assert skipped["grad_scaler"]["scale"] == before["grad_scaler"]["scale"] / 2 == 32768.0
    assert not torch.equal(after["model"]["lm_head.weight"], skipped["model"]["lm_head.weight"])
    # Parameters and optimizer state stay float32 under float16 autocast.
    assert all(t.dtype == torch.float32 for t in after["model"].values())
    assert after["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32
    losses = logged_losses(float16_run["stderr"])
    assert float(losses[12]) < float(losses[1]) - 0.5


@pytest.mark.slow
def test_float16_resume_restores_the_scaler_bit_identically(tiny_data, float16_run, tmp_path):
    state = copy_state_up_to(float16_run["state"], tmp_path / "state", last_step=7)
    stderr = pretrain_ok(tiny_data, float16_run["config"], state)  # no fault now: steps 8-12 as before
    assert "resuming from step 7" in stderr
    a, b = final_payload(float16_run["state"]), final_payload(state)
    for key in ("model", "optimizer", "grad_scaler"):
        assert_same(a[key], b[key], key)


@pytest.mark.slow
def test_bfloat16_with_compile_trains_and_saves_plain_float32_weights(tiny_data, accumulated, tmp_path):
    config = write_tiny_config(
        tmp_path / "config.yaml",
        train={"world_size": 1, "dtype": "bfloat16", "compile": True, "peak_flops": 1e11},
    )
    stderr = pretrain_ok(tiny_data, config, tmp_path / "state")
    assert len(re.findall(r"torch.compile: the first step took [\d.]+ s", stderr)) == 1
    assert re.search(
        r"step 12/12 loss \S+ \(1 step\) lr \S+ [\d,]+ tok/s MFU [\d.]+% peak mem [\d,]+ MiB", stderr
    )
    assert "MFU" not in accumulated["stderr"]  # on the CPU only with train.peak_flops
    from tinylm.model import Transformer

    payload = final_payload(tmp_path / "state")
    plain = Transformer(**payload["model_config"]).state_dict()
    assert payload["model"].keys() == plain.keys()  # no "_orig_mod." prefix
    assert all(t.dtype == torch.float32 for t in payload["model"].values())
    # bf16 rounds, but it trains on the same tokens as the float32 run and stays close to it.
    ours, reference = logged_losses(stderr), logged_losses(accumulated["stderr"])
    assert all(abs(float(ours[s]) - float(reference[s])) < 0.05 for s in reference)


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_bits_through_ddp_sharding_and_a_resume(
    tiny_data, uninterrupted, tmp_path
):
    """World size 2, sharded AdamW: full recomputation gives the uninterrupted run's losses and
    weights bit for bit; killed at step 9 and resumed without it, still the same bits."""
    cfg = yaml.safe_load(uninterrupted["config"].read_text())
    cfg["train"]["activation_checkpointing"] = "full"
    config = tmp_path / "full.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = tmp_path / "state"
    crashed = pretrain(tiny_data, config, state, fault="rank=1,step=9,action=kill")
    assert crashed.returncode != 0 and committed_steps(state) == [4, 8]
    assert logged_losses(crashed.stderr) == {
        s: v for s, v in logged_losses(uninterrupted["stderr"]).items() if s <= 9
    }
    pretrain_ok(tiny_data, uninterrupted["config"], state)  # activation checkpointing may change on resume
    a, b = final_payload(uninterrupted["state"]), final_payload(state)
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_activation_checkpointing_keeps_float16_with_accumulation_bit_identical(
    tiny_data, float16_run, tmp_path
):
    """float16 loss scaling (an overflow at step 6 included) and two accumulation micro-steps per
    rank, every second block recomputed: the float16 run's weights, bit for bit."""
    cfg = yaml.safe_load(float16_run["config"].read_text())
    cfg["train"].update(activation_checkpointing="selective", grad_accum_steps=2)
    config = tmp_path / "selective.yaml"
    config.write_text(yaml.safe_dump(cfg))
    accumulated_plain = tmp_path / "plain.yaml"
    cfg["train"]["activation_checkpointing"] = "none"
    accumulated_plain.write_text(yaml.safe_dump(cfg))
    fault = "rank=1,step=5,action=overflow"
    stderr = pretrain_ok(tiny_data, config, tmp_path / "selective", fault=fault)
    plain = pretrain_ok(tiny_data, accumulated_plain, tmp_path / "plain", fault=fault)
    assert "float16 gradients overflowed" in stderr and logged_losses(stderr) == logged_losses(plain)
    a, b = final_payload(tmp_path / "plain"), final_payload(tmp_path / "selective")
    for key in ("model", "optimizer", "grad_scaler"):
        assert_same(a[key], b[key], key)


# ------------------------------------------------------------------------------------------------
# Units of the loop


def test_micro_batches_tile_the_global_batch_in_rank_major_order():
    from tinylm.data import global_batch_starts, micro_batch_starts

    starts = global_batch_starts(seed=3, step=7, batch_size=24, num_starts=10_000)
    assert torch.equal(starts, global_batch_starts(seed=3, step=7, batch_size=24, num_starts=10_000))
    assert not torch.equal(starts, global_batch_starts(seed=3, step=8, batch_size=24, num_starts=10_000))
    for world_size, accum in [(1, 1), (2, 1), (2, 3), (3, 2), (1, 8), (4, 2)]:
        slices = [
            micro_batch_starts(starts, r, m, world_size, accum)
            for r in range(world_size)
            for m in range(accum)
        ]
        assert {len(s) for s in slices} == {24 // (world_size * accum)}
        assert torch.equal(torch.cat(slices), starts), (world_size, accum)


# ------------------------------------------------------------------------------------------------
# The log: header, the mean loss since the previous line, the closing summary, the run name, signals


def test_the_first_progress_line_comes_within_seconds_then_one_a_minute(monkeypatch, capsys):
    """On a slow machine (2 s a step, log_interval 50) the speed and the time left come after the
    first few seconds, then at least once a minute, between the lines by steps; the loss lines keep
    their windows of log_interval steps."""
    from tinylm.config import TrainConfig
    from tinylm.model import Transformer
    from tinylm.parallel import RankContext
    from tinylm.precision import LossScaler
    from tinylm.pretrain import log

    clock = [1000.0]
    monkeypatch.setattr(log.time, "perf_counter", lambda: clock[0])
    ctx = RankContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    model = Transformer(vocab_size=64, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    train = TrainConfig(max_iters=100, log_interval=50, batch_size=4)
    meter_log = log.TrainingLog(ctx, train, model, torch.float32, 0, "state", None, 0.0)
    capsys.readouterr()
    for step in range(1, 101):
        meter_log.step_begins()
        clock[0] += 2.0
        meter_log.step_done(step, LossScaler(False), False)
        meter_log.values(step, 3.0, 1.0, {"matrices": 1e-3}, LossScaler(False))
    lines = capsys.readouterr().err.splitlines()
    steps = [int(re.search(r"step (\d+)/100", line).group(1)) for line in lines]
    assert steps == [3, 33, 50, 80, 100], lines
    timed = [line for line in lines if " loss " not in line]
    assert len(timed) == 3 and all(re.search(r"16 tok/s .*ETA \d+s$", line) for line in timed), timed
    assert "ETA 194s" in lines[0]  # 97 steps left at 2 s each
    assert "loss 3.0000 (mean of 50 steps)" in lines[2] and "(mean of 50 steps)" in lines[4]


@pytest.mark.slow
def test_the_log_has_a_header_mean_losses_a_summary_and_the_run_name(tiny_data, uninterrupted, tmp_path):
    """log_interval 5 prints the mean of the per-step losses that log_interval 1 printed (the same
    run: log_interval never changes the weights)."""
    cfg = yaml.safe_load(uninterrupted["config"].read_text())
    cfg["train"]["log_interval"] = 5
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = pretrain(
        tiny_data,
        config,
        tmp_path / "state",
        checkpoint_dir=tmp_path / "ckpt",
        extra=("--run-name", "wide-2"),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("[pretrain wide-2] ") for line in lines), proc.stderr
    assert "\r" not in proc.stderr
    first = next(i for i, line in enumerate(lines) if "] model: " in line)
    assert (
        lines[0] == f"[pretrain wide-2] config: {config} over config/config.yaml over the built-in defaults"
    )
    assert lines[1] == "[pretrain wide-2] train.dtype float32"  # what the forward pass runs in, first
    assert "memory plan per rank" in lines[2] and any(" total " in line for line in lines[:first])
    header = "\n".join(lines[first : first + 2])
    for words in [
        "parameters (vocab 300, d_model 32",
        "12 steps of 128 tokens (batch 8 x context 16)",
        "world size 2, backend gloo, device cpu, autocast float32",
        f"state {tmp_path / 'state'}",
        "fresh start",
        "the loss printed is the mean over the steps since the previous line",
    ]:
        assert words in header, (words, header)
    per_step = {step: float(loss) for step, loss in logged_losses(uninterrupted["stderr"]).items()}
    means = re.findall(r"step (\d+)/12 loss (\S+) \(mean of (\d+) steps\)", proc.stderr)
    assert [(int(step), int(n)) for step, _, n in means] == [(5, 5), (10, 5), (12, 2)]
    for step, loss, n in means:
        window = [per_step[s] for s in range(int(step) - int(n) + 1, int(step) + 1)]
        assert abs(float(loss) - sum(window) / len(window)) < 2e-4, (step, loss, window)
    summary = next(line for line in lines if "done: " in line)
    assert re.search(r"done: steps 1-12 of 12 trained in [\d.]+ s \([\d,]+ tokens/s", summary), summary
    final_val = re.findall(r"step 12 val_loss (\S+)", proc.stderr)[0]
    assert f"final val_loss estimate {final_val}" in summary and str(tmp_path / "state") in summary
    assert f"3 checkpoints (steps 4, 8, 12) published to {tmp_path / 'ckpt'}" in lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_stopped_run_says_its_last_committed_step_and_how_to_resume(tiny_data, tmp_path, how):
    """SIGTERM to the launcher (kill, Snakemake, schedulers), SIGINT to the process group (Ctrl-C)."""
    import signal

    config = write_tiny_config(
        tmp_path / "config.yaml",
        train={"max_iters": 5000, "checkpoint_interval": 10, "log_interval": 10, "val_interval": 1000},
    )
    args = [
        "pretrain",
        "--config",
        str(config),
        "--tokenizer",
        str(tiny_data["tokenizer"]),
        "--train-tokens",
        str(tiny_data["train"]),
        "--valid-tokens",
        str(tiny_data["valid"]),
        "--state-dir",
        str(tmp_path / "state"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--log",
        str(tmp_path / "logs" / "pretrain.log"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinylm", *args],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in proc.stderr:
            if "step 20 committed" in line:
                break
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        returncode = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert returncode == (143 if how == "SIGTERM" else 130), rest
    last = committed_steps(tmp_path / "state")[-1]
    assert last >= 20
    assert (
        f"tinylm pretrain: stopped by {how}" in rest
        and f"last committed step: {last} in {tmp_path / 'state'}" in rest
    )
    assert "Traceback" not in rest, rest
    command = rest.split("Resume with:\n  ", 1)[1].strip()
    assert command == "python -m tinylm " + " ".join(args)
    # --log: the file gets all that the terminal got, the ranks' lines and the last one included.
    log = (tmp_path / "logs" / "pretrain.log").read_text()
    assert "step 20 committed" in log and log.endswith(rest) and "Resume with:" in log
    assert not (tmp_path / "ckpt").exists()  # published only when the run finishes (or by `sample`'s lookup)


def test_each_rank_gets_its_share_of_compile_threads(monkeypatch):
    import torch._inductor.config as inductor_config

    from tinylm.parallel.launch import limit_compile_threads, ranks_on_this_machine

    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_on_this_machine(8) == 8
    assert limit_compile_threads(8) == 2 == inductor_config.compile_threads
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    assert limit_compile_threads(32) == 1 == inductor_config.compile_threads  # at least one
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")  # the user's setting wins
    assert limit_compile_threads(8) == 3 == inductor_config.compile_threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: the ranks started on this machine
    assert ranks_on_this_machine(16) == 4


def test_resume_check_names_the_value_that_differs():
    from dataclasses import replace

    from helpers import IDENTITY as MANIFEST

    from tinylm.checkpoint import FORMAT, CheckpointError
    from tinylm.pretrain.resume import check_resumable

    saved = replace(MANIFEST, format=FORMAT)
    check_resumable(saved, MANIFEST, "s")
    with pytest.raises(CheckpointError, match="format differs"):
        check_resumable(replace(saved, format=1), MANIFEST, "s")
    # The same batches at any world size or thread count: those may change.
    check_resumable(saved, replace(MANIFEST, world_size=3, threads_per_rank=2), "s")
    with pytest.raises(CheckpointError, match="seed differs.*0.*1"):
        check_resumable(saved, replace(MANIFEST, seed=1), "s")
    with pytest.raises(CheckpointError, match="structural_hash differs"):
        check_resumable(saved, replace(MANIFEST, structural_hash="zzz"), "s")
    with pytest.raises(CheckpointError, match=r"train\.lr_max differs \(state has 0\.1, this run has 0\.2\)"):
        check_resumable(saved, replace(MANIFEST, config={"train": {"max_iters": 10, "lr_max": 0.2}}), "s")


def flip_byte(path: Path, where: float = 0.5) -> None:
    """Corrupt one byte of `path`, at the fraction `where` of its length."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_corrupt_newest_step_is_set_aside_and_the_run_resumes_from_the_intact_one(
    tiny_data, uninterrupted, tmp_path
):
    state = copy_state_up_to(uninterrupted["state"], tmp_path / "state", last_step=12)
    assert committed_steps(state) == [8, 12]
    flip_byte(state / "step_0000012" / "checkpoint.pt")
    proc = pretrain(tiny_data, uninterrupted["config"], state)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (corrupt,) = [line for line in proc.stderr.splitlines() if "is corrupt" in line]
    assert (
        "committed step 12 is corrupt: " in corrupt and "do not match the sha256 in its manifest" in corrupt
    )
    assert (
        f"step 12 set aside as {state / 'step_0000012.corrupt'} (kept for inspection); resuming from step 8, "
        "intact" in proc.stderr
    )
    assert f"resuming from step 8 in {state}" in proc.stderr
    full, again = logged_losses(uninterrupted["stderr"]), logged_losses(proc.stderr)
    assert sorted(again) == [9, 10, 11, 12]
    assert all(again[s] == full[s] for s in again)
    a, b = final_payload(uninterrupted["state"]), final_payload(state)
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")
    assert (state / "step_0000012.corrupt" / "checkpoint.pt").is_file()  # kept, never deleted

    # No intact step at all: one line saying what to do; nothing renamed, nothing trained.
    broken = copy_state_up_to(uninterrupted["state"], tmp_path / "broken", last_step=12)
    flip_byte(broken / "step_0000008" / "weights.pt")
    flip_byte(broken / "step_0000012" / "checkpoint.pt", where=0.9)
    proc = pretrain(tiny_data, uninterrupted["config"], broken)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "loss" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"tinylm pretrain: error: {broken}: no committed step is intact (steps 12, 8, see above), so the run "
        f"cannot resume; they are left as they are: move or delete {broken} to train from the start"
    )
    assert committed_steps(broken) == [8, 12]


@pytest.mark.slow
def test_a_run_is_refused_a_checkpoint_folder_of_another_run_before_it_trains(
    tiny_data, uninterrupted, tmp_path
):
    published = uninterrupted["state"].parent / "state_ckpt"
    before = sorted((p.name, p.stat().st_ino) for p in published.iterdir())
    # (A config whose tokenizer.vocab_size is not the file's: said in one line, the file's is used.)
    config = write_tiny_config(tmp_path / "short.yaml", train={"max_iters": 8}, tokenizer={"vocab_size": 512})
    proc = pretrain(tiny_data, config, tmp_path / "state", checkpoint_dir=published)
    assert (
        f"[pretrain] {tiny_data['tokenizer']} has 300 tokens, tokenizer.vocab_size is 512: the model takes "
        "the file's 300" in proc.stderr
    )
    assert proc.returncode == 1 and "loss" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        f"tinylm pretrain: error: {published}: holds the checkpoints of another run (train.max_iters: 12 "
        "there, 8 in this run); they are left as they are: publish this run into a folder of its own with "
        "--checkpoint-dir, or move"
    ), proc.stderr
    assert committed_steps(tmp_path / "state") == []
    assert sorted((p.name, p.stat().st_ino) for p in published.iterdir()) == before


@pytest.mark.slow
def test_each_run_has_its_own_tensorboard_folder_and_too_many_threads_are_said(tiny_data, tmp_path):
    from tinylm.config import load_config, run_hash

    folders = []
    for name, train in [("wide", {"world_size": 4}), ("seed1", {"world_size": 1, "seed": 1})]:
        config = write_tiny_config(
            tmp_path / f"{name}.yaml", train={"max_iters": 2, "checkpoint_interval": 2, **train}
        )
        proc = pretrain(tiny_data, config, tmp_path / name, extra=("--tensorboard-dir", str(tmp_path / "tb")))
        assert proc.returncode == 0, proc.stderr
        warned = [line for line in proc.stderr.splitlines() if "threads (train.threads_per_rank) on" in line]
        cores = len(os.sched_getaffinity(0))
        ranks = train["world_size"]
        assert len(warned) == (1 if ranks > cores else 0), proc.stderr
        if warned:
            assert (
                f"warning: {ranks} ranks x 1 threads (train.threads_per_rank) on {cores} cores" in warned[0]
            )
        folders.append(run_hash(load_config(config))[:8])
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == sorted(folders)
    for folder in folders:
        assert list((tmp_path / "tb" / folder).glob("events.out.tfevents.*"))
