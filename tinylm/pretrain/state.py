"""A run's committed steps: the state folder that `pretrain` writes and resumes from.

    state_dir/step_0000500/{checkpoint.pt, weights.pt, manifest.json}   (tinylm/pretrain/steps.py)

A step folder exists for readers only once its manifest is written (the commit); one without is an
interrupted write, removed by the next commit. Two collectives, called by every rank:

- `save_step`: rank 0 plans both files (tinylm/checkpoint/pieces.py), every rank writes the
  tensors it holds into them in place (a parameter's owner its weights and sharded optimizer
  state, rank 0 the rest), hashing as it writes; rank 0 writes the manifest, publishes and prunes.
  The ranks meet through the store (tinylm/pretrain/heartbeat.py), so a slow disk is never a hung
  rank.
- `restore_step`: each rank reads, one checked tensor at a time, the model and the optimizer state
  of the parameters it steps; the consolidated format (keyed by global parameter index) resumes
  at any world size.

Every byte is checked against the manifest's sha256 before it is parsed or used, and pickles are
parsed only with `torch.load(..., weights_only=True)`: a corrupt or hostile file is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinylm.checkpoint.file import REQUIRED_KEYS, CheckpointError, check_plain
from tinylm.checkpoint.manifest import (
    FORMAT,
    Manifest,
    file_entry,
    read_manifest,
    weights_sha256,
    write_manifest,
)
from tinylm.checkpoint.pieces import (
    CheckpointReader,
    Layout,
    map_tensors,
    plan_file,
    tensor_leaves,
    write_tensors,
)
from tinylm.checkpoint.published import PUBLISHED_DIR, published_file, read_model_state
from tinylm.io import fsync_dir
from tinylm.parallel.sharded import ShardedOptimizer
from tinylm.pretrain.heartbeat import Heartbeat
from tinylm.pretrain.publish import republish
from tinylm.pretrain.steps import CHECKPOINT, MANIFEST, STEP_DIR, WEIGHTS, committed_steps, step_dir

# ------------------------------------------------------------------------------------------------
# Saving


def save_step(
    ctx,
    state_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: ShardedOptimizer,
    manifest: Manifest,
    entries: dict[str, Any] | None = None,
    per_rank: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Collective: commit `step` of this run to `state_dir`; every rank calls it. Returns the folder.

    ctx: the rank's RankContext; model: the model (not a DDP wrapper); optimizer: the run's
    ShardedOptimizer (sharded or not); manifest: the run's identity; entries: plain values for the top of
    the checkpoint (rank 0's are written); per_rank: plain values of this rank (RNG states), saved
    as lists over the ranks (`restore_step` returns them as such); keep: step folders kept.
    """
    rank, world_size = ctx.rank, ctx.world_size
    entries, per_rank = dict(entries or {}), dict(per_rank or {})
    for key, value in {**entries, **per_rank}.items():
        if key in REQUIRED_KEYS:
            raise ValueError(f"checkpoint entry {key!r} would overwrite a required entry")
        check_plain(value, where=key)
    optimizer.wait_for_parameters()  # its pending all-gathers: the weights are current
    model_state = model.state_dict()
    optimizer_state = optimizer.sharded_state_dict()  # the state tensors on "meta": written in pieces
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(per_rank, gathered, dst=0)  # small: RNG states and the like
    else:
        gathered = [per_rank]

    # Who writes each tensor: the holder of a parameter's first element its weights; each piece of
    # the optimizer's state its holder; rank 0 the rest.
    writer_of_storage = {p.data_ptr(): r for p, r in optimizer.parameter_writers().items()}
    model_writer = {name: writer_of_storage.get(t.data_ptr(), 0) for name, t in model_state.items()}
    pieces = optimizer.state_pieces()

    def items_of(name: str, payload: dict[str, Any], layout: Layout) -> list[tuple[int, torch.Tensor]]:
        """(byte offset, tensor) of everything this rank writes into file `name`."""
        items = []
        for path, tensor in tensor_leaves(payload):
            if path[0] == "model":
                mine = model_writer[path[1]] == rank
            elif path[:2] == ("optimizer", "state"):
                mine = False  # written in pieces, below
            else:
                mine = rank == 0
            if mine:
                items.append((layout.records[path][0], tensor))
        if name == CHECKPOINT:
            for index, state_name, first, tensor in pieces:
                offset = layout.records[("optimizer", "state", index, state_name)][0]
                items.append((offset + first * tensor.element_size(), tensor))
        return items

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
        items_of,
        replace(manifest, world_size=world_size),
        keep,
    )


