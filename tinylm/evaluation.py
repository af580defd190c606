"""Exact validation metrics of every checkpoint: fixed, non-overlapping windows over the whole file.

The validation tokens are cut into consecutive windows of `context_length + 1` tokens that share
their boundary token (window i covers tokens[i*T : i*T + T + 1]), so every token after the first is
predicted exactly once, with as much context as its window gives. No sampling: the numbers are
exact and reproducible. Bits per byte divides the summed loss (in bits) by the UTF-8 bytes of the
predicted tokens, which makes it comparable across vocabularies.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tinylm import state as state_lib
from tinylm.data import load_tokens
from tinylm.io import atomic_path
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy

COLUMNS = ["step", "tokens_seen", "val_loss", "val_ppl", "bits_per_byte", "unigram_entropy", "gap_to_unigram"]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the empirical token distribution: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_byte_lengths(vocab: dict[int, bytes]) -> np.ndarray:
    """UTF-8 byte length of every token id."""
    lengths = np.zeros(max(vocab) + 1, dtype=np.int64)
    for i, b in vocab.items():
        lengths[i] = len(b)
    return lengths


@torch.no_grad()
def exact_loss(model: Transformer, tokens: np.ndarray, context_length: int, batch_size: int,
               device: torch.device | str = "cpu") -> tuple[float, int]:
    """Summed cross-entropy (nats) over every predicted token of `tokens`, and their number."""
    model.eval()
    n = len(tokens)
    starts = list(range(0, n - 1, context_length))
    total, count = 0.0, 0
    for b in range(0, len(starts), batch_size):
        batch_starts = starts[b:b + batch_size]
        # Windows in one batch share a length; only the last window of the file can be shorter.
        full = [s for s in batch_starts if s + context_length + 1 <= n]
        rest = [s for s in batch_starts if s + context_length + 1 > n]
        for group, length in ((full, context_length + 1), *(([s], n - s) for s in rest)):
            if not group:
                continue
            windows = np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in group])
            w = torch.from_numpy(windows).to(device)
            targets = w[:, 1:]
            total += cross_entropy(model(w[:, :-1]).float(), targets).item() * targets.numel()
            count += targets.numel()
    return total, count


def evaluate_checkpoints(checkpoint_dir: str | os.PathLike, valid_tokens_path: str | os.PathLike,
                         vocab: dict[int, bytes], batch_size: int = 32, device: str = "cpu") -> pd.DataFrame:
    """One row per published checkpoint in `checkpoint_dir` (ascending step); see COLUMNS.

    Each checkpoint is verified against its manifest and loaded with weights_only=True. Validation
    data must use ids of this vocabulary.
    """
    steps = state_lib.published_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no committed checkpoints (step_N.pt with step_N.json)")
    vocab_size = len(vocab)
    tokens = load_tokens(valid_tokens_path, vocab_size)
    byte_len = token_byte_lengths(vocab)
    predicted_bytes = int(byte_len[np.asarray(tokens[1:], dtype=np.int64)].sum())
    entropy = unigram_entropy(tokens, vocab_size)

    rows = []
    for step in steps:
        path = Path(checkpoint_dir) / f"step_{step}.pt"
        payload, _ = state_lib.load_verified(path, map_location=device)
        config = payload["model_config"]
        if config["vocab_size"] != vocab_size:
            raise ValueError(f"{path}: model vocabulary {config['vocab_size']} differs from the tokenizer's {vocab_size}")
        model = Transformer(**config, device=device)
        model.load_state_dict(payload["model"])
        total, count = exact_loss(model, tokens, config["context_length"], batch_size, device)
        loss = total / count
        rows.append({
            "step": step,
            "tokens_seen": int(payload["tokens_seen"]),
            "val_loss": loss,
            "val_ppl": math.exp(loss),
            "bits_per_byte": total / math.log(2) / predicted_bytes,
            "unigram_entropy": entropy,
            "gap_to_unigram": entropy - loss,
        })
        print(f"[evaluate] step {step}: val_loss {loss:.4f} ({count} tokens), "
              f"{rows[-1]['bits_per_byte']:.3f} bits/byte, unigram entropy {entropy:.4f}", file=sys.stderr)
    return pd.DataFrame(rows, columns=COLUMNS)


def write_eval(table: pd.DataFrame, csv_path: str | os.PathLike, plot_path: str | os.PathLike | None) -> None:
    """Write the table as CSV (fixed float format) and the loss curve as PNG, both atomically."""
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f")
    if plot_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(table["step"], table["val_loss"], marker="o", label="validation loss (exact)")
    ax.axhline(table["unigram_entropy"].iloc[0], color="gray", linestyle="--", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title("tinylm validation loss")
    ax.legend()
    fig.tight_layout()
    with atomic_path(plot_path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
