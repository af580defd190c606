"""Hand-made manifests for the tests that write a checkpoint file by other means than tinylm."""

from pathlib import Path

from tinylm.io import sha256_file
from tinylm.state import FORMAT


def whole_file_entry(path: Path) -> dict:
    """A manifest entry for `path` that lists no tensors: one byte range, the whole file."""
    size = path.stat().st_size
    return {"bytes": size, "records": [], "other": [[0, size, sha256_file(path)]]}


def manifest_for(path: Path, **keys) -> dict:
    """A committed manifest (this format) describing the single file `path`."""
    return {"format": FORMAT, **keys, "files": {path.name: whole_file_entry(path)}}
