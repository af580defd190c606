"""Named runs side by side: every run's eval.csv and training wall times -> compare.csv and compare.png.

    table = compare_runs([{"name": "default", "eval": "results/eval.csv",
                           "checkpoints": "results/checkpoints", "overrides": {}}, ...])
    write_compare(table, "results/compare.csv", "results/compare.png")

compare.csv has one row per run and checkpoint (COLUMNS); `train_seconds` is the training wall
time up to that checkpoint, from its manifest (rank 0's clock, summed over resumes), so it is the
one column that differs between reruns. compare.png plots validation loss and bits per byte
against tokens seen and against training time, one line per run, above a table of the final
figures; `final_figures(table)` gives that table as a frame (`markdown_table` as Markdown).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from tinylm.io import atomic_path

COLUMNS = ["run", "overrides", "step", "tokens_seen", "train_seconds", "val_loss", "bits_per_byte"]


def describe_overrides(overrides: dict[str, Any]) -> str:
    """'train.lr_max=0.003 model.d_ff=512' (or '-' for none), in the given order."""
    return " ".join(f"{key}={value}" for key, value in overrides.items()) or "-"


def compare_runs(runs: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (run, evaluated checkpoint), runs in the given order; see COLUMNS.

    Each run: name, eval (its eval.csv), checkpoints (its published checkpoint folder, for the
    `train_seconds` of each step's manifest; NaN where a manifest has none) and overrides.
    """
    rows = []
    for run in runs:
        path = Path(run["eval"])
        if not path.is_file():
            raise FileNotFoundError(f"run {run['name']}: {path} not found (evaluate the run first)")
        table = pd.read_csv(path)  # a plain CSV (see evaluation.write_eval)
        missing = {"step", "tokens_seen", "val_loss", "bits_per_byte"} - set(table.columns)
        if missing:
            raise ValueError(f"run {run['name']}: {path} lacks the columns {sorted(missing)}")
        for record in table.to_dict("records"):
            step = int(record["step"])
            rows.append({
                "run": run["name"],
                "overrides": describe_overrides(run.get("overrides") or {}),
                "step": step,
                "tokens_seen": int(record["tokens_seen"]),
                "train_seconds": _train_seconds(Path(run["checkpoints"]) / f"step_{step}.json"),
                "val_loss": float(record["val_loss"]),
                "bits_per_byte": float(record["bits_per_byte"]),
            })
    return pd.DataFrame(rows, columns=COLUMNS)


def _train_seconds(manifest_path: Path) -> float:
    try:
        return float(json.loads(manifest_path.read_text(encoding="utf-8")).get("train_seconds", math.nan))
    except (OSError, ValueError):
        return math.nan


def final_figures(table: pd.DataFrame) -> pd.DataFrame:
    """The last checkpoint of each run, in run order, with its loss relative to the first run's."""
    final = table.groupby("run", sort=False).tail(1).reset_index(drop=True)
    final = final[["run", "overrides", "step", "tokens_seen", "train_seconds", "val_loss", "bits_per_byte"]].copy()
    final["vs_first"] = final["val_loss"] - final["val_loss"].iloc[0]
    return final


def markdown_table(final: pd.DataFrame) -> str:
    lines = ["| run | overrides | steps | tokens | train s | val_loss | bits/byte | val_loss vs first |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in final.itertuples():
        lines.append(f"| {r.run} | {r.overrides} | {r.step:,} | {r.tokens_seen:,} | {r.train_seconds:,.1f} | "
                     f"{r.val_loss:.4f} | {r.bits_per_byte:.4f} | {r.vs_first:+.4f} |")
    return "\n".join(lines) + "\n"


def write_compare(table: pd.DataFrame, csv_path: str | os.PathLike, plot_path: str | os.PathLike | None) -> None:
    """compare.csv (every row) and compare.png (four panels and the final table), both atomically."""
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f")
    if plot_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    final = final_figures(table)
    fig = plt.figure(figsize=(11, 8.5 + 0.3 * len(final)), dpi=100)
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.25 + 0.12 * len(final)])
    panels = [("tokens_seen", "val_loss"), ("train_seconds", "val_loss"),
              ("tokens_seen", "bits_per_byte"), ("train_seconds", "bits_per_byte")]
    labels = {"tokens_seen": "tokens seen", "train_seconds": "training wall time (s)",
              "val_loss": "validation loss (nats/token; compare within one vocabulary)", "bits_per_byte": "bits per byte"}
    for i, (x, y) in enumerate(panels):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        for name, rows in table.groupby("run", sort=False):
            ax.plot(rows[x], rows[y], marker="o", markersize=3, label=name)
        ax.set_xlabel(labels[x])
        ax.set_ylabel(labels[y])
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[2, :])
    ax.axis("off")
    cells = [[r.run, r.overrides, f"{r.step:,}", f"{r.train_seconds:,.1f}", f"{r.val_loss:.4f}",
              f"{r.bits_per_byte:.4f}", f"{r.vs_first:+.4f}"] for r in final.itertuples()]
    widths = [0.12, 0.46, 0.07, 0.08, 0.09, 0.09, 0.09]
    grid_table = ax.table(cellText=cells, colLabels=["run", "overrides", "steps", "train s", "val_loss",
                                                     "bits/byte", "vs first"],
                          colWidths=widths, loc="center", cellLoc="left")
    grid_table.auto_set_font_size(False)
    grid_table.set_fontsize(9)
    grid_table.scale(1, 1.4)
    fig.suptitle("tinylm runs compared (exact validation metrics of every checkpoint)")
    fig.tight_layout()
    with atomic_path(plot_path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
