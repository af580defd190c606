"""Named runs side by side: every run's eval.csv and training wall times -> compare.csv and compare.png.

    table = compare_runs([{"name": "default", "eval": "results/eval.csv",
                           "checkpoints": "results/checkpoints", "overrides": {},
                           "values": {"train.lr_max": 0.006}}, ...])
    write_compare(table, "results/compare.csv", "results/compare.png")

compare.csv has one row per run and checkpoint (COLUMNS); `train_seconds` is the training wall
time up to that checkpoint, from its manifest (rank 0's clock, summed over resumes), so it is the
one column that differs between reruns; `vocab_size` is the model's, from the manifest too.
compare.png plots bits per byte (and, when every run has the same vocabulary, validation loss)
against tokens seen and against training time, one line per run, above a table of the final
figures. The table names, for each run, only the keys whose values differ between the runs, and
compares each run with the first in bits per byte, the one figure that compares runs of any two
vocabularies (a loss per token does not). `final_figures(table)` gives that table as a frame
(`markdown_table` as Markdown).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd

from tinylm.io import atomic_path

COLUMNS = [
    "run",
    "overrides",
    "differs",
    "vocab_size",
    "step",
    "tokens_seen",
    "train_seconds",
    "val_loss",
    "bits_per_byte",
]


def describe_overrides(overrides: dict[str, Any]) -> str:
    """'train.lr_max=0.003 model.d_ff=512' (or '-' for none), in the given order."""
    return " ".join(f"{key}={value}" for key, value in overrides.items()) or "-"


def differing_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The dotted keys whose values are not the same in every run, in order of first mention.

    Each run's "values" maps keys to its value (the compare rule gives every key that any run
    overrides); without "values", its "overrides" (a key a run does not override then counts as
    the main config's value, which the others do not show, so it differs from any override).
    """
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(run.get("values") or run.get("overrides") or {}))
    missing = object()

    def value(run, key):
        return (run.get("values") or run.get("overrides") or {}).get(key, missing)

    return [key for key in keys if len({json.dumps(value(r, key), default=str) for r in runs}) > 1]


