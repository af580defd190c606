"""eval.csv: the table of exact validation metrics that `evaluate` writes and the stages after it
read (`generate` quotes the final row, `compare` sets runs side by side). Its columns are named
here once (COLUMNS), and so is how it is written and read.

    step, tokens_seen, val_loss, val_ppl, bits_per_byte, unigram_entropy, gap_to_unigram

one row per checkpoint, a plain CSV that `pd.read_csv` loads as it is; beside it eval_columns.md
(how each column is counted, with the evaluation's counts) and the loss curve as a PNG. A run
trained on, or from, other runs' data (a branch of another corpus, a mixture) has two more columns
per such run, `val_loss_on_<run>` and `bits_per_byte_on_<run>`: the same checkpoints scored on that
run's validation set (`beside_other_data`), so that what it forgets is read beside what it learns.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from tinylm.io import atomic_path, atomic_write_text

COLUMNS = ["step", "tokens_seen", "val_loss", "val_ppl", "bits_per_byte", "unigram_entropy", "gap_to_unigram"]


def other_data_columns(name: str) -> list[str]:
    """The columns of the validation set of run `name`: val_loss_on_<name>, bits_per_byte_on_<name>."""
    return [f"val_loss_on_{name}", f"bits_per_byte_on_{name}"]


def beside_other_data(table: pd.DataFrame, name: str, on_other: pd.DataFrame, valid: str) -> pd.DataFrame:
    """`table` (the run's checkpoints on its own validation set) with `other_data_columns(name)` from
    `on_other` (the same checkpoints on run `name`'s validation set, `valid`), step by step, and a
    note saying what they are."""
    if list(on_other["step"]) != list(table["step"]):
        raise ValueError("the two evaluations scored other checkpoints")
    loss, bits = other_data_columns(name)
    out = table.copy()
    out[loss] = on_other["val_loss"].to_numpy()
    out[bits] = on_other["bits_per_byte"].to_numpy()
    out.attrs["notes"] = [
        *table.attrs.get("notes", []),
        f"{loss}, {bits}: the same checkpoints on the validation set of run {name!r} ({valid}), counted "
        f"as val_loss and bits_per_byte are: beside that run's own eval.csv, what this run learnt or "
        f"forgot of its data. There "
        + "; ".join(note for note in on_other.attrs.get("notes", []) if note.startswith("scored:")),
    ]
    return out


def read_eval(csv_path: str | os.PathLike) -> pd.DataFrame:
    """Read an eval.csv written by `write_eval`: a plain CSV, header line first, every one of COLUMNS
    (a ValueError naming the file and the columns it lacks otherwise)."""
    table = pd.read_csv(csv_path)
    missing = [column for column in COLUMNS if column not in table.columns]
    if missing:
        raise ValueError(f"{csv_path}: lacks the columns {missing} of an eval.csv (see tinylm/eval_table.py)")
    return table


def eval_beside(checkpoint_dir: str | os.PathLike, step: int) -> tuple[Path | None, str | None]:
    """(the eval.csv beside a checkpoint folder that holds `step`'s row, or None; a line saying why
    not). The folder's eval.csv is the one the evaluate stage writes for it (results/checkpoints ->
    results/eval.csv, results/runs/<run>/checkpoints -> results/runs/<run>/eval.csv); a file older
    than the step's checkpoint was made before it was trained and is not quoted."""
    path = Path(checkpoint_dir).parent / "eval.csv"
    checkpoint = Path(checkpoint_dir) / f"step_{step}.pt"
    why = None
    if not path.is_file():
        why = f"{path} does not exist"
    elif checkpoint.is_file() and path.stat().st_mtime < checkpoint.stat().st_mtime:
        why = f"{path} is older than {checkpoint}"
    elif step not in set(read_eval(path)["step"]):
        why = f"{path} has no row for step {step}"
    if why:
        return None, f"no exact-loss line: {why} (run evaluate, or give --eval)"
    return path, None


def notes_path_for(csv_path: str | os.PathLike) -> Path:
    """The sidecar file that says how each column of `csv_path` is counted: eval_columns.md beside it."""
    return Path(csv_path).with_name("eval_columns.md")


def write_eval(
    table: pd.DataFrame,
    csv_path: str | os.PathLike,
    plot_path: str | os.PathLike | None,
    notes_path: str | os.PathLike | None = None,
) -> None:
    """Write the table as a plain CSV (header line, then one row per checkpoint, fixed float format, so
    that `pd.read_csv` loads it as it is), the notes of `evaluate_checkpoints` (how each column is
    counted) as Markdown to `notes_path`, and the loss curve as PNG to `plot_path`; each file
    atomically, and only those whose path is given."""
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f", lineterminator="\n")
    if notes_path is not None:
        lines = [f"- {note}" for note in table.attrs.get("notes", [])]
        atomic_write_text(
            notes_path,
            f"# How the columns of {Path(csv_path).name} are counted\n\n" + "\n".join(lines) + "\n",
        )
    if plot_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(table["step"], table["val_loss"], marker="o", label="validation loss (exact)")
    ax.axhline(table["unigram_entropy"].iloc[0], color="gray", linestyle="--", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title("tinylm validation loss")
    ax.legend()
    fig.tight_layout()
    with atomic_path(plot_path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
