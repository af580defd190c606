"""Tokenizer: encode/decode against tiktoken and Hugging Face `tokenizers` loaded with our merges,
round trips, streaming, and the tokenizer file formats."""

from __future__ import annotations

import json
import operator
import random
import tracemalloc

import pytest
import tiktoken
import tiktoken.load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tinylm.tokenizer import GPT2_PATTERN, Tokenizer, train_bpe
from tinylm.tokenizer import tokenizer as tokenizer_module
from tinylm.tokenizer.tokenizer import gpt2_byte_to_char

SPECIALS = ["<|endoftext|>", "<|pad|>"]

# Pieces of text that exercise every branch of the GPT-2 regex: contractions (in both cases),
# numbers, punctuation runs, whitespace runs of every kind, letters from several scripts, combining
# marks, emoji, and control characters.
UNICODE_WORDS = [
    "naïve",
    "Straße",
    "日本語",
    "привет",
    "café",
    "e\u0301",
    "🙂",
    "👍🏽",
    "١٢٣",
    "Ⅻ",
    "½",
    "ǅ",
    "\u00a0",
]
PUNCTUATION = [".", ",", "!", "?", "...", "--", "(", ")", '"', "'", "—", ";", ":", "#$%", "\u2019s"]
SPACES = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "   ", "\x0b", "\x1c"]


def make_text(
    rng: random.Random, num_chars: int, specials: list[str] = SPECIALS, ascii_only: bool = False
) -> str:
    """Varied English-like text with numbers, punctuation, unicode and special tokens mixed in.

    With `ascii_only`, characters outside ASCII are left out (long ASCII stretches take a faster path).
    """
    syllables = ["th", "e", "an", "re", "ing", "o", "st", "al", "qu", "ee", "x", "ou", "ch", "ea"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    out: list[str] = []
    size = 0
    while size < num_chars:
        r = rng.random()
        if r < 0.70:
            word = rng.choice(words[: rng.choice([20, 100, 600])])
            word = word.capitalize() if rng.random() < 0.15 else word.upper() if rng.random() < 0.02 else word
            piece = word + (
                rng.choice(["'s", "'t", "'ll", "'ve", "'re", "'d", "'m", "'S", "'LL"])
                if rng.random() < 0.04
                else ""
            )
        elif r < 0.78:
            piece = str(rng.randint(0, 10 ** rng.randint(1, 7)))
        elif r < 0.90:
            piece = rng.choice(PUNCTUATION)
        elif r < 0.96:
            piece = rng.choice(UNICODE_WORDS)
        elif r < 0.99:
            piece = chr(
                rng.choice(
                    [rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1F64F)]
                )
            )
        else:
            piece = rng.choice(specials) if specials else "."
        out.append(piece)
        out.append(rng.choice(SPACES) if rng.random() < 0.85 else "")
        size += len(piece) + 1
    text = "".join(out)
    return text.encode("ascii", errors="ignore").decode("ascii") if ascii_only else text


# --- tiktoken and Hugging Face tokenizers built from our own trained merges -----------------------


def write_gpt2_files(tok: Tokenizer, folder) -> tuple:
    """Write `tok` as GPT-2's vocab.json + merges.txt (the format HF and GPT-2 publish)."""
    to_char = gpt2_byte_to_char()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps({text(t): i for i, t in tok.vocab.items()}, ensure_ascii=False), "utf-8")
    merges_path.write_text(
        "#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in tok.merges), "utf-8"
    )
    return vocab_path, merges_path


def hf_tokenizer(vocab_path, merges_path, specials: list[str]) -> HFTokenizer:
    hf = HFTokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(specials)
    return hf


def tiktoken_encoding(tok: Tokenizer) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        "tinylm-test",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=tok.tiktoken_ranks(),
        special_tokens=tok.special_ids,
    )


@pytest.fixture(scope="module")
def trained_merges(tmp_path_factory):
    """(vocab, merges) trained on ~300 KB of generated text."""
    corpus = tmp_path_factory.mktemp("corpus") / "train.txt"
    corpus.write_text(make_text(random.Random(0), 300_000), "utf-8")
    return train_bpe(corpus, 1500, SPECIALS, num_workers=1, progress=False)


@pytest.fixture(scope="module", params=["tiktoken", "python"])
def trained(request, trained_merges, tmp_path_factory):
    """A tokenizer with the trained merges on each engine, and tiktoken and Hugging Face tokenizers
    loaded with its merges.

    engine="tiktoken" raises unless the trained vocabulary passes the checks of tiktoken_engine.
    """
    folder = tmp_path_factory.mktemp("tok")
    vocab, merges = trained_merges
    tok = Tokenizer(vocab, merges, SPECIALS, engine=request.param)
    vocab_path, merges_path = write_gpt2_files(tok, folder)
    return (
        tok,
        tiktoken_encoding(tok),
        hf_tokenizer(vocab_path, merges_path, SPECIALS),
        (vocab_path, merges_path),
    )


