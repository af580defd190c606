"""A run's committed steps: the state folder that `pretrain` writes and resumes from.

    state_dir/step_0000500/{checkpoint.pt, weights.pt, manifest.json}   (see docs/architecture.md)

A step folder exists for readers only once its manifest is written (the commit); one without is an
interrupted write, removed by the next commit. Two collectives, called by every rank:

- `save_step`: rank 0 plans both files (tinylm/checkpoint.py), every rank writes the tensors it
  holds into them in place (a parameter's owner its weights and sharded optimizer state, rank 0
  the rest), hashing as it writes; rank 0 writes the manifest, publishes and prunes. The ranks
  meet through the store (tinylm/parallel/heartbeat.py), so a slow disk is never a hung rank.
- `restore_step`: each rank reads, one checked tensor at a time, the model and the optimizer state
  of the parameters it steps; the consolidated format (keyed by global parameter index) resumes
  at any world size.

Every byte is checked against the manifest's sha256 before it is parsed or used, and pickles are
parsed only with `torch.load(..., weights_only=True)`: a corrupt or hostile file is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinylm.checkpoint import (
    REQUIRED_KEYS,
    CheckpointError,
    CheckpointReader,
    Layout,
    check_plain,
    map_tensors,
    plan_file,
    tensor_leaves,
    write_tensors,
)
from tinylm.io import atomic_write_text, fsync_dir, link_or_copy
from tinylm.parallel.heartbeat import Heartbeat

FORMAT = 2  # of the files and manifests below; a state written in another format is not resumed
MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.pt"
WEIGHTS = "weights.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PUBLISHED = re.compile(r"^step_(\d+)\.pt$")


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
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name)) and manifest_of(p).is_file()
    )


# ------------------------------------------------------------------------------------------------
# Saving


def save_step(
    ctx,
    state_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    manifest: dict[str, Any],
    entries: dict[str, Any] | None = None,
    per_rank: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Collective: commit `step` of this run to `state_dir`; every rank calls it. Returns the folder.

    ctx: the rank's RankContext; model: the model (not a DDP wrapper); optimizer: sharded or plain
    (the same on every rank); manifest: the run's identity; entries: plain values for the top of
    the checkpoint (rank 0's are written); per_rank: plain values of this rank (RNG states), saved
    as lists over the ranks (`restore_step` returns them as such); keep: step folders kept.
    """
    rank, world_size = ctx.rank, ctx.world_size
    entries, per_rank = dict(entries or {}), dict(per_rank or {})
    for key, value in {**entries, **per_rank}.items():
        if key in REQUIRED_KEYS:
            raise ValueError(f"checkpoint entry {key!r} would overwrite a required entry")
        check_plain(value, where=key)
    model_state = model.state_dict()
    owner = getattr(optimizer, "owner", None)  # a sharded optimizer's {parameter: rank}
    sharded = owner is not None
    optimizer_state = optimizer.sharded_state_dict() if sharded else optimizer.state_dict()
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(per_rank, gathered, dst=0)  # small: RNG states and the like
    else:
        gathered = [per_rank]

    # Who writes each tensor: a parameter's owner its weights and optimizer state, rank 0 the rest.
    owners = [owner[p] for group in optimizer.param_groups for p in group["params"]] if sharded else []
    owner_of_storage = {p.data_ptr(): rank for p, rank in owner.items()} if sharded else {}
    model_writer = {name: owner_of_storage.get(t.data_ptr(), 0) for name, t in model_state.items()}

    def writer_of(path: tuple) -> int:
        if path[0] == "model":
            return model_writer[path[1]]
        if path[:2] == ("optimizer", "state") and sharded:
            return owners[path[2]]  # the state of the parameter with this global index
        return 0

    checkpoint = {"model": model_state, "optimizer": optimizer_state, "iteration": int(step)}
    weights = {"model": model_state, "iteration": int(step)}
    if rank == 0:
        checkpoint |= entries | {key: [values[key] for values in gathered] for key in per_rank}
        weights |= entries
    heartbeat = Heartbeat(ctx.store, rank, world_size, ctx.timeout_s, f"commit/{step}")
    return _commit_files(
        heartbeat,
        state_dir,
        step,
        {CHECKPOINT: checkpoint, WEIGHTS: weights},
        writer_of,
        {**manifest, "world_size": world_size},
        keep,
    )


