"""Checkpoint files for the tests: hand-made manifests (for files written by other means than
tinylm) and a checked read of a committed file."""

from pathlib import Path

from tinylm.checkpoint import CheckpointReader, map_tensors
from tinylm.io import sha256_file
from tinylm.state import FORMAT, read_manifest


def whole_file_entry(path: Path) -> dict:
    """A manifest entry for `path` that lists no tensors: one byte range, the whole file."""
    size = path.stat().st_size
    return {"bytes": size, "records": [], "other": [[0, size, sha256_file(path)]]}


def manifest_for(path: Path, **keys) -> dict:
    """A committed manifest (this format) describing the single file `path`."""
    return {"format": FORMAT, **keys, "files": {path.name: whole_file_entry(path)}}


def read_checked(path: Path) -> tuple[dict, dict]:
    """(payload, manifest) of a committed file, every tensor read through CheckpointReader.

    The manifest is `step_N.json` beside a published `step_N.pt`, else manifest.json in its folder.
    """
    path = Path(path)
    manifest_path = (
        path.parent / "manifest.json"
        if path.name in ("checkpoint.pt", "weights.pt")
        else path.with_suffix(".json")
    )
    manifest = read_manifest(manifest_path)
    return read_all(path, manifest["files"][path.name]), manifest


def read_all(path: Path, entry: dict) -> dict:
    """Every tensor of the file `path`, each read and checked against its manifest `entry`."""
    with CheckpointReader(path, entry) as reader:
        return map_tensors(reader.structure, lambda _, meta: reader.read(meta))
