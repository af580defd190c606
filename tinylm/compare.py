"""Named runs side by side: every run's eval.csv and training wall times -> compare.csv and compare.png.

    table = compare_runs([{"name": "default", "eval": "results/eval.csv",
                           "checkpoints": "results/checkpoints", "overrides": {},
                           "values": {"train.lr_max": 0.006}, "config": "default", "seed": 0}, ...])
    write_compare(table, "results/compare.csv", "results/compare.png")  # + results/compare_seeds.csv

compare.csv has one row per run and checkpoint (COLUMNS); `train_seconds` is the training wall
time up to that checkpoint, from its manifest (rank 0's clock, summed over resumes), so it is the
one column that differs between reruns; `vocab_size` is the model's, from the manifest too.
`config` and `seed` name the configuration a run is a seed of (a sweep with `seeds:` trains the
run `<config>.s<seed>` per seed) and its train.seed; a run given without them is a configuration of
its own, of one seed.

compare_seeds.csv, beside compare.csv (`seeds_csv_path`), has one row per configuration
(SEED_COLUMNS, `seed_figures`): the mean and the spread over its seeds of the final checkpoint's
figures. The spread is the sample standard deviation (ddof=1: the sum of squared deviations from
the mean divided by n - 1), empty for a configuration of one seed. `vs_first` is the difference of
the mean bits per byte to the first configuration's, and `within_spread` says whether it is within
the two configurations' combined spread: |vs_first| <= sqrt(std**2 + std_first**2) of bits per
byte (the standard deviation of the difference of one seed of each); empty for the first
configuration and wherever a spread is unknown (one seed). `p_welch` is the two-sided p-value of
Welch's t-test (unequal variances; scipy.stats.ttest_ind) of the configuration's bits per byte
against the first's, over their seeds: the chance of a difference of means at least this large if
both had the same mean; empty where either has fewer than two seeds (or both have no spread).

compare.png plots bits per byte (and, when every run has the same vocabulary, validation loss)
against tokens seen and against training time, one line per configuration (the mean over its
seeds, in a band of plus and minus one standard deviation when it has several), above a table of
the final figures per configuration (mean ± std when it has several seeds; "~" marks a difference
to the first within the spread). The table names, for each configuration, only the keys whose
values differ between them, and compares each with the first in bits per byte, the one figure that
compares runs of any two vocabularies (a loss per token does not). `final_figures(table)` gives
each run's final figures as a frame (`markdown_table` as Markdown).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import scipy.stats

from tinylm.checkpoint import Manifest, published_run
from tinylm.eval_table import read_eval
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
    "config",
    "seed",
    "started_from",
]
SEED_COLUMNS = [
    "config",
    "differs",
    "num_seeds",
    "seeds",
    "vocab_size",
    "step",
    "tokens_seen",
    "train_seconds_mean",
    "val_loss_mean",
    "val_loss_std",
    "bits_per_byte_mean",
    "bits_per_byte_std",
    "vs_first",
    "within_spread",
    "p_welch",
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
    `train_seconds` and `vocab_size` of each step's manifest; NaN where a manifest has none; a
    folder of several runs' checkpoints is refused),
    overrides (its own, shown in compare.csv) and, optionally, values (see `differing_keys`), config
    (the configuration it is a seed of; default: its name) and seed (its train.seed; default: none).
    `differs` holds, of the keys that differ between the runs, the first configuration's values of
    them all and each other run's values where they are not the first run's (the seeds of the first
    configuration show them all too).
    """
    rows = []
    differs = differing_keys(runs)
    first_config = runs[0].get("config", runs[0]["name"]) if runs else None
    for run in runs:
        config = run.get("config", run["name"])
        path = Path(run["eval"])
        if not path.is_file():
            raise FileNotFoundError(f"run {run['name']}: {path} not found (evaluate the run first)")
        try:
            table = read_eval(path)
        except ValueError as e:
            raise ValueError(f"run {run['name']}: {e}") from None
        values = run.get("values") or run.get("overrides") or {}
        first = runs[0].get("values") or runs[0].get("overrides") or {}
        # The first configuration is the reference: it shows every key that differs, the others where
        # they differ from it.
        shown = {
            key: values[key]
            for key in differs
            if key in values and (config == first_config or values[key] != first.get(key))
        }
        manifests = published_run(run["checkpoints"])  # refuses a folder of several runs
        for record in table.to_dict("records"):
            step = int(record["step"])
            manifest = manifests.get(step) or Manifest()
            rows.append(
                {
                    "run": run["name"],
                    "overrides": describe_overrides(run.get("overrides") or {}),
                    "differs": describe_overrides(shown),
                    "vocab_size": (manifest.model_config or {}).get("vocab_size", math.nan),
                    "step": step,
                    "tokens_seen": int(record["tokens_seen"]),
                    "train_seconds": math.nan if manifest.train_seconds is None else manifest.train_seconds,
                    "val_loss": float(record["val_loss"]),
                    "bits_per_byte": float(record["bits_per_byte"]),
                    "config": config,
                    "seed": run.get("seed"),
                    "started_from": manifest.parent_checkpoint or "-",  # train.init_from's checkpoint
                }
            )
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["seed"] = table["seed"].astype("Int64")  # an integer, or empty where a run has none
    return table


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


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean (NaN for no values, or where one is NaN)."""
    values = [float(v) for v in values]
    return math.fsum(values) / len(values) if values else math.nan


def sample_std(values: Iterable[float]) -> float:
    """The sample standard deviation, ddof=1: sqrt(sum((v - mean)**2) / (n - 1)); NaN for fewer than 2."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return math.nan
    centre = mean(values)
    return math.sqrt(math.fsum((v - centre) ** 2 for v in values) / (len(values) - 1))