def commit(
    state_dir: str | os.PathLike, step: int, payload: dict[str, Any], manifest: dict[str, Any], keep: int = 2
) -> Path:
    """One process: commit `payload` (a full checkpoint dict) as `step`; see `save_step`.

    weights.pt gets the payload's entries but "optimizer" and lists (per-rank entries).
    """
    weights = {
        key: value for key, value in payload.items() if key != "optimizer" and not isinstance(value, list)
    }
    heartbeat = Heartbeat(None, 0, 1, 1.0, f"commit/{step}")
    return _commit_files(
        heartbeat, state_dir, step, {CHECKPOINT: payload, WEIGHTS: weights}, lambda path: 0, manifest, keep
    )


def _commit_files(
    heartbeat: Heartbeat,
    state_dir: str | os.PathLike,
    step: int,
    files: dict[str, Any],
    writer_of,
    manifest: dict[str, Any],
    keep: int,
) -> Path:
    """Write `files` ({name: payload}) of a step folder from every rank, then (rank 0) commit it.

    Rank 0's payloads are complete; another rank's need only hold the tensors it writes, at the
    same paths. A failure on rank 0 removes the half-written folder.
    """
    rank, world_size = heartbeat.rank, heartbeat.world_size
    folder = step_dir(Path(state_dir), step)
    try:
        if rank == 0:
            if folder.exists():  # a leftover of an interrupted commit of this very step
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            layouts = {name: plan_file(folder / name, payload) for name, payload in files.items()}
            heartbeat.post("layout", json.dumps({name: layout.to_json() for name, layout in layouts.items()}))
        planned = json.loads(heartbeat.wait({"layout": 0}, "planning the checkpoint files")["layout"])
        layouts = {name: Layout.from_json(data) for name, data in planned.items()}

        hashes = {}
        for name, payload in files.items():
            mine = [
                (layouts[name].records[path][0], tensor)
                for path, tensor in tensor_leaves(payload)
                if writer_of(path) == rank
            ]
            if any(tensor.device.type == "meta" for _, tensor in mine):
                raise RuntimeError(f"rank {rank} was asked to write a tensor it does not hold")
            hashes[name] = write_tensors(folder / name, mine, heartbeat.beat)
        heartbeat.post(f"hashes/{rank}", json.dumps(hashes))

        if rank == 0:
            written = heartbeat.wait(
                {f"hashes/{r}": r for r in range(world_size)}, "writing its checkpoint tensors"
            )
            merged: dict[str, dict[int, str]] = {name: {} for name in files}
            for value in written.values():
                for name, by_offset in json.loads(value).items():
                    merged[name].update({int(offset): sha for offset, sha in by_offset.items()})
            fsync_dir(folder)
            described = {name: layouts[name].entry(merged[name]) for name in files}
            manifest = {
                **manifest,
                "format": FORMAT,
                "step": step,
                "torch_version": torch.__version__,
                "files": described,
            }
            if "model" in files.get(WEIGHTS, {}):
                manifest["weights_sha256"] = _weights_sha256(
                    files[WEIGHTS]["model"], layouts[WEIGHTS], merged[WEIGHTS]
                )
            atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _republish(Path(state_dir))
            _prune(Path(state_dir), keep)
            heartbeat.post("done", "1")
    except BaseException:
        if rank == 0 and folder.exists() and not (folder / MANIFEST).exists():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    heartbeat.wait({"done": 0}, "committing the checkpoint")
    return folder


