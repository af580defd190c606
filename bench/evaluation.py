"""Evaluation speed: seconds per million validation tokens for the default model, and what a rerun costs.

    python bench/evaluation.py [--tokens 1000000] [--device cpu|cuda]

The default config's model (vocab 2048, context 256, d_model 128, 4 layers, 4 heads, d_ff 344),
randomly initialized (speed does not depend on the weights), published as checkpoints the way
training publishes them; validation tokens: `--tokens` ids of a tokenizer trained at vocab 2048 on
text from bench/make_corpus.py (stories). Measured, in one process:
1. evaluating two checkpoints from scratch (with an empty cache folder);
2. the rerun after one more checkpoint: only the new one is scored;
3. a rerun with nothing new: every checkpoint is read from the cache;
4. the plain-PyTorch baseline: the same windows of one checkpoint scored by a loop with F.cross_entropy.
On the CPU with `evaluate.threads` torch threads and float32; on CUDA in bfloat16 (the checkpoints'
`train.dtype`). Prints Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tinylm.config import Config
from tinylm.evaluate import evaluate_checkpoints
from tinylm.model import Transformer
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish as publish_run
from tinylm.tokenizer import Tokenizer, encode_corpus, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def make_corpus(path: Path, size: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import make_corpus

    with open(path, "wb") as f:
        make_corpus.generate("stories", size, f, seed=1)


def publish(folder: Path, steps: list[int], model_config: dict, dtype: str) -> Path:
    for step in steps:
        torch.manual_seed(step)
        model = Transformer(**model_config)
        payload = {
            "model": model.state_dict(),
            "optimizer": {},
            "iteration": step,
            "tokens_seen": step,
            "model_config": model_config,
            "rng": [],
        }
        manifest = {"world_size": 1, "config": {"train": {"dtype": dtype}}}
        state_lib.commit(folder / "state", step, payload, manifest, keep=100)
    publish_run(folder / "state", folder / "checkpoints")
    return folder / "checkpoints"


@torch.inference_mode()
def plain_torch_loss(checkpoint: Path, valid: Path, max_tokens: int, batch_size: int, device: str) -> float:
    """The plain-PyTorch baseline: the same windows scored by a loop with F.cross_entropy (sum), one
    checkpoint, loading included (as in the evaluation)."""
    payload = torch.load(checkpoint, map_location=device, weights_only=True)
    config = payload["model_config"]
    model = Transformer(**config, device=device)
    model.load_state_dict(payload["model"])
    model.eval()
    tokens = np.load(valid, mmap_mode="r")[:max_tokens]
    t = config["context_length"]
    total = 0.0
    windows = [np.asarray(tokens[s : s + t + 1], dtype=np.int64) for s in range(0, len(tokens) - 1, t)]
    full = [w for w in windows if len(w) == t + 1]
    batches = [full[b : b + batch_size] for b in range(0, len(full), batch_size)]
    batches += [[w] for w in windows if len(w) < t + 1]  # the short last window
    for batch in batches:
        x = torch.from_numpy(np.stack(batch)).to(device)
        logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    return total


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="validation tokens scored")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    cfg = Config()
    torch.set_num_threads(cfg.evaluate.threads)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_config = {"vocab_size": cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model)}

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_corpus(folder / "text.txt", args.tokens * 5)  # about 4 bytes per token at vocab 2048
        tokenizer = train_tokenizer(
            folder / "text.txt",
            folder / "tokenizer.json",
            cfg.tokenizer.vocab_size,
            cfg.tokenizer.special_tokens,
            progress=False,
        )
        num_tokens = encode_corpus(tokenizer, folder / "text.txt", folder / "valid.npy", progress=False)
        tokenizer = Tokenizer.load(folder / "tokenizer.json")
        scored = min(args.tokens, num_tokens)
        cache = folder / "eval_cache"

        def evaluate():
            return evaluate_checkpoints(
                folder / "checkpoints",
                folder / "valid.npy",
                tokenizer,
                cfg.evaluate.batch_size,
                args.device,
                max_tokens=args.tokens,
                cache_dir=cache,
            )

        publish(folder, [1, 2], model_config, dtype)
        first, table = timed(evaluate)
        publish(folder, [3], model_config, dtype)
        more, _ = timed(evaluate)
        again, _ = timed(evaluate)
        plain, plain_loss = timed(
            lambda: plain_torch_loss(
                folder / "checkpoints" / "step_1.pt",
                folder / "valid.npy",
                args.tokens,
                cfg.evaluate.batch_size,
                args.device,
            )
        )

    per_checkpoint = first / 2
    print(f"## Evaluation speed ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(
        f"- model: the default config's, "
        f"{sum(p.numel() for p in Transformer(**model_config).parameters()):,} "
        f"parameters; {scored:,} validation tokens in windows of {cfg.model.context_length + 1}, "
        f"batch {cfg.evaluate.batch_size}"
    )
    print(
        f"- device: {args.device} ({dtype}), torch {torch.__version__}, {cfg.evaluate.threads} threads, "
        f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores; load average "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    print("| run | checkpoints scored | seconds |\n|---|---:|---:|")
    print(f"| two checkpoints, empty cache | 2 | {first:.2f} |")
    print(f"| rerun after one more checkpoint | 1 | {more:.2f} |")
    print(f"| rerun, nothing new | 0 | {again:.2f} |")
    print()
    print(f"- **{per_checkpoint / scored * 1e6:.1f} s per million validation tokens** per checkpoint")
    print(
        f"- the same windows scored by a plain PyTorch loop (`F.cross_entropy`, sum) for one checkpoint: "
        f"{plain:.2f} s; tinylm's evaluation per checkpoint / that: **{per_checkpoint / plain:.2f}x** "
        f"(summed loss {plain_loss:.6g} vs {table.iloc[0]['val_loss'] * (scored - 1):.6g} nats)"
    )
    print(
        f"- the rerun after one more checkpoint cost **{more / per_checkpoint:.2f}x** "
        f"one checkpoint's evaluation; "
        f"with nothing new {again:.2f} s (hashing the checkpoints and the tokens)"
    )
    print(f"- final row: {table.iloc[-1].to_dict()}", file=sys.stderr)


if __name__ == "__main__":
    main()
