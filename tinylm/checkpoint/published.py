"""A folder of published checkpoints: what evaluation, generation, sampling and export read.

    folder/step_N.pt + step_N.json    a checkpoint file (tinylm/checkpoint/file.py's format) and
                                      its manifest (tinylm/checkpoint/manifest.py)

The newest step's file is the full checkpoint (model, optimizer, iteration, ...), every older
step's holds the weights only (model, iteration, ...); the manifest's "contents" says which
("full" or "weights"). A step exists for readers once both files are there. `pretrain` writes such
folders (tinylm/pretrain/publish.py); this module reads them: `load_model` builds the model of a
step and reads only its weights, each tensor checked against the manifest as it is read, never
the optimizer state.

A folder holds the checkpoints of one run: `published_run` reads every step's manifest and refuses
a folder whose steps differ in the run's identity (its seed, model shape, tokenizer or any key that
decides the weights, see `identity_differences`); `check_tokenizer` refuses a tokenizer file other
than the one the run was trained with.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tinylm.checkpoint.file import CheckpointError
from tinylm.checkpoint.manifest import (
    Manifest,
    describe_differences,
    file_entry,
    identity_differences,
    numbered_steps,
    read_manifest,
)
from tinylm.checkpoint.pieces import CheckpointReader
from tinylm.io import sha256_file
from tinylm.model import RotaryEmbedding, Transformer

if TYPE_CHECKING:
    from tinylm.tokenizer import Tokenizer

PUBLISHED_DIR = "published"  # the published folder inside a run's state folder
_PUBLISHED_FILE = re.compile(r"^step_(\d+)\.pt$")


def published_file(folder: str | os.PathLike, step: int) -> Path:
    """The checkpoint file of `step` in a published folder; its manifest is .with_suffix(".json")."""
    return Path(folder) / f"step_{step}.pt"


def published_steps(folder: str | os.PathLike) -> list[int]:
    """Steps of `step_N.pt` files that have their `step_N.json` manifest beside them, ascending."""
    return numbered_steps(folder, _PUBLISHED_FILE, lambda p: p.with_suffix(".json"))


def published_manifest(folder: str | os.PathLike, step: int) -> Manifest:
    """The manifest (step_N.json) of published checkpoint `step`."""
    return read_manifest(published_file(folder, step).with_suffix(".json"))


def published_run(folder: str | os.PathLike) -> dict[int, Manifest]:
    """{step: manifest} of every published step of `folder`, ascending, checked to be one run's.

    A folder whose steps belong to several runs (they differ in a key of the run's identity) is a
    CheckpointError in one line naming the folder, two steps that differ and the keys; a manifest that
    cannot be read is one naming its file. An empty or missing folder gives {}.
    """
    manifests = {step: published_manifest(folder, step) for step in published_steps(folder)}
    if not manifests:
        return manifests
    newest = max(manifests)
    for step, manifest in manifests.items():
        differences = identity_differences(manifest, manifests[newest])
        if differences:
            listed = describe_differences(differences, f"at step {step}", f"at step {newest}")
            raise CheckpointError(
                f"{folder}: holds the checkpoints of more than one run (steps {step} and {newest} differ "
                f"in {listed}); a folder must hold one run: train each into its own --checkpoint-dir"
            )
    return manifests


def check_tokenizer(
    manifest: Manifest, tokenizer_path: str | os.PathLike, checkpoint: str | os.PathLike
) -> None:
    """Refuse `tokenizer_path` unless it is the tokenizer file the checkpoint was trained with (the same
    sha256 as the manifest's `tokenizer_sha256`): another one, even of the same vocabulary size,
    would give the model's ids other meanings. A manifest that records no tokenizer is not checked."""
    recorded = manifest.tokenizer_sha256
    if recorded is None:
        return
    actual = sha256_file(tokenizer_path)
    if actual != recorded:
        where = f"{manifest.tokenizer_path} when it was trained, " if manifest.tokenizer_path else ""
        raise CheckpointError(
            f"{tokenizer_path} (sha256 {actual[:12]}...) is not the tokenizer {checkpoint} was trained with "
            f"({where}sha256 {recorded[:12]}...): give that file with --tokenizer"
        )


def load_model(
    checkpoint_dir: str | os.PathLike,
    step: int | None = None,
    device: str | torch.device = "cpu",
    tokenizer: Tokenizer | None = None,
) -> tuple[Transformer, int]:
    """The model of published checkpoint `step` (default: the newest) in `checkpoint_dir`, and its step.

    Only the model's tensors are read, one at a time, straight into the parameters, each checked
    against the manifest before it is used; the optimizer state in the same file is never touched,
    so the memory needed is the model's. The model is built from the config stored in the file
    (weights_only parsing), then moved to `device`. A missing step, a checkpoint without a model
    config, weights that do not fit that config, or a model whose vocabulary is not `tokenizer`'s
    (its logits would not mean the tokenizer's ids) are errors naming the file.
    """
    steps = published_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no committed checkpoints (step_N.pt with step_N.json)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"{checkpoint_dir}: no published checkpoint of step {step} (published: {steps})")
    path = published_file(checkpoint_dir, step)
    manifest_path = path.with_suffix(".json")
    entry = file_entry(read_manifest(manifest_path), path.name, manifest_path)
    with CheckpointReader(path, entry) as reader:
        saved = reader.structure
        config = saved.get("model_config") if isinstance(saved, dict) else None
        # A key left out (a model option the checkpoint's trainer did not have) is at its default.
        known, required = set(Transformer.CONFIG_KEYS), set(Transformer.REQUIRED_KEYS)
        if not isinstance(config, dict) or not required <= set(config) <= known:
            raise CheckpointError(
                f"{path}: model_config {config!r} does not hold the keys {sorted(required)} (and any of "
                f"{sorted(known - required)}) and no others"
            )
        if not isinstance(saved.get("model"), dict):
            raise CheckpointError(f"checkpoint {path} lacks the entry 'model'")
        dtypes = {meta.dtype for meta in saved["model"].values()}
        try:  # in the dtype the weights were saved in (float32 unless a test trained in float64)
            model = _uninitialised_model(config, dtypes.pop() if len(dtypes) == 1 else None)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: model_config {config}: {e}") from None
        read_model_state(reader, saved["model"], model)
    if tokenizer is not None and model.vocab_size != len(tokenizer.vocab):
        raise CheckpointError(
            f"{path}: model vocabulary {model.vocab_size} differs from the tokenizer's {len(tokenizer.vocab)}"
        )
    return model.to(device), step


def read_model_state(
    reader: CheckpointReader, saved: dict[str, torch.Tensor], model: torch.nn.Module, beat=None
) -> None:
    """Read every entry of a saved state dict (`saved`: its tensors on the meta device, from
    `reader.structure`) straight into the model's parameters and buffers, each checked.

    `beat` is called after every piece read (see CheckpointReader.read_into).
    """
    target = model.state_dict()
    if saved.keys() != target.keys():
        missing, unexpected = sorted(target.keys() - saved.keys()), sorted(saved.keys() - target.keys())
        raise CheckpointError(
            f"{reader.path}: its weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    done = set()
    for name, meta in saved.items():
        tensor = target[name]
        if tensor.shape != meta.shape:
            raise CheckpointError(
                f"{reader.path}: its weights do not fit the model: {name!r} has shape "
                f"{tuple(meta.shape)}, the model's {tuple(tensor.shape)}"
            )
        if tensor.dtype != meta.dtype:
            raise CheckpointError(
                f"{reader.path}: model entry {name!r} has dtype {meta.dtype}, the model's {tensor.dtype}"
            )
        if tensor.data_ptr() not in done:  # tied weights are one tensor
            reader.read_into(meta, tensor, beat)
            done.add(tensor.data_ptr())


def _uninitialised_model(config: dict[str, Any], dtype: torch.dtype | None) -> Transformer:
    """A Transformer on the CPU whose weights are left uninitialised, for a checkpoint to fill.

    Random initialisation would cost time and, through its temporaries, about twice the weights'
    memory, for values that are overwritten at once. Only the RoPE tables, which are computed and
    not saved, get their values.
    """
    with torch.device("meta"):
        model = Transformer(**config, dtype=dtype)
    model.to_empty(device="cpu")
    if model.config["tie_embeddings"]:  # to_empty gave each module a tensor of its own
        model.token_embeddings.weight = model.lm_head.weight
    tables = RotaryEmbedding(model.rope.theta, model.rope.d_k, model.rope.max_seq_len)
    model.rope.cos.copy_(tables.cos)
    model.rope.sin.copy_(tables.sin)
    return model
