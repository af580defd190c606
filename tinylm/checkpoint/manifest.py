"""Manifests: the JSON beside checkpoint files that says what they hold and the sha256 of every byte.

A manifest is written after the files it describes (it is their commit) and holds

    format          FORMAT; a manifest of another format is refused
    step            the optimizer step of the checkpoint
    files           {file name: {"bytes", "records", "other"}}: each file cut into byte ranges with
                    their sha256 (see tinylm/checkpoint/pieces.py, `Layout.entry`)
    weights_sha256  the model's identity (`weights_sha256`), the same for any file holding its weights
    ...             the writer's facts: the run's identity (IDENTITY_KEYS and "config", the
                    keys that decide the weights), model_config, tokens_seen, ...

Readers check every byte range they read against it; a file without a manifest does not exist
for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint.file import CheckpointError
from tinylm.checkpoint.pieces import Layout
from tinylm.config import weight_config_differences
from tinylm.io import atomic_write_text

FORMAT = 2  # of checkpoint files and manifests; a checkpoint written in another format is not read
# What names the run a checkpoint belongs to, besides its "config" (the keys that decide the weights):
# the checkpoints of one run agree on all of them, and a resume must too.
IDENTITY_KEYS = ("seed", "structural_hash", "tokenizer_sha256")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest at `path`, checked for a files table and this FORMAT; errors name the file."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest not found (the checkpoint was never committed)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: manifest has no 'files' table")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: manifest of format {manifest.get('format')!r}, this tinylm reads format "
            f"{FORMAT}: write the checkpoint again (delete the state folder to start afresh)"
        )
    return manifest


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key of the run's identity in which two manifests
    (or a manifest and a run's identity) differ: IDENTITY_KEYS that either records, then the keys of
    "config" (see `tinylm.config.weight_config_differences`)."""
    out = [
        (key, saved.get(key), current.get(key))
        for key in IDENTITY_KEYS
        if (key in saved or key in current) and saved.get(key) != current.get(key)
    ]
    saved_config, config = saved.get("config"), current.get("config")
    if isinstance(saved_config, dict) and isinstance(config, dict):
        out += weight_config_differences(saved_config, config)
    return out


def file_entry(manifest: dict[str, Any], name: str, manifest_path: str | os.PathLike) -> dict[str, Any]:
    """The manifest's description of the file `name` (for `CheckpointReader`); errors name the manifest."""
    entry = manifest["files"].get(name)
    if not isinstance(entry, dict) or not {"bytes", "records", "other"} <= entry.keys():
        raise CheckpointError(f"{manifest_path}: manifest does not describe the file {name}")
    return entry


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write `manifest` as sorted, indented JSON, atomically: the commit of the files it describes."""
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def weights_sha256(model_state: dict[str, torch.Tensor], layout: Layout, hashes: dict[int, str]) -> str:
    """The model's identity: sha256 over each tensor's name, dtype, shape and the sha256 of its bytes.

    Computed from the hashes taken while writing (`hashes`: by byte offset in the file of
    `layout`), so nothing is read again; the same weights give the same value in any file that
    holds them, and at any world size.
    """
    described = []
    for name, tensor in model_state.items():
        offset, nbytes = layout.records[("model", name)]
        described.append([name, str(tensor.dtype), list(tensor.shape), hashes.get(offset) if nbytes else ""])
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def numbered_steps(
    folder: str | os.PathLike, pattern: re.Pattern, manifest_of: Callable[[Path], Path]
) -> list[int]:
    """Ascending steps of the entries of `folder` named like `pattern` (group 1: the step) whose
    manifest, `manifest_of(entry)`, exists. A missing folder has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name)) and manifest_of(p).is_file()
    )
