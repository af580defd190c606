"""BPE training against a naive reference trainer; chunking and workers; the train-tokenizer stage
and its errors on bad input."""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import tempfile
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
import regex
from _reference_bpe import descending_key, reference_merges
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.tokenizer import Tokenizer, train_bpe, train_tokenizer
from tinylm.tokenizer import pair_index as pair_index_module
from tinylm.tokenizer import pretokenize as pretokenize_module
from tinylm.tokenizer.pretokenize import find_chunk_boundaries, pretokenize

ROOT = Path(__file__).resolve().parents[1]

# Written out here rather than imported, so that a typo in the package's copy shows up.
GPT2_SPLIT = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def naive_train_bpe(text: str, vocab_size: int, special_tokens: list[str]):
    """Reference trainer: recount every pair before every merge. Slow, short, obviously right.

    Special tokens here must not overlap one another (re.split picks the first alternative).
    """
    parts = regex.split("|".join(regex.escape(t) for t in special_tokens), text) if special_tokens else [text]
    words = Counter(
        tuple(bytes([b]) for b in piece.encode("utf-8"))
        for part in parts
        for piece in GPT2_SPLIT.findall(part)
    )
    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    merges = []
    while len(vocab) < vocab_size:
        pairs = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))  # ties: greater (bytes, bytes)
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return vocab, merges


def write(folder: Path, name: str, data: str | bytes) -> Path:
    path = folder / name
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


# Few letters, repeated words and runs like "aaaa" / "abab" make ties and overlapping pairs common.
tie_corpus = st.lists(
    st.one_of(
        st.text(alphabet="ab c\n", min_size=1, max_size=8),
        st.sampled_from(["ab", "ba", " ab", "aaaa", "abab", "cc", " c", "'s", "<|eot|>", "é", "\t"]),
    ),
    min_size=1,
    max_size=40,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=tie_corpus, extra=st.integers(1, 40))
def test_train_bpe_matches_naive_reference(text, extra):
    specials = ["<|eot|>"]
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), "corpus.txt", text)
        if not any(not p.isspace() for p in pretokenize(text, specials)):
            with pytest.raises(ValueError, match="no text"):
                train_bpe(path, 257 + extra, specials, num_workers=1, progress=False)
            return
        got = train_bpe(path, 257 + extra, specials, num_workers=1, progress=False)
    assert got == naive_train_bpe(text, 257 + extra, specials)


def test_train_bpe_matches_naive_reference_on_generated_text(tmp_path):
    rng = random.Random(0)
    words = [
        "the",
        "then",
        "there",
        "he",
        "here",
        "a",
        "ab",
        "ba",
        "low",
        "lower",
        "newest",
        "widest",
        "1999",
    ]
    text = "".join(
        rng.choice(words) + rng.choice([" ", " ", ", ", ".\n", "<|endoftext|>"]) for _ in range(3000)
    )
    path = write(tmp_path, "corpus.txt", text)
    got = train_bpe(path, 400, ["<|endoftext|>"], num_workers=1, progress=False)
    assert got == naive_train_bpe(text, 400, ["<|endoftext|>"])


def load_make_corpus():
    """bench/make_corpus.py, the generator of corpus-scale text, imported from its file."""
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "bench" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("profile", ["stories", "web"])
def test_train_bpe_matches_the_reference_trainer_on_generated_corpora(tmp_path, monkeypatch, profile):
    # Many merges on realistic text (runs of spaces and dashes, non-ASCII, long rare words), with
    # the build in small slices so that every slice boundary is crossed; checked against the
    # independent heap-and-lists trainer, for one and for several workers.
    make_corpus = load_make_corpus()
    path = tmp_path / "corpus.txt"
    with open(path, "wb") as f:
        make_corpus.generate(profile, 400_000, f, seed=3, num_workers=1, batch_words=20_000)
    monkeypatch.setattr(pretokenize_module, "CHUNK_BYTES", 50_000)
    monkeypatch.setattr(pair_index_module.PairIndex, "BUILD_POSITIONS", 10_007)
    counts = pretokenize_module.count_pretokens(path, ["<|endoftext|>"], num_workers=1, progress=False)
    expected = reference_merges(counts, 1, 1500 - 257)
    vocab, merges = train_bpe(path, 1500, ["<|endoftext|>"], num_workers=1, progress=False)
    assert merges == expected and len(vocab) == 1500
    assert train_bpe(path, 1500, ["<|endoftext|>"], num_workers=3, progress=False) == (vocab, merges)


