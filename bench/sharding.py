"""Benchmark: ZeRO-1 over equal flat slices at world sizes 2, 4 and 8, beside torch's sharding.

    python bench/sharding.py [--steps 6] [--warmup 2] [--sizes 2,4,8] [--timed 2,4] [--out FILE]

gloo on the CPU, one thread per rank, a small Transformer with a GPT-2-like share of its elements
in the embedding and the untied head (vocab 8,192, d_model 256, 4 layers), 1 MB buckets so that
even this model has several.

1. Counts (every world size in --sizes): for tinylm's DDP(shards) + ShardedOptimizer, with AdamW
   and with Muon, one update's collective calls by kind and the bytes each rank sends (counted on
   the real step, ring algorithms: all-reduce 2 (w - 1) / w n, reduce-scatter and all-gather
   (w - 1) / w n), beside tinylm's plan of the same (tinylm/parallel/comm_plan.py) and plain
   DDP's all-reduce; the optimizer state each rank holds (max / mean); with Muon each rank's
   Newton-Schulz work (max / mean). Beside them the balance of the layout tinylm had before (each
   parameter whole to one rank, largest first to the least loaded), from the sizes.
2. Step time (every world size in --timed): four variants in the same processes, their steps
   interleaved on the same batches, median over the measured steps:
       A  tinylm DDP + ShardedOptimizer(AdamW)
       B  torch DDP + ZeroRedundancyOptimizer(AdamW)
       C  torch FSDP2 (`fully_shard` per block and the root, reshard_after_forward=False) + AdamW
       D  tinylm DDP + AdamW (unsharded)
   A step is zero the gradients, forward, loss, backward, gradient sync, optimizer step; A and D
   end with the same parameters (checked). With 8 ranks on 2 cores a step is mostly waiting, so
   the times are for A against B and C at the same world size, not across world sizes.
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
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tinylm.config import TrainConfig
from tinylm.model import Transformer
from tinylm.optim import AdamW
from tinylm.parallel import DDP, ShardedOptimizer, launch
from tinylm.parallel.comm_plan import plan_communication
from tinylm.parallel.shard_layout import newton_schulz_work
from tinylm.pretrain.optimizer import build_optimizer, parameter_specs

SHAPE = dict(vocab_size=8192, context_length=128, d_model=256, num_layers=4, num_heads=8, d_ff=688)
BUCKET_MB = 1.0
LR = 1e-3
BATCH_PER_RANK = 2


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(**SHAPE)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(SHAPE["vocab_size"], (BATCH_PER_RANK, SHAPE["context_length"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


class Counter:
    """Counts this rank's collective calls and the bytes it sends, by kind, while active."""

    NAMES = {
        "all_reduce": "all_reduce",
        "reduce_scatter": "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor",
        "all_gather": "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
        "broadcast": "broadcast",
    }

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.sent: dict[str, float] = {}
        self._originals = {kind: getattr(dist, name) for kind, name in self.NAMES.items()}

    def __enter__(self) -> Counter:
        w = dist.get_world_size()
        for kind, name in self.NAMES.items():
            original = self._originals[kind]

            def counted(tensor, *args, kind=kind, original=original, **kwargs):
                full = args[0] if kind == "reduce_scatter" else tensor  # (output, input)
                n = full.numel() * full.element_size()
                factor = {"all_reduce": 2 * (w - 1) / w, "broadcast": 1.0}.get(kind, (w - 1) / w)
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.sent[kind] = self.sent.get(kind, 0.0) + factor * n
                return original(tensor, *args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for kind, name in self.NAMES.items():
            setattr(dist, name, self._originals[kind])


def tinylm_step(ddp, optimizer, x, y) -> None:
    """One update as the training loop makes it: the loss averaged over ranks, the clip, the step."""
    ddp.zero_grad()
    loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
    loss.backward()
    ddp.finish_gradient_sync()
    dist.all_reduce(loss.detach())
    optimizer.clip_grad_norm_(ddp.module.parameters(), 1.0)
    optimizer.step()


# ---------------------------------------------------------------- 1. counts


def run_counts(ctx, optimizer_name: str, out_path: str) -> None:
    model = make_model()
    train = TrainConfig(optimizer=optimizer_name, world_size=ctx.world_size, bucket_size_mb=BUCKET_MB)
    optimizer = build_optimizer(model, train, ctx.world_size)
    ddp = DDP(model, BUCKET_MB, shards=optimizer.buckets)
    for step in range(2):
        tinylm_step(ddp, optimizer, *batch(step, ctx.rank))
    with Counter() as counter:
        tinylm_step(ddp, optimizer, *batch(2, ctx.rank))
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.local_state().values()
        for name, v in s.items()
        if torch.is_tensor(v) and name != "step"
    )
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"calls": counter.calls, "sent": counter.sent, "state": state})
    if ctx.is_main:
        specs = parameter_specs(model, train)
        work = newton_schulz_work([b.layout for b in optimizer.buckets], specs, ctx.world_size)
        Path(out_path).write_text(json.dumps({"ranks": gathered, "work": work}))


def whole_parameter_balance(sizes: list[int], world_size: int) -> float:
    """Max / mean elements per rank of the layout tinylm had before: each parameter whole, largest
    first to the rank with the fewest elements so far."""
    load = [0] * world_size
    for size in sorted(sizes, reverse=True):
        load[load.index(min(load))] += size
    return max(load) / (sum(load) / world_size)


# ---------------------------------------------------------------- 2. step time


VARIANTS = (
    "A tinylm DDP + ShardedOptimizer",
    "B torch DDP + ZeroRedundancyOptimizer",
    "C torch FSDP2",
    "D tinylm DDP + AdamW",
)


