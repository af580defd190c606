"""The memory plan against the peak memory of real runs on the CPU.

For each shape and activation checkpointing mode: `python -m tinylm pretrain --plan` (the plan's
total per rank), then the same command without `--plan` for a few steps (rank 0's peak resident
memory, VmHWM, from the log's last progress line: the training peak, before the final checkpoint is
written), twice: with glibc's default allocator, which keeps freed memory for reuse (so the RSS
also holds its heap's slack), and with MALLOC_MMAP_THRESHOLD_=1 MiB, which gives every large tensor
its own mapping, returned when freed (so the RSS holds the tensors and little else). The plan
counts the tensors and, on the CPU, the free chunks glibc's heap keeps (its `allocator` line: the
difference between the two measurements is what it stands for). Prints a markdown table: planned,
of it the allocator, measured both ways, planned / measured.

    python bench/memory_plan.py                     # the shapes below; needs results/tokens and
                                                    # results/tokenizer of the default run
    python bench/memory_plan.py --only default
    python bench/memory_plan.py --steps 20 --commit-every 10 --defaults-only   # as a run validates
                                                    # and commits, glibc's defaults only
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# name -> (model keys, train keys); vocabulary 4096 (the default run's tokenizer)
SHAPES = {
    "default": ({}, {}),
    "ctx512 d256 6L": (
        dict(context_length=512, d_model=256, num_layers=6, num_heads=4, d_ff=688),
        dict(world_size=1, batch_size=16),
    ),
    "ctx512 d256 6L, float32": (
        dict(context_length=512, d_model=256, num_layers=6, num_heads=4, d_ff=688),
        dict(world_size=1, batch_size=16, dtype="float32"),
    ),
    "ctx1024 d256 8L": (
        dict(context_length=1024, d_model=256, num_layers=8, num_heads=4, d_ff=688),
        dict(world_size=1, batch_size=8),
    ),
    "ctx1024 d256 8L, selective": (
        dict(context_length=1024, d_model=256, num_layers=8, num_heads=4, d_ff=688),
        dict(world_size=1, batch_size=8, activation_checkpointing="selective"),
    ),
    "ctx1024 d256 8L, full": (
        dict(context_length=1024, d_model=256, num_layers=8, num_heads=4, d_ff=688),
        dict(world_size=1, batch_size=8, activation_checkpointing="full"),
    ),
    "ctx256 d128 4L, every option, ws 2": (
        dict(
            context_length=256,
            qk_norm=True,
            mlp="relu2",
            tie_embeddings=True,
            value_embeddings=True,
            dropout=0.1,
            logit_softcap=15.0,
        ),
        dict(batch_size=32),
    ),
}


def pretrain(config: Path, folder: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    results = ROOT / "results"
    command = [
        *(sys.executable, "-m", "tinylm", "pretrain", "--config", str(config)),
        *("--tokenizer", str(results / "tokenizer" / "tokenizer.json")),
        *("--train-tokens", str(results / "tokens" / "train.npy")),
        *("--valid-tokens", str(results / "tokens" / "valid.npy")),
        *("--state-dir", str(folder / "state"), "--checkpoint-dir", str(folder / "ckpt")),
        *("--tensorboard-dir", str(folder / "tb"), *extra),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=1800, env={**os.environ, **(env or {})}
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--commit-every",
        type=int,
        default=None,
        help="validate and commit a checkpoint every this many steps (default: neither), as a real run does",
    )
    parser.add_argument(
        "--defaults-only", action="store_true", help="skip the runs with the threshold pinned"
    )
    args = parser.parse_args()
    print(
        "| shape | planned total per rank, MiB | of it glibc's heap | peak RSS of rank 0, MiB "
        "| planned / RSS | peak RSS, mmap threshold 1 MiB | planned / RSS |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for name in args.only:
        model, train = SHAPES[name]
        cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
        cfg["model"].update(model)
        cfg["train"].update(
            max_iters=args.steps,
            log_interval=1,
            val_interval=args.commit_every or 10**6,
            checkpoint_interval=args.commit_every or 10**6,
            warmup_iters=1,
            **train,
        )
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            config = folder / "config.yaml"
            config.write_text(yaml.safe_dump(cfg))
            plan = pretrain(config, folder, "--plan")
            planned = re.search(r"total\s+([\d.]+) (GiB|MiB)", plan.stderr)
            allocator = re.search(r"allocator\s+([\d.]+) (GiB|MiB)", plan.stderr)
            runs = []
            envs = [{}] if args.defaults_only else [{}, {"MALLOC_MMAP_THRESHOLD_": str(2**20)}]
            for i, env in enumerate(envs):
                runs.append(pretrain(config, folder / f"run{i}", env=env))
        peaks = [re.findall(r"peak mem ([\d,]+) MiB", run.stderr) for run in runs]
        failed_run = plan.returncode or any(run.returncode for run in runs)
        if failed_run or not planned or not allocator or not all(peaks):
            failed = plan.stderr + "".join(run.stderr for run in runs)
            print(f"| {name} | failed: {failed[-300:]!r} | | | | | |", flush=True)
            continue
        planned_mib, allocator_mib = (
            float(found.group(1)) * (1024 if found.group(2) == "GiB" else 1) for found in (planned, allocator)
        )
        row = f"| {name} | {planned_mib:,.0f} | {allocator_mib:,.0f} "
        for found in peaks:
            measured_mib = float(found[-1].replace(",", ""))
            row += f"| {measured_mib:,.0f} | {planned_mib / measured_mib:.2f} "
        print(row + "|", flush=True)


if __name__ == "__main__":
    main()