@pytest.mark.parametrize("seed", range(6))
def test_eager_compaction_and_tiny_build_slices_keep_the_merges(tmp_path, monkeypatch, seed):
    # Compacting a record as soon as it holds more than 4 entries per occurrence left (and the
    # byte-pair table once most bytes are merged), and building in slices of a few positions, must
    # not change a merge: the pruned entries are exactly the ones that no longer hold their pair.
    monkeypatch.setattr(pair_index_module.PairIndex, "COMPACT_MIN", 0)
    monkeypatch.setattr(pair_index_module.PairIndex, "BUILD_POSITIONS", 5)
    rng = random.Random(seed)
    pieces = ["a", "b", "ab", "ba", "aaaa", "abab", " ", "  ", "-", "--", "é", "x", "\n", "<|e|>"]
    text = "".join(rng.choice(pieces) for _ in range(2000))
    path = write(tmp_path, "corpus.txt", text)
    got = train_bpe(path, 257 + 120, ["<|e|>"], num_workers=1, progress=False)
    assert got == naive_train_bpe(text, 257 + 120, ["<|e|>"])


def test_ties_go_to_the_greater_pair(tmp_path):
    # every pair occurs once: ("c", "d") > ("b", "c") > ("a", "b")
    vocab, merges = train_bpe(write(tmp_path, "t.txt", "abcd"), 256 + 3, [], progress=False)
    assert merges == [(b"c", b"d"), (b"b", b"cd"), (b"a", b"bcd")]
    assert vocab[256] == b"cd" and vocab[258] == b"abcd"


def test_ids_are_bytes_then_specials_then_merges(tmp_path):
    vocab, merges = train_bpe(
        write(tmp_path, "t.txt", "hello hello<|a|>hello"), 262, ["<|a|>", "<|b|>"], progress=False
    )
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert vocab[256] == b"<|a|>" and vocab[257] == b"<|b|>"
    assert [vocab[258 + i] for i in range(len(merges))] == [a + b for a, b in merges]
    assert all(b"<|" not in t for t in vocab.values() if t not in (b"<|a|>", b"<|b|>"))  # never merged


def test_stops_when_no_pairs_are_left(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        vocab, merges = train_bpe(write(tmp_path, "t.txt", "ab ab"), 1000, [], progress=False)
    assert merges == [(b"a", b"b"), (b" ", b"ab")]
    assert len(vocab) == 258 and "no pairs left" in caplog.text


def test_descending_key_reverses_byte_order():
    rng = random.Random(0)
    tokens = list({bytes(rng.choice(b"ab\x00\xff") for _ in range(rng.randint(1, 4))) for _ in range(300)})
    pairs = [(a, b) for a in tokens[:40] for b in tokens[:40]]
    assert sorted(pairs, reverse=True) == sorted(
        pairs, key=lambda p: descending_key(p[0]) + descending_key(p[1])
    )


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_ascii_fast_path_splits_like_the_gpt2_regex(text):
    assert pretokenize_module.find_pretokens(text) == GPT2_SPLIT.findall(text)


# --- chunks and workers ---------------------------------------------------------------------------


def varied_text(rng: random.Random, num_words: int, special: str | None) -> str:
    words = [
        "the",
        " cat",
        "sat",
        "on",
        "ünïcode",
        "日本",
        "42",
        "!!",
        "it's",
        "'ll",
        "  ",
        "\n",
        "\n\n",
        " \n",
        "\t",
    ]
    if special:
        words += [special] * 2
    return "".join(rng.choice(words) + rng.choice(["", " ", "\n"]) for _ in range(num_words))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_chunks=st.integers(2, 40),
    special=st.sampled_from([None, "<|endoftext|>"]),
)
def test_chunk_boundaries_keep_pretokens_identical(seed, num_chunks, special):
    specials = [special] if special else []
    text = varied_text(random.Random(seed), 300, special)
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), "t.txt", text)
        bounds = find_chunk_boundaries(path, num_chunks, specials, block_bytes=16)
    data = text.encode("utf-8")
    assert bounds[0] == 0 and bounds[-1] == len(data) and bounds == sorted(set(bounds))
    chunks = [data[a:b].decode("utf-8") for a, b in pairwise(bounds)]  # decodes: on char boundaries
    assert [p for c in chunks for p in pretokenize(c, specials)] == pretokenize(text, specials)
    # About a thousand bytes with a safe split every few bytes: (nearly) every chunk asked for exists.
    assert len(data) > 16 * num_chunks and len(bounds) - 1 >= 0.75 * num_chunks


