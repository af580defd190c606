"""encode_corpus: a text file -> uint16 .npy, identical to encoding the whole text, for any number of
workers; bad input raises and leaves nothing behind."""

from __future__ import annotations

import importlib
import io
import logging
import random

import numpy as np
import pytest

from tinylm.tokenizer import Tokenizer, encode_corpus, train_bpe

# the package exports the function encode_corpus under the module's name; fetch the module itself
encode_corpus_module = importlib.import_module("tinylm.tokenizer.encode")

WORDS = [
    "the",
    " cat",
    "sat",
    "on",
    "ünïcode",
    "日本",
    "42",
    "!!",
    "it's",
    "  ",
    "\n",
    "\n\n",
    " \n",
    "\t",
    "é",
]


def make_corpus(rng: random.Random, num_words: int, special: str | None) -> str:
    words = WORDS + ([special] if special else [])
    return "".join(rng.choice(words) + rng.choice(["", " ", " ", "\n"]) for _ in range(num_words))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(make_corpus(random.Random(0), 20_000, "<|endoftext|>"), "utf-8")
    vocab, merges = train_bpe(path, 400, ["<|endoftext|>"], num_workers=1, progress=False)
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


@pytest.mark.parametrize("special", [None, "<|endoftext|>"])
def test_matches_encoding_the_whole_text_for_any_workers(tokenizer, tmp_path, monkeypatch, special):
    monkeypatch.setattr(encode_corpus_module, "ENCODE_CHUNK_BYTES", 10_000)  # many chunks
    text = make_corpus(random.Random(1), 50_000, special)
    src = tmp_path / "valid.txt"
    src.write_text(text, "utf-8")
    expected = tokenizer.encode(text)
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"tokens_{workers}.npy"
        n = encode_corpus(tokenizer, src, out, num_workers=workers, progress=False)
        ids = np.load(out, mmap_mode="r")
        assert ids.dtype == np.uint16 and ids.shape == (n,)
        assert ids.tolist() == expected
        saved = io.BytesIO()
        np.save(saved, np.array(expected, dtype=np.uint16))
        assert out.read_bytes() == saved.getvalue()  # the very bytes np.save writes
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens_1.npy", "tokens_3.npy", "valid.txt"]


def test_empty_file_gives_an_empty_array(tokenizer, tmp_path):
    src = tmp_path / "empty.txt"
    src.write_text("", "utf-8")
    assert encode_corpus(tokenizer, src, tmp_path / "out.npy", num_workers=2, progress=False) == 0
    assert np.load(tmp_path / "out.npy").shape == (0,)


def test_refuses_ids_beyond_uint16(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {70_000: b"ab"}
    tok = Tokenizer(vocab, [(b"a", b"b")])
    src = tmp_path / "t.txt"
    src.write_text("ab ab", "utf-8")
    with pytest.raises(ValueError, match="70000.*65536"):
        encode_corpus(tok, src, tmp_path / "out.npy", progress=False)
    assert not (tmp_path / "out.npy").exists()


def test_bad_input_raises_and_leaves_nothing(tokenizer, tmp_path):
    out_dir = tmp_path / "tokens"
    out_dir.mkdir()
    previous = out_dir / "train.npy"
    previous.write_bytes(b"previous")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(("fine line\n" * 5000).encode() + b"\xff tail\n" + b"more text\n" * 5000)
    with pytest.raises(ValueError, match=r"bad\.txt.*byte offset 50000"):
        encode_corpus(tokenizer, bad, previous, num_workers=2, progress=False)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        encode_corpus(tokenizer, tmp_path / "missing.txt", previous, progress=False)
    assert previous.read_bytes() == b"previous"
    assert [p.name for p in out_dir.iterdir()] == ["train.npy"]  # no temporary files left


def test_invalid_utf8_can_be_replaced(tokenizer, tmp_path, caplog):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"caf\xe9 ok \xf0\x9f")
    with caplog.at_level(logging.WARNING):
        n = encode_corpus(tokenizer, src, tmp_path / "out.npy", errors="replace", progress=False)
    assert np.load(tmp_path / "out.npy").tolist() == tokenizer.encode("caf\ufffd ok \ufffd") and n > 0
    assert "replaced 3 invalid UTF-8 bytes" in caplog.text
