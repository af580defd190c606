"""GPU training-step speed: tinylm beside the torch-native baseline at GPT-2-small shape, bf16.

One training step is the tinylm loop's step on one device: forward under bf16 autocast, loss in
float32, backward, gradient clip, AdamW (ours: multi-tensor, two param groups; the baseline's:
torch.optim.AdamW with its default foreach path), with and without torch.compile. Each variant runs in
its own subprocess so that its peak memory (torch.cuda.max_memory_allocated) is its own. Reports
tokens/s, MFU (tinylm/throughput.py: 6 x matmul weights + attention, over the table's bf16 peak)
and peak memory, with ratios to the baseline of the same compile setting.

    python bench/gpu.py                     # on a CUDA machine: about 5 minutes, markdown on stdout
    python bench/gpu.py --out results.json  # also the raw figures
    python bench/gpu.py --smoke             # a tiny shape for a few steps (runs on the CPU too)

The baseline model is bench/train_step.py's NativeTransformer (nn.Embedding, nn.Linear, nn.RMSNorm,
F.scaled_dot_product_attention, F.silu, F.cross_entropy): same architecture, PyTorch's own parts.
"""

from __future__ import annotations

import argparse
import json
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
# name -> (model, compile, deterministic kernels)
VARIANTS = {
    "tinylm": ("tinylm", False, False),
    "native": ("native", False, False),
    "tinylm+compile": ("tinylm", True, False),
    "native+compile": ("native", True, False),
    "tinylm+compile, deterministic": ("tinylm", True, True),
}


def build(impl: str, shape: dict, device: torch.device):
    """(model, optimizer, loss function) on `device`, parameters float32."""
    if impl == "tinylm":
        from tinylm.model import Transformer
        from tinylm.nn_utils import cross_entropy
        from tinylm.optim import AdamW, param_groups

        model = Transformer(**shape, device=device)
        return model, AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95)), cross_entropy
    from train_step import NativeTransformer

    model = NativeTransformer(**shape).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95))
    return model, optimizer, lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def worker(name: str, shape: dict, batch_size: int, steps: int, warmup: int) -> dict:
    from tinylm.nn_utils import gradient_clip
    from tinylm.precision import autocast
    from tinylm.throughput import flops_per_token, mfu, peak_flops, peak_memory_mib
    from tinylm.training import configure_kernels

    impl, compiled, deterministic = VARIANTS[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_kernels(device, deterministic)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model, optimizer, loss_fn = build(impl, shape, device)
    forward = torch.compile(model) if compiled else model
    generator = torch.Generator().manual_seed(1)
    V, T = shape["vocab_size"], shape["context_length"]

    def step() -> None:
        ids = torch.randint(0, V, (batch_size, T + 1), generator=generator).to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = forward(ids[:, :-1])
        loss = loss_fn(logits, ids[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gradient_clip(model.parameters(), 1.0)
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    tokens = batch_size * T
    tok_s = tokens / statistics.median(times)
    peak = peak_flops(device, dtype, tf32=not deterministic)
    utilisation = mfu(tok_s, flops_per_token(shape), peak, 1)
    return {"variant": name, "tokens_per_s": tok_s, "mfu": utilisation, "peak_memory_mib": peak_memory_mib(device),
            "warmup_s": warmup_s, "step_s": times,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 3 steps: checks the script runs")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16 x 1024 tokens)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="write the raw figures as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else GPT2_SMALL
    steps, warmup = (3, 1) if args.smoke else (args.steps, args.warmup)
    batch_size = 2 if args.smoke else args.batch_size

    if args.worker:
        print(json.dumps(worker(args.worker, shape, batch_size, steps, warmup)))
        return

    results = []
    for name in args.variants:
        cmd = [sys.executable, __file__, "--worker", name, "--batch-size", str(batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"[gpu bench] {name}: {results[-1]['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)

    by_name = {r["variant"]: r for r in results}
    device = results[0]["device"] if results else "?"
    print(f"Training step at {'smoke' if args.smoke else 'GPT-2-small'} shape {shape}, batch {batch_size} x "
          f"{shape['context_length']} tokens, bf16 autocast, on {device}, torch {torch.__version__}; median of "
          f"{steps} steps after {warmup} warm-up steps; each variant in its own process.\n")
    print("| variant | tokens/s | vs native (same compile) | MFU | peak memory MiB | warm-up s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        native = by_name.get("native+compile" if "compile" in r["variant"] else "native")
        ratio = f"{r['tokens_per_s'] / native['tokens_per_s']:.2f}x" if native else "-"
        utilisation = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {ratio} | {utilisation} | "
              f"{r['peak_memory_mib']:,.0f} | {r['warmup_s']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
