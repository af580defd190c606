"""Shared fixtures."""

import random
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test starts with one torch thread. The tensors here are small: a second OpenMP thread
    gains little on an idle machine and, when the other core is busy, makes small ops many times
    slower (its threads spin-wait for each other). Tests that want more threads set them."""
    torch.set_num_threads(1)


WORDS = (
    "the king queen lord lady sword crown love night day speak hear come go castle ghost storm "
    "sea ship island father son daughter brother sister friend enemy war peace"
).split()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict:
    """A small generated corpus, its tokenizer and token files."""
    from tinylm.tokenizer import Tokenizer, encode_corpus, train_tokenizer

    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    docs = []
    for _ in range(400):
        lines = [
            f"{rng.choice(WORDS).upper()}:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            for _ in range(rng.randint(2, 6))
        ]
        docs.append("\n\n".join(lines))
    (folder / "train.txt").write_text("<|endoftext|>".join(docs[:360]))
    (folder / "valid.txt").write_text("<|endoftext|>".join(docs[360:]))
    tok_path = folder / "tokenizer.json"
    train_tokenizer(folder / "train.txt", tok_path, 300, ["<|endoftext|>"], num_workers=1)
    tokenizer = Tokenizer.load(tok_path)
    for split in ("train", "valid"):
        encode_corpus(tokenizer, folder / f"{split}.txt", folder / f"{split}.npy", num_workers=1)
    return {"tokenizer": tok_path, "train": folder / "train.npy", "valid": folder / "valid.npy"}


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> dict:
    """A tiny model briefly trained on multi-script text, its tokenizer and its published checkpoint."""
    from helpers import build_tiny_lm

    return build_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))
