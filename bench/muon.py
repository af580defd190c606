"""Muon step time: tinylm's Muon beside torch.optim.Muon on the same matrices.

The matrices are the 2-D weights of the Transformer blocks (what `train.optimizer: muon` gives
Muon) of the default model and of a larger one, float32, each with a fixed random gradient. One
step is `optimizer.step()` (momentum, five Newton-Schulz iterations in bfloat16 per matrix, decay,
update). A second row adds the AdamW groups (token embedding, head, gains): tinylm's one Muon
optimizer against torch.optim.Muon plus torch.optim.AdamW(foreach=True). The two run interleaved,
round by round, in one process; medians over the rounds.

    python bench/muon.py                                  # both configs, markdown table on stdout
    python bench/muon.py --configs default --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinylm.model import Transformer
from tinylm.muon import Muon

CONFIGS = {
    "default": dict(vocab_size=4096, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=344),
    "small": dict(vocab_size=10000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344),
}


def split(model: torch.nn.Module) -> tuple[list, list]:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
    others = [p for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    return matrices, others


def make(config: dict, with_adamw: bool):
    """Two identical models with equal fixed gradients.

    Returns (our step, torch's step, the number of Muon matrices, their elements)."""
    torch.manual_seed(0)
    ours_model, theirs_model = Transformer(**config), Transformer(**config)
    theirs_model.load_state_dict(ours_model.state_dict())
    for a, b in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        a.grad = torch.randn_like(a) * 1e-3
        b.grad = a.grad.clone()
    matrices, others = split(ours_model)
    their_matrices, their_others = split(theirs_model)
    adamw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if with_adamw:
        ours = Muon([{"params": matrices}, {"params": others, "use_muon": False, **adamw}], lr=0.02)
        theirs = [
            torch.optim.Muon(their_matrices, lr=0.02),
            torch.optim.AdamW(their_others, foreach=True, **adamw),
        ]
    else:
        ours, theirs = Muon(matrices, lr=0.02), [torch.optim.Muon(their_matrices, lr=0.02)]
    return ours.step, lambda: [o.step() for o in theirs], len(matrices), sum(p.numel() for p in matrices)


def timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round and optimizer (default: 5, small 1)"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds (interleaved), medians")
    print()
    print("| config | groups | Muon matrices (elements) | tinylm ms/step | torch ms/step | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.configs:
        for with_adamw in (False, True):
            ours, theirs, count, elements = make(CONFIGS[name], with_adamw)
            ours(), theirs()  # warm up (state allocation)
            mine, torchs = [], []
            steps = args.steps or (1 if name == "small" else 5)
            for _ in range(args.rounds):
                mine.append(timed(ours, steps))
                torchs.append(timed(theirs, steps))
            a, b = statistics.median(mine), statistics.median(torchs)
            groups = "Muon + AdamW (torch: Muon + foreach AdamW)" if with_adamw else "Muon only"
            print(
                f"| {name} | {groups} | {count} ({elements:,}) | {a * 1e3:.2f} | {b * 1e3:.2f} | "
                f"{a / b:.3f}x |"
            )


if __name__ == "__main__":
    main()
