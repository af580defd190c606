"""Benchmark: tinylm's DDP, ShardedOptimizer and sharded checkpoints beside torch's
DistributedDataParallel and ZeroRedundancyOptimizer, in one run, on the small model.

    python bench/ddp.py [--steps 10] [--warmup 3] [--batch-per-rank 4] [--out FILE]

World size 2, one thread per rank, gloo, 25 MB buckets on both sides.

1. Step time. Every rank holds four copies of the model, one per variant, starting from the same
   weights, and runs their steps interleaved (A step, B step, C step, D step, A step, ...) on the
   same batches, so that load from other processes on the machine hits all variants alike:

       A  tinylm DDP + AdamW                  B  torch DDP + AdamW
       C  tinylm DDP + ShardedOptimizer       D  torch DDP + ZeroRedundancyOptimizer

   A step is zero the gradients, forward, backward, gradient sync, optimizer step: each side the
   way it is meant to be used (tinylm: `ddp.zero_grad()`, which zeroes the buckets in place, and in
   C `DDP(shards=optimizer.buckets)`, each gradient bucket reduce-scattered into equal slices; torch:
   `zero_grad(set_to_none=True)`, its default). Reported: the median step time over the measured
   steps (for tinylm also the time spent in finish_gradient_sync(), the communication that
   backward could not hide), tokens per second, optimizer state bytes per rank, the collectives one
   ShardedOptimizer / ZeroRedundancyOptimizer step issues (counted), and the bytes each rank sends
   in one step by collective kind (counted outside the timed steps, see `ByteCounter`). A and B
   must end with the same parameters (checked).
2. Memory during a step: each variant alone in a fresh pair of processes; the peak resident set
   (VmHWM, reset after the first step) of each rank over the next steps. glibc's mmap threshold is
   pinned to 64 KiB (MALLOC_MMAP_THRESHOLD_) in the processes of parts 2 and 3, so that a freed
   buffer leaves the resident set at once and the peaks count live memory, not what the allocator
   happened to keep (its adaptive threshold otherwise moves the peaks by about 1 % from run to run).
3. Memory while checkpointing (variant C): the rise of each rank's peak resident set over its
   resident set just before `save_step`, and during `restore_step` into a fresh model and
   optimizer in fresh processes.
4. The same global batch on world size 1 with two threads (plain model + AdamW) for comparison.
5. Overlap: the fraction of backward's wall time that passes before the first all-reduce starts
   (tinylm DDP, 1 MB buckets), eager, with each Transformer block compiled (as the trainer does),
   with the whole model compiled, and eager and block-compiled with full activation checkpointing
   (each block recomputed in backward); the median of 5 steps after 2 warm-up steps.
   `--only-overlap` runs this part alone.
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tinylm.checkpoint import Manifest
from tinylm.model import Transformer
from tinylm.parallel import DDP, ShardedOptimizer, launch
from tinylm.pretrain import state as state_lib

SMALL = dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344)
BUCKET_MB = 25.0
LR = 1e-3
VARIANTS = (
    "A tinylm DDP + AdamW",
    "B torch DDP + AdamW",
    "C tinylm DDP + ShardedOptimizer",
    "D torch DDP + ZeroRedundancyOptimizer",
)
MIB = 2**20


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(**SMALL)


def make_variant(name: str):
    """(wrapped model, optimizer, the call that completes the gradient sync) for one variant."""
    model = make_model()
    if name.startswith("A"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model = DDP(model, BUCKET_MB)
    elif name.startswith("C"):
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size_mb=BUCKET_MB, lr=LR)
        model = DDP(model, BUCKET_MB, shards=optimizer.buckets)
    else:
        model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        if name.startswith("B"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        else:
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    finish = (
        model.finish_gradient_sync if isinstance(model, DDP) else (lambda: None)
    )  # torch: inside backward
    return model, optimizer, finish


def batch(step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(SMALL["vocab_size"], (batch_size, SMALL["context_length"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def state_bytes(optimizer) -> int:
    """Bytes of tensors in an optimizer's state (for the sharded ones: this rank's local share)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        state = optimizer.optim.state
    elif isinstance(optimizer, ShardedOptimizer):
        state = optimizer.local_state()
    else:
        state = optimizer.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def timed_step(model, optimizer, finish, x, y) -> tuple[float, float]:
    """One training step; returns (step seconds, seconds spent in finish())."""
    start = time.perf_counter()
    if isinstance(model, DDP):
        model.zero_grad()  # the buckets, in place
    else:
        optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    before_finish = time.perf_counter()
    finish()
    after_finish = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start, after_finish - before_finish


