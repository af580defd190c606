"""The communication and memory plans of sharded runs on clusters this machine cannot reach.

    python bench/comm_plan.py [--out FILE]

Planned, not measured: for GPT-2-small and a 1B shape, at 8, 64 and 512 GPUs (H100 80 GB), each
rank a micro-batch of 16 x 1,024 tokens (weak scaling: the global batch grows with the GPUs),
bf16, ZeRO-1 with 25 MB buckets (the default) and 100 MB, AdamW. For each: one update's
collectives and the bytes each rank sends (tinylm/parallel/comm_plan.py, exactly the collectives
the trainer issues), their time at NVLink within one node of 8 and at InfiniBand beyond (nominal
bandwidths and latencies of comm_plan.LINKS), backward's time at 40 % MFU, and the memory plan per
rank (pretrain --plan's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from tinylm.config import TrainConfig
from tinylm.flops import flops_per_token
from tinylm.model import Transformer
from tinylm.parallel.comm_plan import default_link, plan_communication
from tinylm.pretrain.memory import named_device, plan_memory
from tinylm.pretrain.optimizer import parameter_specs

SHAPES = {
    "GPT-2 small": dict(
        vocab_size=50304, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048
    ),
    "1B": dict(vocab_size=50304, context_length=1024, d_model=2048, num_layers=18, num_heads=16, d_ff=5632),
}
WORLD_SIZES = (8, 64, 512)
MICRO_BATCH = 16
DEVICE = "h100-80gb"
MFU = 0.4
BUCKET_MB = (25.0, 100.0)


def rows() -> list[str]:
    lines = [
        "| shape | parameters | GPUs | bucket MB | link | collectives per update | MiB sent per rank "
        "| gradients' time | parameters' time | backward at 40 % MFU | optimizer state per rank "
        "| plan per rank (total) |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape_name, shape in SHAPES.items():
        with torch.device("meta"):
            model = Transformer(**shape)
        parameters = sum(p.numel() for p in model.parameters())
        for world, bucket_mb in [(w, b) for w in WORLD_SIZES for b in BUCKET_MB]:
            train = dataclasses.replace(
                TrainConfig(),
                bucket_size_mb=bucket_mb,
                world_size=world,
                batch_size=MICRO_BATCH * world,
                grad_accum_steps=1,
                shard_optimizer=True,
                dtype="bfloat16",
            )
            device = named_device(DEVICE, world)
            plan = plan_communication(
                parameter_specs(model, train), world, train.bucket_size_mb * 2**20, True
            )
            link = default_link(world)
            tokens = MICRO_BATCH * shape["context_length"]
            backward = 2 / 3 * tokens * flops_per_token(shape) / (MFU * device.peak_bf16)
            memory = plan_memory(shape, train, world, device)
            calls = (
                f"{plan.calls('reduce_scatter')} + {plan.calls('all_gather')} + {plan.calls('all_reduce')}"
            )
            lines.append(
                f"| {shape_name} | {parameters / 1e6:,.0f} M | {world} | {bucket_mb:g} | {link.name} | "
                f"{calls} | "
                f"{plan.sent_bytes() / 2**20:,.0f} | {plan.seconds(link, 'backward') * 1e3:.1f} ms | "
                f"{plan.seconds(link, 'after step') * 1e3:.1f} ms | {backward * 1e3:.0f} ms | "
                f"{memory.parts['optimizer'] / 2**20:,.1f} MiB | {memory.total / 2**30:.2f} GiB |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args()
    text = "\n".join(rows()) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
