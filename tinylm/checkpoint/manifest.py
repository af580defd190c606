"""Manifests: the record beside checkpoint files that says what they hold and the sha256 of every byte.

A manifest is written after the files it describes (it is their commit) and read before any of
their bytes are used; a file without one does not exist for readers. Its one type is `Manifest`
(its fields say what each entry means); `write_manifest` is its one writer and `read_manifest` its
one reader, which also reads the files of earlier tinylm versions of this FORMAT (their fields are
a subset) and refuses other formats. Readers check every byte range they read against `files`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
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
IDENTITY_KEYS = ("seed", "structural_hash", "tokenizer_sha256", "parent")


@dataclass
class Manifest:
    """What a checkpoint folder's (or a published file's) manifest records; None: not recorded.

    The run's identity (IDENTITY_KEYS and `config`) is the same in every manifest of a run; a resume
    must match it (tinylm/pretrain/resume.py) and a checkpoint folder holds one identity
    (tinylm/checkpoint/published.py). `tokenizer_path`, the execution facts and the step's facts
    are not identity."""

    # The commit
    format: int = FORMAT  # a manifest of another format is refused
    step: int | None = None  # the optimizer step of the checkpoint
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> bytes, records, other
    weights_sha256: str | None = None  # the weights' identity, the same in any file that holds them
    contents: str | None = None  # a published file's: "full" (with the optimizer state) or "weights"
    # The run's identity
    seed: int | None = None
    structural_hash: str | None = None  # of the model config: what the tensors' shapes depend on
    tokenizer_sha256: str | None = None  # of the tokenizer file the run was trained with
    config: dict[str, dict[str, Any]] | None = None  # the keys that decide the weights (weight_config)
    parent: dict[str, Any] | None = None  # the checkpoint the run started from: step, weights_sha256
    # How the run executed, and what made its numbers (none of it changes the math)
    tokenizer_path: str | None = None  # where the tokenizer of tokenizer_sha256 was, at training time
    parent_checkpoint: str | None = None  # where the parent's checkpoint was, at training time
    world_size: int | None = None
    threads_per_rank: int | None = None
    grad_accum_steps: int | None = None
    dtype: str | None = None  # the forward pass's autocast dtype, train.dtype resolved on the device
    torch_version: str | None = None
    machine: dict[str, Any] | None = None  # tinylm.precision.machine of rank 0
    # The step
    model_config: dict[str, Any] | None = None  # the Transformer's constructor arguments
    tokens_seen: int | None = None
    train_seconds: float | None = None  # training wall time up to this step, over every resume

    def to_json(self) -> dict[str, Any]:
        """The fields that are recorded (not None), as plain JSON data."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: Any, path: str | os.PathLike) -> Manifest:
        """A manifest from its JSON data, checked for a files table and this FORMAT; entries this
        tinylm does not know (written by a newer one) are left out. Errors name the file."""
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise CheckpointError(f"{path}: manifest has no 'files' table")
        if data.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}: manifest of format {data.get('format')!r}, this tinylm reads format "
                f"{FORMAT}: write the checkpoint again (delete the state folder to start afresh)"
            )
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest at `path` (see `Manifest.from_json`); errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest not found (the checkpoint was never committed)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON: {e}") from None
    return Manifest.from_json(data, path)


def identity_differences(saved: Manifest, current: Manifest) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key of the run's identity in which two manifests
    (or a manifest and a run's identity) differ: IDENTITY_KEYS that either records, then the keys of
    `config` (see `tinylm.config.weight_config_differences`)."""
    out = [
        (key, getattr(saved, key), getattr(current, key))
        for key in IDENTITY_KEYS
        if getattr(saved, key) != getattr(current, key)
    ]
    if saved.config is not None and current.config is not None:
        out += weight_config_differences(saved.config, current.config)
    return out


def describe_differences(differences: list[tuple[str, Any, Any]], saved: str, current: str) -> str:
    """'key: A <saved>, B <current>; ...' for the first four `identity_differences`, and how many more."""
    listed = "; ".join(f"{key}: {a!r} {saved}, {b!r} {current}" for key, a, b in differences[:4])
    return listed + (f" and {len(differences) - 4} more" if len(differences) > 4 else "")


def file_entry(manifest: Manifest, name: str, manifest_path: str | os.PathLike) -> dict[str, Any]:
    """The manifest's description of the file `name` (for `CheckpointReader`); errors name the manifest."""
    entry = manifest.files.get(name)
    if not isinstance(entry, dict) or not {"bytes", "records", "other"} <= entry.keys():
        raise CheckpointError(f"{manifest_path}: manifest does not describe the file {name}")
    return entry


def write_manifest(path: str | os.PathLike, manifest: Manifest) -> None:
    """Write `manifest` as sorted, indented JSON, atomically: the commit of the files it describes."""
    atomic_write_text(path, json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")


def weights_sha256(
    model_state: dict[str, torch.Tensor], layout: Layout, hashes: dict[int, tuple[int, str]]
) -> str:
    """The model's identity: sha256 over each tensor's name, dtype, shape and the sha256 of its bytes.

    Computed from the hashes taken while writing (`hashes`: by byte offset in the file of
    `layout`), so nothing is read again; the same weights give the same value in any file that
    holds them, and at any world size.
    """
    described = []
    for name, tensor in model_state.items():
        offset, nbytes = layout.records[("model", name)]
        described.append([name, str(tensor.dtype), list(tensor.shape), hashes[offset][1] if nbytes else ""])
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