def compare_runs(runs: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (run, evaluated checkpoint), runs in the given order; see COLUMNS.

    Each run: name, eval (its eval.csv), checkpoints (its published checkpoint folder, for the
    `train_seconds` and `vocab_size` of each step's manifest; NaN where a manifest has none),
    overrides (its own, shown in compare.csv) and, optionally, values (see `differing_keys`).
    `differs` holds, of the keys that differ between the runs, the first run's values of them all
    and each other run's values where they are not the first run's.
    """
    rows = []
    differs = differing_keys(runs)
    for run in runs:
        path = Path(run["eval"])
        if not path.is_file():
            raise FileNotFoundError(f"run {run['name']}: {path} not found (evaluate the run first)")
        table = pd.read_csv(path)  # a plain CSV (see evaluation.write_eval)
        missing = {"step", "tokens_seen", "val_loss", "bits_per_byte"} - set(table.columns)
        if missing:
            raise ValueError(f"run {run['name']}: {path} lacks the columns {sorted(missing)}")
        values = run.get("values") or run.get("overrides") or {}
        first = runs[0].get("values") or runs[0].get("overrides") or {}
        # The first run is the reference: it shows every key that differs, the others where they
        # differ from it.
        shown = {
            key: values[key]
            for key in differs
            if key in values and (run is runs[0] or values[key] != first.get(key))
        }
        for record in table.to_dict("records"):
            step = int(record["step"])
            manifest = _manifest(Path(run["checkpoints"]) / f"step_{step}.json")
            rows.append(
                {
                    "run": run["name"],
                    "overrides": describe_overrides(run.get("overrides") or {}),
                    "differs": describe_overrides(shown),
                    "vocab_size": (manifest.get("model_config") or {}).get("vocab_size", math.nan),
                    "step": step,
                    "tokens_seen": int(record["tokens_seen"]),
                    "train_seconds": float(manifest.get("train_seconds", math.nan)),
                    "val_loss": float(record["val_loss"]),
                    "bits_per_byte": float(record["bits_per_byte"]),
                }
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def _manifest(path: Path) -> dict[str, Any]:
    """A published step's manifest as plain data; {} where it is missing or unreadable."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def one_vocabulary(table: pd.DataFrame) -> bool:
    """False when the runs' models have two or more vocabulary sizes (unknown sizes are not counted)."""
    return table["vocab_size"].dropna().nunique() <= 1


def final_figures(table: pd.DataFrame) -> pd.DataFrame:
    """The last checkpoint of each run, in run order, with its bits per byte relative to the first run's
    (`vs_first`: bits per byte compares runs of any two vocabularies, a loss per token does not)."""
    final = table.groupby("run", sort=False).tail(1).reset_index(drop=True)
    final = final[
        ["run", "differs", "vocab_size", "step", "tokens_seen", "train_seconds", "val_loss", "bits_per_byte"]
    ].copy()
    final["vs_first"] = final["bits_per_byte"] - final["bits_per_byte"].iloc[0]
    return final


def markdown_table(final: pd.DataFrame) -> str:
    """The final figures as Markdown; the val_loss column only when every run has one vocabulary."""
    with_loss = one_vocabulary(final)
    head = [
        "run",
        "differs",
        "steps",
        "tokens",
        "train s",
        *(["val_loss"] if with_loss else []),
        "bits/byte",
        "bits/byte vs first",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in final.itertuples():
        loss = [f"{r.val_loss:.4f}"] if with_loss else []
        cells = [
            r.run,
            r.differs,
            f"{r.step:,}",
            f"{r.tokens_seen:,}",
            f"{r.train_seconds:,.1f}",
            *loss,
            f"{r.bits_per_byte:.4f}",
            f"{r.vs_first:+.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# compare.png: inches per panel row and per line of table text; characters per line of the wrapped cells.
PANEL_HEIGHT = 3.4
LINE_HEIGHT = 0.17
ROW_PADDING = 0.6  # lines
WRAP = {"run": 22, "differs": 64}


def write_compare(
    table: pd.DataFrame, csv_path: str | os.PathLike, plot_path: str | os.PathLike | None
) -> None:
    """compare.csv (every row) and compare.png (the panels and the final table), both atomically.

    With one vocabulary: validation loss and bits per byte, each against tokens seen and training
    time; with several: bits per byte only. The table's long cells are wrapped, and its height
    grows with their lines, so that nothing is cut.
    """
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f")
    if plot_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    final = final_figures(table)
    with_loss = one_vocabulary(table)
    panels = [("tokens_seen", "bits_per_byte"), ("train_seconds", "bits_per_byte")]
    if with_loss:
        panels = [("tokens_seen", "val_loss"), ("train_seconds", "val_loss"), *panels]
    labels = {
        "tokens_seen": "tokens seen",
        "train_seconds": "training wall time (s)",
        "val_loss": "validation loss (nats/token)",
        "bits_per_byte": "bits per byte",
    }

    head = [
        "run",
        "differs",
        "steps",
        "train s",
        *(["val_loss"] if with_loss else []),
        "bits/byte",
        "bits/byte\nvs first",
    ]
    cells = []
    for r in final.itertuples():
        loss = [f"{r.val_loss:.4f}"] if with_loss else []
        cells.append(
            [
                textwrap.fill(r.run, WRAP["run"], break_long_words=True),
                textwrap.fill(r.differs, WRAP["differs"], break_long_words=True),
                f"{r.step:,}",
                f"{r.train_seconds:,.1f}",
                *loss,
                f"{r.bits_per_byte:.4f}",
                f"{r.vs_first:+.4f}",
            ]
        )
    # Each row is as high as its lines of text and a little more (the header has two lines).
    row_heights = [2 + ROW_PADDING] + [
        max(cell.count("\n") + 1 for cell in row) + ROW_PADDING for row in cells
    ]
    table_height = LINE_HEIGHT * sum(row_heights) + 0.2
    rows = len(panels) // 2
    note = 0.0 if with_loss else 0.35
    fig = plt.figure(
        figsize=(12, 0.8 + note + rows * PANEL_HEIGHT + table_height), dpi=100, layout="constrained"
    )
    grid = fig.add_gridspec(rows + 1, 2, height_ratios=[PANEL_HEIGHT] * rows + [table_height])
    for i, (x, y) in enumerate(panels):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        for name, group in table.groupby("run", sort=False):
            ax.plot(group[x], group[y], marker="o", markersize=3, label=name)
        ax.set_xlabel(labels[x])
        ax.set_ylabel(labels[y])
        ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=8, title="run")

    ax = fig.add_subplot(grid[rows, :])
    ax.axis("off")
    widths = [0.16, 0.44, 0.07, 0.08, *([0.08] if with_loss else []), 0.08, 0.09]
    shown = ax.table(
        cellText=cells,
        colLabels=head,
        colWidths=[w / sum(widths) for w in widths],
        cellLoc="left",
        colLoc="left",
        bbox=[0, 0, 1, 1],
    )
    shown.auto_set_font_size(False)
    shown.set_fontsize(9)
    for (row, _), cell in shown.get_celld().items():
        cell.set_height(row_heights[row] / sum(row_heights))
        cell.PAD = 0.02  # of the cell's width: the text starts near the left edge of wide cells too
        cell.get_text().set_verticalalignment("center")
    title = "tinylm runs compared (exact validation metrics of every checkpoint)"
    if not with_loss:
        title += "\nthe runs' vocabularies differ: compared by bits per byte only"
    fig.suptitle(title)
    with atomic_path(plot_path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
