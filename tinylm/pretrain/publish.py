"""Publishing: a run's committed steps as a folder of published checkpoints, for the other stages.

    state_dir/published/step_N.pt + step_N.json     republished at every commit
    checkpoint_dir/step_N.pt + step_N.json          hard links of those, when the run ends

The newest step is published in full (its checkpoint.pt: model, optimizer, iteration, ...), every
older one as its weights (weights.pt); each file with a manifest of its own whose "contents" says
which (the format: tinylm/checkpoint/published.py). `state_dir/published` is outside the
workflow's declared outputs, so a running or stopped run's newest step can be read there
(tinylm/locate.py); `checkpoint_dir` is the declared output of `pretrain`, filled when it ends.

A checkpoint folder holds one run. Publishing into a folder that holds another run's checkpoints
is refused (`check_checkpoint_dir`, also called before training starts), and the folder is left as
it was: replacing it would silently discard a finished run's checkpoints on a mistyped config or
path, while a refusal costs one more option. (Snakemake clears its declared output before a job,
so the workflow never meets such a folder.)
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from tinylm.checkpoint.file import CheckpointError
from tinylm.checkpoint.manifest import (
    Manifest,
    describe_differences,
    identity_differences,
    read_manifest,
    write_manifest,
)
from tinylm.checkpoint.published import (
    PUBLISHED_DIR,
    published_file,
    published_manifest,
    published_run,
    published_steps,
)
from tinylm.io import fsync_dir, link_or_copy
from tinylm.pretrain.steps import CHECKPOINT, WEIGHTS, committed_steps, step_dir, step_manifest


def republish(state_dir: str | os.PathLike) -> None:
    """Make state_dir/published hold the newest committed step's checkpoint.pt and every older
    step's weights.pt, each with its manifest.

    Idempotent and safe to interrupt: a step's manifest is removed before its file is relinked
    and written again after, so a published step_N.pt always matches its step_N.json.
    """
    published = Path(state_dir) / PUBLISHED_DIR
    published.mkdir(exist_ok=True)
    steps = committed_steps(state_dir)
    for step in steps:
        contents, name = ("full", CHECKPOINT) if step == steps[-1] else ("weights", WEIGHTS)
        target = published_file(published, step)
        if _contents(target.with_suffix(".json")) == contents:
            continue
        manifest = step_manifest(state_dir, step)
        target.with_suffix(".json").unlink(missing_ok=True)
        fsync_dir(published)
        link_or_copy(step_dir(state_dir, step) / name, target)
        single = replace(manifest, contents=contents, files={target.name: manifest.files[name]})
        write_manifest(target.with_suffix(".json"), single)


def _contents(path: Path) -> str | None:
    """The `contents` of a published manifest; None if it is missing or unreadable (publish it again)."""
    try:
        return read_manifest(path).contents
    except (OSError, CheckpointError):
        return None


def check_checkpoint_dir(
    checkpoint_dir: str | os.PathLike, identity: Manifest, state_dir: str | os.PathLike
) -> None:
    """Refuse to publish the run of `identity` (a manifest, or the run's identity before its first
    commit) into a folder that holds another run's checkpoints: one line naming the folder, the keys
    that differ and what to do. A folder of this run's own checkpoints, or none, passes."""
    existing = published_run(checkpoint_dir)
    if not existing:
        return
    newest = max(existing)
    differences = identity_differences(existing[newest], identity)
    if differences:
        listed = describe_differences(differences, "there", "in this run")
        raise CheckpointError(
            f"{checkpoint_dir}: holds the checkpoints of another run ({listed}); they are left as "
            f"they are: publish this run into a folder of its own with --checkpoint-dir, or move "
            f"{checkpoint_dir} away (this run's state is in {state_dir})"
        )


def publish(state_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Link every published checkpoint of the run (and its manifest) into `checkpoint_dir`; return
    the .pt paths, ascending by step. A `checkpoint_dir` that holds another run's checkpoints is
    refused (see `check_checkpoint_dir`) before anything is linked."""
    republish(state_dir)
    source = Path(state_dir) / PUBLISHED_DIR
    steps = published_steps(source)
    if steps:
        check_checkpoint_dir(checkpoint_dir, published_manifest(source, steps[-1]), state_dir)
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for step in steps:
        src, dst = published_file(source, step), published_file(checkpoint_dir, step)
        link_or_copy(src.with_suffix(".json"), dst.with_suffix(".json"))
        link_or_copy(src, dst)
        paths.append(dst)
    return paths
