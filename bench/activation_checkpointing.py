"""Activation checkpointing on the CPU: peak memory and step time of `none`, `selective` and `full`.

A shape where activations dominate: context 1,024, d_model 256, 8 layers, vocab 4,096, micro-batch
8, bf16 autocast, our cross-entropy and AdamW, one process on the machine's threads.

1. Step time: the three modes interleaved step by step in one process (the same model weights and
   batches), so that load from other processes hits them alike; the median step of each.
2. Peak memory: each mode alone in a fresh process, its peak resident set (VmHWM) over the steps
   above its resident set before the first step; once as glibc runs by default, once with its mmap
   threshold pinned to 64 KiB (MALLOC_MMAP_THRESHOLD_), so that a freed buffer leaves the resident
   set at once and the peak counts live memory, not what the allocator happened to keep.

    python bench/activation_checkpointing.py          # markdown on stdout, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.optim import AdamW, param_groups
from tinylm.precision import autocast

SHAPE = dict(vocab_size=4096, context_length=1024, d_model=256, num_layers=8, num_heads=4, d_ff=688)
MODES = ("none", "selective", "full")


def make_step(mode: str, micro_batch: int):
    torch.manual_seed(0)
    model = Transformer(**SHAPE)
    model.set_activation_checkpointing(mode)
    optimizer = AdamW(param_groups(model, 0.1), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")

    def step() -> None:
        ids = torch.randint(
            0, SHAPE["vocab_size"], (micro_batch, SHAPE["context_length"] + 1), generator=generator
        )
        with autocast(cpu, torch.bfloat16):
            logits = model(ids[:, :-1])
        cross_entropy(logits, ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_worker(mode: str, micro_batch: int, steps: int) -> None:
    step = make_step(mode, micro_batch)
    before = status_mib("VmRSS:")
    for _ in range(steps):
        step()
    print(json.dumps({"peak_above_start_mib": status_mib("VmHWM:") - before}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        memory_worker(args.worker, args.micro_batch, args.memory_steps)
        return

    steps = {mode: make_step(mode, args.micro_batch) for mode in MODES}
    for step in steps.values():
        step()  # warm-up
    times = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    del steps

    memory = {}
    for pinned in (False, True):
        env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)} if pinned else {})}
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", mode, "--micro-batch", str(args.micro_batch),
                 "--memory-steps", str(args.memory_steps)],
                capture_output=True, text=True, env=env, check=True,
            ).stdout  # fmt: skip
            memory[(mode, pinned)] = json.loads(out.strip().splitlines()[-1])["peak_above_start_mib"]

    base_time, base_memory = statistics.median(times["none"]), memory[("none", True)]
    print(
        f"Training step at context {SHAPE['context_length']}, d_model {SHAPE['d_model']}, "
        f"{SHAPE['num_layers']} layers, vocab {SHAPE['vocab_size']}, micro-batch {args.micro_batch}, bf16 "
        f"autocast, {torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.rounds} "
        f"interleaved steps; peak resident memory above the process's before the first step, over "
        f"{args.memory_steps} steps.\n"
    )
    print(
        "| activation checkpointing | step s | vs none | peak MiB (glibc default) "
        "| peak MiB (live: mmap pinned) | vs none |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        median = statistics.median(times[mode])
        print(
            f"| {mode} | {median:.2f} | {median / base_time:.2f}x | {memory[(mode, False)]:,.0f} | "
            f"{memory[(mode, True)]:,.0f} | {memory[(mode, True)] / base_memory:.2f}x |"
        )


if __name__ == "__main__":
    main()
