"""The GPU training step: tinylm beside a strong torch-native baseline, where its time goes, and
what each fast path is worth.

One training step at GPT-2-small shape (vocab 50,304, context 1,024, d_model 768, 12 layers, batch
16), bf16 autocast, is forward to the loss, backward, gradient clip at 1.0 and AdamW. Each variant
runs in its own process (its peak memory is its own) and reports:

- tokens/s (median step), MFU (tinylm/throughput.py's FLOP count, the log's, over the table's bf16
  peak), peak memory (torch.cuda.max_memory_allocated) beside the memory plan's tensors;
- per-region times from CUDA events around each part of the step: forward (embeddings and blocks),
  loss (the head, the soft-cap and the cross-entropy), backward, clip, optimizer (median over the
  timed steps; a model compiled whole has forward and loss as one region);
- the device's kernels of one step and torch.profiler's top 40 kernels by device time, written to
  `<out dir>/profile_<variant>.txt`;
- for compiled variants, torch._dynamo's graph breaks and the recompilations after the warm-up
  steps, both of which must be 0.

The baseline ("native") is what a careful PyTorch user writes for speed: tinylm's architecture from
PyTorch's parts (fused q/k/v projection, F.scaled_dot_product_attention, nn.RMSNorm, SwiGLU, RoPE,
untied head), F.cross_entropy on float32 logits inside the forward, torch.optim.AdamW(fused=True),
clip_grad_norm_(foreach=True); compiled, the whole model with its loss is one torch.compile.
tinylm is the trainer's step: `model(x, targets=y)`, ours everywhere, compiled as
`train.compile` compiles (tinylm.pretrain.loop.compile_model: on one GPU the whole model with its
loss; under DDP each block, and the loss region).

The ablation rows change one thing each against "tinylm" (eager) or "tinylm+compile": the fused
cross-entropy, the fused AdamW, the multi-tensor clip, F.rms_norm (against our written-out formula),
the attention backend (flash, cuDNN, memory-efficient, math), deterministic kernels (train.deterministic),
activation checkpointing, and the compile per block (as under DDP) against the whole model.

    python bench/gpu.py                          # every variant (about 8 minutes, cold caches)
    python bench/gpu.py --variants native tinylm --out-dir bench/out
    python bench/gpu.py --smoke                  # a tiny shape for a few steps: runs on the CPU too
    python bench/gpu.py --summary bench/out/eager bench/out/compiled   # one table of both runs

A variant that dies (an exception, an out-of-memory kill, a segfault) or passes --variant-timeout
is one row saying why, and the next variant runs.

On the CPU (--smoke), "kernels" are the aten operators that ran (leaves of the profiler's tree),
the fused paths are forced on as on CUDA (their kernels are torch's CPU ones), and the attention
backend rows are skipped: they are CUDA's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPT2_SMALL = dict(vocab_size=50304, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048)
SMOKE = dict(vocab_size=512, context_length=64, d_model=64, num_layers=2, num_heads=2, d_ff=128)
REGIONS = ("forward", "loss", "backward", "clip", "optimizer")


@dataclasses.dataclass(frozen=True)
class Variant:
    impl: str  # "native" or "tinylm"
    compiled: bool = False
    fused_loss: bool = True  # tinylm: cross_entropy(fused=)
    whole: bool = True  # tinylm+compile: one graph of the model and loss (one GPU), or per block
    fused_adamw: bool = True
    fused_clip: bool = True
    rms_norm: str = "torch"  # "torch" (F.rms_norm) or "formula" (written out)
    attention: str | None = None  # an SDPA backend to force, or None for torch's choice
    deterministic: bool = False
    checkpointing: str = "none"

    def compared_to(self) -> str:
        return "native+compile" if self.compiled else "native"


VARIANTS = {
    "native": Variant("native"),
    "native+compile": Variant("native", compiled=True),
    "tinylm": Variant("tinylm"),
    "tinylm+compile": Variant("tinylm", compiled=True),
    # Every fast path off: the CPU's own step, and tinylm's GPU step before the fused paths.
    "tinylm, no fast paths": Variant(
        "tinylm", fused_loss=False, fused_adamw=False, fused_clip=False, rms_norm="formula"
    ),
    # One change each against tinylm (eager).
    "tinylm, unfused loss": Variant("tinylm", fused_loss=False),
    "tinylm, unfused AdamW": Variant("tinylm", fused_adamw=False),
    "tinylm, per-tensor clip": Variant("tinylm", fused_clip=False),
    "tinylm, RMSNorm formula": Variant("tinylm", rms_norm="formula"),
    "tinylm, deterministic": Variant("tinylm", deterministic=True),
    "tinylm, full checkpointing": Variant("tinylm", checkpointing="full"),
    "tinylm, selective checkpointing": Variant("tinylm", checkpointing="selective"),
    # One change each against tinylm+compile.
    "tinylm+compile, per block": Variant("tinylm", compiled=True, whole=False),
    "tinylm+compile, flash attention": Variant("tinylm", compiled=True, attention="FLASH_ATTENTION"),
    "tinylm+compile, cuDNN attention": Variant("tinylm", compiled=True, attention="CUDNN_ATTENTION"),
    "tinylm+compile, efficient attention": Variant("tinylm", compiled=True, attention="EFFICIENT_ATTENTION"),
    "tinylm+compile, math attention": Variant("tinylm", compiled=True, attention="MATH"),
    "tinylm+compile, deterministic": Variant("tinylm", compiled=True, deterministic=True),
    "tinylm+compile, full checkpointing": Variant("tinylm", compiled=True, checkpointing="full"),
}
EAGER = [name for name, v in VARIANTS.items() if not v.compiled]
COMPILED = [name for name, v in VARIANTS.items() if v.compiled]


# ---------------------------------------------------------------- the baseline


class FusedNativeBlock(torch.nn.Module):
    """A pre-norm block with one q/k/v projection, SDPA, and a SwiGLU feed-forward, in PyTorch's parts."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, rope):
        super().__init__()
        self.num_heads, self.rope = num_heads, rope
        self.ln1 = torch.nn.RMSNorm(d_model, eps=1e-5)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)
        self.ln2 = torch.nn.RMSNorm(d_model, eps=1e-5)
        self.w1 = torch.nn.Linear(d_model, d_ff, bias=False)
        self.w3 = torch.nn.Linear(d_model, d_ff, bias=False)
        self.w2 = torch.nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class FusedNativeTransformer(torch.nn.Module):
    """tinylm's architecture from PyTorch's parts; forward(ids, targets) is the mean cross-entropy."""

    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta=10000.0):
        super().__init__()
        from train_step import NativeRoPE

        self.embed = torch.nn.Embedding(vocab_size, d_model)
        rope = NativeRoPE(rope_theta, d_model // num_heads, context_length)
        self.layers = torch.nn.ModuleList(
            FusedNativeBlock(d_model, num_heads, d_ff, rope) for _ in range(num_layers)
        )
        self.ln_final = torch.nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = torch.nn.Linear(d_model, vocab_size, bias=False)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_final(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.output_loss(self.hidden_states(ids), targets)


# ---------------------------------------------------------------- one variant


def rms_norm_formula(self, x: torch.Tensor) -> torch.Tensor:
    """tinylm's RMSNorm written out (the ablation of F.rms_norm): about seven kernels forward."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    inv_rms = torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return (wide * inv_rms * self.weight).to(x.dtype)


def build(variant: Variant, shape: dict, device: torch.device):
    """(model, optimizer, clip) on `device`, float32 parameters, the variant's switches applied."""
    if variant.impl == "native":
        model = FusedNativeTransformer(**shape).to(device)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=3e-4,
            betas=(0.9, 0.95),
            fused=True,
        )
        if variant.compiled:
            model = torch.compile(model)  # the whole model with its loss
        return model, optimizer, lambda params: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    import tinylm.model.transformer as transformer
    import tinylm.nn_utils as nn_utils
    from tinylm.model import Transformer
    from tinylm.model.layers import RMSNorm
    from tinylm.optim import AdamW, param_groups
    from tinylm.pretrain.loop import compile_model

    # The switches, set as the defaults the trainer's code sees (on CUDA every fused path is the
    # default; on the CPU they are forced on, so that the rows mean the same on both).
    transformer.cross_entropy = functools.partial(nn_utils.cross_entropy, fused=variant.fused_loss)
    nn_utils.squared_norms = functools.partial(nn_utils.squared_norms, fused=variant.fused_clip)
    if variant.rms_norm == "formula":
        RMSNorm.forward = rms_norm_formula
    model = Transformer(**shape, device=device)
    model.set_activation_checkpointing(variant.checkpointing)
    optimizer = AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95), fused=variant.fused_adamw)
    if variant.compiled:  # as train.compile compiles on one GPU (whole), or under DDP (per block)
        compile_model(model, 1 if variant.whole else 2, device)
    return model, optimizer, lambda params: nn_utils.gradient_clip(params, 1.0)


