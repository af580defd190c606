"""Committed training states: folders that exist for the loader only once their manifest is written.

Layout of a state folder (resume state, outside Snakemake's declared outputs):

    state_dir/
      lock                      held (flock) by the running trainer
      step_0000500/
        checkpoint.pt           the full state: model, optimizer (consolidated, torch's format),
                                iteration, the trainer's entries (tokens_seen, model_config) and
                                its per-rank entries as lists over the ranks (rng, ...)
        weights.pt              model, iteration and the trainer's entries: what evaluation and
                                generation need of a step
        manifest.json           written last: format, step, world_size, threads_per_rank, seed,
                                structural hash, tokenizer sha256, the config, torch version,
                                weights_sha256 (the model tensors' identity, equal in both files),
                                and for each file its byte ranges with their sha256
      published/step_500.pt     + step_500.json: the newest committed step's checkpoint.pt (the
                                seed's full format) and every older step's weights.pt (hard links)

What a run keeps on disk: the newest `keep_checkpoints` step folders, and the weights of every
committed step: keep x (checkpoint.pt + weights.pt) + (number of committed steps - keep) x
weights.pt. With fp32 AdamW, checkpoint.pt is about 3 x 4 bytes per parameter (weights and the
two moments) and weights.pt 4 bytes per parameter.

Saving (`save_step`, a collective) never puts the whole state on one rank: rank 0 plans both
files (tinylm/checkpoint.py: everything but the tensor data), then every rank writes the tensors
it holds into them, in place, hashing while it writes. A ShardedOptimizer's state and the weights
of each parameter are written by the parameter's owner, everything else by rank 0; each rank
holds nothing beyond its own state and one piece (64 MiB) of one tensor. Rank 0 then writes the
manifest (the commit), publishes and prunes. The ranks meet through the store
(tinylm/parallel/heartbeat.py), not in collectives, so a slow disk is never taken for a hung rank,
while a rank that stops making progress is still reported within train.timeout_s.

Loading (`restore_step`) reads on the CPU, one tensor at a time, straight into the parameters and
into this rank's own optimizer state (on the parameters' device; AdamW's `step` counters stay CPU
tensors): the model and the rank's own share, nothing else, each piece checked against the
manifest before it is used. The full state is in torch's consolidated format, keyed by global
parameter index, so a step saved at one world size (or with a plain optimizer) resumes at any
other. `load_model` builds the model of a published step and reads only its weights from the
file, each tensor checked as it is read, never the optimizer state (evaluation, generation,
export); `load_verified` checks a whole file in one pass and loads all of it.

A step folder without a manifest is an interrupted write and does not exist for the loader; the
next commit removes it. Every byte is checked against the manifest's sha256 before it is parsed or
used, and pickles are parsed only with `torch.load(..., weights_only=True)`, so a corrupt,
truncated or hostile file is refused, never trusted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinylm.checkpoint import (
    REQUIRED_KEYS,
    WEIGHTS_KEYS,
    CheckpointError,
    CheckpointReader,
    Layout,
    check_plain,
    map_tensors,
    plan_file,
    read_checkpoint,
    tensor_leaves,
    verify_file,
    write_tensors,
)
from tinylm.config import default_weight_config
from tinylm.io import atomic_path, atomic_write_text, fsync_dir
from tinylm.model import RotaryEmbedding, Transformer
from tinylm.parallel.heartbeat import Heartbeat
from tinylm.parallel.sharded import ShardedOptimizer

FORMAT = 2  # of the files and manifests below; a state written in another format is not resumed
MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint.pt"
WEIGHTS = "weights.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PUBLISHED = re.compile(r"^step_(\d+)\.pt$")

# Keys of the manifest that must match for a resume, checked in this order; then every key of the
# training config ("config": {section: {key: value}}) must match too. The world size, threads and
# accumulation may differ: every step's global batch is the same at any of them.
RESUME_KEYS = ("format", "seed", "structural_hash", "tokenizer_sha256")


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

    ctx: the rank's RankContext (rank, world_size, store, timeout_s); model: the model (not a DDP
    wrapper); optimizer: a ShardedOptimizer or a plain
    optimizer (the same on every rank); manifest: the run's identity, written into the manifest;
    entries: plain values for the top of the checkpoint (rank 0's are written); per_rank: plain
    values of this rank (RNG states, a gradient scaler's state), saved as lists over the ranks
    (`restore_step` returns them as such); keep: step folders kept.
    """
    rank, world_size = ctx.rank, ctx.world_size
    entries, per_rank = dict(entries or {}), dict(per_rank or {})
    for key, value in {**entries, **per_rank}.items():
        if key in (*REQUIRED_KEYS, *WEIGHTS_KEYS):
            raise ValueError(f"checkpoint entry {key!r} would overwrite a required entry")
        check_plain(value, where=key)
    model_state = model.state_dict()
    sharded = isinstance(optimizer, ShardedOptimizer)
    optimizer_state = optimizer.sharded_state_dict() if sharded else optimizer.state_dict()
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(per_rank, gathered, dst=0)  # small: RNG states and the like
    else:
        gathered = [per_rank]

    # Who writes each tensor: a parameter's owner its weights and optimizer state, rank 0 the rest.
    owners = (
        [optimizer.owner[p] for group in optimizer.param_groups for p in group["params"]] if sharded else []
    )
    owner_of_storage = {p.data_ptr(): optimizer.owner[p] for p in optimizer.owner} if sharded else {}
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
        _link_or_copy(step_dir(state_dir, step) / name, published / f"step_{step}.pt")
        single = {**manifest, "contents": contents, "files": {f"step_{step}.pt": manifest["files"][name]}}
        atomic_write_text(target, json.dumps(single, indent=2, sort_keys=True) + "\n")


