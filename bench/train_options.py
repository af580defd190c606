"""The training loop's options on the CPU, each beside its reference, measured in one run.

1. AdamW step: our multi-tensor AdamW against torch.optim.AdamW(foreach=True) and the for-loop
   torch.optim.AdamW(foreach=False), on the small config's parameters (22.7M) with the same
   gradients; only `optimizer.step()` is timed, the three interleaved.
2. Gradient accumulation: tokens/s of one update of the default model's global batch (16 x 256)
   in 1 micro-step against 4 micro-steps of 4 (the loop's forward, loss / 4, backward, clip, AdamW),
   interleaved in one process.
3. Precision and compilation on the default model (global batch 16 x 256, one process, 2 threads):
   float32, bf16 autocast, float32 + torch.compile, bf16 + torch.compile, interleaved after warm-up.

    python bench/train_options.py                 # all three, markdown on stdout
    python bench/train_options.py --only adamw
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch

from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import AdamW, param_groups
from tinylm.precision import autocast

SMALL = dict(vocab_size=10000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344)
DEFAULT = dict(vocab_size=2048, context_length=256, d_model=128, num_layers=4, num_heads=4, d_ff=344)


def median_ratio(reference: list[float], other: list[float]) -> float:
    """Median over rounds of other / reference (time ratios: < 1 is faster)."""
    return statistics.median(o / r for r, o in zip(reference, other, strict=True))


def bench_adamw(rounds: int) -> None:
    torch.manual_seed(0)
    model = Transformer(**SMALL)
    params = {
        name: [p.detach().clone().requires_grad_() for p in model.parameters()]
        for name in ("tinylm", "torch foreach", "torch for-loop")
    }
    for copies in params.values():
        for p, source in zip(copies, model.parameters(), strict=True):
            p.grad = torch.randn_like(source) * 1e-3

    def groups(copies):
        return [
            {"params": [p for p in copies if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in copies if p.dim() < 2], "weight_decay": 0.0},
        ]

    optimizers = {
        "tinylm": AdamW(groups(params["tinylm"]), lr=1e-3),
        "torch foreach": torch.optim.AdamW(groups(params["torch foreach"]), lr=1e-3, foreach=True),
        "torch for-loop": torch.optim.AdamW(groups(params["torch for-loop"]), lr=1e-3, foreach=False),
    }
    times = {name: [] for name in optimizers}
    for i in range(rounds + 2):
        order = list(optimizers) if i % 2 == 0 else list(optimizers)[::-1]
        for name in order:
            start = time.perf_counter()
            optimizers[name].step()
            if i >= 2:  # two warm-up rounds (state allocation)
                times[name].append(time.perf_counter() - start)
    reference = times["torch foreach"]
    n = sum(p.numel() for p in model.parameters())
    print(f"\n### AdamW step ({n:,} parameters, two param groups, {rounds} rounds)\n")
    print("| optimizer | step ms (median) | time vs torch foreach |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {1000 * statistics.median(t):.1f} | {median_ratio(reference, t):.3f}x |")


def make_step(model, optimizer, micro_steps: int, dtype: torch.dtype, forward=None):
    """One update of the global batch in `micro_steps` micro-batches, the way the training loop does it."""
    forward = model if forward is None else forward
    generator = torch.Generator().manual_seed(0)
    batch, T, V = 16, model.context_length, model.vocab_size

    def step() -> float:
        ids = torch.randint(0, V, (batch, T + 1), generator=generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for chunk in ids.chunk(micro_steps):
            with autocast("cpu", dtype):
                logits = forward(chunk[:, :-1])
            (cross_entropy(logits, chunk[:, 1:]) / micro_steps).backward()
        gradient_clip(model.parameters(), 1.0)
        optimizer.step()
        return time.perf_counter() - start

    return step


def bench_steps(title: str, variants: dict, rounds: int, warmup: int, reference: str) -> None:
    for step in variants.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in variants}
    for i in range(rounds):
        for name in list(variants) if i % 2 == 0 else list(variants)[::-1]:
            times[name].append(variants[name]())
    tokens = 16 * DEFAULT["context_length"]
    print(f"\n### {title} (default model, global batch 16 x 256, {rounds} rounds after {warmup} warm-up)\n")
    print(f"| variant | tokens/s (median) | tokens/s vs {reference} |")
    print("|---|---:|---:|")
    for name, t in times.items():
        speed = 1 / median_ratio(times[reference], t)
        print(f"| {name} | {tokens / statistics.median(t):,.0f} | {speed:.3f}x |")


def fresh(dtype=torch.float32, micro_steps: int = 1, compiled: bool = False):
    torch.manual_seed(0)
    model = Transformer(**DEFAULT)
    optimizer = AdamW(param_groups(model, 0.1), lr=1e-3)
    return make_step(model, optimizer, micro_steps, dtype, torch.compile(model) if compiled else None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["adamw", "accumulation", "precision"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"CPU ({platform.machine()}), torch {torch.__version__}, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    with contextlib.suppress(KeyboardInterrupt):
        if args.only in (None, "adamw"):
            bench_adamw(args.rounds)
        if args.only in (None, "accumulation"):
            bench_steps(
                "Gradient accumulation",
                {"1 micro-step of 16": fresh(), "4 micro-steps of 4": fresh(micro_steps=4)},
                args.rounds,
                warmup=3,
                reference="1 micro-step of 16",
            )
        if args.only in (None, "precision"):
            bench_steps(
                "Precision and torch.compile",
                {
                    "float32": fresh(),
                    "bf16 autocast": fresh(torch.bfloat16),
                    "float32 + compile": fresh(compiled=True),
                    "bf16 + compile": fresh(torch.bfloat16, compiled=True),
                },
                args.rounds,
                warmup=3,
                reference="float32",
            )


if __name__ == "__main__":
    main()
