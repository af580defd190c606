"""What the loss's row chunks cost on the CPU: one rank's training step of the default model.

The cross-entropy (tinylm.nn_utils.cross_entropy) and the evaluation's token losses work on the
logits a chunk of rows at a time in float32 (nn_utils.row_chunks; CPU_LOSS_CHUNK_BYTES on the CPU,
LOSS_CHUNK_BYTES elsewhere). This script runs the default run's per-rank step (micro-batch 16 x 128,
vocab 4096, bf16 autocast, AdamW, one thread) with chunks of several sizes, from whole rows (one
chunk of 32 MiB here) down, interleaved round by round in one process so that every size sees the
same machine, and prints each one's median step time and its ratio to whole rows. The loss and
its gradient are the same bits at every size (tests/test_nn_utils.py), so only the time differs.

    python bench/loss_chunks.py                  # markdown on stdout, about 2 minutes
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from model_options import DEFAULT, make_step  # bench/model_options.py: the default run's rank step

import tinylm.nn_utils as nn_utils

CHUNK_MIB = [256, 16, 4, 1, 0.25]  # 256: whole rows at this shape


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="steps per chunk size per round")
    parser.add_argument("--batch-size", type=int, default=16, help="one rank's micro-batch (default 16)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    step, _ = make_step({}, args.batch_size)  # reads nn_utils.CPU_LOSS_CHUNK_BYTES at every step
    for _ in range(3):  # warm-up
        step()
    times: dict[float, list[float]] = {mib: [] for mib in CHUNK_MIB}
    for _ in range(args.rounds):
        for mib in CHUNK_MIB:
            nn_utils.CPU_LOSS_CHUNK_BYTES = int(mib * 2**20)
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[mib].append(time.perf_counter() - start)
    rows = args.batch_size * DEFAULT["context_length"]
    base = statistics.median(times[CHUNK_MIB[0]])
    print(
        f"One rank's training step of the default model (micro-batch {args.batch_size} x "
        f"{DEFAULT['context_length']}: logits {rows:,} x {DEFAULT['vocab_size']:,}, bf16 autocast, "
        "1 thread), "
        f"by the loss's chunk size; median of {args.rounds} x {args.steps} steps, sizes interleaved; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}.\n"
    )
    print("| chunk (float32) | rows per chunk | step ms | vs whole rows |")
    print("|---|---:|---:|---:|")
    for mib in CHUNK_MIB:
        per_chunk = min(rows, max(1, int(mib * 2**20) // (4 * DEFAULT["vocab_size"])))
        median = statistics.median(times[mib])
        print(f"| {mib:g} MiB | {per_chunk:,} | {1000 * median:.1f} | {median / base:.3f}x |")


if __name__ == "__main__":
    main()
