"""Data parallelism on several GPUs (NCCL): tinylm's DDP and sharded optimizer (ZeRO-1) beside
torch's DistributedDataParallel and ZeroRedundancyOptimizer, at every world size the machine has.

At each world size w in 2, 4, 8, ... up to the GPU count (and the count itself), every rank holds
the four variants of one GPT-2-small model (bench/gpu.py's shape; all from the same weights) and
steps them interleaved on the same batches (A, B, C, D, A, ...), so that whatever else the
machine does hits them alike:

    A  tinylm DDP + AdamW                  B  torch DDP + torch AdamW (fused)
    C  tinylm DDP + ShardedOptimizer       D  torch DDP + ZeroRedundancyOptimizer (fused AdamW)

A step is zero the gradients, forward to the loss under bf16 autocast, backward, the gradient sync,
the optimizer step, each side as it is meant to be used; 25 MB buckets on both sides. Reported per
world size and variant: the median step time, tokens/s over all ranks, the exposed communication
(tinylm: the time in finish_gradient_sync(), what backward could not hide), the optimizer state on
rank 0 and the largest rank's over the mean, and the bytes one rank sends per step as tinylm's
communication plan counts them (tinylm/parallel/comm_plan.py; tests/test_ddp.py holds the plan to
the bytes counted on gloo). Rows are written as they are measured.

    python bench/gpu_ddp.py                    # on a machine with 2 or more GPUs
    python bench/gpu_ddp.py --smoke            # a tiny shape at world size 2 on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinylm.model import Transformer  # noqa: E402
from tinylm.nn_utils import cross_entropy  # noqa: E402
from tinylm.optim import AdamW  # noqa: E402
from tinylm.parallel import DDP, ShardedOptimizer, launch  # noqa: E402
from tinylm.parallel.comm_plan import plan_communication  # noqa: E402
from tinylm.parallel.shard_layout import ParamSpec  # noqa: E402
from tinylm.precision import autocast  # noqa: E402

GPT2_SMALL = dict(vocab_size=50304, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048)
SMOKE = dict(vocab_size=512, context_length=64, d_model=64, num_layers=2, num_heads=2, d_ff=128)
BUCKET_MB = 25.0
VARIANTS = (
    "A tinylm DDP + AdamW",
    "B torch DDP + AdamW",
    "C tinylm DDP + ShardedOptimizer",
    "D torch DDP + ZeroRedundancyOptimizer",
)


def make_variant(name: str, shape: dict, device: torch.device):
    """(wrapped model, optimizer, the call that completes the gradient sync) of one variant."""
    torch.manual_seed(0)
    model = Transformer(**shape, device=device)
    fused = device.type == "cuda"
    if name.startswith("A"):
        optimizer = AdamW(model.parameters(), lr=3e-4)
        model = DDP(model, BUCKET_MB)
    elif name.startswith("C"):
        optimizer = ShardedOptimizer(model.parameters(), AdamW, bucket_size_mb=BUCKET_MB, lr=3e-4)
        model = DDP(model, BUCKET_MB, shards=optimizer.buckets)
    else:
        # gradient_as_bucket_view: gradients live in the buckets, never copied (as tinylm's DDP does)
        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        if name.startswith("B"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
        else:
            optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4, fused=fused
            )
    finish = model.finish_gradient_sync if isinstance(model, DDP) else (lambda: None)
    return model, optimizer, finish


def state_bytes(optimizer) -> int:
    """Bytes of this rank's optimizer state tensors."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        state = optimizer.optim.state
    elif isinstance(optimizer, ShardedOptimizer):
        state = optimizer.local_state()
    else:
        state = optimizer.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def planned_bytes(shape: dict, world_size: int, sharded: bool) -> float:
    with torch.device("meta"):
        model = Transformer(**shape)
    specs = [ParamSpec(p.numel(), tuple(p.shape), 4, "float32", 0, False) for p in model.parameters()]
    return plan_communication(specs, world_size, BUCKET_MB * 2**20, sharded).sent_bytes()


def rank_main(ctx, shape: dict, batch_per_rank: int, steps: int, warmup: int, out: str) -> None:
    device = ctx.device
    variants = {name: make_variant(name, shape, device) for name in VARIANTS}
    V, T = shape["vocab_size"], shape["context_length"]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = {name: [] for name in VARIANTS}
    exposed = {name: [] for name in VARIANTS}
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        ids = torch.randint(V, (batch_per_rank, T + 1), generator=g).to(device)
        for name, (model, optimizer, finish) in variants.items():
            sync()
            dist.barrier()
            start = time.perf_counter()
            if isinstance(model, DDP):
                model.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=True)
            with autocast(device, torch.bfloat16):
                logits = model(ids[:, :-1])
            cross_entropy(logits, ids[:, 1:]).backward()
            sync()
            before = time.perf_counter()
            finish()
            sync()
            after = time.perf_counter()
            optimizer.step()
            sync()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
                exposed[name].append(after - before)
    states = [None] * ctx.world_size
    dist.all_gather_object(states, {name: state_bytes(v[1]) for name, v in variants.items()})
    if ctx.rank == 0:
        rows = []
        for name in VARIANTS:
            per_rank = [s[name] for s in states]
            sharded = name[0] in "CD"
            rows.append(
                {
                    "world_size": ctx.world_size,
                    "variant": name,
                    "step_ms": 1e3 * statistics.median(times[name]),
                    "tokens_per_s": ctx.world_size * batch_per_rank * T / statistics.median(times[name]),
                    "exposed_ms": 1e3 * statistics.median(exposed[name]) if name[0] in "AC" else None,
                    "state_mib_rank0": per_rank[0] / 2**20,
                    "state_max_over_mean": max(per_rank) / statistics.mean(per_rank),
                    "planned_mib_sent": planned_bytes(shape, ctx.world_size, sharded) / 2**20
                    if name[0] in "AC"
                    else None,
                }
            )
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shape, world size 2, on the CPU (gloo)")
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.smoke:
        shape, world_sizes, backend, batch, steps, warmup = SMOKE, [2], "gloo", 2, 2, 1
    else:
        count = torch.cuda.device_count()
        if count < 2:
            sys.exit(f"bench/gpu_ddp.py needs 2 or more GPUs; this machine has {count}")
        world_sizes = sorted({w for w in (2, 4, 8, 16) if w <= count} | {count})
        shape, backend, batch, steps, warmup = (
            GPT2_SMALL,
            "nccl",
            args.batch_per_rank,
            args.steps,
            args.warmup,
        )
    print(
        f"Data parallelism at shape {shape}, {batch} sequences per rank, bf16 autocast, {backend}, "
        f"{BUCKET_MB:g} MB buckets, torch {torch.__version__}; median of {steps} steps after {warmup}.\n"
    )
    print(
        "| world size | variant | step ms | tokens/s | exposed communication ms | state MiB (rank 0) "
        "| state max / mean | planned MiB sent per rank |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    results = []
    for world_size in world_sizes:
        out = Path(f"/tmp/gpu_ddp_{world_size}.json")
        launch(
            rank_main,
            args=(shape, batch, steps, warmup, str(out)),
            world_size=world_size,
            backend=backend,
            timeout_s=600,
        )
        for r in json.loads(out.read_text()):
            results.append(r)
            exposed = "-" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}"
            sent = "-" if r["planned_mib_sent"] is None else f"{r['planned_mib_sent']:,.1f}"
            print(
                f"| {world_size} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} "
                f"| {exposed} | {r['state_mib_rank0']:,.1f} | {r['state_max_over_mean']:.3f} | {sent} |",
                flush=True,
            )
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