# Special tokens that contain spaces, overlap themselves ("a a" in "a a a") and one another.
TRICKY_SPECIALS = ["<|endoftext|>", "a a", "<s> x", "x</s>", "<s> x</s>"]


def pieces(text: str, specials: list[str]) -> list[tuple[bool, str]]:
    """(is special, text) for each special token and pre-token, as encoding sees them."""
    ordered = sorted(specials, key=len, reverse=True)  # longest match first
    parts = regex.split("(" + "|".join(regex.escape(t) for t in ordered) + ")", text)
    return [
        (i % 2 == 1, p)
        for i, part in enumerate(parts)
        for p in ([part] if i % 2 else GPT2_SPLIT.findall(part))
    ]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from([*TRICKY_SPECIALS, "a", " ", "\n", "x", "<s>", "</s>", "é", "  ", " \n", "1"]),
        max_size=30,
    ),
    as_bytes=st.booleans(),
)
def test_find_split_is_safe(parts, as_bytes):
    text = "".join(parts)
    data = text.encode() if as_bytes else text
    specials = [t.encode() for t in TRICKY_SPECIALS] if as_bytes else TRICKY_SPECIALS
    margin = max(map(len, specials))
    for lo in range(len(data)):
        cut = pretokenize_module.find_split(data, lo, max(lo, len(data) - margin), specials)
        if cut is None:
            continue
        assert lo <= cut < len(data) - margin
        left, right = (data[:cut].decode(), data[cut:].decode()) if as_bytes else (data[:cut], data[cut:])
        assert pieces(left, TRICKY_SPECIALS) + pieces(right, TRICKY_SPECIALS) == pieces(text, TRICKY_SPECIALS)


def test_chunk_boundaries_prefer_special_tokens(tmp_path):
    text = "one two three\nfour five<|endoftext|>six seven eight nine\nten<|endoftext|>eleven"
    bounds = find_chunk_boundaries(write(tmp_path, "t.txt", text), 3, ["<|endoftext|>"], block_bytes=64)
    specials_at = [i for i in range(len(text)) if text.startswith("<|endoftext|>", i)]
    assert bounds[1:-1] and set(bounds[1:-1]) <= set(specials_at)


@pytest.mark.parametrize("special", [None, "<|endoftext|>"])
def test_num_workers_do_not_change_the_result(tmp_path, monkeypatch, special):
    monkeypatch.setattr(pretokenize_module, "CHUNK_BYTES", 20_000)  # many chunks
    specials = [special] if special else []
    path = write(tmp_path, "corpus.txt", varied_text(random.Random(1), 60_000, special))
    one = train_bpe(path, 700, specials, num_workers=1, progress=False)
    four = train_bpe(path, 700, specials, num_workers=4, progress=False)
    assert one == four
    counts = pretokenize_module.count_pretokens(path, specials, num_workers=4, progress=False)
    assert counts == Counter(pretokenize(path.read_text("utf-8"), specials))


