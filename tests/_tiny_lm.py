"""A tiny language model briefly trained on generated multi-script text, published as a checkpoint.

Used by the generation, sampling and export tests: it is small enough to train in a second, and
trained enough that greedy decoding does not just repeat one token.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from tinylm import published as published_lib
from tinylm import state as state_lib
from tinylm.model import Transformer
from tinylm.tokenizer import Tokenizer, train_bpe

SPECIALS = ["<|endoftext|>", "<|pad|>"]
WORDS = (
    "the king said that we shall go to sea and the queen spoke of love at night, "
    "but it's late: you'll hear 42 ships"
).split()
OTHER_SCRIPTS = [
    "日本語",
    "東京",
    "привет",
    "мир",
    "ελληνικά",
    "العربية",
    "हिन्दी",
    "한국어",
    "naïve",
    "Straße",
    "café",
    "e\u0301",
]
EMOJI = ["🙂", "👍🏽", "🇫🇷", "🚀", "❤️", "👨‍👩‍👧"]
SPACES = [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "\u00a0", " \t "]
# vocab_size 320 with the byte tokens and these special tokens; rope_theta away from the default, so
# an export that lost it would show.
MODEL = dict(
    vocab_size=320, context_length=64, d_model=16, num_layers=2, num_heads=2, d_ff=40, rope_theta=500.0
)


def mixed_text(rng: random.Random, num_pieces: int) -> str:
    """English words, other scripts, emoji, numbers, punctuation and whitespace runs, with special tokens."""
    out = []
    for _ in range(num_pieces):
        r = rng.random()
        if r < 0.6:
            piece = rng.choice(WORDS)
        elif r < 0.75:
            piece = rng.choice(OTHER_SCRIPTS)
        elif r < 0.85:
            piece = rng.choice(EMOJI)
        elif r < 0.9:
            piece = str(rng.randint(0, 99999))
        elif r < 0.97:
            piece = rng.choice([".", ",", "!?", "--", "(", ")", "'", '"', "—", "…"])
        else:
            piece = rng.choice(SPECIALS)
        out.append(piece + rng.choice(SPACES))
    return "".join(out)


def build_tiny_lm(folder: Path, steps: int = 150) -> dict:
    """Train tokenizer and model in `folder`; publish the model as step `steps` in folder/ckpt."""
    text = mixed_text(random.Random(0), 6000)
    (folder / "train.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(
        folder / "train.txt", MODEL["vocab_size"], SPECIALS, num_workers=1, progress=False
    )
    tokenizer = Tokenizer(vocab, merges, SPECIALS)
    tokenizer.save(folder / "tokenizer.json")

    data = torch.tensor(tokenizer.encode(text))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread, whatever else runs
    torch.manual_seed(0)
    model = Transformer(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    T = MODEL["context_length"]
    for _ in range(steps):
        starts = torch.randint(len(data) - T - 1, (16,), generator=generator)
        x = torch.stack([data[s : s + T] for s in starts])
        y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    payload = {"model": model.state_dict(), "optimizer": {}, "iteration": steps, "model_config": dict(MODEL)}
    manifest = {
        "world_size": 1,
        "tokens_seen": steps * 16 * MODEL["context_length"],
        "model_config": dict(MODEL),
    }
    state_lib.commit(folder / "state", steps, payload, manifest)
    published_lib.publish(folder / "state", folder / "ckpt")
    return {
        "tokenizer": folder / "tokenizer.json",
        "checkpoints": folder / "ckpt",
        "step": steps,
        "text": text,
    }
