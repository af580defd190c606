"""Which checkpoints a stage run by hand reads, and whether they were trained with the config it was given.

A run publishes its checkpoints into its checkpoint folder (results/checkpoints) only when it
finishes, because that folder is a declared Snakemake output (Snakemake deletes the outputs of a
failed job). Every committed step is also published, at once, inside the run's state folder
(`<state dir>/published`, see tinylm/pretrain/publish.py), which is outside Snakemake's outputs. So while a
run trains, or after it was stopped, `sample`, `evaluate` and `export` find its newest committed
step there: `find_checkpoints` picks, of the two folders, the one whose newest step is newer, and
says so. The state folder is the one the config describes (results/state/<run hash>), so the user
needs no hash. A folder named explicitly (--checkpoint-dir) is read as it is.

A stage reads only the run its config describes (`checkpoints_of_config`): results/checkpoints
holding another run gives way to the state folder of the config's run, and checkpoints trained with
other keys (`config_differences`: the model and train keys that decide the weights, see
`config.weight_config`, and the vocabulary) are refused naming the keys.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tinylm.checkpoint import Manifest, published_run, published_steps
from tinylm.checkpoint.published import PUBLISHED_DIR
from tinylm.config import Config, weight_config, weight_config_differences
from tinylm.precision import machine, machine_differences


def find_checkpoints(
    checkpoint_dir: str | os.PathLike, state_dir: str | os.PathLike | None, step: int | None = None
) -> tuple[Path, str | None]:
    """(the folder of published checkpoints to read, a line saying why it is not `checkpoint_dir`, or None).

    With `state_dir` None, `checkpoint_dir` as it is. Otherwise the newest committed step (or, with
    `step`, the folder that holds that step) of `checkpoint_dir` and `state_dir/published`,
    `checkpoint_dir` when both have it. When neither has any, `checkpoint_dir` (the loader then
    names it in its error) and a line naming the state folder that was searched too.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if state_dir is None:
        return checkpoint_dir, None
    state_published = Path(state_dir) / PUBLISHED_DIR
    published, committed = published_steps(checkpoint_dir), published_steps(state_published)
    if not published and not committed:
        return checkpoint_dir, (
            f"no committed checkpoints in {checkpoint_dir} nor in the state folder of the run "
            f"this config describes, {state_dir}"
        )
    if step is not None:
        if step in published or step not in committed:
            return checkpoint_dir, None
        return state_published, (
            f"step {step} is not in {checkpoint_dir}; using it from {state_published} "
            "(committed, not yet published: the run is training or was stopped)"
        )
    if committed and (not published or committed[-1] > published[-1]):
        has = f"its newest is step {published[-1]}" if published else "it has none yet"
        return state_published, (
            f"using step {committed[-1]} from {state_published}: {checkpoint_dir} is published "
            f"when the run finishes and {has} (the run is training or was stopped)"
        )
    return checkpoint_dir, None


def config_differences(
    manifest: Manifest, cfg: Config, sections: tuple[str, ...] = ("model", "tokenizer", "train")
) -> list[str]:
    """'section.key: V in the checkpoint, W in the config' for every key of `sections` that differs.

    Compared: the model and train keys that decide the trained weights, as the manifest's "config"
    records them (`weight_config` at training time), and `tokenizer.vocab_size` with the model's
    vocabulary. A manifest without them gives no differences.
    """
    out = []
    saved = manifest.config
    if "tokenizer" in sections and manifest.model_config and "vocab_size" in manifest.model_config:
        trained, now = manifest.model_config["vocab_size"], cfg.tokenizer.vocab_size
        if trained != now:
            out.append(f"tokenizer.vocab_size: {trained!r} in the checkpoint, {now!r} in the config")
    if saved is not None:
        out += [
            f"{key}: {before!r} in the checkpoint, {now!r} in the config"
            for key, before, now in weight_config_differences(saved, weight_config(cfg), sections)
        ]
    return out


def checkpoints_of_config(
    checkpoint_dir: str | os.PathLike,
    state_dir: str | os.PathLike | None,
    step: int | None,
    cfg: Config,
    sections: tuple[str, ...],
    config_name: str,
    step_option: str = "step",
) -> tuple[Path, int | None, Manifest | None, list[str]]:
    """(folder, step, its manifest, lines to say): the checkpoints of the run `cfg` describes, or an
    error.

    `find_checkpoints` picks the folder; when it is `checkpoint_dir` but that folder holds another
    run (its newest step differs from `cfg` in a key of `sections`) while the state folder holds
    committed steps of the run `cfg` describes, the state folder is read instead, said in a line.
    The step read (`step`, else the newest) must exist, and its checkpoint must have been trained
    with `cfg`'s keys of `sections`: otherwise a ValueError naming the keys (or `step_option`, the
    option or key that asked for a step that is not there) and where the config's
    run is (nothing is compared when `sections` is empty: a config that gave no model keys).
    """
    folder, note = find_checkpoints(checkpoint_dir, state_dir, step)
    lines = [note] if note else []
    manifests = published_run(folder)
    if state_dir is not None and folder == Path(checkpoint_dir) and manifests:
        state_published = Path(state_dir) / PUBLISHED_DIR
        newest = manifests[step if step in manifests else max(manifests)]
        differences = config_differences(newest, cfg, sections)
        committed = published_steps(state_published)
        if differences and committed and (step is None or step in committed):
            folder, manifests = state_published, published_run(state_published)
            lines = [
                f"{checkpoint_dir} holds another run than {config_name} ({differences[0]}); reading the "
                f"run it describes from {state_published}"
            ]
    if not manifests:
        return folder, step, None, lines  # the loader names the folder that has none
    if step is None:
        step = max(manifests)
    if step not in manifests:
        raise ValueError(f"{step_option} {step}: {folder} holds steps {', '.join(map(str, manifests))}")
    differences = config_differences(manifests[step], cfg, sections)
    if differences:
        where = (
            f"the run it describes has no committed step in {Path(state_dir) / PUBLISHED_DIR} (train it, or "
            f"give the folder of its checkpoints with --checkpoint-dir)"
            if state_dir is not None
            else "give the config the checkpoints were trained with, or the folder of the run it describes"
        )
        raise ValueError(
            f"{Path(folder) / f'step_{step}.pt'} was trained with another config than {config_name}: "
            f"{'; '.join(differences)}; {where}"
        )
    return folder, step, manifests[step], lines


def warn_if_other_machine(stage: str, checkpoint: str | os.PathLike, manifest: Manifest, device) -> list[str]:
    """Print one line `[stage] <checkpoint> was trained on another machine kind: ...` when the
    manifest's `machine` record (what made its numbers) differs from this process's on `device` in
    torch's version, the device kind, or the CPU capability or GPU; returns the differences. Figures
    made here then differ from those made there in the last bits (a manifest without the record,
    written by an older tinylm, says nothing)."""
    recorded = manifest.machine
    if recorded is None:
        return []
    differences = machine_differences(recorded, machine(device))
    if differences:
        print(
            f"[{stage}] {checkpoint} was trained on another machine kind ({'; '.join(differences)}): "
            "figures made here differ from that machine's in the last bits (within the seed spread)",
            file=sys.stderr,
            flush=True,
        )
    return differences