def make_variant(name: str):
    model = make_model()
    if name.startswith("A"):
        optimizer = ShardedOptimizer(model.parameters(), AdamW, bucket_size_mb=BUCKET_MB, lr=LR)
        return DDP(model, BUCKET_MB, shards=optimizer.buckets), optimizer
    if name.startswith("D"):
        return DDP(model, BUCKET_MB), AdamW(model.parameters(), lr=LR)
    if name.startswith("B"):
        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def timed_step(model, optimizer, x, y) -> float:
    start = time.perf_counter()
    if isinstance(model, DDP):
        model.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    if isinstance(model, DDP):
        model.finish_gradient_sync()
    optimizer.step()
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.wait_for_parameters()  # what the next forward would wait for: inside the step's time
    return time.perf_counter() - start


def run_step_times(ctx, steps: int, warmup: int, out_path: str) -> None:
    variants = {name: make_variant(name) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    for step in range(warmup + steps):
        x, y = batch(step, ctx.rank)
        for name, (model, optimizer) in variants.items():
            seconds = timed_step(model, optimizer, x, y)
            if step >= warmup:
                times[name].append(seconds)
    a, d = variants[VARIANTS[0]][0].module, variants[VARIANTS[3]][0].module
    diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), d.parameters(), strict=True))
    if ctx.is_main:
        medians = {name: statistics.median(t) for name, t in times.items()}
        Path(out_path).write_text(json.dumps({"median_s": medians, "max_diff_A_D": diff}))


# ---------------------------------------------------------------- report


def report(counts: dict, timed: dict, args, load: tuple[str, str]) -> str:
    model = make_model()
    sizes = [p.numel() for p in model.parameters()]
    lines = [
        f"Model {SHAPE}, {sum(sizes):,} parameters in {len(sizes)} tensors (embedding and head "
        f"{2 * SHAPE['vocab_size'] * SHAPE['d_model'] / sum(sizes):.0%} of them); {BUCKET_MB:g} MB "
        f"buckets; gloo, one thread per rank, torch {torch.__version__}; load average before/after: "
        f"{load[0]} / {load[1]}.",
        "",
        "| world size | optimizer | collectives per update (counted) | as planned "
        "| MiB sent per rank: counted | planned | plain DDP's all-reduce | state per rank max / mean "
        "| whole-parameter layout max / mean | Newton-Schulz work max / mean |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (world, name), result in sorted(counts.items()):
        ranks = result["ranks"]
        calls = ranks[0]["calls"]
        train = TrainConfig(optimizer=name, world_size=world, bucket_size_mb=BUCKET_MB)
        specs = parameter_specs(model, train)
        plan = plan_communication(specs, world, BUCKET_MB * 2**20, sharded=True)
        planned = {kind: plan.calls(kind) for kind in ("reduce_scatter", "all_gather", "all_reduce")}
        ddp = plan_communication(specs, world, BUCKET_MB * 2**20, sharded=False).sent_bytes()
        sent = [sum(r["sent"].values()) / 2**20 for r in ranks]
        state = [r["state"] for r in ranks]
        work = result["work"]
        balance = whole_parameter_balance(sizes, world) if name == "adamw" else float("nan")
        ns = f"{max(work) / (sum(work) / world):.3f}" if name == "muon" else ""
        lines.append(
            f"| {world} | {name} | {_calls(calls)} | {_calls(planned)} | {max(sent):,.2f} | "
            f"{plan.sent_bytes() / 2**20:,.2f} | {ddp / 2**20:,.2f} | "
            f"{max(state) / (sum(state) / world):.3f} | "
            + (f"{balance:.2f}" if name == "adamw" else "")
            + f" | {ns} |"
        )
    lines += [
        "",
        f"Step time, median of {args.steps} steps after {args.warmup} warm-up steps, the variants "
        "interleaved:",
        "",
        "| world size | " + " | ".join(VARIANTS) + " | A / B | A / C | max diff A, D |",
        "|---:|" + "---:|" * (len(VARIANTS) + 3),
    ]
    for world, result in sorted(timed.items()):
        t = result["median_s"]
        a, b, c = (t[VARIANTS[i]] for i in range(3))
        lines.append(
            f"| {world} | "
            + " | ".join(f"{t[name] * 1e3:,.0f} ms" for name in VARIANTS)
            + f" | {a / b:.2f}x | {a / c:.2f}x | {result['max_diff_A_D']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _calls(calls: dict[str, int]) -> str:
    return ", ".join(
        f"{calls[kind]} {kind}" for kind in ("reduce_scatter", "all_gather", "all_reduce") if calls.get(kind)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sizes", default="2,4,8", help="world sizes of part 1")
    parser.add_argument("--timed", default="2,4", help="world sizes of part 2")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown tables here")
    args = parser.parse_args()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    counts, timed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.sizes.split(",") if w]:
            for name in ("adamw", "muon"):
                out = Path(tmp) / f"counts-{world}-{name}.json"
                launch(
                    run_counts,
                    args=(name, str(out)),
                    world_size=world,
                    backend="gloo",
                    threads_per_rank=1,
                    timeout_s=900,
                )
                counts[(world, name)] = json.loads(out.read_text())
                print(f"counted world size {world}, {name}", file=sys.stderr, flush=True)
        for world in [int(w) for w in args.timed.split(",") if w]:
            out = Path(tmp) / f"times-{world}.json"
            launch(
                run_step_times,
                args=(args.steps, args.warmup, str(out)),
                world_size=world,
                backend="gloo",
                threads_per_rank=1,
                timeout_s=1800,
            )
            timed[world] = json.loads(out.read_text())
            print(f"timed world size {world}", file=sys.stderr, flush=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(counts, timed, args, (load_before, load_after))
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
