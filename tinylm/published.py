"""Published checkpoints: the folder the stages read, and the one way to load a trained model.

    checkpoint_dir/step_N.pt + step_N.json   the newest step's full checkpoint (model, optimizer,
                                              iteration, ...), every older step's weights; each
                                              with its manifest (tinylm/state.py writes them)

A published file is an ordinary torch.save file: `torch.load(path, weights_only=True)` reads it and
`tinylm.checkpoint.load_checkpoint(path, model, optimizer)` restores the newest. `load_model`
builds the model of a step and reads only its weights, each tensor checked against the manifest as
it is read, never the optimizer state: evaluation, generation and export use it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tinylm.checkpoint import CheckpointError, CheckpointReader
from tinylm.io import link_or_copy
from tinylm.model import RotaryEmbedding, Transformer

if TYPE_CHECKING:
    from tinylm.tokenizer import Tokenizer

from tinylm.state import _PUBLISHED, _file_entry, _read_model, _republish, _steps, read_manifest


def publish(state_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Link every published checkpoint (and its manifest) into `checkpoint_dir`; return the .pt paths."""
    _republish(Path(state_dir))
    src = Path(state_dir) / "published"
    out = Path(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for step in published_steps(src):
        link_or_copy(src / f"step_{step}.json", out / f"step_{step}.json")
        link_or_copy(src / f"step_{step}.pt", out / f"step_{step}.pt")
        paths.append(out / f"step_{step}.pt")
    return paths


def published_steps(checkpoint_dir: str | os.PathLike) -> list[int]:
    """Steps of `step_N.pt` files that have their `step_N.json` manifest beside them, ascending."""
    return _steps(checkpoint_dir, _PUBLISHED, lambda p: p.with_suffix(".json"))


def published_manifest(checkpoint_dir: str | os.PathLike, step: int) -> dict[str, Any]:
    """The manifest (step_N.json) of published checkpoint `step`."""
    return read_manifest(Path(checkpoint_dir) / f"step_{step}.json")


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
    path = Path(checkpoint_dir) / f"step_{step}.pt"
    manifest_path = path.with_suffix(".json")
    entry = _file_entry(read_manifest(manifest_path), path.name, manifest_path)
    with CheckpointReader(path, entry) as reader:
        saved = reader.structure
        config = saved.get("model_config") if isinstance(saved, dict) else None
        expected_keys = set(inspect.signature(Transformer).parameters) - {"device", "dtype"}
        if not isinstance(config, dict) or set(config) != expected_keys:
            raise CheckpointError(
                f"{path}: model_config {config!r} does not hold exactly the keys {sorted(expected_keys)}"
            )
        if not isinstance(saved.get("model"), dict):
            raise CheckpointError(f"checkpoint {path} lacks the entry 'model'")
        dtypes = {meta.dtype for meta in saved["model"].values()}
        try:  # in the dtype the weights were saved in (float32 unless a test trained in float64)
            model = _uninitialised_model(config, dtypes.pop() if len(dtypes) == 1 else None)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: model_config {config}: {e}") from None
        _read_model(reader, saved["model"], model, beat=None)
    if tokenizer is not None and model.vocab_size != len(tokenizer.vocab):
        raise CheckpointError(
            f"{path}: model vocabulary {model.vocab_size} differs from the tokenizer's {len(tokenizer.vocab)}"
        )
    return model.to(device), step


def _uninitialised_model(config: dict[str, Any], dtype: torch.dtype | None) -> Transformer:
    """A Transformer on the CPU whose weights are left uninitialised, for a checkpoint to fill.

    Random initialisation would cost time and, through its temporaries, about twice the weights'
    memory, for values that are overwritten at once. Only the RoPE tables, which are computed and
    not saved, get their values.
    """
    with torch.device("meta"):
        model = Transformer(**config, dtype=dtype)
    model.to_empty(device="cpu")
    tables = RotaryEmbedding(model.rope.theta, model.rope.d_k, model.rope.max_seq_len)
    model.rope.cos.copy_(tables.cos)
    model.rope.sin.copy_(tables.sin)
    return model