def test_trained_vocab_has_no_duplicate_tokens(trained):
    tok = trained[0]
    assert len(tok.vocab) == 1500
    assert len(set(tok.vocab.values())) == len(tok.vocab)


@pytest.mark.parametrize("ascii_only", [False, True])
def test_encode_matches_tiktoken_and_hf_on_varied_text(trained, ascii_only):
    tok, enc, hf, _ = trained
    text = make_text(random.Random(1), 300_000, ascii_only=ascii_only)  # unseen text, same kind
    ids = tok.encode(text)
    assert ids == enc.encode(text, allowed_special="all")
    assert ids == hf.encode(text).ids
    assert tok.decode(ids) == text


special_or_text = st.one_of(
    st.sampled_from(SPECIALS),
    st.text(max_size=40),
    st.text(alphabet=st.characters(max_codepoint=127), max_size=40),
    st.sampled_from(UNICODE_WORDS + SPACES + ["'s", "'LL", "123", "!?", " 4", "a1"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(special_or_text, max_size=12))
def test_encode_matches_peers_on_arbitrary_unicode(trained, parts):
    tok, enc, hf, _ = trained
    text = "".join(parts)
    ids = tok.encode(text)
    assert ids == enc.encode(text, allowed_special="all")
    assert ids == hf.encode(text).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(special_or_text, max_size=12))
def test_decode_inverts_encode(trained, parts):
    tok = trained[0]
    text = "".join(parts)
    assert tok.decode(tok.encode(text)) == text


def test_decode_replaces_invalid_utf8(trained):
    tok = trained[0]
    euro = "€".encode()  # three bytes
    ids = [tok.encode("a")[0], euro[0], euro[1], tok.encode("b")[0], 0xFF]
    assert tok.decode(ids) == "a\ufffdb\ufffd"
    assert tok.decode([euro[0], euro[1], euro[2]]) == "€"
    with pytest.raises(ValueError, match="99999"):
        tok.decode([99999])


def test_special_tokens_encode_to_their_ids(trained):
    tok = trained[0]
    eot, pad = tok.special_ids["<|endoftext|>"], tok.special_ids["<|pad|>"]
    assert (eot, pad) == (256, 257)
    assert tok.encode("<|endoftext|><|pad|>") == [eot, pad]
    # a special token splits the words around it: no merge crosses it
    assert tok.encode("the<|endoftext|>the") == tok.encode("the") + [eot] + tok.encode("the")
    assert tok.encode("<|endoftext") == tok.encode("<|") + tok.encode("endoftext")  # incomplete: text


def test_overlapping_special_tokens_longest_match_wins(trained, tmp_path):
    base = trained[0]
    specials = ["<|a|>", "<|a|><|b|>", "<|b|>", "ab"]
    tok = Tokenizer(base.vocab, base.merges, specials)
    ids = tok.special_ids
    assert len(set(ids.values())) == 4 and min(ids.values()) == len(base.vocab)  # appended after the vocab
    assert tok.encode("<|a|><|b|>") == [ids["<|a|><|b|>"]]
    assert tok.encode("<|a|><|a|><|b|>x") == [ids["<|a|>"], ids["<|a|><|b|>"], *tok.encode("x")]
    assert tok.encode("xaby") == tok.encode("x") + [ids["ab"]] + tok.encode("y")
    # Hugging Face matches added tokens leftmost-longest too
    vocab_path, merges_path = write_gpt2_files(tok, tmp_path)
    hf = hf_tokenizer(vocab_path, merges_path, specials)
    rng = random.Random(2)
    for _ in range(200):
        text = "".join(
            rng.choice(["<|a|>", "<|b|>", "<|", "|>", "a", "b", " ", "x", "<|a|><|b|>"]) for _ in range(12)
        )
        assert tok.encode(text) == hf.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text


def test_one_character_special_token():
    # laid out as train_bpe does it: the byte at its own id, the special token after the bytes
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"|"}
    tok = Tokenizer(vocab, [], ["|"])
    assert tok.special_ids["|"] == 256
    assert tok.encode("a|b") == [ord("a"), 256, ord("b")]
    assert tok.decode([ord("|"), 256]) == "||"
    # a special token already in the vocabulary keeps its id, even a single byte's
    assert Tokenizer(vocab, [], ["a"]).special_ids["a"] == ord("a")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_encode_iterable_equals_encode(trained_merges, data):
    # special tokens with spaces inside can straddle a cut near the end of the buffer
    specials = [*SPECIALS, "q xyz", "a a"]
    tok = Tokenizer(*trained_merges, specials)
    parts = data.draw(
        st.lists(st.one_of(special_or_text, st.sampled_from(["q xy", "z", " ", "a", "q", "\n"])), max_size=40)
    )
    text = "".join(parts)
    # cut the text into pieces at arbitrary places (inside words and special tokens too)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    old = tokenizer_module.STREAM_CHUNK_CHARS
    tokenizer_module.STREAM_CHUNK_CHARS = data.draw(st.integers(1, 64))  # force frequent splitting
    try:
        assert list(tok.encode_iterable(pieces)) == tok.encode(text)
    finally:
        tokenizer_module.STREAM_CHUNK_CHARS = old


