"""Benchmark: tinylm's DDP and ShardedOptimizer beside torch's DistributedDataParallel and
ZeroRedundancyOptimizer, in one run, on the small model.

    python bench/ddp.py [--steps 10] [--warmup 3] [--batch-per-rank 4] [--out FILE]

World size 2, one thread per rank, gloo, 25 MB buckets on both sides. Every rank holds four
copies of the model, one per variant, starting from the same weights, and runs their steps
interleaved (variant A step, B step, C step, D step, A step, ...) on the same batches, so that load
from other processes on the machine hits all variants alike:

    A  tinylm DDP + AdamW                  B  torch DDP + AdamW
    C  tinylm DDP + ShardedOptimizer       D  torch DDP + ZeroRedundancyOptimizer

A step is forward, backward, gradient sync, optimizer step, zero_grad. Reported: the median step
time over the measured steps (and of its parts for tinylm: the time spent in
finish_gradient_sync() is the all-reduce that backward could not hide), tokens per second,
optimizer state bytes per rank. Then the same global batch on world size 1 with two threads
(plain model + AdamW) for comparison. A and B must end with the same parameters (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tinylm.model import Transformer
from tinylm.parallel import DDP, ShardedOptimizer, launch

SMALL = dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344)
BUCKET_MB = 25.0
LR = 1e-3


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(**SMALL)


def batch(step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(SMALL["vocab_size"], (batch_size, SMALL["context_length"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def state_bytes(optimizer) -> int:
    """Bytes of tensors in an optimizer's state (for ZeroRedundancyOptimizer: this rank's local share)."""
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def timed_step(model, optimizer, finish, x, y) -> tuple[float, float]:
    """One training step; returns (step seconds, seconds spent in finish())."""
    start = time.perf_counter()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    before_finish = time.perf_counter()
    finish()
    after_finish = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, after_finish - before_finish


def run_world_of_two(ctx, args, out_path: str) -> None:
    ours, theirs = (
        DDP(make_model(), BUCKET_MB),
        DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_MB),
    )
    ours_sh, theirs_zero = (
        DDP(make_model(), BUCKET_MB),
        DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_MB),
    )
    variants = {
        "A tinylm DDP + AdamW": (
            ours,
            torch.optim.AdamW(ours.parameters(), lr=LR),
            ours.finish_gradient_sync,
        ),
        "B torch DDP + AdamW": (theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), lambda: None),
        "C tinylm DDP + ShardedOptimizer": (
            ours_sh,
            ShardedOptimizer(ours_sh.parameters(), torch.optim.AdamW, lr=LR),
            ours_sh.finish_gradient_sync,
        ),
        "D torch DDP + ZeroRedundancyOptimizer": (
            theirs_zero,
            ZeroRedundancyOptimizer(theirs_zero.parameters(), optimizer_class=torch.optim.AdamW, lr=LR),
            lambda: None,
        ),
    }
    times = {name: [] for name in variants}
    finish_times = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        x, y = batch(step, ctx.rank, args.batch_per_rank)
        for name, (model, optimizer, finish) in variants.items():
            seconds, finish_seconds = timed_step(model, optimizer, finish, x, y)
            if step >= args.warmup:
                times[name].append(seconds)
                finish_times[name].append(finish_seconds)

    max_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    )
    if ctx.is_main:
        result = {
            name: {
                "step_s": statistics.median(times[name]),
                "finish_s": statistics.median(finish_times[name]),
                "optimizer_state_bytes": state_bytes(optimizer),
            }
            for name, (_, optimizer, _) in variants.items()
        }
        result["max_param_diff_A_B"] = max_diff
        result["num_parameters"] = sum(p.numel() for p in ours.module.parameters())
        Path(out_path).write_text(json.dumps(result))


def run_world_of_one(ctx, args, out_path: str) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    times = []
    for step in range(args.warmup + args.steps):
        x0, y0 = batch(step, 0, args.batch_per_rank)
        x1, y1 = batch(step, 1, args.batch_per_rank)
        seconds, _ = timed_step(model, optimizer, lambda: None, torch.cat([x0, x1]), torch.cat([y0, y1]))
        if step >= args.warmup:
            times.append(seconds)
    result = {"step_s": statistics.median(times), "threads": torch.get_num_threads()}
    result["optimizer_state_bytes"] = state_bytes(optimizer)
    Path(out_path).write_text(json.dumps(result))


def report(two: dict, one: dict, args, load_before, load_after) -> str:
    tokens = 2 * args.batch_per_rank * SMALL["context_length"]
    mib = 2**20
    a, b = two["A tinylm DDP + AdamW"]["step_s"], two["B torch DDP + AdamW"]["step_s"]
    lines = [
        f"Small model {SMALL}, {two['num_parameters']:,} parameters; global batch "
        f"{2 * args.batch_per_rank} x {SMALL['context_length']} = {tokens} tokens per step; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps; bucket {BUCKET_MB} MB; gloo on CPU; "
        f"torch {torch.__version__}; load average before/after: {load_before} / {load_after}.",
        "",
        "| setup | step (s) | tokens/s | finish_gradient_sync (s) | optimizer state per rank (MiB) |",
        "|---|---|---|---|---|",
    ]
    for name, r in two.items():
        if not isinstance(r, dict):
            continue
        finish = f"{r['finish_s']:.3f}" if name.startswith(("A", "C")) else "(inside backward)"
        lines.append(
            f"| world 2 x 1 thread: {name} | {r['step_s']:.3f} | {tokens / r['step_s']:,.0f} | {finish} | "
            f"{r['optimizer_state_bytes'] / mib:.1f} |"
        )
    lines.append(
        f"| world 1 x {one['threads']} threads: model + AdamW | {one['step_s']:.3f} | "
        f"{tokens / one['step_s']:,.0f} | - | {one['optimizer_state_bytes'] / mib:.1f} |"
    )
    c = two["C tinylm DDP + ShardedOptimizer"]
    d = two["D torch DDP + ZeroRedundancyOptimizer"]
    lines += [
        "",
        f"- tinylm DDP / torch DDP step time: **{a / b:.3f}x** (target <= 1.05x)",
        f"- tinylm DDP + ShardedOptimizer / torch DDP + ZeroRedundancyOptimizer: {c['step_s'] / d['step_s']:.3f}x",
        f"- ShardedOptimizer / AdamW step time (both with tinylm DDP): {c['step_s'] / a:.3f}x; state per rank "
        f"{c['optimizer_state_bytes'] / mib:.1f} MiB instead of "
        f"{two['A tinylm DDP + AdamW']['optimizer_state_bytes'] / mib:.1f} MiB",
        f"- unhidden all-reduce (finish_gradient_sync) in tinylm DDP: {two['A tinylm DDP + AdamW']['finish_s'] / a:.1%} "
        "of a step",
        f"- world 2 x 1 thread (tinylm DDP) / world 1 x 2 threads step time: {a / one['step_s']:.3f}x",
        f"- largest parameter difference between A and B after all steps: {two['max_param_diff_A_B']:.2e}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args()

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        two_path, one_path = os.path.join(tmp, "two.json"), os.path.join(tmp, "one.json")
        launch(run_world_of_two, args=(args, two_path), world_size=2, backend="gloo", threads_per_rank=1)
        launch(run_world_of_one, args=(args, one_path), world_size=1, backend="gloo", threads_per_rank=2)
        two, one = json.loads(Path(two_path).read_text()), json.loads(Path(one_path).read_text())
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(two, one, args, load_before, load_after)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
