"""The checkpoint file format, and the folders of published checkpoints that the stages read.

    file.py        save_checkpoint / load_checkpoint: {model, optimizer, iteration} in one torch.save file
    pieces.py      the same files written and read in pieces, each piece checked (sharded runs)
    manifest.py    the JSON beside a checkpoint: what it holds, and the sha256 of every byte range
    published.py   a folder of published steps (step_N.pt + step_N.json) and `load_model`

Nothing here knows how a run is trained or resumed (tinylm/pretrain/ writes these files).
"""

from tinylm.checkpoint.file import (
    REQUIRED_KEYS,
    CheckpointError,
    check_plain,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from tinylm.checkpoint.manifest import FORMAT, Manifest, file_entry, read_manifest
from tinylm.checkpoint.pieces import (
    CheckpointReader,
    Layout,
    map_tensors,
    plan_file,
    tensor_leaves,
    write_tensors,
)
from tinylm.checkpoint.published import (
    check_tokenizer,
    load_model,
    published_file,
    published_manifest,
    published_run,
    published_steps,
)

__all__ = [
    "FORMAT",
    "REQUIRED_KEYS",
    "CheckpointError",
    "CheckpointReader",
    "Layout",
    "Manifest",
    "check_plain",
    "check_tokenizer",
    "file_entry",
    "load_checkpoint",
    "load_model",
    "map_tensors",
    "plan_file",
    "published_file",
    "published_manifest",
    "published_run",
    "published_steps",
    "read_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "tensor_leaves",
    "write_tensors",
]