class ByteCounter:
    """Counts the bytes this rank sends, by collective kind, while it is active.

    torch.distributed's Python collectives are wrapped; torch's DistributedDataParallel all-reduces
    from C++, so for the counted step it gets torch's own `allreduce_hook` as its communication hook
    (`hook_for`), which does what the built-in path does through the Python `dist.all_reduce`, and is
    counted there. Bytes sent per call, for n bytes in a world of w (ring algorithms):
    all_reduce 2 (w - 1) / w * n; reduce_scatter and all_gather (n: the full tensor) (w - 1) / w * n;
    reduce: n unless this rank is the destination; broadcast: n if this rank is the source. At
    w = 2 these are exact for any algorithm.
    """

    KINDS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather")
    NAMES = {  # the torch.distributed function behind each kind (the flat ones by their 2.13 names)
        "all_reduce": "all_reduce",
        "reduce": "reduce",
        "broadcast": "broadcast",
        "reduce_scatter": "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor",
        "all_gather": "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
    }

    def __init__(self):
        self.sent = {kind: 0.0 for kind in self.KINDS}
        self.active = False
        self._originals = {kind: getattr(dist, self.NAMES[kind]) for kind in self.KINDS}
        for kind in self.KINDS:
            setattr(dist, self.NAMES[kind], self._wrap(kind))

    def close(self) -> None:
        for kind, original in self._originals.items():
            setattr(dist, self.NAMES[kind], original)

    def add(self, kind: str, tensor: torch.Tensor, peer: int | None = None) -> None:
        if not self.active:
            return
        n, rank, w = tensor.numel() * tensor.element_size(), dist.get_rank(), dist.get_world_size()
        if kind == "all_reduce":
            self.sent[kind] += 2 * (w - 1) / w * n
        elif kind in ("reduce_scatter", "all_gather"):  # n: the full (input, output) tensor
            self.sent[kind] += (w - 1) / w * n
        elif kind == "reduce":
            self.sent[kind] += 0 if peer == rank else n
        else:
            self.sent[kind] += n if peer == rank else 0

    def _wrap(self, kind: str):
        original = self._originals[kind]

        def counted(tensor, *args, **kwargs):
            peer = kwargs.get("dst", kwargs.get("src", args[0] if args else None))
            full = args[0] if kind == "reduce_scatter" else tensor  # (output, input)
            self.add(kind, full, peer)
            return original(tensor, *args, **kwargs)

        return counted

    @staticmethod
    def hook_for():
        """torch's default all-reduce as a DDP communication hook, so that it runs through dist.all_reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook


def count_collectives(fn) -> int:
    """How many torch.distributed collectives (of the usual kinds) `fn()` issues."""
    names = (
        "broadcast",
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "send",
        "recv",
        "isend",
        "irecv",
    )
    originals = {name: getattr(dist, name) for name in names}
    calls = []

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return len(calls)


# ---------------------------------------------------------------- 1. step time, interleaved


def run_step_times(ctx, args, out_path: str) -> None:
    variants = {name: make_variant(name) for name in VARIANTS}
    times = {name: [] for name in variants}
    finish_times = {name: [] for name in variants}
    collectives = {}
    for step in range(args.warmup + args.steps):
        x, y = batch(step, ctx.rank, args.batch_per_rank)
        for name, (model, optimizer, finish) in variants.items():
            seconds, finish_seconds = timed_step(model, optimizer, finish, x, y)
            if step >= args.warmup:
                times[name].append(seconds)
                finish_times[name].append(finish_seconds)
    for name in VARIANTS[2:]:  # one more optimizer step each, counted
        model, optimizer, finish = variants[name]
        x, y = batch(0, ctx.rank, args.batch_per_rank)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        finish()
        collectives[name] = count_collectives(optimizer.step)
        optimizer.zero_grad(set_to_none=True)
    counter = ByteCounter()  # one more step of each variant, its bytes counted
    sent = {}
    for name, (model, optimizer, finish) in variants.items():
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, counter.hook_for())
        x, y = batch(0, ctx.rank, args.batch_per_rank)
        counter.sent = {kind: 0.0 for kind in counter.KINDS}
        counter.active = True
        timed_step(model, optimizer, finish, x, y)
        counter.active = False
        sent[name] = dict(counter.sent)
    counter.close()

    ours, theirs = variants[VARIANTS[0]][0], variants[VARIANTS[1]][0]
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
                "collectives_per_optimizer_step": collectives.get(name),
                "bytes_sent": sent[name],
            }
            for name, (_, optimizer, _) in variants.items()
        }
        result["max_param_diff_A_B"] = max_diff
        result["num_parameters"] = sum(p.numel() for p in ours.module.parameters())
        result["num_parameter_tensors"] = len(list(ours.module.parameters()))
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


# ---------------------------------------------------------------- 2. and 3. memory


def _status_mib(key: str) -> float:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: peak since the last reset), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _write_rank_result(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_step_memory(ctx, args, name: str, out_dir: str) -> None:
    model, optimizer, finish = make_variant(name)
    x, y = batch(0, ctx.rank, args.batch_per_rank)
    timed_step(model, optimizer, finish, x, y)  # gradients, buckets and optimizer state now exist
    _reset_peak()
    for step in range(1, 3):
        x, y = batch(step, ctx.rank, args.batch_per_rank)
        timed_step(model, optimizer, finish, x, y)
    _write_rank_result(out_dir, ctx.rank, {"peak_mib": _status_mib("VmHWM")})


def _trained_c(args, ctx):
    model, optimizer, finish = make_variant(VARIANTS[2])
    for step in range(2):
        x, y = batch(step, ctx.rank, args.batch_per_rank)
        timed_step(model, optimizer, finish, x, y)
    return model, optimizer


def run_checkpoint_save(ctx, args, how: str, folder: str, out_dir: str) -> None:
    model, optimizer = _trained_c(args, ctx)
    before = _status_mib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    state_lib.save_step(ctx, folder, 2, model.module, optimizer, manifest=Manifest(seed=0))
    seconds = time.perf_counter() - start
    writers = optimizer.parameter_writers()
    params = [p for p in model.module.parameters() if writers.get(p) == ctx.rank]
    _write_rank_result(
        out_dir,
        ctx.rank,
        {
            "before_mib": before,
            "peak_mib": _status_mib("VmHWM"),
            "seconds": seconds,
            "model_mib": sum(p.numel() * p.element_size() for p in model.module.parameters()) / MIB,
            "own_share_mib": state_bytes(optimizer) / MIB,
            "owned_params_mib": sum(p.numel() * p.element_size() for p in params) / MIB,
        },
    )


def run_checkpoint_load(ctx, args, how: str, folder: str, out_dir: str) -> None:
    model, optimizer, _ = make_variant(VARIANTS[2])
    before = _status_mib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    state_lib.restore_step(ctx, folder, model.module, optimizer)
    seconds = time.perf_counter() - start
    _write_rank_result(
        out_dir,
        ctx.rank,
        {
            "before_mib": before,
            "peak_mib": _status_mib("VmHWM"),
            "seconds": seconds,
            "own_share_mib": state_bytes(optimizer) / MIB,
        },
    )


# ---------------------------------------------------------------- 5. overlap of communication and backward


OVERLAP_VARIANTS = (
    "eager",
    "compiled blocks",
    "compiled whole model",
    "eager, full activation checkpointing",
    "compiled blocks, full activation checkpointing",
)


def run_overlap(ctx, args, how: str, out_path: str) -> None:
    """Fraction of backward's wall time before the first all-reduce starts (median of 5 steps)."""
    model = make_model()
    if "full activation checkpointing" in how:
        model.set_activation_checkpointing("full")
    if how.startswith("compiled blocks"):
        for block in model.layers:
            block.compile()
    elif how == "compiled whole model":
        model = torch.compile(model)
    ddp = DDP(model, bucket_size_mb=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    original = dist.all_reduce
    fractions = []
    for step in range(7):
        x, y = batch(step, ctx.rank, args.batch_per_rank)
        ddp.zero_grad()
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        first = []

        def timed(tensor, *a, first=first, **k):
            first.append(first[0] if first else time.perf_counter())
            return original(tensor, *a, **k)

        dist.all_reduce = timed
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        dist.all_reduce = original
        ddp.finish_gradient_sync()
        optimizer.step()
        if step >= 2:
            fractions.append((first[0] - began) / (ended - began) if first else 1.0)
    if ctx.is_main:
        Path(out_path).write_text(json.dumps({"fraction": statistics.median(fractions)}))


# ---------------------------------------------------------------- the report


def _read_ranks(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def report(
    two: dict, one: dict, memory: dict, checkpoint: dict, overlap: dict, args, load_before, load_after
) -> str:
    tokens = 2 * args.batch_per_rank * SMALL["context_length"]
    a, b = two[VARIANTS[0]]["step_s"], two[VARIANTS[1]]["step_s"]
    c, d = two[VARIANTS[2]]["step_s"], two[VARIANTS[3]]["step_s"]
    lines = [
        f"Small model {SMALL}, {two['num_parameters']:,} parameters in "
        f"{two['num_parameter_tensors']} tensors; "
        f"global batch {2 * args.batch_per_rank} x {SMALL['context_length']} = {tokens} tokens per step; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps; bucket {BUCKET_MB} MB; "
        f"gloo on CPU; "
        f"torch {torch.__version__}; load average before/after: {load_before} / {load_after}.",
        "",
        "| setup | step (s) | tokens/s | finish_gradient_sync (s) | optimizer state per rank (MiB) | "
        "peak RSS per rank in a step (MiB, rank 0 / rank 1) |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        r = two[name]
        finish = f"{r['finish_s']:.3f}" if name.startswith(("A", "C")) else "(inside backward)"
        peaks = " / ".join(f"{m['peak_mib']:,.0f}" for m in memory[name])
        lines.append(
            f"| world 2 x 1 thread: {name} | {r['step_s']:.3f} | {tokens / r['step_s']:,.0f} | {finish} | "
            f"{r['optimizer_state_bytes'] / MIB:.1f} | {peaks} |"
        )
    lines.append(
        f"| world 1 x {one['threads']} threads: model + AdamW | {one['step_s']:.3f} | "
        f"{tokens / one['step_s']:,.0f} | - | {one['optimizer_state_bytes'] / MIB:.1f} | - |"
    )
    peak = {name: max(m["peak_mib"] for m in memory[name]) for name in VARIANTS}
    lines += [
        "",
        f"- tinylm DDP / torch DDP step time: **{a / b:.3f}x** (target <= 1.0x)",
        f"- tinylm DDP + ShardedOptimizer / torch DDP + ZeroRedundancyOptimizer step time: **{c / d:.3f}x** "
        "(target <= 1.0x)",
        f"- tinylm DDP + ShardedOptimizer / tinylm DDP + AdamW step time: **{c / a:.3f}x** (target <= 1.05x)",
        f"- peak RSS per rank in a step, tinylm DDP / torch DDP: "
        f"**{peak[VARIANTS[0]] / peak[VARIANTS[1]]:.3f}x**; "
        f"with the sharded optimizers: **{peak[VARIANTS[2]] / peak[VARIANTS[3]]:.3f}x** (target <= 1.0x)",
        f"- collectives per optimizer step: ShardedOptimizer "
        f"**{two[VARIANTS[2]]['collectives_per_optimizer_step']}**, ZeroRedundancyOptimizer "
        f"{two[VARIANTS[3]]['collectives_per_optimizer_step']} (one broadcast per parameter tensor: "
        f"{two['num_parameter_tensors']})",
        f"- ShardedOptimizer state per rank "
        f"{two[VARIANTS[2]]['optimizer_state_bytes'] / MIB:.1f} MiB instead of "
        f"{two[VARIANTS[0]]['optimizer_state_bytes'] / MIB:.1f} MiB",
        f"- unhidden all-reduce (finish_gradient_sync) in tinylm DDP: "
        f"{two[VARIANTS[0]]['finish_s'] / a:.1%} of a step",
        f"- world 2 x 1 thread (tinylm DDP) / world 1 x 2 threads step time: {a / one['step_s']:.3f}x",
        f"- largest parameter difference between A and B after all steps: {two['max_param_diff_A_B']:.2e}",
        "",
        "Bytes each rank sends in one step, by collective kind (MiB; ring model, exact at world 2):",
        "",
        "| setup | " + " | ".join(ByteCounter.KINDS) + " | total | / torch DDP |",
        "|---|" + "---|" * (len(ByteCounter.KINDS) + 2),
    ]
    ddp_total = sum(two[VARIANTS[1]]["bytes_sent"].values())
    for name in VARIANTS:
        sent = two[name]["bytes_sent"]
        total = sum(sent.values())
        lines.append(
            f"| {name} | "
            + " | ".join(f"{sent[k] / MIB:.2f}" for k in ByteCounter.KINDS)
            + f" | {total / MIB:.2f} | {total / ddp_total:.3f}x |"
        )
    lines += [
        "",
        "Overlap: share of backward's wall time that passed before the first all-reduce started "
        "(tinylm DDP, 1 MB buckets, median of 5 steps): "
        + ", ".join(f"{how} **{fraction:.0%}**" for how, fraction in overlap.items()),
        "",
        "Checkpoint of variant C (model + ShardedOptimizer) after 2 steps. Rise = peak RSS during the "
        "call minus RSS just before it (MiB).",
        "",
        "| checkpoint | rank | RSS before | peak during | rise | seconds | model | own optimizer share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (how, op), ranks in checkpoint.items():
        for rank, r in enumerate(ranks):
            model = (
                f"{r['model_mib']:.1f}"
                if "model_mib" in r
                else f"{checkpoint[(how, 'save')][rank]['model_mib']:.1f}"
            )
            lines.append(
                f"| {how} {op} | {rank} | {r['before_mib']:,.0f} | {r['peak_mib']:,.0f} | "
                f"{r['peak_mib'] - r['before_mib']:,.1f} | {r['seconds']:.2f} | {model} | "
                f"{r['own_share_mib']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--only-overlap", action="store_true", help="part 5 alone: print each fraction")
    args = parser.parse_args()
    if args.only_overlap:
        with tempfile.TemporaryDirectory() as tmp:
            for i, how in enumerate(OVERLAP_VARIANTS):
                out = Path(tmp) / f"overlap{i}.json"
                launch(run_overlap, args=(args, how, str(out)), world_size=2, backend="gloo", timeout_s=600)
                fraction = json.loads(out.read_text())["fraction"]
                print(f"| {how} | {fraction:.0%} |", flush=True)
        return

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    common = dict(world_size=2, backend="gloo", threads_per_rank=1, timeout_s=600)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        launch(run_step_times, args=(args, str(tmp / "two.json")), **common)
        launch(
            run_world_of_one,
            args=(args, str(tmp / "one.json")),
            world_size=1,
            backend="gloo",
            threads_per_rank=2,
        )
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc in each rank started now
        memory = {}
        for i, name in enumerate(VARIANTS):
            (tmp / f"mem{i}").mkdir()
            launch(run_step_memory, args=(args, name, str(tmp / f"mem{i}")), **common)
            memory[name] = _read_ranks(tmp / f"mem{i}")
        checkpoint = {}
        for how in ("tinylm",):
            folder = tmp / f"ckpt-{how}"
            for op, fn in (("save", run_checkpoint_save), ("load", run_checkpoint_load)):
                out = tmp / f"{how}-{op}"
                out.mkdir()
                launch(fn, args=(args, how, str(folder), str(out)), **common)
                checkpoint[(how, op)] = _read_ranks(out)
        two, one = json.loads((tmp / "two.json").read_text()), json.loads((tmp / "one.json").read_text())
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        overlap = {}
        for i, how in enumerate(OVERLAP_VARIANTS):
            launch(run_overlap, args=(args, how, str(tmp / f"overlap{i}.json")), **common)
            overlap[how] = json.loads((tmp / f"overlap{i}.json").read_text())["fraction"]
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(two, one, memory, checkpoint, overlap, args, load_before, load_after)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