def _weights_sha256(model_state: dict[str, torch.Tensor], layout: Layout, hashes: dict[int, str]) -> str:
    """The model's identity: sha256 over each tensor's name, dtype, shape and the sha256 of its bytes.

    Computed from the hashes taken while writing, so nothing is read again; the same weights give
    the same value in checkpoint.pt and weights.pt, and at any world size.
    """
    described = []
    for name, tensor in model_state.items():
        offset, nbytes = layout.records[("model", name)]
        described.append([name, str(tensor.dtype), list(tensor.shape), hashes.get(offset) if nbytes else ""])
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def _prune(state_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` committed step folders, and folders never committed."""
    committed = committed_steps(state_dir)
    for path in state_dir.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (int(m.group(1)) not in committed or int(m.group(1)) in committed[:-keep]):
            shutil.rmtree(path)


# ------------------------------------------------------------------------------------------------
# Publishing


def _republish(state_dir: Path) -> None:
    """Make published/ hold the newest committed step's checkpoint.pt and every older step's weights.pt.

    Idempotent and safe to interrupt: a step's manifest is removed before its file is relinked
    and written again after, so a published step_N.pt always matches its step_N.json.
    """
    published = state_dir / "published"
    published.mkdir(exist_ok=True)
    steps = committed_steps(state_dir)
    for step in steps:
        contents, name = ("full", CHECKPOINT) if step == steps[-1] else ("weights", WEIGHTS)
        target = published / f"step_{step}.json"
        if target.is_file() and _contents(target) == contents:
            continue
        manifest = read_manifest(step_dir(state_dir, step) / MANIFEST)
        target.unlink(missing_ok=True)
        fsync_dir(published)
        link_or_copy(step_dir(state_dir, step) / name, published / f"step_{step}.pt")
        single = {**manifest, "contents": contents, "files": {f"step_{step}.pt": manifest["files"][name]}}
        atomic_write_text(target, json.dumps(single, indent=2, sort_keys=True) + "\n")


def _contents(published_manifest: Path) -> str | None:
    try:
        return json.loads(published_manifest.read_text(encoding="utf-8")).get("contents")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: publish it again


# ------------------------------------------------------------------------------------------------
# Restoring


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
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: manifest of format {manifest.get('format')!r}, this tinylm reads format "
            f"{FORMAT}: write the checkpoint again (delete the state folder to start afresh)"
        )
    return manifest


def _file_entry(manifest: dict[str, Any], name: str, manifest_path: Path) -> dict[str, Any]:
    entry = manifest["files"].get(name)
    if not isinstance(entry, dict) or not {"bytes", "records", "other"} <= entry.keys():
        raise CheckpointError(f"{manifest_path}: manifest does not describe the file {name}")
    return entry


def restore_step(
    ctx, state_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Load the newest committed step into `model` and `optimizer` on every rank; None if there is none.

    Collective in the sense that every rank calls it and they leave together (through the store,
    see the module docs). Each rank reads the model and the optimizer state of the parameters its
    optimizer holds (a ShardedOptimizer: its own share, at this world size), nothing else.
    Returns the checkpoint's other entries, read on the CPU: "iteration", the trainer's entries
    and the per-rank entries as lists over the ranks that saved them.
    """
    steps = committed_steps(state_dir)
    if not steps:
        return None
    folder = step_dir(Path(state_dir), steps[-1])
    manifest = read_manifest(folder / MANIFEST)
    heartbeat = Heartbeat(ctx.store, ctx.rank, ctx.world_size, ctx.timeout_s, f"restore/{steps[-1]}")
    path = folder / CHECKPOINT
    with CheckpointReader(path, _file_entry(manifest, CHECKPOINT, folder / MANIFEST)) as reader:
        saved = reader.structure
        if not isinstance(saved, dict) or any(key not in saved for key in REQUIRED_KEYS):
            raise CheckpointError(f"checkpoint {path} lacks one of the entries {list(REQUIRED_KEYS)}")
        _read_model(reader, saved["model"], model, heartbeat.beat)
        _read_optimizer(reader, saved["optimizer"], optimizer, heartbeat.beat)
        rest = map_tensors(
            {key: value for key, value in saved.items() if key not in ("model", "optimizer")},
            lambda _, meta: reader.read(meta, "cpu", heartbeat.beat),
        )
    heartbeat.barrier("restored")
    return rest


def _read_model(
    reader: CheckpointReader, saved: dict[str, torch.Tensor], model: torch.nn.Module, beat
) -> None:
    """Read every entry of the saved state dict straight into the model's parameters and buffers."""
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


def _read_optimizer(
    reader: CheckpointReader, saved: dict[str, Any], optimizer: torch.optim.Optimizer, beat
) -> None:
    """Read the state of the parameters this rank's optimizer steps (all, or its own share) and load it.

    State tensors go to their parameter's device, except `step` counters, which stay on the CPU.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owner = getattr(optimizer, "owner", None)  # a sharded optimizer's {parameter: rank}
    state = {}
    for index, entry in saved["state"].items():
        if index >= len(params):
            raise CheckpointError(
                f"{reader.path}: optimizer state for parameter {index}, the optimizer has {len(params)}"
            )
        if owner is not None and owner[params[index]] != optimizer.rank:
            continue
        state[index] = {
            name: reader.read(value, "cpu" if name == "step" else params[index].device, beat)
            if isinstance(value, torch.Tensor)
            else value
            for name, value in entry.items()
        }
    try:
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    except ValueError as e:
        raise CheckpointError(
            f"{reader.path}: the optimizer state does not fit this optimizer: {e}"
        ) from None
