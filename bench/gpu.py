"""GPU training-step speed: tinylm beside the torch-native baseline at GPT-2-small shape, bf16.

One training step is the tinylm loop's step on one device: forward under bf16 autocast, loss in
float32, backward, gradient clip, AdamW (ours: multi-tensor, two param groups), with and without
torch.compile (both sides compile each Transformer block, as the trainer does), and with full and
selective activation checkpointing (train.activation_checkpointing), whose rows give the memory
it saves and the speed it costs. The baseline is
written as a PyTorch user would write it for speed: fused q/k/v projection,
F.scaled_dot_product_attention, nn.RMSNorm, F.cross_entropy, torch.optim.AdamW(fused=True) and
clip_grad_norm_(foreach=True). Each variant runs in
its own subprocess so that its peak memory (torch.cuda.max_memory_allocated) is its own. Reports
tokens/s, MFU (tinylm/throughput.py: 6 x matmul weights + attention, over the table's bf16 peak)
and peak memory, with ratios to the baseline of the same compile setting.

    python bench/gpu.py                     # on a CUDA machine: about 5 minutes, markdown on stdout
    python bench/gpu.py --out results.json  # also the raw figures
    python bench/gpu.py --smoke             # a tiny shape for a few steps (runs on the CPU too)

The baseline model (`FusedNativeTransformer` below) has tinylm's architecture (RoPE, RMSNorm,
SwiGLU, no biases, untied head) built from PyTorch's own parts.
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
# name -> (model, compile, deterministic kernels, activation checkpointing); the baselines first, so
# that each tinylm row can give its ratio as soon as it is measured.
VARIANTS = {
    "native": ("native", False, False, "none"),
    "native+compile": ("native", True, False, "none"),
    "tinylm": ("tinylm", False, False, "none"),
    "tinylm, full checkpointing": ("tinylm", False, False, "full"),
    "tinylm, selective checkpointing": ("tinylm", False, False, "selective"),
    "tinylm+compile": ("tinylm", True, False, "none"),
    "tinylm+compile, deterministic": ("tinylm", True, True, "none"),
    "tinylm+compile, full checkpointing": ("tinylm", True, False, "full"),
    "tinylm+compile, selective checkpointing": ("tinylm", True, False, "selective"),
}


def build(impl: str, shape: dict, device: torch.device):
    """(model, optimizer, loss function) on `device`, parameters float32."""
    if impl == "tinylm":
        from tinylm.model import Transformer
        from tinylm.nn_utils import cross_entropy
        from tinylm.optim import AdamW, param_groups

        model = Transformer(**shape, device=device)
        return model, AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95)), cross_entropy
    model = FusedNativeTransformer(**shape).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    return model, optimizer, lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def planned_tensor_mib(shape: dict, batch_size: int, checkpointing: str) -> float:
    """The memory plan's total without its framework part (tinylm/pretrain/memory.py): what
    torch.cuda.max_memory_allocated should see for one rank training this shape with AdamW in bf16."""
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
    # Planned for this machine's GPU (the loss in a GPU's chunks of rows), as `pretrain` plans it.
    plan = plan_memory(dict(shape), train, 1, "cuda:0")
    return (plan.total - plan.parts["framework"]) / 2**20


def worker(name: str, shape: dict, batch_size: int, steps: int, warmup: int) -> dict:
    from tinylm.flops import flops_per_token
    from tinylm.nn_utils import gradient_clip
    from tinylm.precision import autocast, configure_kernels
    from tinylm.throughput import mfu, peak_flops, peak_memory_mib

    impl, compiled, deterministic, checkpointing = VARIANTS[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_kernels(device, deterministic)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model, optimizer, loss_fn = build(impl, shape, device)
    if impl == "tinylm":
        model.set_activation_checkpointing(checkpointing)
    if compiled:  # block by block on both sides, as the trainer compiles
        for block in model.layers:
            block.compile()
    generator = torch.Generator().manual_seed(1)
    V, T = shape["vocab_size"], shape["context_length"]

    def step() -> None:
        ids = torch.randint(0, V, (batch_size, T + 1), generator=generator).to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = model(ids[:, :-1])
        loss = loss_fn(logits, ids[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if impl == "tinylm":
            gradient_clip(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
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
    planned = planned_tensor_mib(shape, batch_size, checkpointing) if impl == "tinylm" else None
    return {
        "variant": name,
        "planned_tensor_mib": planned,
        "tokens_per_s": tok_s,
        "mfu": utilisation,
        "peak_memory_mib": peak_memory_mib(device),
        "warmup_s": warmup_s,
        "step_s": times,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }


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
    parser.add_argument("--out", type=Path, help="write the raw figures as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else GPT2_SMALL
    steps, warmup = (3, 1) if args.smoke else (args.steps, args.warmup)
    batch_size = 2 if args.smoke else args.batch_size

    if args.worker:
        print(json.dumps(worker(args.worker, shape, batch_size, steps, warmup)))
        return

    # Every figure is written as soon as it is measured (a session may be cut short): a row of the
    # markdown table on stdout, and the JSON of every result so far at --out.
    print(
        f"Training step at {'smoke' if args.smoke else 'GPT-2-small'} shape {shape}, batch {batch_size} x "
        f"{shape['context_length']} tokens, bf16 autocast, torch {torch.__version__}; median of "
        f"{steps} steps after {warmup} warm-up steps; each variant in its own process.\n"
    )
    print(
        "| variant | device | tokens/s | vs native (same compile) | MFU | peak memory MiB "
        "| planned MiB (plan / peak) | warm-up s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    results, by_name = [], {}
    for name in args.variants:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--batch-size",
            str(batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        by_name[name] = r
        native = by_name.get("native+compile" if "compile" in name else "native")
        ratio = f"{r['tokens_per_s'] / native['tokens_per_s']:.2f}x" if native and native is not r else "-"
        utilisation = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        planned = r["planned_tensor_mib"]
        plan = "-" if planned is None else f"{planned:,.0f} ({planned / r['peak_memory_mib']:.2f})"
        print(
            f"| {name} | {r['device']} | {r['tokens_per_s']:,.0f} | {ratio} | {utilisation} | "
            f"{r['peak_memory_mib']:,.0f} | {plan} | {r['warmup_s']:.1f} |",
            flush=True,
        )
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
