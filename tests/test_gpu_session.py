"""bench/gpu_session.sh cannot rot: its --smoke path runs every part on the CPU, and a variant that
dies is one row saying why."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_dead_variant_is_one_row_saying_why():
    bench = gpu_bench()
    # An out-of-memory kill or a segfault writes nothing to stderr: the row still says what happened.
    assert bench.failure_row("tinylm", -signal.SIGKILL, "") == (
        "| tinylm | failed: killed by SIGKILL (out of memory?) |"
    )
    assert bench.failure_row("tinylm", -signal.SIGSEGV, "") == "| tinylm | failed: killed by SIGSEGV |"
    assert bench.failure_row("native", 1, "Traceback\n  ...\nRuntimeError: CUDA error\n\n") == (
        "| native | failed: exit status 1: RuntimeError: CUDA error |"
    )
    assert bench.failure_row("native", None, "", timeout_s=30) == "| native | failed: timed out after 30 s |"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
def test_the_session_script_runs_every_part_and_ends_with_one_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", "bench/gpu_session.sh", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "gpu_summary.md").read_text()
    rows = [
        line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| variant")
    ]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == ["native", "tinylm", "tinylm+compile"]
    assert "failed" not in summary and "No figure" not in summary
    # tinylm's eager row is against the eager baseline measured in the same session.
    native = float(rows[0].split(" | ")[1].replace(",", ""))
    tinylm = float(rows[1].split(" | ")[1].replace(",", ""))
    # (the figures are printed rounded: the ratio agrees to their rounding)
    assert float(rows[1].split(" | ")[2].removesuffix("x")) == pytest.approx(tinylm / native, rel=0.01)
    assert "test_cuda exit status: 0" in (tmp_path / "test_cuda.log").read_text()
    assert proc.stdout.rstrip().endswith(rows[-1])