def within_spread(difference: float, std_a: float, std_b: float) -> bool | None:
    """Whether a difference of two configurations' means is within their combined spread:
    |difference| <= sqrt(std_a**2 + std_b**2). None when either spread is unknown (NaN: one seed)."""
    if math.isnan(std_a) or math.isnan(std_b):
        return None
    return abs(difference) <= math.sqrt(std_a**2 + std_b**2)


def welch_p_value(a: Iterable[float], b: Iterable[float]) -> float | None:
    """The two-sided p-value of Welch's t-test of the means of samples `a` and `b` (unequal
    variances); None when either has fewer than two values, or neither varies."""
    a, b = list(a), list(b)
    if len(a) < 2 or len(b) < 2:
        return None
    p = float(scipy.stats.ttest_ind(a, b, equal_var=False).pvalue)
    return None if math.isnan(p) else p


def seed_figures(table: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration, in run order (SEED_COLUMNS): the final checkpoint of each of its seeds'
    runs, averaged, with the sample standard deviation (ddof=1) of val_loss and bits_per_byte, and the
    difference of the mean bits per byte to the first configuration's, marked `within_spread` (see there;
    None for the first configuration), with Welch's p-value against the first (`welch_p_value`).

    The seeds of one configuration must end at the same step; a ValueError says which do not.
    """
    final = table.groupby("run", sort=False).tail(1)
    rows, samples = [], []  # samples: each configuration's final bits per byte, one per seed
    for config, group in final.groupby("config", sort=False):
        if group["step"].nunique() > 1:
            ends = ", ".join(f"{r.run} at {r.step}" for r in group.itertuples())
            raise ValueError(f"config {config}: its seeds' runs end at different steps ({ends})")
        rows.append(
            {
                "config": config,
                "differs": group["differs"].iloc[0],
                "num_seeds": len(group),
                "seeds": " ".join(str(seed) for seed in group["seed"].dropna()),
                "vocab_size": group["vocab_size"].iloc[0],
                "step": int(group["step"].iloc[0]),
                "tokens_seen": int(group["tokens_seen"].iloc[0]),
                "train_seconds_mean": mean(group["train_seconds"]),
                "val_loss_mean": mean(group["val_loss"]),
                "val_loss_std": sample_std(group["val_loss"]),
                "bits_per_byte_mean": mean(group["bits_per_byte"]),
                "bits_per_byte_std": sample_std(group["bits_per_byte"]),
            }
        )
        samples.append(list(group["bits_per_byte"]))
    figures = pd.DataFrame(rows, columns=SEED_COLUMNS)
    if figures.empty:
        return figures
    first = figures.iloc[0]
    figures["vs_first"] = figures["bits_per_byte_mean"] - first["bits_per_byte_mean"]
    figures["within_spread"] = [None] + [
        within_spread(r.vs_first, r.bits_per_byte_std, first["bits_per_byte_std"])
        for r in figures.iloc[1:].itertuples()
    ]
    figures["p_welch"] = [None] + [welch_p_value(sample, samples[0]) for sample in samples[1:]]
    return figures


def mean_curves(table: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Per configuration (in run order) and step (ascending): the means of `x` and `y` over the seeds,
    `y`'s sample standard deviation (`<y>_std`, NaN with one seed) and the number of seeds."""
    rows = []
    for config, runs in table.groupby("config", sort=False):
        for step, group in runs.groupby("step", sort=True):
            rows.append(
                {
                    "config": config,
                    "step": step,
                    x: mean(group[x]),
                    y: mean(group[y]),
                    f"{y}_std": sample_std(group[y]),
                    "num_seeds": len(group),
                }
            )
    return pd.DataFrame(rows, columns=["config", "step", x, y, f"{y}_std", "num_seeds"])


