"""A run that starts from another run's checkpoint (`train.init_from`): which checkpoint, checked
before anything is written, and its weights read into the model.

The parent's folder is the one the Snakemake rule passes (`--init-dir`), else `init_from` itself
when it is a folder, else where the workflow publishes that run (results/checkpoints for `default`,
results/runs/<name>/checkpoints). The step is `init_step`, else the folder's newest. The checkpoint
must hold that step, have been trained with this run's tokenizer (by sha256), and have a model whose
weights have this run's shapes (tinylm/config/lineage.py names the keys that may differ); each is
one error naming the file and the key. What was found is the run's `parent`, recorded in every
manifest as part of its identity: its step and its weights' sha256. With `train.init_optimizer` the
checkpoint must also hold the optimizer state of the same `train.optimizer`, which is read into the
run's optimizer with this run's hyperparameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint import CheckpointReader, file_entry, published_file, published_run, read_manifest
from tinylm.checkpoint.published import read_model_state
from tinylm.config import DEFAULT_RUN, RESULTS, Config
from tinylm.config.lineage import names_a_folder, shape_differences
from tinylm.parallel import ShardedOptimizer
from tinylm.pretrain.state import read_optimizer_state


@dataclass(frozen=True)
class Init:
    """The checkpoint a run starts from: its published file, step and weights' sha256."""

    checkpoint: str
    step: int
    weights_sha256: str

    def identity(self) -> dict[str, Any]:
        """What the run's identity records of its parent (the file's path may change; these may not)."""
        return {"step": self.step, "weights_sha256": self.weights_sha256}


def parent_folder(init_from: str, init_dir: str | os.PathLike | None) -> Path:
    """Where the parent's published checkpoints are (see the module docs)."""
    if init_dir is not None:
        return Path(init_dir)
    if names_a_folder(init_from):
        return Path(init_from)
    run_dir = "" if init_from == DEFAULT_RUN else f"runs/{init_from}/"
    return Path(RESULTS) / f"{run_dir}checkpoints"


def find_init(
    cfg: Config, init_dir: str | os.PathLike | None, tokenizer_sha256: str, model_config: dict[str, Any]
) -> Init | None:
    """The checkpoint this run starts from, checked (see the module docs); None without `init_from`."""
    train = cfg.train
    if train.init_from is None:
        return None
    folder = parent_folder(train.init_from, init_dir)
    if not folder.is_dir():
        raise ValueError(
            f"train.init_from: {folder} does not exist (the checkpoints of {train.init_from!r}; train "
            f"that run first, or give its folder)"
        )
    manifests = published_run(folder)
    if not manifests:
        raise ValueError(f"train.init_from: {folder} holds no published checkpoint")
    step = train.init_step if train.init_step is not None else max(manifests)
    if step not in manifests:
        raise ValueError(
            f"train.init_step: {step} is not in {folder} (steps {', '.join(map(str, manifests))})"
        )
    path, manifest = published_file(folder, step), manifests[step]
    if manifest.tokenizer_sha256 != tokenizer_sha256:
        raise ValueError(
            f"train.init_from: {path} was trained with another tokenizer (sha256 "
            f"{str(manifest.tokenizer_sha256)[:12]}...) than this run's ({tokenizer_sha256[:12]}...): a run "
            f"that starts from another keeps its tokenizer"
        )
    parent_model = manifest.model_config or {}
    differences = shape_differences(parent_model, model_config)
    if differences:
        key = differences[0].replace("model.vocab_size", "tokenizer.vocab_size")
        raise ValueError(f"train.init_from: {path}: {key}: it changes a weight's shape")
    if train.max_iters <= step:
        raise ValueError(
            f"train.max_iters: {train.max_iters} is not past the step it starts from ({path}): the run would "
            f"train no step"
        )
    if train.init_optimizer:
        check_optimizer_state(path, manifest, train.optimizer)
    return Init(str(path), step, manifest.weights_sha256)


def check_optimizer_state(path: Path, manifest, optimizer: str) -> None:
    """For train.init_optimizer: the checkpoint holds an optimizer state, of `optimizer`'s kind."""
    if manifest.contents != "full":
        raise ValueError(
            f"train.init_optimizer: {path} holds the weights only, no optimizer state to carry; set "
            f"train.init_optimizer: false"
        )
    trained_with = ((manifest.config or {}).get("train") or {}).get("optimizer", "adamw")
    if trained_with != optimizer:
        raise ValueError(
            f"train.init_optimizer: {path} holds the state of train.optimizer {trained_with!r}, this run "
            f"uses {optimizer!r}; set train.init_optimizer: false to start the optimizer fresh"
        )


def load_init_state(init: Init, model: torch.nn.Module, optimizer: ShardedOptimizer | None = None) -> None:
    """Read the parent checkpoint's model tensors into `model` and, given `optimizer` (with
    train.init_optimizer), its optimizer state into it with the optimizer's own hyperparameters;
    every tensor checked against the manifest."""
    path = Path(init.checkpoint)
    manifest_path = path.with_suffix(".json")
    entry = file_entry(read_manifest(manifest_path), path.name, manifest_path)
    with CheckpointReader(path, entry) as reader:
        read_model_state(reader, reader.structure["model"], model)
        if optimizer is not None:
            read_optimizer_state(reader, reader.structure["optimizer"], optimizer, keep_hyperparameters=True)