@pytest.mark.parametrize(("size", "workers"), [(300_000, 2), (300_000, 1), (300_000, 5), (3_000_000, 2)])
def test_tasks_are_sized_by_the_input_and_the_workers(tmp_path, monkeypatch, size, workers):
    # CHUNK_BYTES scaled down 10x: 300 KB stands for a 3 MB corpus, 3 MB for 30 MB.
    monkeypatch.setattr(pretokenize_module, "CHUNK_BYTES", 100_000)
    monkeypatch.setattr(pretokenize_module, "TASK_CHUNKS", 4)
    path = write(tmp_path, "corpus.txt", varied_text(random.Random(3), size // 5, "<|endoftext|>"))
    size = path.stat().st_size
    tasks = pretokenize_module.plan_tasks(path, workers, ["<|endoftext|>"])
    chunks = [chunk for task in tasks for chunk in task]
    # the chunks tile the file, in order
    assert chunks[0][0] == 0 and chunks[-1][1] == size and all(a[1] == b[0] for a, b in pairwise(chunks))
    task_bytes = [task[-1][1] - task[0][0] for task in tasks]
    # enough tasks for every worker to get several (a small corpus is not left on one core) ...
    assert len(tasks) >= min(4 * workers, size // 1000)
    # ... of about equal size, and never more than TASK_CHUNKS chunks of about CHUNK_BYTES each
    assert max(task_bytes) <= 2 * min(task_bytes) + 2_000
    assert max(map(len, tasks)) <= 4 and max(end - start for start, end in chunks) <= 100_000 + 2_000


# --- the train-tokenizer stage and bad input --------------------------------------------------------


def test_train_tokenizer_writes_a_loadable_reproducible_file(tmp_path):
    corpus = write(tmp_path, "train.txt", varied_text(random.Random(2), 5_000, "<|endoftext|>"))
    out = tmp_path / "results" / "tokenizer" / "tokenizer.json"
    tok = train_tokenizer(corpus, out, 400, ["<|endoftext|>"], num_workers=2, progress=False)
    first = out.read_bytes()
    loaded = Tokenizer.load(out)
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges and len(tok.vocab) == 400
    train_tokenizer(corpus, out, 400, ["<|endoftext|>"], num_workers=1, progress=False)
    assert out.read_bytes() == first
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokenizer.json"]


def bad_inputs(tmp_path: Path):
    """(name, corpus path, vocab_size, special tokens, error type, message pattern)."""
    good = write(tmp_path, "good.txt", "some text to train on, " * 20)
    bad_utf8 = write(tmp_path, "bad_utf8.txt", b"fine text\n" * 100 + b"caf\xe9 au lait")
    return [
        ("empty", write(tmp_path, "empty.txt", ""), 300, [], ValueError, "empty.txt.*no text"),
        ("whitespace", write(tmp_path, "ws.txt", " \n\t  \n" * 50), 300, [], ValueError, "ws.txt.*no text"),
        (
            "only specials",
            write(tmp_path, "sp.txt", "<|endoftext|>" * 9),
            300,
            ["<|endoftext|>"],
            ValueError,
            "sp.txt",
        ),
        ("vocab too small", good, 256, ["<|endoftext|>"], ValueError, "vocab_size 256 .*257"),
        ("vocab over uint16", good, 70_000, [], ValueError, "vocab_size 70000 .*65536"),
        ("invalid utf-8", bad_utf8, 300, [], ValueError, "bad_utf8.txt.*byte offset 1003"),
        ("missing file", tmp_path / "nope.txt", 300, [], FileNotFoundError, "nope.txt"),
        ("a directory", tmp_path, 300, [], ValueError, "cannot read"),
        ("duplicate special", good, 300, ["<|x|>", "<|x|>"], ValueError, "more than once"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_input_raises_and_writes_nothing(tmp_path, case):
    name, corpus, vocab_size, specials, error, pattern = bad_inputs(tmp_path)[case]
    out = tmp_path / "results" / "tokenizer.json"
    with pytest.raises(error, match=pattern):
        train_tokenizer(corpus, out, vocab_size, specials, num_workers=2, progress=False)
    assert not out.parent.exists() or list(out.parent.iterdir()) == [], name


def test_bad_input_leaves_an_existing_output_alone(tmp_path):
    out = write(tmp_path, "tokenizer.json", "previous")
    with pytest.raises(ValueError):
        train_tokenizer(write(tmp_path, "empty.txt", ""), out, 300, [], progress=False)
    assert out.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "tokenizer.json"]


def test_invalid_utf8_can_be_replaced(tmp_path, caplog):
    corpus = write(tmp_path, "bad.txt", b"caf\xe9 caf\xe9 \xff\xfe ok ok")
    with caplog.at_level(logging.WARNING):
        vocab, merges = train_bpe(corpus, 270, [], num_workers=1, errors="replace", progress=False)
    assert "replaced 4 invalid UTF-8 bytes" in caplog.text and "bad.txt" in caplog.text
    assert "\ufffd".encode() in vocab.values()  # the most frequent pairs were U+FFFD's bytes


# ------------------------------------------------------------------------------------------------
# Training on the first documents (tokenizer.max_train_bytes)


def test_a_byte_budget_trains_on_the_whole_documents_that_fit(tmp_path):
    """The merges are train_bpe's on a file of exactly the documents that fit, built here from the
    document list; the cut lands on a document boundary and the temporary sample is removed."""
    rng = random.Random(7)
    docs = [varied_text(rng, rng.randint(20, 60), None).replace("<|endoftext|>", "") for _ in range(40)]
    text = "<|endoftext|>".join(docs)
    path = write(tmp_path, "train.txt", text)
    budget = len(text.encode()) // 2
    kept, used = [], 0
    for i, doc in enumerate(docs):  # whole documents, each after the first behind its separator
        size = len(doc.encode()) + (len("<|endoftext|>") if i else 0)
        if used + size > budget:
            break
        kept.append(doc)
        used += size
    (tmp_path / "expected").mkdir()
    expected_path = write(tmp_path / "expected", "kept.txt", "<|endoftext|>".join(kept))
    expected = train_bpe(expected_path, 320, ["<|endoftext|>"], num_workers=1, progress=False)
    out = tmp_path / "out" / "tokenizer.json"
    tokenizer = train_tokenizer(
        path, out, 320, ["<|endoftext|>"], num_workers=1, max_train_bytes=budget, progress=False
    )
    assert (tokenizer.vocab, tokenizer.merges) == expected
    assert os.listdir(out.parent) == ["tokenizer.json"]  # no sample left behind
    whole = train_tokenizer(
        path, tmp_path / "whole.json", 320, ["<|endoftext|>"], num_workers=1, progress=False
    )
    assert whole.merges != tokenizer.merges  # the budget did change what was trained on
    same = train_tokenizer(
        path,
        tmp_path / "big.json",
        320,
        ["<|endoftext|>"],
        num_workers=1,
        max_train_bytes=10**9,
        progress=False,
    )
    assert same.merges == whole.merges  # a budget above the file's size: all of it


def test_a_first_document_longer_than_the_budget_is_cut_on_a_character_boundary(tmp_path, capsys):
    from tinylm.tokenizer.bpe import training_sample

    text = "ab" + "é" * 50 + "<|endoftext|>tail"  # é is two bytes: byte 3 is inside a character
    path = write(tmp_path, "t.txt", text)
    with training_sample(path, 5, tmp_path) as sample:
        cut = sample.read_bytes()
    assert cut == "abé".encode() and cut.decode("utf-8")  # 4 bytes: 5 would split the second é
    assert "part of its first document" in capsys.readouterr().err
    with training_sample(path, len(text.encode()) - 2, tmp_path) as sample:
        assert sample.read_bytes() == text[: text.index("<|endoftext|>")].encode()


@pytest.mark.parametrize("value", [0, -5])
def test_a_budget_of_zero_or_below_is_refused_naming_the_key(tmp_path, value):
    from tinylm.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=f"tokenizer.max_train_bytes: {value} is out of range"):
        from_dict({"tokenizer": {"max_train_bytes": value}})
    path = write(tmp_path, "t.txt", "some text")
    with pytest.raises(ValueError, match="tokenizer.max_train_bytes"):
        train_tokenizer(path, tmp_path / "tok.json", 300, ["<|endoftext|>"], max_train_bytes=value)
    assert not (tmp_path / "tok.json").exists()
