"""Cooldown branches against cosine runs of the same lengths: the table and the figure.

    snakemake --cores all results/compare.csv --configfile config/cooldown.yaml
    python bench/cooldown.py [--compare results/compare.csv] [--figure bench/cooldown.png]

Reads the sweep's compare.csv (every run's evaluated checkpoints: tokens seen, training seconds,
bits per byte). A branch `coolK` of config/cooldown.yaml starts from step K of `const` and decays
to its own last step; its cost is its own training time plus the share of `const` up to step K
that it needs (the parent's time to K, which every branch at or past K shares). Printed as Markdown
for bench/RESULTS.md: per length, the branch's and the cosine run's final bits per byte, their
difference, and the training seconds each took; the figure plots bits per byte against tokens seen:
`const`'s curve, each branch's decay from its checkpoint, and each cosine run's final point.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd


def cooldown_table(compare: pd.DataFrame) -> pd.DataFrame:
    """One row per length and seed: the branch `cool<K>` (its last step) beside the cosine run of
    that length at the same seed. Runs are matched by their configuration (`config`: the run's name
    without a `.s<seed>` suffix), seed by seed."""
    tables = []
    for seed, runs in compare.groupby(compare["seed"].fillna(-1), sort=True):
        table = _one_seed(runs.assign(run=runs["config"]))
        tables.append(table.assign(seed=int(seed)) if seed >= 0 else table)
    return pd.concat(tables, ignore_index=True)


def _one_seed(compare: pd.DataFrame) -> pd.DataFrame:
    final = compare.sort_values("step").groupby("run").tail(1).set_index("run")
    const = compare[compare["run"] == "const"].set_index("step")
    rows = []
    for run in final.index:
        match = re.fullmatch(r"cool(\d+)", run)
        if not match:
            continue
        start, branch = int(match.group(1)), final.loc[run]
        cosine_name = f"cos{int(branch['step'])}"
        if cosine_name not in final.index:
            continue
        cosine = final.loc[cosine_name]
        parent_seconds = float(const.loc[start, "train_seconds"]) if start in const.index else float("nan")
        rows.append(
            {
                "steps": int(branch["step"]),
                "tokens": int(branch["tokens_seen"]),
                "branch from": start,
                "branch bits/byte": branch["bits_per_byte"],
                "cosine bits/byte": cosine["bits_per_byte"],
                "branch - cosine": branch["bits_per_byte"] - cosine["bits_per_byte"],
                "branch s (own)": branch["train_seconds"],
                "parent s to the branch": parent_seconds,
                "cosine s": cosine["train_seconds"],
            }
        )
    return pd.DataFrame(rows).sort_values("steps")


def plot(compare: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, rows in compare.groupby("run", sort=False):
        rows = rows.sort_values("step")
        if run == "const":
            label = "const (warmup-stable-decay to its last step)"
            ax.plot(rows["tokens_seen"], rows["bits_per_byte"], "k-", marker="o", label=label)
        elif run.startswith("cool"):
            start = int(run.removeprefix("cool"))
            const = compare[(compare["run"] == "const") & (compare["step"] == start)]
            xs = [*const["tokens_seen"], *rows["tokens_seen"]]
            ys = [*const["bits_per_byte"], *rows["bits_per_byte"]]
            ax.plot(xs, ys, "C0-", marker="s", label="decay branches" if start == 400 else None)
        elif run.startswith("cos"):  # each cosine run's final checkpoint: the loss at its length
            last = rows.tail(1)
            label = "cosine runs, each its own length" if run == "cos500" else None
            ax.plot(last["tokens_seen"], last["bits_per_byte"], "C3^", markersize=9, label=label)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("bits per byte (held-out plays)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, default=Path("results/compare.csv"))
    parser.add_argument("--figure", type=Path, default=Path("bench/cooldown.png"))
    args = parser.parse_args()
    compare = pd.read_csv(args.compare)
    table = cooldown_table(compare)
    first_seed = compare["seed"].dropna().min() if compare["seed"].notna().any() else None
    if first_seed is not None:  # the figure shows the first seed's curves
        compare = compare[compare["seed"] == first_seed].assign(run=lambda c: c["config"])
    print("| " + " | ".join(table.columns) + " |")
    print("|" + "---:|" * len(table.columns))
    for row in table.itertuples(index=False):
        cells = [f"{v:,}" if isinstance(v, int) else f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}" for v in row]
        print("| " + " | ".join(cells) + " |")
    plot(compare, args.figure)
    print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
