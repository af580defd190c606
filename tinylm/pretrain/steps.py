"""The layout of a run's state folder: step folders, their files, and which steps are committed.

    state_dir/
      lock                       held by the running trainer (tinylm/pretrain/lock.py)
      step_0000500/
        checkpoint.pt            the full checkpoint: model, optimizer, iteration, the trainer's
                                 entries and per-rank RNG states
        weights.pt               the same without the optimizer state and per-rank entries
        manifest.json            written last (the commit): see tinylm/checkpoint/manifest.py
      published/                 tinylm/pretrain/publish.py

A step folder without a manifest is an interrupted write: readers ignore it, the next commit
removes it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tinylm.checkpoint.manifest import Manifest, numbered_steps, read_manifest

MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.pt"
WEIGHTS = "weights.pt"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(state_dir: str | os.PathLike, step: int) -> Path:
    return Path(state_dir) / f"step_{step:07d}"


def committed_steps(state_dir: str | os.PathLike) -> list[int]:
    """Steps whose folder has a manifest, ascending. Folders without one are ignored."""
    return numbered_steps(state_dir, STEP_DIR, lambda p: p / MANIFEST)


def step_manifest(state_dir: str | os.PathLike, step: int) -> Manifest:
    """The manifest of committed step `step` (checked: see tinylm/checkpoint/manifest.py)."""
    return read_manifest(step_dir(state_dir, step) / MANIFEST)
