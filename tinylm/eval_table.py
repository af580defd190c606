"""eval.csv: the table of exact validation metrics that `evaluate` writes and the stages after it
read (`generate` quotes the final row, `compare` sets runs side by side). Its columns are named
here once (COLUMNS), and so is how it is written and read.

    step, tokens_seen, val_loss, val_ppl, bits_per_byte, unigram_entropy, gap_to_unigram

one row per checkpoint, a plain CSV that `pd.read_csv` loads as it is; beside it eval_columns.md
(how each column is counted, with the evaluation's counts) and the loss curve as a PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from tinylm.io import atomic_path, atomic_write_text

COLUMNS = ["step", "tokens_seen", "val_loss", "val_ppl", "bits_per_byte", "unigram_entropy", "gap_to_unigram"]


def read_eval(csv_path: str | os.PathLike) -> pd.DataFrame:
    """Read an eval.csv written by `write_eval`: a plain CSV, header line first, every one of COLUMNS
    (a ValueError naming the file and the columns it lacks otherwise)."""
    table = pd.read_csv(csv_path)
    missing = [column for column in COLUMNS if column not in table.columns]
    if missing:
        raise ValueError(f"{csv_path}: lacks the columns {missing} of an eval.csv (see tinylm/eval_table.py)")
    return table


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