def seeds_csv_path(csv_path: str | os.PathLike) -> Path:
    """Where compare_seeds.csv goes beside a compare.csv: `<folder>/<name>_seeds.csv`."""
    path = Path(csv_path)
    return path.with_name(f"{path.stem}_seeds.csv")


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
TITLE_LINE = 0.35  # inches per extra line of the title
WRAP = {"run": 22, "differs": 64}
WRAP_SEEDED = {"run": 19, "differs": 42, "seeds": 10}  # the narrower columns of the table with seeds
WITHIN_SPREAD_MARK = "~"


def _mean_std(average: float, std: float, digits: int = 4) -> str:
    """'4.0812 ± 0.0123', or '4.0812' where the spread is unknown (one seed)."""
    return f"{average:.{digits}f}" if math.isnan(std) else f"{average:.{digits}f} ± {std:.{digits}f}"


def table_cells(figures: pd.DataFrame, with_loss: bool) -> tuple[list[str], list[list[str]], list[float]]:
    """compare.png's final table from `seed_figures`: (header, rows of cells, relative column widths).

    With one seed per configuration it is one row per run, as the runs' final figures; with several,
    the configuration's seeds, mean ± std of the figures, and a difference to the first configuration
    within the spread (`within_spread`) followed by WITHIN_SPREAD_MARK.
    """
    seeded = bool((figures["num_seeds"] > 1).any())
    head = [
        "config" if seeded else "run",
        "differs",
        *(["seeds"] if seeded else []),
        "steps",
        "train s\n(mean)" if seeded else "train s",
        *(["val_loss"] if with_loss else []),
        "bits/byte",
        "bits/byte\nvs first",
    ]
    widths = [0.16, 0.44, 0.07, 0.08, *([0.08] if with_loss else []), 0.08, 0.09]
    if seeded:
        widths = [0.14, 0.30, 0.07, 0.06, 0.07, *([0.13] if with_loss else []), 0.13, 0.10]
    wrap = WRAP_SEEDED if seeded else WRAP
    cells = []
    for r in figures.itertuples():
        mark = f" {WITHIN_SPREAD_MARK}" if r.within_spread is True else ""
        cells.append(
            [
                textwrap.fill(r.config, wrap["run"], break_long_words=True),
                textwrap.fill(r.differs, wrap["differs"], break_long_words=True),
                *([textwrap.fill(r.seeds or "-", wrap["seeds"])] if seeded else []),
                f"{r.step:,}",
                f"{r.train_seconds_mean:,.1f}",
                *([_mean_std(r.val_loss_mean, r.val_loss_std)] if with_loss else []),
                _mean_std(r.bits_per_byte_mean, r.bits_per_byte_std),
                f"{r.vs_first:+.4f}{mark}",
            ]
        )
    return head, cells, widths


