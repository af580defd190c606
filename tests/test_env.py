"""`python -m tinylm env`: the machine and the config resolved on it, in one block."""

import os
import re
import subprocess
import sys

import torch
from helpers import ROOT, write_tiny_config

from tinylm.config import load_config


def test_env_names_the_machine_and_the_config_resolved_here(tmp_path, monkeypatch):
    config = write_tiny_config(tmp_path / "c.yaml", train={"dtype": "auto", "world_size": 2})
    out = subprocess.run(
        [sys.executable, "-m", "tinylm", "env", "--config", str(config), "--timed-steps", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"},  # the CPU as it is
        check=True,
    ).stdout
    fields = dict(re.findall(r"^(\S[\w .]*?)\s{2,}(.*)$", out, re.M))
    assert fields["torch"].startswith(torch.__version__)
    assert f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}" in fields["cpu"]
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    if "flags" in flags:  # x86 Linux: the kernel's flags are a second opinion on native bfloat16
        native = bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))
        assert fields["cpu bfloat16"].startswith("native" if native else "not native")
        assert f"train.dtype auto: {'bfloat16' if native else 'float32'} (" in out
    assert re.search(r"train.world_size 2 \(2 ranks here\), backend gloo on cpu", out)
    assert re.search(r"memory plan +[\d,]+ MiB per rank; fits", out)
    estimate = re.search(r"estimate +([\d,]+) tokens/s, so 12 steps in about ([\d.]+) min", out)
    assert estimate and int(estimate.group(1).replace(",", "")) > 0, out
    assert "no CUDA device" in out or re.search(r"^gpu 0 ", out, re.M)


def test_env_says_when_the_config_does_not_fit_and_then_times_nothing(tmp_path):
    from tinylm.env import config_lines

    huge = {"context_length": 2048, "d_model": 8192, "num_layers": 48, "num_heads": 64, "d_ff": 22016}
    cfg = load_config(write_tiny_config(tmp_path / "c.yaml", model=huge, train={"world_size": 1}))
    lines = config_lines(cfg, "c.yaml", timed_steps=3)
    assert any("memory plan" in line and "does not fit: needs at least" in line for line in lines)
    assert not any("estimate" in line for line in lines)