def _contents(published_manifest: Path) -> str | None:
    try:
        return json.loads(published_manifest.read_text(encoding="utf-8")).get("contents")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: publish it again


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (replacing it), falling back to an atomic copy across devices."""
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(src, tmp)


def publish(state_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Link every published checkpoint (and its manifest) into `checkpoint_dir`; return the .pt paths."""
    _republish(Path(state_dir))
    src = Path(state_dir) / "published"
    out = Path(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for step in published_steps(src):
        _link_or_copy(src / f"step_{step}.json", out / f"step_{step}.json")
        _link_or_copy(src / f"step_{step}.pt", out / f"step_{step}.pt")
        paths.append(out / f"step_{step}.pt")
    return paths


def published_steps(checkpoint_dir: str | os.PathLike) -> list[int]:
    """Steps of `step_N.pt` files that have their `step_N.json` manifest beside them, ascending."""
    return _steps(checkpoint_dir, _PUBLISHED, lambda p: p.with_suffix(".json"))


# ------------------------------------------------------------------------------------------------
# Loading


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


def load_verified(
    checkpoint_path: str | os.PathLike,
    manifest_path: str | os.PathLike | None = None,
    map_location: str | torch.device = "cpu",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a checkpoint's every byte against its manifest (one pass), then load it with weights_only=True.

    `manifest_path` defaults to `step_N.json` beside a published `step_N.pt`, or `manifest.json` in
    a step folder. Returns (payload, manifest). A published weights file holds at least model and
    iteration; any other checkpoint model, optimizer and iteration. A flipped byte, a truncated
    file or a pickle that would run code is a CheckpointError naming the file; no code from the
    file ever runs.
    """
    path = Path(checkpoint_path)
    if manifest_path is None:
        manifest_path = (
            path.parent / MANIFEST if path.name in (CHECKPOINT, WEIGHTS) else path.with_suffix(".json")
        )
    manifest = read_manifest(manifest_path)
    verify_file(path, _file_entry(manifest, path.name, Path(manifest_path)))
    weights_only = manifest.get("contents") == "weights" or path.name == WEIGHTS
    return read_checkpoint(path, map_location, WEIGHTS_KEYS if weights_only else REQUIRED_KEYS), manifest


def published_manifest(checkpoint_dir: str | os.PathLike, step: int) -> dict[str, Any]:
    """The manifest (step_N.json) of published checkpoint `step`."""
    return read_manifest(Path(checkpoint_dir) / f"step_{step}.json")


def load_model(
    checkpoint_dir: str | os.PathLike, step: int | None = None, device: str | torch.device = "cpu"
) -> tuple[Transformer, int]:
    """The model of published checkpoint `step` (default: the newest) in `checkpoint_dir`, and its step.

    Only the model's tensors are read, one at a time, straight into the parameters, each checked
    against the manifest before it is used; the optimizer state in the same file is never touched,
    so the memory needed is the model's. The model is built from the config stored in the file
    (weights_only parsing), then moved to `device`. A missing step, a checkpoint without a model
    config, or weights that do not fit that config are errors naming the file.
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
    sharded = isinstance(optimizer, ShardedOptimizer)
    state = {}
    for index, entry in saved["state"].items():
        if index >= len(params):
            raise CheckpointError(
                f"{reader.path}: optimizer state for parameter {index}, the optimizer has {len(params)}"
            )
        if sharded and optimizer.owner[params[index]] != optimizer.rank:
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


def check_resumable(manifest: dict[str, Any], expected: dict[str, Any], where: str | os.PathLike) -> None:
    """Refuse a resume whose manifest differs from this run in a key of RESUME_KEYS."""
    expected = {"format": FORMAT, **expected}
    differences = [
        (key, manifest.get(key), expected[key])
        for key in RESUME_KEYS
        if key in expected and manifest.get(key) != expected[key]
    ]
    # A weight key that one side leaves out (see tinylm.config.weight_config) is at its default there:
    # an AdamW state has no train.optimizer, and a Muon run is still refused on it, and the reverse.
    # Keys are checked in the config's order (train.optimizer before the keys that depend on it).
    saved_config, config = manifest.get("config", {}), expected.get("config", {})
    defaults = default_weight_config()
    for section in dict.fromkeys([*config, *saved_config]):
        saved_values, values = saved_config.get(section, {}), config.get(section, {})
        section_defaults = defaults.get(section, {})
        known = [k for k in section_defaults if k in values or k in saved_values]
        for key in dict.fromkeys([*known, *values]):
            saved = saved_values.get(key, section_defaults.get(key))
            wanted = values.get(key, section_defaults.get(key))
            if saved != wanted:
                differences.append((f"{section}.{key}", saved, wanted))
    if differences:
        key, saved, wanted = differences[0]
        raise CheckpointError(
            f"{where}: cannot resume: {key} differs (state has {saved!r}, this run has {wanted!r}); "
            f"use another --state-dir or delete this one to start afresh"
        )


class StateLock:
    """An exclusive, non-blocking lock on `state_dir/lock`: one trainer per state folder.

    flock where the filesystem supports it (released by the kernel when the process dies). Where it
    does not (some network filesystems answer ENOSYS or EOPNOTSUPP), a lock file `lock.pid` created
    with O_EXCL instead, said in one line; such a file outlives a killed trainer, so one whose
    process no longer runs on this machine is taken over.
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / "lock"
        self._fd: int | None = None
        self._exclusive: Path | None = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"{self.path.parent}: another trainer (pid {holder}) is using this state folder"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
            print(
                f"[pretrain] {self.path.parent}: this filesystem has no flock ({errno.errorcode[e.errno]}); "
                f"locking with the file {self.path.name}.pid instead",
                file=sys.stderr,
                flush=True,
            )
            self._take_exclusive_file()
            return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _take_exclusive_file(self) -> None:
        path = self.path.with_name("lock.pid")
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = path.read_text(errors="replace").strip()
                host, _, pid = holder.partition(":")
                if host == socket.gethostname() and pid.isdigit() and not _process_exists(int(pid)):
                    path.unlink(missing_ok=True)  # left by a trainer that died: take it over
                    continue
                raise CheckpointError(
                    f"{self.path.parent}: another trainer ({holder or 'unknown'}) is using this "
                    f"state folder (delete {path} if no trainer runs)"
                ) from None
            os.write(fd, f"{socket.gethostname()}:{os.getpid()}\n".encode())
            os.close(fd)
            self._exclusive = path
            return
        raise CheckpointError(f"{self.path.parent}: could not take the lock file {path}")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._exclusive is not None:
            self._exclusive.unlink(missing_ok=True)
            self._exclusive = None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