def commit(
    state_dir: str | os.PathLike, step: int, payload: dict[str, Any], manifest: Manifest, keep: int = 2
) -> Path:
    """One process: commit `payload` (a full checkpoint dict) as `step`; see `save_step`.

    weights.pt gets the payload's entries but "optimizer" and lists (per-rank entries).
    """
    weights = {
        key: value for key, value in payload.items() if key != "optimizer" and not isinstance(value, list)
    }
    heartbeat = Heartbeat(None, 0, 1, 1.0, f"commit/{step}")

    def everything(name: str, tree: dict[str, Any], layout: Layout) -> list[tuple[int, torch.Tensor]]:
        return [(layout.records[path][0], tensor) for path, tensor in tensor_leaves(tree)]

    return _commit_files(
        heartbeat, state_dir, step, {CHECKPOINT: payload, WEIGHTS: weights}, everything, manifest, keep
    )


def _commit_files(
    heartbeat: Heartbeat,
    state_dir: str | os.PathLike,
    step: int,
    files: dict[str, Any],
    items_of: Callable[[str, Any, Layout], list[tuple[int, torch.Tensor]]],
    manifest: Manifest,
    keep: int,
) -> Path:
    """Write `files` ({name: payload}) of a step folder from every rank, then (rank 0) commit it.

    Rank 0's payloads plan the files (their tensors may be on the meta device); every rank writes
    `items_of(name, its payload, the file's layout)`: (byte offset, tensor) of whole tensors or
    of pieces. A failure on rank 0 removes the half-written folder.
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
            mine = items_of(name, payload, layouts[name])
            if any(tensor.device.type == "meta" for _, tensor in mine):
                raise RuntimeError(f"rank {rank} was asked to write a tensor it does not hold")
            hashes[name] = write_tensors(folder / name, mine, heartbeat.beat)
        heartbeat.post(f"hashes/{rank}", json.dumps(hashes))

        if rank == 0:
            written = heartbeat.wait(
                {f"hashes/{r}": r for r in range(world_size)}, "writing its checkpoint tensors"
            )
            merged: dict[str, dict[int, tuple[int, str]]] = {name: {} for name in files}
            for value in written.values():
                for name, by_offset in json.loads(value).items():
                    merged[name].update({int(offset): tuple(n_sha) for offset, n_sha in by_offset.items()})
            fsync_dir(folder)
            described = {name: layouts[name].entry(merged[name]) for name in files}
            manifest = replace(
                manifest, format=FORMAT, step=step, torch_version=torch.__version__, files=described
            )
            if "model" in files.get(WEIGHTS, {}):
                manifest.weights_sha256 = weights_sha256(
                    files[WEIGHTS]["model"], layouts[WEIGHTS], merged[WEIGHTS]
                )
            write_manifest(folder / MANIFEST, manifest)
            republish(Path(state_dir))
            _prune(Path(state_dir), keep)
            heartbeat.post("done", "1")
    except BaseException:
        if rank == 0 and folder.exists() and not (folder / MANIFEST).exists():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    heartbeat.wait({"done": 0}, "committing the checkpoint")
    return folder


def _prune(state_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` committed step folders, and folders never committed."""
    committed = committed_steps(state_dir)
    for path in state_dir.iterdir():
        m = STEP_DIR.match(path.name)
        if m and (int(m.group(1)) not in committed or int(m.group(1)) in committed[:-keep]):
            shutil.rmtree(path)


# ------------------------------------------------------------------------------------------------
# Restoring

CORRUPT_SUFFIX = ".corrupt"  # a committed step found corrupt is renamed step_NNNNNNN.corrupt, kept
OTHER_PARENT_SUFFIX = ".other-parent"  # a step of a run that started from another checkpoint


def verify_step(state_dir: str | os.PathLike, step: int) -> Manifest:
    """The manifest of committed `step`, once every byte of its files has been checked against it;
    a CheckpointError (or OSError) naming the file and what is wrong otherwise."""
    folder = step_dir(Path(state_dir), step)
    manifest = read_manifest(folder / MANIFEST)
    for name in (CHECKPOINT, WEIGHTS):
        with CheckpointReader(folder / name, file_entry(manifest, name, folder / MANIFEST)) as reader:
            reader.verify()
    return manifest


