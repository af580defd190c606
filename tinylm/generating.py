"""Sampling text from a trained model: temperature, top-p (nucleus) and a seeded generator."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import torch

from tinylm import state as state_lib
from tinylm.io import atomic_write_text
from tinylm.model import Transformer
from tinylm.nn_utils import softmax
from tinylm.tokenizer import Tokenizer


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`; renormalize.

    probs: [..., V] probabilities. The most likely token is always kept. Ties at the boundary are
    resolved by the (stable) sort order, so the result is deterministic.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token id from the last-position logits [V]; temperature 0 means greedy (argmax)."""
    logits = logits.float()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = top_p_filter(softmax(logits / temperature, dim=-1), top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, context_length: int,
             temperature: float = 1.0, top_p: float = 1.0, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Extend `prompt_ids` by up to `max_new_tokens` sampled ids; returns only the new ids.

    The context is cropped to the last `context_length` ids. Generation stops after `eos_id`
    (which is included in the result) or after `max_new_tokens`.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt encodes to no tokens; give at least one character")
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-context_length:]], dtype=torch.long, device=device)
        next_id = sample_next(model(context)[0, -1].cpu(), temperature, top_p, generator)
        ids.append(next_id)
        new.append(next_id)
        if next_id == eos_id:
            break
    return new


def write_samples(gen_cfg, checkpoint_dir: str | os.PathLike, tokenizer_path: str | os.PathLike,
                  output_path: str | os.PathLike, eval_path: str | os.PathLike | None = None) -> str:
    """Sample a completion for every configured prompt from the newest checkpoint; write them all.

    The checkpoint is verified against its manifest and loaded with weights_only=True; the model is
    rebuilt from the config stored in it. One generator seeded with `gen_cfg.seed` draws every
    sample, so the file is reproducible. With `eval_path` (eval.csv) the header quotes the
    checkpoint's exact validation loss.
    """
    steps = state_lib.published_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no committed checkpoints (step_N.pt with step_N.json)")
    path = Path(checkpoint_dir) / f"step_{steps[-1]}.pt"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    payload, _ = state_lib.load_verified(path, map_location=device)
    tokenizer = Tokenizer.load(tokenizer_path)
    config = payload["model_config"]
    if config["vocab_size"] != len(tokenizer.vocab):
        raise ValueError(f"{path}: model vocabulary {config['vocab_size']} differs from {tokenizer_path}'s "
                         f"{len(tokenizer.vocab)}")
    torch.set_num_threads(gen_cfg.threads)
    model = Transformer(**config, device=device)
    model.load_state_dict(payload["model"])
    if "<|endoftext|>" not in tokenizer.special_ids:
        raise ValueError(f"{tokenizer_path}: has no <|endoftext|> special token to end samples with")
    eos_id = tokenizer.special_ids["<|endoftext|>"]
    generator = torch.Generator().manual_seed(gen_cfg.seed)

    parts = [f"# tinylm samples: checkpoint step {steps[-1]}, temperature {gen_cfg.temperature}, "
             f"top_p {gen_cfg.top_p}, seed {gen_cfg.seed}\n"]
    if eval_path is not None:
        rows = pd.read_csv(eval_path, comment="#")  # eval.csv starts with `#` note lines
        row = rows[rows["step"] == steps[-1]]
        if row.empty:
            raise ValueError(f"{eval_path}: has no row for step {steps[-1]}; rerun the evaluate stage")
        parts.append(f"# exact validation loss {row['val_loss'].iloc[0]:.4f} nats per token, "
                     f"{row['bits_per_byte'].iloc[0]:.4f} bits per byte\n")
    for i, prompt in enumerate(gen_cfg.prompts, start=1):
        new = generate(model, tokenizer.encode(prompt), gen_cfg.max_new_tokens, config["context_length"],
                       gen_cfg.temperature, gen_cfg.top_p, eos_id, generator)
        ended = "stopped at <|endoftext|>" if new and new[-1] == eos_id else f"{len(new)} tokens"
        completion = tokenizer.decode([t for t in new if t != eos_id])
        parts.append(f"\n===== sample {i} ({ended}) =====\n----- prompt -----\n{prompt}\n"
                     f"----- completion -----\n{completion}\n")
    text = "".join(parts)
    atomic_write_text(output_path, text)
    return text
