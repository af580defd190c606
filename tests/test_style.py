"""The tree stays uniform: `ruff format --check` and `ruff check` (line length 110, E501 on) pass."""

import re
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


def module_map() -> dict[str, str]:
    """docs/architecture.md's module map: {entry ("io.py", "pretrain/"): its text, children included}."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Module map", 1)[1].split("\n\n", 2)[1]  # the indented block after the title
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        if line.startswith("      ") and not line.startswith("       "):  # an entry: six spaces
            name = line.split()[0]
            entries[name] = line
        elif name is not None:
            entries[name] += "\n" + line
    return entries


def test_every_module_is_on_the_module_map_and_every_entry_exists():
    entries = module_map()
    package = ROOT / "tinylm"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if path.name == "__init__.py" and len(relative.parts) > 1:
            continue  # a package's __init__ is its entry
        if len(relative.parts) == 1:
            if relative.name != "__init__.py" and relative.name not in entries:
                missing.append(str(relative))
        else:
            folder = f"{relative.parts[0]}/"
            if folder not in entries or path.name not in re.findall(r"[\w.]+\.py", entries[folder]):
                missing.append(str(relative))
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"
    stale = [name for name in entries if not (package / name.rstrip("/")).exists()]
    assert not stale, f"docs/architecture.md's module map names what does not exist: {stale}"