def write_compare(
    table: pd.DataFrame,
    csv_path: str | os.PathLike,
    plot_path: str | os.PathLike | None,
    seeds_path: str | os.PathLike | None = None,
) -> None:
    """compare.csv (every row), compare_seeds.csv (`seed_figures`; at `seeds_path`, by default
    `seeds_csv_path(csv_path)`) and compare.png (the panels and the final table), each atomically.

    With one vocabulary: validation loss and bits per byte, each against tokens seen and training
    time; with several: bits per byte only. One line per configuration, the mean over its seeds, in a
    band of ± one sample standard deviation where it has several. The table's long cells are wrapped,
    and its height grows with their lines, so that nothing is cut.
    """
    figures = seed_figures(table)
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f")
    # p-values in 6 significant digits: a fixed 6 decimals would write a small one as 0.000000.
    p_values = ["" if pd.isna(p) else f"{p:.6g}" for p in figures["p_welch"]]
    with atomic_path(seeds_path or seeds_csv_path(csv_path), suffix=".csv") as tmp:
        figures.assign(p_welch=p_values).to_csv(tmp, index=False, float_format="%.6f")
    if plot_path is not None:
        _write_plot(table, figures, plot_path)


PANEL_LABELS = {
    "tokens_seen": "tokens seen",
    "train_seconds": "training wall time (s)",
    "val_loss": "validation loss (nats/token)",
    "bits_per_byte": "bits per byte",
}


def _write_plot(table: pd.DataFrame, figures: pd.DataFrame, plot_path: str | os.PathLike) -> None:
    """compare.png: the panels above the table of final figures, titled (see `write_compare`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_loss = one_vocabulary(table)
    seeded = bool((figures["num_seeds"] > 1).any())
    panels = [("tokens_seen", "bits_per_byte"), ("train_seconds", "bits_per_byte")]
    if with_loss:
        panels = [("tokens_seen", "val_loss"), ("train_seconds", "val_loss"), *panels]

    head, cells, widths = table_cells(figures, with_loss)
    # Each row is as high as its lines of text and a little more (the header has two lines).
    row_heights = [2 + ROW_PADDING] + [
        max(cell.count("\n") + 1 for cell in row) + ROW_PADDING for row in cells
    ]
    table_height = LINE_HEIGHT * sum(row_heights) + 0.2
    rows = len(panels) // 2
    note = TITLE_LINE * ((not with_loss) + 2 * seeded)
    fig = plt.figure(
        figsize=(12, 0.8 + note + rows * PANEL_HEIGHT + table_height), dpi=100, layout="constrained"
    )
    grid = fig.add_gridspec(rows + 1, 2, height_ratios=[PANEL_HEIGHT] * rows + [table_height])
    _draw_panels(fig, grid, table, panels, seeded)
    _draw_table(fig.add_subplot(grid[rows, :]), head, cells, widths, row_heights)
    title = "tinylm runs compared (exact validation metrics of every checkpoint)"
    if not with_loss:
        title += "\nthe runs' vocabularies differ: compared by bits per byte only"
    if seeded:
        title += (
            "\nper configuration: the mean over its seeds ± the sample standard deviation (ddof=1);"
            f"\n{WITHIN_SPREAD_MARK}: the difference to the first is within the spread, "
            "|Δ| ≤ sqrt(std² + std_first²) of bits per byte"
        )
    fig.suptitle(title)
    with atomic_path(plot_path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)


def _draw_panels(fig, grid, table: pd.DataFrame, panels: list[tuple[str, str]], seeded: bool) -> None:
    """One panel per (x, y): a line per configuration (its mean, in a band of its spread), a legend."""
    for i, (x, y) in enumerate(panels):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        for config, curve in mean_curves(table, x, y).groupby("config", sort=False):
            seeds = int(curve["num_seeds"].max())
            label = f"{config} ({seeds} seeds)" if seeds > 1 else config
            (line,) = ax.plot(curve[x], curve[y], marker="o", markersize=3, label=label)
            if seeds > 1:
                spread = curve[f"{y}_std"]
                ax.fill_between(
                    curve[x], curve[y] - spread, curve[y] + spread, color=line.get_color(), alpha=0.2, lw=0
                )
        ax.set_xlabel(PANEL_LABELS[x])
        ax.set_ylabel(PANEL_LABELS[y])
        ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(
        handles, names, loc="outside right upper", fontsize=8, title="configuration" if seeded else "run"
    )


def _draw_table(
    ax, head: list[str], cells: list[list[str]], widths: list[float], row_heights: list[float]
) -> None:
    """The table of final figures, its rows as high as their lines of text."""
    ax.axis("off")
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
