"""The tree stays uniform: `ruff format --check` and `ruff check` (line length 110, E501 on) pass."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    executable = shutil.which("ruff")
    command = [executable] if executable else [sys.executable, "-m", "ruff"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("format", "--check", "."), ("check", ".")])
def test_ruff_is_clean(args):
    proc = ruff(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
