"""A checkpoint file: {model, optimizer, iteration}, saved and loaded whole, in one process.

A checkpoint is one torch.save'd dictionary with at least
    model      the model's state_dict
    optimizer  the optimizer's state_dict
    iteration  the number of optimizer steps taken (int)
plus any extra entries of plain types (e.g. the model config). It is always read with
torch.load(weights_only=True), so loading a file never runs code from it:

    save_checkpoint(model, optimizer, iteration, "step_100.pt")
    iteration = load_checkpoint("step_100.pt", model, optimizer)

Every file tinylm publishes is this format. A sharded run writes and reads it in pieces, so that
no rank holds the whole optimizer state (tinylm/checkpoint/pieces.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tinylm.io import atomic_path

REQUIRED_KEYS = ("model", "optimizer", "iteration")
PLAIN_SCALARS = (str, int, float, bool, type(None), torch.Tensor)


class CheckpointError(ValueError):
    """A checkpoint file is truncated, unsafe, or lacks an entry; the message names the file."""


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
    out: str | os.PathLike,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write model, optimizer and iteration (and the `extra` entries) atomically to `out`.

    `extra` values must be plain types (str, int, float, bool, None, tensors, and lists, tuples and
    str- or int-keyed dicts of them) so that the file loads with weights_only=True.
    """
    state = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "iteration": int(iteration),
    }
    for key, value in (extra or {}).items():
        if key in state:
            raise ValueError(f"extra checkpoint entry {key!r} would overwrite a required entry")
        check_plain(value, where=key)
        state[key] = value
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)  # through a handle: the archive is named "archive", not after tmp


def load_checkpoint(
    src: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Restore `model` (and `optimizer`, if given) from `src`; return the saved iteration."""
    state = read_checkpoint(src)
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint dictionary with weights_only=True and check it has model, optimizer, iteration.

    Raises FileNotFoundError if `path` does not exist and CheckpointError if it cannot be loaded
    safely or lacks a required entry; both name the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    state = torch_load(path, map_location)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the entries {missing}")
    return state


def torch_load(path: Path, map_location: str | torch.device) -> Any:
    """torch.load(path, weights_only=True); any failure is a CheckpointError naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, pickle of arbitrary objects, not a torch file at all
        raise CheckpointError(f"cannot load checkpoint {path} with weights_only=True: {e}") from e


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module itself under a torch.compile wrapper, so parameter names carry no `_orig_mod.`."""
    return getattr(model, "_orig_mod", model)


def check_plain(value: Any, where: str) -> None:
    """Raise TypeError if `value` contains anything torch.load(weights_only=True) may refuse."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise TypeError(f"checkpoint entry {where!r}: key {k!r} is not a str or int")
            check_plain(v, where=f"{where}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_plain(v, where=f"{where}[{i}]")
    elif not isinstance(value, PLAIN_SCALARS):
        raise TypeError(f"checkpoint entry {where!r} has type {type(value).__name__}, not a plain type")
