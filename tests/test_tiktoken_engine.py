"""The tiktoken engine: exactly the reference encoder's ids where its checks pass, the reference
where they fail, on mixed scripts, random vocabularies and the encode stage's chunks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm.tokenizer import GPT2_PATTERN, Tokenizer, encode_corpus, train_bpe

SPECIAL = "<|endoftext|>"

# Short runs of many scripts and whitespace kinds; joined at random they make mixed text.
MIXED = [
    "The quick brown fox", " jumps", " over", " the lazy dog.", " It's", " they'll", " 1984", " $3.50",
    " Привет", " мир", ", как дела?", " Καλημέρα", " κόσμε", " 日本語のテキスト", "中文", " 한국어",
    " 🙂", "👍🏽", " 🇫🇷", " naïve café", " e\u0301", "\u00a0", "  ", "   ", "\n", "\n\n", "\n\n\n",
    " \n", "\t", "\r\n", "    indented", "\u2019s", " — ", "...", "!!", "(x)", SPECIAL,
]  # fmt: skip


def mixed_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(MIXED) for _ in range(pieces))


@pytest.fixture(scope="module")
def merges(tmp_path_factory):
    """(vocab, merges) trained on mixed text."""
    path = tmp_path_factory.mktemp("engine") / "train.txt"
    path.write_text(mixed_text(random.Random(0), 40_000), "utf-8")
    return train_bpe(path, 700, [SPECIAL], num_workers=1, progress=False)


def test_trained_vocabulary_takes_tiktoken_and_gives_the_reference_ids(merges):
    vocab, merge_list = merges
    fast = Tokenizer(vocab, merge_list, [SPECIAL])
    reference = Tokenizer(vocab, merge_list, [SPECIAL], engine="python")
    assert fast.tiktoken_engine() is not None, fast.tiktoken_refusal
    rng = random.Random(1)
    for _ in range(30):
        text = mixed_text(rng, rng.randint(0, 400))
        ids = fast.encode_array(text)
        assert ids.dtype == np.uintc
        assert ids.tolist() == reference.encode(text)
    # special tokens at the very edges and next to each other
    for text in [SPECIAL, SPECIAL * 3, f"{SPECIAL}  \n{SPECIAL}", f" x{SPECIAL}", f"{SPECIAL}x ", ""]:
        assert fast.encode(text) == reference.encode(text)


@pytest.fixture(scope="module")
def engines(merges):
    """(tiktoken engine, reference engine) with the trained merges."""
    vocab, merge_list = merges
    return (
        Tokenizer(vocab, merge_list, [SPECIAL], engine="tiktoken"),
        Tokenizer(vocab, merge_list, [SPECIAL], engine="python"),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_engines_agree_on_arbitrary_unicode(engines, text):
    fast, reference = engines
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates: not text a file holds
    assert fast.encode(text) == reference.encode(text)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), alphabet=st.sampled_from(["ab", "abc ", "aab  b\n", "xyzzy x"]))
def test_random_small_vocabularies_pass_the_checks_and_agree(tmp_path_factory, seed, alphabet):
    # Tiny alphabets make many overlapping merges (aa, aaa, aab, ...), the hard cases for tiktoken.
    rng = random.Random(seed)
    path = tmp_path_factory.mktemp("small") / "train.txt"
    path.write_text("".join(rng.choice(alphabet) for _ in range(rng.randint(20, 400))), "utf-8")
    vocab, merge_list = train_bpe(
        path, 256 + 1 + rng.randint(1, 40), [SPECIAL], num_workers=1, progress=False
    )
    fast = Tokenizer(vocab, merge_list, [SPECIAL], engine="tiktoken")  # raises if the checks fail
    reference = Tokenizer(vocab, merge_list, [SPECIAL], engine="python")
    for _ in range(20):
        text = "".join(rng.choice(alphabet + "é") for _ in range(rng.randint(0, 60)))
        assert fast.encode(text) == reference.encode(text), text


def byte_vocab(merges: list[tuple[bytes, bytes]]) -> dict[int, bytes]:
    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    return vocab


def test_a_token_its_bytes_do_not_reach_is_refused_and_tiktoken_would_differ():
    # "bc" before "ab": the bytes "abcd" become a, bc, d and never meet the merge (ab, cd).
    merges = [(b"b", b"c"), (b"a", b"b"), (b"c", b"d"), (b"ab", b"cd")]
    vocab = byte_vocab(merges)
    auto = Tokenizer(vocab, merges)
    assert auto.tiktoken_engine() is None and auto.tiktoken_refusal.startswith("C4:")
    assert auto.encode("abcd") == [ord("a"), 256, ord("d")]  # the reference's ids
    # tiktoken itself, given these ranks, returns the whole pre-token as one token:
    naive = tiktoken.Encoding(
        "naive", pat_str=GPT2_PATTERN, mergeable_ranks=auto.tiktoken_ranks(), special_tokens={}
    )
    assert naive.encode("abcd") == [259]
    with pytest.raises(ValueError, match="C4"):
        Tokenizer(vocab, merges, engine="tiktoken").encode("abcd")


@pytest.mark.parametrize(
    ("vocab_edit", "merges", "condition"),
    [
        (lambda v: v | {300: b"ab"}, [(b"a", b"b")], "C1"),  # a second id with the bytes of a token
        (lambda v: v, [(b"a", b"b"), (b"abc", b"d")], "C2"),  # a part that no earlier merge makes
        (lambda v: v | {258: b"zz"}, [(b"a", b"b")], "C2"),  # a token that no merge makes
        (lambda v: {**{i: t for i, t in v.items() if i < 256}, 257: b"ab", 256: b"cd"},
         [(b"a", b"b"), (b"c", b"d")], "C3"),  # ids that do not grow with merge rank
    ],
)  # fmt: skip
def test_each_condition_is_checked(vocab_edit, merges, condition):
    vocab = byte_vocab([m for m in merges if len(m[0]) == 1 and len(m[1]) == 1])
    vocab = vocab_edit(vocab)
    for a, b in merges:
        if a + b not in vocab.values():
            vocab[max(vocab) + 1] = a + b
        for part in (a, b):
            if part not in vocab.values():
                vocab[max(vocab) + 1] = part
    tok = Tokenizer(vocab, merges)
    assert tok.tiktoken_engine() is None and tok.tiktoken_refusal.startswith(condition + ":"), (
        tok.tiktoken_refusal
    )
    reference = Tokenizer(vocab, merges, engine="python")
    for text in ["abcd abab zz", "cdab", "ab"]:
        assert tok.encode(text) == reference.encode(text)


def test_special_tokens_that_prefix_others_are_split_by_us(merges):
    vocab, merge_list = merges
    specials = [SPECIAL, "<|end", "<|endoftext|>!"]
    fast = Tokenizer(vocab, merge_list, specials)
    reference = Tokenizer(vocab, merge_list, specials, engine="python")
    assert fast.tiktoken_engine() is not None
    for text in ["a<|endoftext|>!b", "<|end<|endoftext|>", "<|endoftext|>", "x<|endo"]:
        assert fast.encode(text) == reference.encode(text)


def test_encode_stage_gives_the_reference_ids_at_chunk_edges(merges, tmp_path, monkeypatch):
    # Many small chunks: special tokens and whitespace runs fall at chunk edges.
    import importlib

    module = importlib.import_module("tinylm.tokenizer.encode")
    monkeypatch.setattr(module, "ENCODE_CHUNK_BYTES", 2_000)
    vocab, merge_list = merges
    text = mixed_text(random.Random(5), 20_000)
    src = tmp_path / "valid.txt"
    src.write_text(text, "utf-8")
    expected = Tokenizer(vocab, merge_list, [SPECIAL], engine="python").encode(text)
    for workers in (1, 2):
        out = tmp_path / f"tokens{workers}.npy"
        encode_corpus(Tokenizer(vocab, merge_list, [SPECIAL]), src, out, num_workers=workers, progress=False)
        assert np.load(out).tolist() == expected
