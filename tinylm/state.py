"""Committed training states: folders that exist for the loader only once their manifest is written.

Layout of a state folder (resume state, outside Snakemake's declared outputs):

    state_dir/
      lock                      held (flock) by the running trainer
      step_0000500/
        checkpoint.pt           model, optimizer (consolidated), iteration, model_config, rng
        manifest.json           written last: step, world_size, threads_per_rank, seed, structural
                                hash, tokenizer sha256, sha256 of every file, torch version
      published/step_500.pt     hard links to every committed checkpoint.pt (+ step_500.json)

A step folder without a manifest is an interrupted write and does not exist for the loader. Every
file is checked against the manifest's sha256 before it is parsed, and parsed only with
`torch.load(..., weights_only=True)`, so a corrupt, truncated or hostile file is refused, never
trusted. `publish()` links the published checkpoints into the declared output folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint import CheckpointError, read_checkpoint
from tinylm.io import atomic_path, atomic_write_text, fsync_dir, sha256_file

MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PUBLISHED = re.compile(r"^step_(\d+)\.pt$")

# Keys of the manifest that must match for a resume, checked in this order; then every key of the
# training config ("config": {section: {key: value}}) must match too. The world size, threads and
# accumulation may differ: every step's global batch is the same at any of them.
RESUME_KEYS = ("seed", "structural_hash", "tokenizer_sha256")


def step_dir(state_dir: Path, step: int) -> Path:
    return Path(state_dir) / f"step_{step:07d}"


def committed_steps(state_dir: str | os.PathLike) -> list[int]:
    """Steps whose folder has a manifest, ascending. Folders without one are ignored."""
    return _steps(state_dir, _STEP_DIR, lambda p: p / MANIFEST)


def _steps(folder: str | os.PathLike, pattern: re.Pattern, manifest_of) -> list[int]:
    """Ascending steps of the entries of `folder` named like `pattern` whose manifest file exists."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir()
                  if (m := pattern.match(p.name)) and manifest_of(p).is_file())


def commit(state_dir: str | os.PathLike, step: int, payload: dict[str, Any], manifest: dict[str, Any],
           keep: int = 2) -> Path:
    """Write `payload` as a committed step folder, publish it, then prune old steps.

    The checkpoint file is written to a temp name, fsynced and renamed; the manifest (with the
    file's sha256) is written the same way and last. Only then does the step exist.
    """
    state_dir = Path(state_dir)
    folder = step_dir(state_dir, step)
    if folder.exists():  # a leftover of an interrupted commit of this very step
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    ckpt = folder / CHECKPOINT
    with atomic_path(ckpt) as tmp, open(tmp, "wb") as f:
        torch.save(payload, f)  # through a handle: the archive is named "archive", not after tmp
    manifest = {**manifest, "step": step, "files": {CHECKPOINT: sha256_file(ckpt)}, "torch_version": torch.__version__}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    published = state_dir / "published"
    published.mkdir(exist_ok=True)
    _link_or_copy(ckpt, published / f"step_{step}.pt")
    _link_or_copy(folder / MANIFEST, published / f"step_{step}.json")
    fsync_dir(published)

    for old in committed_steps(state_dir)[:-keep]:
        shutil.rmtree(step_dir(state_dir, old))
    return folder


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (replacing it), falling back to an atomic copy across devices."""
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(src, tmp)


def publish(state_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Link every published checkpoint (and its manifest) into `checkpoint_dir`; return the .pt paths."""
    src = Path(state_dir) / "published"
    out = Path(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for step in published_steps(src):
        _link_or_copy(src / f"step_{step}.json", out / f"step_{step}.json")
        _link_or_copy(src / f"step_{step}.pt", out / f"step_{step}.pt")
        paths.append(out / f"step_{step}.pt")
    return paths


def published_steps(checkpoint_dir: str | os.PathLike) -> list[int]:
    """Steps of `step_N.pt` files that have their `step_N.json` manifest beside them, ascending."""
    return _steps(checkpoint_dir, _PUBLISHED, lambda p: p.with_suffix(".json"))


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest not found (the checkpoint was never committed)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: manifest has no 'files' table")
    return manifest


def load_verified(checkpoint_path: str | os.PathLike, manifest_path: str | os.PathLike | None = None,
                  map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a checkpoint's sha256 against its manifest, then load it with weights_only=True.

    `manifest_path` defaults to `step_N.json` beside a published `step_N.pt`, or `manifest.json` in
    a step folder. Returns (payload, manifest). A flipped byte, a truncated file or a pickle that
    would run code is a CheckpointError naming the file; no code from the file ever runs.
    """
    path = Path(checkpoint_path)
    if manifest_path is None:
        manifest_path = path.parent / MANIFEST if path.name == CHECKPOINT else path.with_suffix(".json")
    manifest = read_manifest(manifest_path)
    expected = manifest["files"].get(CHECKPOINT)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(
            f"{path}: sha256 {actual[:16]}... does not match its manifest {Path(manifest_path).name} "
            f"({str(expected)[:16]}...): the file is corrupt or truncated"
        )
    return read_checkpoint(path, map_location), manifest


def check_resumable(manifest: dict[str, Any], expected: dict[str, Any], where: str | os.PathLike) -> None:
    """Refuse a resume whose manifest differs from this run in a key of RESUME_KEYS."""
    differences = [(key, manifest.get(key), expected[key]) for key in RESUME_KEYS
                   if key in expected and manifest.get(key) != expected[key]]
    saved_config, config = manifest.get("config", {}), expected.get("config", {})
    differences += [(f"{section}.{key}", saved_config.get(section, {}).get(key), value)
                    for section, values in config.items() for key, value in values.items()
                    if saved_config.get(section, {}).get(key) != value]
    if differences:
        key, saved, wanted = differences[0]
        raise CheckpointError(
            f"{where}: cannot resume: {key} differs (state has {saved!r}, this run has {wanted!r}); "
            f"use another --state-dir or delete this one to start afresh"
        )


class StateLock:
    """An exclusive, non-blocking flock on `state_dir/lock`: one trainer per state folder."""

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / "lock"
        self._fd: int | None = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"{self.path.parent}: another trainer (pid {holder}) is using this state folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
