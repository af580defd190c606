"""eval.csv: the table of exact validation metrics that `evaluate` writes and the stages after it
read (`generate` quotes the final row, `compare` sets runs side by side). Its columns are named
here once (COLUMNS), and so is how it is written and read.

    step, tokens_seen, val_loss, val_ppl, bits_per_byte, unigram_entropy, gap_to_unigram

one row per checkpoint, a plain CSV that `pd.read_csv` loads as it is; beside it eval_columns.md
(how each column is counted, with the evaluation's counts) and the loss curve as a PNG. A run that
started from another run's checkpoint and trains on other data has two more columns,
PARENT_DATA_COLUMNS: the same checkpoints scored on the parent's validation set (`beside_parent_data`),
so that what it forgets can be read beside what it learns.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from tinylm.io import atomic_path, atomic_write_text

COLUMNS = ["step", "tokens_seen", "val_loss", "val_ppl", "bits_per_byte", "unigram_entropy", "gap_to_unigram"]

PARENT_DATA_COLUMNS = ["parent_val_loss", "parent_bits_per_byte"]


def beside_parent_data(table: pd.DataFrame, on_parent: pd.DataFrame, parent_valid: str) -> pd.DataFrame:
    """`table` (the run's checkpoints on its own validation set) with PARENT_DATA_COLUMNS from
    `on_parent` (the same checkpoints on the parent's, `parent_valid`), step by step, and a note
    saying what they are (with `on_parent`'s notes on its tokens)."""
    if list(on_parent["step"]) != list(table["step"]):
        raise ValueError("the two evaluations scored other checkpoints")
    out = table.copy()
    out["parent_val_loss"] = on_parent["val_loss"].to_numpy()
    out["parent_bits_per_byte"] = on_parent["bits_per_byte"].to_numpy()
    out.attrs["notes"] = [
        *table.attrs.get("notes", []),
        f"parent_val_loss, parent_bits_per_byte: the same checkpoints on the parent run's validation "
        f"set ({parent_valid}), counted as val_loss and bits_per_byte are; against the parent's own "
        f"eval.csv they show what this run forgot of the parent's data. There "
        + "; ".join(note for note in on_parent.attrs.get("notes", []) if note.startswith("scored:")),
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
