"""The default run's training speed by dtype, on this CPU and on a CPU without bfloat16 reproduced.

    python bench/precision.py [--steps 60] [--slow-steps 12] [--workdir DIR]

Prepares the default config's token files once (snakemake in a fresh folder), then trains the
default model (`python -m tinylm pretrain`, world size 2, its own state folder each time) with
`train.dtype` auto, float32 and bfloat16, each
- on this machine as it is, and
- with oneDNN limited to AVX2 and torch's kernels to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2
  ATEN_CPU_CAPABILITY=avx2`): a CPU without bfloat16 instructions, reproduced on one that has them.
Each run's tokens/s is the training loop's own, over its second half (the log line at the last step,
`log_interval` = half the steps); --repeats rounds alternate the cases and the median is shown.
bfloat16 on the reproduced CPU takes `--slow-steps`. Prints a Markdown table with the ratio to
float32 on the same CPU kind, and what `auto` chose.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def prepare(workdir: Path) -> None:
    """The default config's corpus, tokenizer and token files in `workdir`/results."""
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "config" / "config.yaml", workdir / "config" / "config.yaml")
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
         "--cores", "2", "results/tokens/train.npy", "results/tokens/valid.npy", "--quiet", "all"],
        cwd=workdir, check=True,
    )  # fmt: skip


def train(workdir: Path, dtype: str, steps: int, env: dict[str, str], name: str) -> tuple[float, str]:
    """(tokens/s over the second half of `steps`, the log's dtype line) of one short default run."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    half = max(1, steps // 2)
    cfg["train"].update(
        dtype=dtype,
        max_iters=steps,
        warmup_iters=2,
        log_interval=half,
        val_interval=10**6,
        checkpoint_interval=10**6,
    )
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = workdir / "state" / name
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(workdir / "ckpt" / name, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", "pretrain", "--config", str(config), "--state-dir", str(state),
         "--checkpoint-dir", str(workdir / "ckpt" / name), "--tensorboard-dir", str(workdir / "tb")],
        cwd=workdir, env={**os.environ, **env}, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pretrain failed:\n{proc.stderr[-3000:]}")
    rate = re.findall(rf"step {steps}/{steps} loss \S+ .*? ([\d,]+) tok/s", proc.stderr)[-1]
    chosen = next(line for line in proc.stderr.splitlines() if "train.dtype" in line)
    return float(rate.replace(",", "")), chosen.split("] ", 1)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--slow-steps", type=int, default=12, help="steps of bfloat16 on the reproduced AVX2 CPU"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every case (the median is shown)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tinylm-precision-"))
    prepare(workdir)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores; default model, world size 2, 1 thread per rank\n")  # fmt: skip
    cases = [(kind, env, dtype) for kind, env in (("this CPU", {}), ("AVX2 reproduced", AVX2))
             for dtype in ("float32", "bfloat16", "auto")]  # fmt: skip
    rates: dict[tuple[str, str], list[float]] = {}
    chosen: dict[str, str] = {}
    for round in range(args.repeats):  # rounds alternate the cases, so that machine noise hits each alike
        for kind, env, dtype in cases:
            steps = args.slow_steps if (env and dtype == "bfloat16") else args.steps
            name = f"{dtype}-{'avx2' if env else 'here'}"
            rate, line = train(workdir, dtype, steps, env, name)
            rates.setdefault((kind, dtype), []).append(rate)
            chosen[kind] = line if dtype == "auto" else chosen.get(kind, "")
            print(f"round {round}: {kind} {dtype} {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
    print("| CPU kind | train.dtype | steps | tokens/s (median) | range | x float32 | what auto chose |")
    print("|---|---|---:|---:|---|---:|---|")
    for kind, env, dtype in cases:
        runs = rates[kind, dtype]
        median, base = statistics.median(runs), statistics.median(rates[kind, "float32"])
        steps = args.slow_steps if (env and dtype == "bfloat16") else args.steps
        print(
            f"| {kind} | {dtype} | {steps} | {median:,.0f} | {min(runs):,.0f}-{max(runs):,.0f} | "
            f"{median / base:.2f} | {chosen[kind] if dtype == 'auto' else ''} |"
        )


if __name__ == "__main__":
    main()
