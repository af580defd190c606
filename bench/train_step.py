"""Training-step speed and peak memory: tinylm beside a torch-native model of the same sizes.

The baseline has the same architecture (pre-norm, RMSNorm, RoPE, SwiGLU, untied head) built from
PyTorch's own pieces: nn.Embedding, nn.Linear, nn.RMSNorm, F.scaled_dot_product_attention, F.silu,
F.cross_entropy and torch.optim.AdamW. One training step is forward, loss, backward and optimizer
step on a fresh random batch. Each (model, config) runs in its own subprocess, so its peak resident
memory (ru_maxrss) is its own; runs alternate between the two models to spread out machine noise.

    python bench/train_step.py                       # both configs, markdown table on stdout
    python bench/train_step.py --configs tiny --steps 5 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

CONFIGS = {
    "tiny": dict(
        vocab_size=2000, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=344, batch_size=32
    ),
    "small": dict(
        vocab_size=10000,
        context_length=256,
        d_model=512,
        num_layers=4,
        num_heads=16,
        d_ff=1344,
        batch_size=16,
    ),
}
# Tokens/s of nanoGPT's model and the CS336 reference, measured earlier on the same machine kind
# with 2 threads (outside this repository), for context.
PEERS = {
    "tiny": {"nanoGPT GPT": 21000, "CS336 reference": 16000},
    "small": {"nanoGPT GPT": 1600, "CS336 reference": 925},
}


# ---------------------------------------------------------------- the torch-native baseline


class NativeRoPE(nn.Module):
    """Rotate-half RoPE with cached cos/sin (the usual formulation in PyTorch codebases)."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float32) / d_k)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-2]
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos[:T] + torch.cat((-x2, x1), dim=-1) * self.sin[:T]


class NativeBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, rope: NativeRoPE):
        super().__init__()
        self.num_heads = num_heads
        self.rope = rope
        self.ln1 = nn.RMSNorm(d_model, eps=1e-5)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.RMSNorm(d_model, eps=1e-5)
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.ln1(x)
        q, k, v = (
            proj(h).view(B, T, self.num_heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class NativeTransformer(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta=10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        rope = NativeRoPE(rope_theta, d_model // num_heads, context_length)
        self.layers = nn.ModuleList(NativeBlock(d_model, num_heads, d_ff, rope) for _ in range(num_layers))
        self.ln_final = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


# ---------------------------------------------------------------- measurements (each in a subprocess)


def build(impl: str, cfg: dict):
    model_cfg = {k: v for k, v in cfg.items() if k != "batch_size"}
    if impl.startswith("tinylm"):
        from tinylm.model import Transformer
        from tinylm.nn_utils import cross_entropy
        from tinylm.optim import AdamW

        model = Transformer(**model_cfg)
        optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        loss_fn = cross_entropy
        if impl == "tinylm-compile":
            model = torch.compile(model)
    else:
        model = NativeTransformer(**model_cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        loss_fn = F.cross_entropy
    return model, optimizer, loss_fn


def make_train_step(impl: str, cfg: dict, seed: int = 1234):
    """Build one model and return a function running one timed training step (seconds)."""
    model, optimizer, loss_fn = build(impl, cfg)
    generator = torch.Generator().manual_seed(seed)
    B, T, V = cfg["batch_size"], cfg["context_length"], cfg["vocab_size"]

    def train_step() -> float:
        tokens = torch.randint(0, V, (B, T + 1), generator=generator)
        x, y = tokens[:, :-1], tokens[:, 1:]
        start = time.perf_counter()
        logits = model(x)
        loss = loss_fn(logits.reshape(-1, V), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item())
        return time.perf_counter() - start

    return train_step


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def speed_worker(impls: list[str], config: str, steps: int, warmup: int) -> dict:
    """All models in one process, steps interleaved A B A B ..., so that load from other processes
    on the machine slows every model alike. Returns the per-step times of each model."""
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    train_steps = {impl: make_train_step(impl, cfg) for impl in impls}
    for step in train_steps.values():
        for _ in range(warmup):
            step()
    times = {impl: [] for impl in impls}
    for i in range(steps):
        order = impls if i % 2 == 0 else impls[::-1]
        for impl in order:
            times[impl].append(train_steps[impl]())
    return times


def memory_worker(impl: str, config: str, steps: int) -> dict:
    """One model alone in its process: peak resident memory over a few training steps."""
    torch.manual_seed(0)
    rss_import = max_rss_mb()
    step = make_train_step(impl, CONFIGS[config])
    rss_build = max_rss_mb()
    for _ in range(steps):
        step()
    return dict(rss_after_import_mb=rss_import, rss_after_build_mb=rss_build, peak_rss_mb=max_rss_mb())


def run_worker(args: list[str]):
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- the side-by-side table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per model (default: 40 tiny, 10 small)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also measure tinylm under torch.compile")
    parser.add_argument("--worker", choices=["speed", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--impls", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.worker == "speed":
        print(json.dumps(speed_worker(args.impls, args.configs[0], args.steps, args.warmup)))
        return
    if args.worker == "memory":
        print(json.dumps(memory_worker(args.impls[0], args.configs[0], args.warmup + 1)))
        return

    impls = ["tinylm", "torch-native"] + (["tinylm-compile"] if args.compile else [])
    print(
        f"Training step (forward, loss, backward, AdamW step), float32, CPU ({platform.machine()}), "
        f"torch {torch.__version__}, {args.threads} threads. Speed: all models in one process, steps "
        "interleaved; 'vs native' is the median over rounds of native step time / this step time. "
        "Memory: each model alone in a subprocess, peak RSS (ru_maxrss).\n"
    )
    print(
        "| config | model | tokens/s median | tokens/s best | speed vs native | peak RSS MB | "
        "memory vs native |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for config in args.configs:
        cfg = CONFIGS[config]
        steps = args.steps or (40 if config == "tiny" else 12)
        common = ["--configs", config, "--threads", str(args.threads), "--warmup", str(args.warmup)]
        times = run_worker(["--worker", "speed", "--impls", *impls, "--steps", str(steps), *common])
        memory = {impl: run_worker(["--worker", "memory", "--impls", impl, *common]) for impl in impls}
        tokens = cfg["batch_size"] * cfg["context_length"]
        native_times, native_peak = times["torch-native"], memory["torch-native"]["peak_rss_mb"]
        for impl in impls:
            ratio = statistics.median(n / t for n, t in zip(native_times, times[impl], strict=True))
            peak = memory[impl]["peak_rss_mb"]
            print(
                f"| {config} | {impl} | {tokens / statistics.median(times[impl]):,.0f} | "
                f"{tokens / min(times[impl]):,.0f} | {ratio:.2f}x | {peak:,.0f} | "
                f"{peak / native_peak:.2f}x |",
                flush=True,
            )
        best = tokens / min(times["tinylm"])
        peers = "; ".join(
            f"{name} ~{tps:,} (tinylm best {best / tps:.2f}x)" for name, tps in PEERS[config].items()
        )
        print(f"| {config} | earlier peer figures | {peers} | | | | |", flush=True)


if __name__ == "__main__":
    main()