def test_encode_iterable_keeps_special_tokens_that_span_pieces(trained_merges, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "STREAM_CHUNK_CHARS", 8)
    tok = Tokenizer(*trained_merges, ["q xyz"])
    # the first piece ends inside "q xyz"; cutting at its space would split the special token
    pieces = ["aaaaaaq xy", "z bbb", " q x", "yz"]
    ids = list(tok.encode_iterable(pieces))
    assert ids == tok.encode("".join(pieces))
    assert ids.count(tok.special_ids["q xyz"]) == 2


def test_encode_iterable_reads_a_file_handle(trained, tmp_path):
    tok = trained[0]
    text = make_text(random.Random(3), 200_000)
    path = tmp_path / "text.txt"
    path.write_text(text, "utf-8")
    with open(path, encoding="utf-8", newline="") as f:
        assert list(tok.encode_iterable(f)) == tok.encode(text)


def test_encode_iterable_memory_stays_bounded(trained, monkeypatch):
    """Stream ~1.5 MB of lines in 4 KB pieces: peak memory stays far below the size of the text.

    (The pre-token cache is warmed first: it grows with distinct pre-tokens, not with the text.)
    """
    tok = trained[0]
    monkeypatch.setattr(tokenizer_module, "STREAM_CHUNK_CHARS", 1 << 12)
    pool = make_text(random.Random(4), 200_000, specials=["<|endoftext|>"]).splitlines(keepends=True)

    def lines():
        rng = random.Random(5)
        for _ in range(120_000):
            yield rng.choice(pool)

    text = "".join(lines())
    assert len(text.encode()) > 1_500_000
    expected = tok.encode(text)
    del text
    tracemalloc.start()
    try:
        stream = tok.encode_iterable(lines())
        matching = sum(map(operator.eq, stream, expected))  # compares as it goes, stores nothing
        leftover = list(stream)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (matching, leftover) == (len(expected), [])
    assert peak < 500_000, f"peak {peak} bytes while streaming 1.5 MB"


@pytest.mark.parametrize("seed", range(4))
def test_encoding_many_pre_tokens_together_matches_the_peers(trained, monkeypatch, seed):
    # From TOGETHER_PIECES new pre-tokens on, they are encoded together with arrays; with the
    # threshold at 1 every text takes that path, and must give tiktoken's and HF's ids.
    tok, enc, hf, _ = trained
    monkeypatch.setattr(tokenizer_module, "TOGETHER_PIECES", 1)
    rng = random.Random(100 + seed)
    for text in [make_text(rng, rng.randint(0, 3_000), ascii_only=seed % 2 == 0) for _ in range(10)]:
        fresh = Tokenizer(tok.vocab, tok.merges, SPECIALS, engine="python")
        ids = fresh.encode(text)
        assert ids == enc.encode(text, allowed_special="all") == hf.encode(text).ids


def test_encoding_together_follows_the_ids_of_any_vocabulary(monkeypatch):
    # Bytes at other ids (as in GPT-2's files), two merges that make the same bytes ("abc" from
    # "ab"+"c" and from "a"+"bc") and a merge whose left token no merge makes: both paths agree.
    vocab = {i: bytes([255 - i]) for i in range(256)}
    merges = [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"a", b"bc"), (b"zz", b"a"), (b"abc", b"abc")]
    for a, b in merges:
        if a + b not in vocab.values():
            vocab[len(vocab)] = a + b
    vocab[len(vocab)] = b"zz"
    texts = ["abcabc", "abc bc abcabcabc", "zza zzabc", "aaaa bbbb cccc", " abcab"] * 3
    one_by_one = [Tokenizer(vocab, merges, engine="python").encode(t) for t in texts]
    auto = Tokenizer(vocab, merges)
    assert [auto.encode(t) for t in texts] == one_by_one
    assert auto.tiktoken_engine() is None and auto.tiktoken_refusal.startswith("C2:")  # two merges make abc
    monkeypatch.setattr(tokenizer_module, "TOGETHER_PIECES", 1)
    together = Tokenizer(vocab, merges, engine="python")
    assert [together.encode(t) for t in texts] == one_by_one
    assert together.decode(together.encode("abcabc abc")) == "abcabc abc"


