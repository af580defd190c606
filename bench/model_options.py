"""What each model option costs per training step, on the default run's per-rank step.

One rank of the default run trains a micro-batch of 16 x 128 tokens on one thread: bf16 autocast
forward, our cross-entropy, backward, the gradient clip and AdamW over both param groups. This
script runs that step for the default model and for each option of the recipe lab on top of it
(config/sweep_lab.yaml), interleaved round by round in one process so that every variant sees the
same machine (the ratios hold when the machine is busy; the milliseconds do not), and prints each
variant's median step time and its ratio to the default's. The ranks' gradient all-reduce is not
in it: the options that change the parameter count (tie_embeddings -0.5M, value_embeddings +1M of
the default's 1.8M) change what each step sends by as much.

    python bench/model_options.py                # markdown on stdout, about 3 minutes
    python bench/model_options.py --rounds 5 --steps 10
    python bench/model_options.py --recipe muon  # the Muon recipe (config/muon.yaml: Muon, compiled
                                                 # blocks) plain and with the options of round 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tinylm.config import load_config
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, gradient_clip
from tinylm.optim import AdamW, param_groups
from tinylm.precision import autocast
from tinylm.pretrain.optimizer import build_optimizer

DEFAULT = dict(vocab_size=4096, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=344)
OPTIONS = {
    "default": {},
    "qk_norm": {"qk_norm": True},
    "mlp relu2": {"mlp": "relu2"},
    "logit_softcap 15": {"logit_softcap": 15.0},
    "zero_init_output": {"zero_init_output": True},
    "tie_embeddings": {"tie_embeddings": True},
    "value_embeddings": {"value_embeddings": True},
    "dropout 0.1": {"dropout": 0.1},
    "embedding_norm": {"embedding_norm": True},
}
ROUND_2 = {"qk_norm": True, "mlp": "relu2", "value_embeddings": True}
# --recipe muon: the default step (AdamW, eager) as the base, then config/muon.yaml's step (Muon
# for the blocks' matrices, compiled blocks) plain and with the options of round 2.
MUON_RECIPE = {
    "default": ({}, False),
    "qk_norm + relu2 + value_embeddings": (ROUND_2, False),
    "muon recipe (compiled)": ({}, True),
    "muon recipe + qk_norm + relu2 + value_embeddings": (ROUND_2, True),
}


def make_step(options: dict, batch_size: int, muon_recipe: bool = False):
    """One rank's training step: AdamW and eager blocks, or with `muon_recipe` config/muon.yaml's
    optimizer (built as the pretrain stage builds it) and torch.compile on each block."""
    torch.manual_seed(0)
    model = Transformer(**DEFAULT, **options)
    model.train()
    if muon_recipe:
        optimizer = build_optimizer(model, load_config("config/muon.yaml").train, world_size=1)
        for block in model.layers:
            block.compile()
    else:
        optimizer = AdamW(param_groups(model, 0.7), lr=1e-3, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(1)
    device = torch.device("cpu")

    def step() -> None:
        ids = torch.randint(
            0, DEFAULT["vocab_size"], (batch_size, DEFAULT["context_length"] + 1), generator=generator
        )
        with autocast(device, torch.bfloat16):
            logits = model(ids[:, :-1])
        cross_entropy(logits, ids[:, 1:]).backward()
        gradient_clip(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model.num_parameters()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=16, help="one rank's micro-batch (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the default run's ranks: 1)")
    parser.add_argument(
        "--recipe",
        choices=["adamw", "muon"],
        default="adamw",
        help="`adamw`: each option alone on the default step; `muon`: the Muon recipe's step",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.recipe == "muon":
        variants = MUON_RECIPE
    else:
        variants = {name: (options, False) for name, options in OPTIONS.items()}
    steps = {
        name: make_step(options, args.batch_size, muon_recipe)
        for name, (options, muon_recipe) in variants.items()
    }
    times = {name: [] for name in variants}
    for step, _ in steps.values():  # warm-up: allocator, first-call overheads, compilation
        for _ in range(3):
            step()
    for _ in range(args.rounds):
        for name, (step, _) in steps.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["default"])
    what = "the Muon recipe" if args.recipe == "muon" else "each option alone"
    print(
        f"One rank's training step of the default model (micro-batch {args.batch_size} x "
        f"{DEFAULT['context_length']}, vocab {DEFAULT['vocab_size']}, bf16 autocast, {args.threads} thread), "
        f"{what}; median of {args.rounds} x {args.steps} steps, variants interleaved; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}.\n"
    )
    print("| variant | parameters | step ms | vs default |")
    print("|---|---:|---:|---:|")
    for name, (_, parameters) in steps.items():
        median = statistics.median(times[name])
        print(f"| {name} | {parameters:,} | {1000 * median:.1f} | {median / base:.3f}x |")


if __name__ == "__main__":
    main()