def newest_intact_step(
    state_dir: str | os.PathLike, say: Callable[[str], None]
) -> tuple[int, Manifest] | None:
    """(step, manifest) of the newest committed step whose files are intact; None if none is committed.

    Each corrupt step is reported through `say` in one line. When an older step is intact, the newer
    corrupt ones are set aside (renamed step_NNNNNNN.corrupt, never deleted, and taken out of the
    published folder), so the run resumes from the intact one; when none is, a CheckpointError says
    what to do and nothing is renamed.
    """
    state_dir = Path(state_dir)
    corrupt = []
    for step in reversed(committed_steps(state_dir)):
        try:
            manifest = verify_step(state_dir, step)
        except (CheckpointError, OSError) as e:
            say(f"committed step {step} is corrupt: {e}")
            corrupt.append(step)
            continue
        for bad in corrupt:
            kept = set_aside(state_dir, bad)
            say(f"step {bad} set aside as {kept} (kept for inspection); resuming from step {step}, intact")
        return step, manifest
    if corrupt:
        raise CheckpointError(
            f"{state_dir}: no committed step is intact (steps {', '.join(map(str, corrupt))}, see above), "
            f"so the run cannot resume; they are left as they are: move or delete {state_dir} to train "
            f"from the start"
        )
    return None


def set_aside(state_dir: Path, step: int, suffix: str = CORRUPT_SUFFIX) -> Path:
    """Rename a committed step's folder out of the committed steps (a fresh name ending in `suffix`:
    a corrupt step, or one of another parent) and remove the step from the published folder; returns
    the new name."""
    folder = step_dir(state_dir, step)
    kept, n = folder.with_name(folder.name + suffix), 1
    while kept.exists():
        n += 1
        kept = folder.with_name(f"{folder.name}{suffix}{n}")
    folder.rename(kept)
    published = published_file(state_dir / PUBLISHED_DIR, step)
    published.with_suffix(".json").unlink(missing_ok=True)  # the manifest first: readers need both
    published.unlink(missing_ok=True)
    fsync_dir(state_dir)
    return kept


def restore_step(
    ctx, state_dir: str | os.PathLike, model: torch.nn.Module, optimizer: ShardedOptimizer
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
    with CheckpointReader(path, file_entry(manifest, CHECKPOINT, folder / MANIFEST)) as reader:
        saved = reader.structure
        if not isinstance(saved, dict) or any(key not in saved for key in REQUIRED_KEYS):
            raise CheckpointError(f"checkpoint {path} lacks one of the entries {list(REQUIRED_KEYS)}")
        read_model_state(reader, saved["model"], model, heartbeat.beat)
        read_optimizer_state(reader, saved["optimizer"], optimizer, heartbeat.beat)
        rest = map_tensors(
            {key: value for key, value in saved.items() if key not in ("model", "optimizer")},
            lambda _, meta: reader.read(meta, "cpu", heartbeat.beat),
        )
    heartbeat.barrier("restored")
    return rest


def read_optimizer_state(
    reader: CheckpointReader,
    saved: dict[str, Any],
    optimizer: ShardedOptimizer,
    beat=None,
    keep_hyperparameters: bool = False,
) -> None:
    """Read the optimizer state this rank holds (all, or its pieces of a sharded one) and load it.

    An elementwise state tensor (the optimizer's `state_contract`) is read only in the range of
    elements this rank holds (`held_ranges`, at this world size: the file may come from another);
    per-parameter tensors (step counts) are read whole and stay on the CPU. The groups'
    hyperparameters are the saved ones (a resume), or with `keep_hyperparameters` the optimizer's
    own (a run that starts from another's checkpoint with its state, train.init_optimizer).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ranges = optimizer.held_ranges()
    contract = optimizer.contract
    state = {}
    for index, entry in saved["state"].items():
        if index >= len(params):
            raise CheckpointError(
                f"{reader.path}: optimizer state for parameter {index}, the optimizer has {len(params)}"
            )
        if index not in ranges:
            continue
        param, (start, stop) = params[index], ranges[index]
        whole = start == 0 and stop == param.numel()
        state[index] = {}
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                state[index][name] = value
            elif not contract.is_elementwise(name):
                state[index][name] = reader.read(value, "cpu", beat)
            elif whole:
                state[index][name] = reader.read(value, param.device, beat)
            else:
                state[index][name] = reader.read_range(value, start, stop, param.device, beat)
    groups = saved["param_groups"]
    if keep_hyperparameters and len(groups) == len(optimizer.param_groups):
        groups = [
            {**{k: v for k, v in ours.items() if k != "params"}, "params": theirs["params"]}
            for ours, theirs in zip(optimizer.param_groups, groups, strict=True)
        ]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except ValueError as e:
        raise CheckpointError(
            f"{reader.path}: the optimizer state does not fit this optimizer: {e}"
        ) from None