def test_a_small_pre_token_cache_gives_the_same_ids(trained):
    # With room for 3 pre-tokens, every call starts a new cache generation and most pre-tokens are
    # encoded again or moved over from the old generation; the ids must not change.
    tok = trained[0]
    small = Tokenizer(tok.vocab, tok.merges, SPECIALS, cache_size=3, engine="python")
    rng = random.Random(6)
    texts = [make_text(rng, 2_000, specials=SPECIALS) for _ in range(20)]
    assert [small.encode(t) for t in texts + texts] == [tok.encode(t) for t in texts + texts]
    assert len(small._cache.current) < 2_000 and small._cache.old  # bounded: two generations


# --- files -----------------------------------------------------------------------------------------


def test_save_load_round_trip(trained, tmp_path):
    tok = trained[0]
    path = tmp_path / "out" / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges
    assert loaded.special_tokens == tok.special_tokens and loaded.special_ids == tok.special_ids
    text = make_text(random.Random(5), 20_000)
    assert loaded.encode(text) == tok.encode(text)
    data = json.loads(path.read_text("utf-8"))
    assert (data["format"], data["version"]) == ("tinylm.tokenizer", 1)
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp files left


def test_save_load_keeps_every_byte_value(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"\x00", b"\xff"), (b"\n", b" "), (b"\xe2", b"\x82"), (b"\x00\xff", b"\n ")]
    for a, b in merges:
        vocab[len(vocab)] = a + b
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tok.save(tmp_path / "t.json")
    loaded = Tokenizer.load(tmp_path / "t.json")
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Tokenizer.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", "utf-8")
    with pytest.raises(ValueError, match="bad.json"):
        Tokenizer.load(bad)
    bad.write_text(json.dumps({"format": "something-else"}), "utf-8")
    with pytest.raises(ValueError, match="not a tinylm.tokenizer file"):
        Tokenizer.load(bad)
    bad.write_text(json.dumps({"format": "tinylm.tokenizer", "version": 99}), "utf-8")
    with pytest.raises(ValueError, match="version 99"):
        Tokenizer.load(bad)
    bad.write_text(json.dumps({"format": "tinylm.tokenizer", "version": 1, "vocab": {}}), "utf-8")
    with pytest.raises(ValueError, match="malformed"):
        Tokenizer.load(bad)


def test_from_gpt2_files_matches(trained):
    tok, _, hf, (vocab_path, merges_path) = trained
    loaded = Tokenizer.from_gpt2_files(vocab_path, merges_path, SPECIALS)
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges
    text = make_text(random.Random(6), 20_000)
    assert loaded.encode(text) == tok.encode(text) == hf.encode(text).ids


def test_from_gpt2_files_with_other_ids(tmp_path):
    """GPT-2's own vocab.json does not put byte b at id b; encoding must follow the file's ids."""
    to_char = gpt2_byte_to_char()
    order = sorted(range(256), key=lambda b: to_char[b])  # GPT-2's files order bytes by character
    vocab = {to_char[b]: i for i, b in enumerate(order)}
    vocab["Ġt"], vocab["he"], vocab["Ġthe"], vocab["<|endoftext|>"] = 256, 257, 258, 259
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), "utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nh e\nĠt he\n", "utf-8")
    tok = Tokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt", ["<|endoftext|>"])
    hf = hf_tokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt", ["<|endoftext|>"])
    for text in [" the", "the the<|endoftext|> then", "\x00\xff€ the"]:
        assert tok.encode(text) == hf.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode(" the") == [258]


def test_tiktoken_export_loads_in_tiktoken(trained, tmp_path, monkeypatch):
    tok = trained[0]
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file itself, no cache keyed by path
    path = tmp_path / "tinylm.tiktoken"
    tok.save_tiktoken(path)
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    assert ranks == tok.tiktoken_ranks()
    assert len(ranks) == len(tok.vocab) - len(SPECIALS)
    enc = tiktoken.Encoding(
        "file", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_ids
    )
    text = make_text(random.Random(7), 20_000)
    assert enc.encode(text, allowed_special="all") == tok.encode(text)


def test_tokenizer_rejects_inconsistent_definitions():
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match="missing from vocab"):
        Tokenizer(vocab, [(b"a", b"b")])
    with pytest.raises(ValueError, match="single bytes"):
        Tokenizer({i: bytes([i]) for i in range(255)}, [])
    with pytest.raises(ValueError, match="more than once"):
        Tokenizer(vocab, [], ["<|x|>", "<|x|>"])
    with pytest.raises(ValueError, match="non-empty"):
        Tokenizer(vocab, [], [""])


def test_pickled_tokenizer_encodes_the_same(trained):
    import pickle

    tok = trained[0]
    copy = pickle.loads(pickle.dumps(tok))
    text = make_text(random.Random(8), 5_000)
    assert copy.encode(text) == tok.encode(text)