class RegionTimer:
    """Device time of each named region of a step: CUDA events on CUDA, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.marks.append((name, event))

    def elapsed_ms(self) -> dict[str, float]:
        """{region: ms} between consecutive marks (after a sync), and the marks cleared."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, start), (name, end) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = start.elapsed_time(end) if self.cuda else 1e3 * (end - start)
        self.marks.clear()
        return out


def kernels_of(prof, device: torch.device, steps: int) -> tuple[float, str]:
    """(kernels per step, the top-40 table) of a profile of `steps` steps."""
    if device.type == "cuda":
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        count = len(events) or sum(len(e.kernels) for e in prof.events())
        sort_by = "self_device_time_total"
    else:  # the aten operators that did the work: those that called no other aten operator
        events = [
            e
            for e in prof.events()
            if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
        ]
        count = len(events)
        sort_by = "self_cpu_time_total"
    return count / steps, prof.key_averages().table(sort_by=sort_by, row_limit=40)


def worker(name: str, shape: dict, batch_size: int, steps: int, warmup: int, out_dir: Path | None) -> dict:
    import torch._dynamo
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tinylm.flops import flops_per_token
    from tinylm.precision import autocast, choose_attention_backend, configure_kernels
    from tinylm.throughput import mfu, peak_flops, peak_memory_mib

    variant = VARIANTS[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_kernels(device, variant.deterministic)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model, optimizer, clip = build(variant, shape, device)
    generator = torch.Generator().manual_seed(1)
    V, T = shape["vocab_size"], shape["context_length"]
    timer = RegionTimer(device)

    def step(timed: bool) -> None:
        ids = torch.randint(0, V, (batch_size, T + 1), generator=generator).to(device, non_blocking=True)
        x, y = ids[:, :-1], ids[:, 1:]
        mark = timer.mark if timed else (lambda _: None)
        mark("start")
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            if variant.compiled and (variant.impl == "native" or variant.whole):
                loss = model(x, y) if variant.impl == "native" else model(x, targets=y)
                mark("forward+loss")
            else:
                hidden = model.hidden_states(x)
                mark("forward")
                loss = model.output_loss(hidden, y)
                mark("loss")
        loss.backward()
        mark("backward")
        clip(model.parameters())
        mark("clip")
        optimizer.step()
        mark("optimizer")

    chosen_attention = None
    if variant.impl == "tinylm" and variant.attention is None:  # the backend training would measure
        heads = shape["num_heads"]
        attention_shape = (batch_size, heads, T, shape["d_model"] // heads)
        chosen_attention = choose_attention_backend(device, attention_shape, dtype, variant.deterministic)
        print(f"{name}: {chosen_attention}", file=sys.stderr)
    attention = (
        sdpa_kernel(getattr(SDPBackend, variant.attention))
        if variant.attention and device.type == "cuda"
        else contextlib.nullcontext()  # the measured backend (tinylm), or torch's own choice (native)
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    with attention:
        start = time.perf_counter()
        for _ in range(warmup):
            step(timed=False)
        sync()
        warmup_s = time.perf_counter() - start
        graphs_after_warmup = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        times, regions = [], []
        for _ in range(steps):
            start = time.perf_counter()
            step(timed=True)
            regions.append(timer.elapsed_ms())  # syncs
            times.append(time.perf_counter() - start)
        peak_mib = peak_memory_mib(device)
        recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_warmup
        graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiled = 2
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(profiled):
                step(timed=False)
            sync()
    kernels, table = kernels_of(prof, device, profiled)
    if out_dir is not None:
        safe = "".join(c if c.isalnum() else "_" for c in name)
        (out_dir / f"profile_{safe}.txt").write_text(f"{name}: {kernels:.0f} kernels per step\n\n{table}\n")

    tokens = batch_size * T
    tok_s = tokens / statistics.median(times)
    peak = peak_flops(device, dtype, tf32=not variant.deterministic)
    planned = (
        planned_tensor_mib(shape, batch_size, variant.checkpointing, device)
        if variant.impl == "tinylm"
        else None
    )
    return {
        "variant": name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "tokens_per_s": tok_s,
        "mfu": mfu(tok_s, flops_per_token(shape), peak, 1),
        "peak_memory_mib": peak_mib,
        "planned_tensor_mib": planned,
        "regions_ms": {k: statistics.median(r[k] for r in regions) for k in regions[0]},
        "kernels_per_step": kernels,
        "graph_breaks": graph_breaks if variant.compiled else None,
        "recompiles": recompiles if variant.compiled else None,
        "warmup_s": warmup_s,
        "step_s": times,
        "attention": chosen_attention,
    }


def planned_tensor_mib(shape: dict, batch_size: int, checkpointing: str, device: torch.device) -> float:
    """The memory plan's tensors (tinylm/pretrain/memory.py: its total without the framework and,
    on the CPU, glibc's heap): what torch.cuda.max_memory_allocated should see for one rank training
    this shape with AdamW in bf16."""
    from tinylm.config import from_dict
    from tinylm.pretrain.memory import plan_memory

    train = from_dict(
        {
            "train": {
                "world_size": 1,
                "batch_size": batch_size,
                "dtype": "bfloat16",
                "activation_checkpointing": checkpointing,
            }
        }
    ).train
    plan = plan_memory(dict(shape), train, 1, "cuda:0" if device.type == "cuda" else "cpu")
    tensors = ("parameters", "gradients", "optimizer", "activations")
    return sum(plan.parts[part] for part in tensors) / 2**20


# ---------------------------------------------------------------- the table


def row(r: dict, by_name: dict) -> str:
    variant = VARIANTS[r["variant"]]
    baseline = by_name.get(variant.compared_to())
    ratio = f"{r['tokens_per_s'] / baseline['tokens_per_s']:.2f}x" if baseline and baseline is not r else "-"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    planned = r["planned_tensor_mib"]
    plan = "-" if planned is None else f"{planned:,.0f} ({planned / r['peak_memory_mib']:.2f})"
    ms = r["regions_ms"]
    if "forward+loss" in ms:  # the baseline compiled whole: one region to the loss
        ms = {**ms, "forward": ms["forward+loss"], "loss": float("nan")}
    regions = " / ".join("-" if ms[k] != ms[k] else f"{ms[k]:.1f}" for k in REGIONS)
    compiler = "-" if r["graph_breaks"] is None else f"{r['graph_breaks']} / {r['recompiles']}"
    memory = f"{r['peak_memory_mib']:,.0f} | {plan}"
    return (
        f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {regions} | "
        f"{r['kernels_per_step']:,.0f} | {compiler} | {memory} | {r['warmup_s']:.1f} |"
    )


def failure_row(name: str, returncode: int | None, stderr: str, timeout_s: float | None = None) -> str:
    """The row of a variant that did not finish: why (timed out, killed by a signal, or its exit
    status) and the last line of its stderr, if it wrote one."""
    if timeout_s is not None:
        why = f"timed out after {timeout_s:g} s"
    elif returncode is not None and returncode < 0:
        name_of = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else -returncode
        why = f"killed by {name_of}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    else:
        why = f"exit status {returncode}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"| {name} | failed: {why}{': ' + last[:200] if last else ''} |"


HEADER = (
    "| variant | tokens/s | vs native (same compile) | MFU | regions ms | kernels per step "
    "| compiler | peak MiB | planned MiB (plan / peak) | warm-up s |\n"
    "|---|---:|---:|---:|---|---:|---|---:|---:|---:|"
)


def summary(folders: list[Path]) -> str:
    """One table of the results.json of several runs of this script (the eager and the compiled
    phases of bench/gpu_session.sh): every variant measured, each against its baseline of the same
    compile, whichever run measured it; a variant with no result is named as missing."""
    results = []
    for folder in folders:
        path = folder / "results.json"
        if path.is_file():
            results += json.loads(path.read_text())
    by_name = {r["variant"]: r for r in results}
    lines = [HEADER, *(row(r, by_name) for r in by_name.values())]
    missing = [name for folder in folders for name in _planned(folder) if name not in by_name]
    if missing:
        lines.append(f"\nNo figure (failed or cut short): {', '.join(missing)}")
    chosen = [f"- {r['variant']}: {r['attention']}" for r in by_name.values() if r.get("attention")]
    if chosen:  # the fused attention backend each tinylm row measured and used
        lines += ["", *chosen]
    return "\n".join(lines)


def _planned(folder: Path) -> list[str]:
    path = folder / "planned.json"
    return json.loads(path.read_text()) if path.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 3 steps: checks the script runs")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per step (default 16 x 1024 tokens)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps first (compilation happens here)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--eager", action="store_true", help="the eager variants only")
    parser.add_argument("--compiled", action="store_true", help="the compiled variants only")
    parser.add_argument("--out-dir", type=Path, help="results.json and one profile file per variant here")
    parser.add_argument(
        "--variant-timeout", type=float, default=None, help="seconds a variant may take (default: no limit)"
    )
    parser.add_argument(
        "--summary", nargs="+", type=Path, metavar="DIR", help="print one table of these --out-dir folders"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    shape = SMOKE if args.smoke else GPT2_SMALL
    steps, warmup = (3, 1) if args.smoke else (args.steps, args.warmup)
    batch_size = 2 if args.smoke else args.batch_size
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "results.json").unlink(missing_ok=True)

    if args.worker:
        result = worker(args.worker, shape, batch_size, steps, warmup, args.out_dir)
        print(json.dumps(result))
        return

    names = EAGER if args.eager else COMPILED if args.compiled else args.variants
    if not torch.cuda.is_available():
        names = [n for n in names if VARIANTS[n].attention is None]  # the backends are CUDA's
    if args.out_dir:
        (args.out_dir / "planned.json").write_text(json.dumps(names) + "\n")
    # Every figure is written as soon as it is measured (a session may be cut short): a row of the
    # markdown table on stdout, and the JSON of every result so far in --out-dir.
    print(
        f"Training step at {'smoke' if args.smoke else 'GPT-2-small'} shape {shape}, batch {batch_size} x "
        f"{shape['context_length']} tokens, bf16 autocast, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; median of {steps} steps "
        f"after {warmup} warm-up steps; each variant in its own process. Regions in ms: forward / loss / "
        f"backward / clip / optimizer (a model compiled whole: forward and loss as one). "
        "Compiler: graph breaks / recompiles after warm-up.\n"
    )
    print(HEADER, flush=True)
    results, by_name = [], {}
    for name in names:
        cmd = [sys.executable, __file__, "--worker", name, "--batch-size", str(batch_size)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += (["--smoke"] if args.smoke else []) + (
            ["--out-dir", str(args.out_dir)] if args.out_dir else []
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.variant_timeout)
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            print(failure_row(name, None, stderr, args.variant_timeout), flush=True)
            print(f"{name}: timed out\n{stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        if proc.returncode != 0:
            print(failure_row(name, proc.returncode, proc.stderr), flush=True)
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        by_name[name] = r
        print(row(r, by_name), flush=True)
        if args.out_dir:
            (args.out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
