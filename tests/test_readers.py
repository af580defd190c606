"""The corpus stage on real-corpus formats: JSON Lines and Parquet, .gz and .zst, globs and URL lists.

Every format must give exactly the train.txt / valid.txt (and token files) of the same documents
given as text files, each file written here with the format's own library (json, pyarrow, gzip,
zstandard); every kind of bad input is refused with one line naming the file, and nothing written.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tinylm.config import from_dict
from tinylm.corpus import END_OF_TEXT, CorpusError, prepare_corpus
from tinylm.tokenizer import Tokenizer, encode_corpus, train_bpe

WORDS = [
    "the",
    "cat",
    "sat",
    " ",
    "  ",
    "\n",
    "\n\n",
    "Привет",
    "Καλημέρα",
    "日本語",
    "🙂",
    "naïve",
    "42",
    "!",
]


def make_documents(seed: int, count: int) -> list[str]:
    """Documents of mixed scripts and whitespace; each has some visible text."""
    rng = random.Random(seed)
    return ["x" + "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(count)]


def run(tmp_path: Path, name: str, **keys) -> tuple[str, str, dict]:
    """The corpus stage with a `corpus:` section; (train.txt, valid.txt, stats)."""
    out = tmp_path / name
    cfg = from_dict({"corpus": {"source": "files", **keys}}).corpus
    stats = prepare_corpus(cfg, out / "train.txt", out / "valid.txt")
    return (out / "train.txt").read_text("utf-8"), (out / "valid.txt").read_text("utf-8"), stats


def as_text_files(folder: Path, documents: list[str]) -> list[str]:
    """One .txt file per document: the reference way of giving documents."""
    folder.mkdir()
    paths = []
    for i, document in enumerate(documents):
        path = folder / f"{i:04d}.txt"
        path.write_bytes(document.encode("utf-8"))
        paths.append(str(path))
    return paths


def write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    lines = "".join(
        json.dumps({"id": i, key: d}, ensure_ascii=i % 2 == 0) + "\n" for i, d in enumerate(documents)
    )
    data = lines.encode("utf-8")
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_parquet(path: Path, documents: list, key: str = "text", kind=None, row_group_size=7) -> Path:
    table = pa.table(
        {"id": pa.array(range(len(documents))), key: pa.array(documents, type=kind or pa.string())}
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


# ---------------------------------------------------------------------------------------------
# Same documents, same outputs


@pytest.mark.parametrize("form", ["jsonl", "json", "jsonl.gz", "jsonl.zst", "parquet"])
def test_every_format_gives_the_train_and_valid_text_of_the_same_documents(tmp_path, form):
    train_docs, valid_docs = make_documents(0, 50), make_documents(1, 9)
    expected_train, expected_valid, expected_stats = run(
        tmp_path,
        "reference",
        train_files=as_text_files(tmp_path / "t", train_docs),
        valid_files=as_text_files(tmp_path / "v", valid_docs),
    )
    assert expected_train == END_OF_TEXT.join(train_docs)  # the reference itself, checked once
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, start in enumerate([0, 20, 35]):  # three shards, found by a glob, read in name order
        part = train_docs[start : [20, 35, 50][i]]
        if form == "parquet":
            write_parquet(shards / f"train-{i:05d}.parquet", part)
        else:
            write_jsonl(shards / f"train-{i:05d}.{form}", part)
    valid = shards / f"valid.{form}"
    write_parquet(valid, valid_docs) if form == "parquet" else write_jsonl(valid, valid_docs)
    train, valid_text, stats = run(
        tmp_path, "formats", train_files=[str(shards / f"train-*.{form}")], valid_files=[str(valid)]
    )
    assert (train, valid_text) == (expected_train, expected_valid)
    assert stats == expected_stats


def test_mixed_formats_hold_out_valid_fraction_and_give_the_same_token_files(tmp_path):
    documents = make_documents(2, 40)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text(END_OF_TEXT.join(documents[:10]), "utf-8")  # a text file of 10 documents
    (folder / "b.txt.gz").write_bytes(gzip.compress(documents[10].encode()))
    write_parquet(folder / "c.parquet", documents[11:30], row_group_size=4)
    write_jsonl(folder / "d.jsonl.zst", documents[30:])
    mixed = run(tmp_path, "mixed", train_files=[str(folder / "*")], valid_fraction=0.2)
    reference = run(
        tmp_path, "reference", train_files=as_text_files(tmp_path / "t", documents), valid_fraction=0.2
    )
    assert mixed == reference
    assert reference[2]["valid_documents"] == 8
    # ... and so the same token files
    vocab, merges = train_bpe(tmp_path / "mixed/train.txt", 300, [END_OF_TEXT], num_workers=1, progress=False)
    tokenizer = Tokenizer(vocab, merges, [END_OF_TEXT])
    for name in ("mixed", "reference"):
        encode_corpus(tokenizer, tmp_path / name / "valid.txt", tmp_path / name / "valid.npy", progress=False)
    assert np.array_equal(np.load(tmp_path / "mixed/valid.npy"), np.load(tmp_path / "reference/valid.npy"))


def test_records_with_separators_or_only_whitespace(tmp_path):
    # A separator inside a record splits it (as in a text file); blank records are skipped.
    folder = tmp_path / "in"
    folder.mkdir()
    write_parquet(folder / "v.parquet", ["four", " \t", "five<|endoftext|>"], key="content")
    write_jsonl(folder / "t2.jsonl", ["one<|endoftext|>two", "   \n", "", "three"], key="content")
    train, valid, stats = run(
        tmp_path, "out", train_files=[str(folder / "t2.jsonl")], valid_files=[str(folder / "v.parquet")],
        text_field="content",
    )  # fmt: skip
    assert train == "one<|endoftext|>two<|endoftext|>three"
    assert valid == "four<|endoftext|>five<|endoftext|>"
    assert (stats["train_documents"], stats["valid_documents"]) == (3, 2)


def test_binary_parquet_column_and_large_strings(tmp_path):
    documents = make_documents(3, 12)
    write_parquet(tmp_path / "b.parquet", [d.encode() for d in documents], kind=pa.binary())
    write_parquet(tmp_path / "l.parquet", documents, kind=pa.large_string())
    train, valid, _ = run(
        tmp_path, "out", train_files=[str(tmp_path / "b.parquet")], valid_files=[str(tmp_path / "l.parquet")]
    )
    assert train == valid == END_OF_TEXT.join(documents)


def test_url_list_downloads_each_format_and_caches(tmp_path):
    documents = make_documents(4, 30)
    www = tmp_path / "www"
    www.mkdir()
    files = [
        write_jsonl(www / "part-0.jsonl.gz", documents[:10]),
        write_parquet(www / "part-1.parquet", documents[10:25]),
    ]
    valid = write_jsonl(www / "valid.jsonl.zst", documents[25:])

    def entry(path: Path) -> str:
        return f"{path.as_uri()}#sha256={hashlib.sha256(path.read_bytes()).hexdigest()}"

    keys = {"source": "url", "cache_dir": str(tmp_path / "cache"), "train_urls": [entry(p) for p in files],
            "valid_urls": [entry(valid)]}  # fmt: skip
    cfg = from_dict({"corpus": keys}).corpus
    stats = prepare_corpus(cfg, tmp_path / "out/train.txt", tmp_path / "out/valid.txt")
    assert (tmp_path / "out/train.txt").read_text("utf-8") == END_OF_TEXT.join(documents[:25])
    assert (tmp_path / "out/valid.txt").read_text("utf-8") == END_OF_TEXT.join(documents[25:])
    assert (stats["train_documents"], stats["valid_documents"]) == (25, 5)
    for path in [*files, valid]:  # the second run reads the cache only
        path.unlink()
    prepare_corpus(cfg, tmp_path / "again/train.txt", tmp_path / "again/valid.txt")
    assert (tmp_path / "again/train.txt").read_bytes() == (tmp_path / "out/train.txt").read_bytes()


def test_url_list_entries_are_checked_by_the_config(tmp_path):
    pinned = f"https://x/b#sha256={'0' * 64}"
    bad = [
        ({"train_urls": ["https://x/a.parquet"]}, "corpus.train_urls[0]"),
        ({"train_urls": ["https://x/a.parquet#sha256=abc"]}, "corpus.train_urls[0]"),
        (
            {"train_url": "https://x/a.txt", "train_sha256": "0" * 64, "train_urls": [pinned]},
            "corpus.train_urls",
        ),
        ({}, "corpus.train_urls"),
        ({"train_urls": [pinned], "valid_urls": ["nohash"]}, "corpus.valid_urls[0]"),
    ]
    for keys, key in bad:
        with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
            from_dict({"corpus": {"source": "url", **keys}})
    with pytest.raises(ValueError, match="corpus.text_field"):
        from_dict({"corpus": {"text_field": ""}})


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file and what is wrong, nothing written


def truncated(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


ZSTD = zstandard.ZstdCompressor()
BAD_INPUTS = {
    "missing key": ("t.jsonl", b'{"text": "fine"}\n{"id": 3, "content": "x"}\n',
                    r"t.jsonl: line 2: no key 'text' \(keys: 'id', 'content'\)"),
    "text not a string": ("t.jsonl", b'{"text": "fine"}\n\n{"text": 17}\n',
                          r"t.jsonl: line 3: 'text' holds int, not a string"),
    "null text": ("t.jsonl", b'{"text": null}\n', r"line 1: 'text' holds NoneType, not a string"),
    "not JSON": ("t.jsonl", b'{"text": "fine"}\n{"text": "cut\n', r"t.jsonl: line 2: not valid JSON"),
    "not an object": ("t.json", b'["a", "b"]\n',
                      r"t.json: line 1: expected one JSON object per line, got list"),
    "bad UTF-8 in JSON": ("t.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
                          r"t.jsonl: line 2: not valid UTF-8"),
    "bad UTF-8 in .gz text": ("t.txt.gz", gzip.compress(b"good text \xff bad"),
                              r"t.txt.gz: not valid UTF-8: invalid byte at offset 10"),
    "truncated .gz": ("t.jsonl.gz", truncated(gzip.compress(b'{"text": "abc"}\n' * 5000)),
                      r"t.jsonl.gz: truncated or corrupt gzip data"),
    "corrupt .gz": ("t.txt.gz", b"\x1f\x8b\x08\x00garbage" * 20, r"t.txt.gz: truncated or corrupt gzip data"),
    "truncated .zst": ("t.jsonl.zst", truncated(ZSTD.compress(b'{"text": "abc"}\n' * 5000)),
                       r"t.jsonl.zst: truncated zstandard data"),
    "corrupt .zst": ("t.txt.zst", b"not zstandard at all", r"t.txt.zst: corrupt zstandard data"),
    "compressed Parquet": ("t.parquet.gz", gzip.compress(b"x"),
                           r"t.parquet.gz: Parquet compresses its own pages"),
    "not Parquet": ("t.parquet", b"PAR1 this is not parquet", r"t.parquet: not a readable Parquet file"),
    "empty JSON Lines": ("t.jsonl", b'{"text": ""}\n{"text": "  "}\n', r"t.jsonl: no record holds text"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_naming_the_file_and_nothing_is_written(tmp_path, case):
    name, data, message = BAD_INPUTS[case]
    (tmp_path / name).write_bytes(data)
    write_jsonl(tmp_path / "good.jsonl", ["a fine document"])
    out = tmp_path / "out"
    with pytest.raises(CorpusError, match=message) as error:
        run(tmp_path, "out", train_files=[str(tmp_path / "good.jsonl")], valid_files=[str(tmp_path / name)])
    assert "\n" not in str(error.value) and str(tmp_path / name) in str(error.value)
    assert not out.exists() or list(out.iterdir()) == []


def parquet_bytes(tmp_path: Path, documents: list, **kw) -> bytes:
    return write_parquet(tmp_path / "scratch.parquet", documents, **kw).read_bytes()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no column", r"no column 'text' \(columns: 'id', 'body'\); set corpus.text_field"),
        ("int column", r"column 'text' holds int64, not strings \(row 0\)"),
        ("null row", r"row 9: 'text' is null, not a string"),
        ("bad UTF-8 row", r"row 4: not valid UTF-8"),
        ("truncated", r"not a readable Parquet file, truncated or corrupt\?"),
        (
            "cut row group",
            r"cannot read the rows from 0 on, truncated or corrupt\?|not a readable Parquet file",
        ),
    ],
)
def test_bad_parquet_is_refused_with_the_column_or_row(tmp_path, case, message):
    docs = make_documents(5, 20)
    if case == "no column":
        data = parquet_bytes(tmp_path, docs, key="body")
    elif case == "int column":
        data = parquet_bytes(tmp_path, list(range(20)), kind=pa.int64())
    elif case == "null row":
        data = parquet_bytes(tmp_path, [*docs[:9], None, *docs[10:]])
    elif case == "bad UTF-8 row":
        data = parquet_bytes(tmp_path, [d.encode() for d in docs[:4]] + [b"caf\xe9"], kind=pa.binary())
    elif case == "truncated":
        data = truncated(parquet_bytes(tmp_path, docs))
    else:  # the footer intact, the middle of the text column's pages overwritten with zeros
        data = bytearray(parquet_bytes(tmp_path, docs * 50, row_group_size=1000))
        middle = len(data) // 2
        data[middle : middle + 2000] = bytes(2000)
        data = bytes(data)
    (tmp_path / "bad.parquet").write_bytes(data)
    write_jsonl(tmp_path / "good.jsonl", ["a fine document"])
    with pytest.raises(CorpusError, match=message) as error:
        run(
            tmp_path,
            "out",
            train_files=[str(tmp_path / "good.jsonl")],
            valid_files=[str(tmp_path / "bad.parquet")],
        )
    assert str(tmp_path / "bad.parquet") in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_glob_that_matches_nothing_is_named(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", ["a document"])
    with pytest.raises(
        CorpusError, match=r"corpus.valid_files: the pattern '.*/nowhere/\*.parquet' matches no file"
    ):
        run(
            tmp_path,
            "out",
            train_files=[str(tmp_path / "*.jsonl")],
            valid_files=[str(tmp_path / "nowhere/*.parquet")],
        )
    assert not (tmp_path / "out").exists()


def test_glob_order_is_by_name_and_recursive(tmp_path):
    for name in ["b/2.txt", "a/10.txt", "a/9.txt", "c.txt"]:
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(name)
    train, _, _ = run(
        tmp_path, "out", train_files=[str(tmp_path / "in/**/*.txt")], valid_files=[str(tmp_path / "in/c.txt")]
    )
    assert train.split(END_OF_TEXT) == ["a/10.txt", "a/9.txt", "b/2.txt", "c.txt"]


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("form", ["jsonl", "jsonl.gz", "jsonl.zst", "txt.gz", "txt.zst"])
def test_lines_and_characters_cut_by_small_reads(tmp_path, monkeypatch, chunk, form):
    # Reads of a few bytes cut JSON lines, multi-byte characters and zstandard frames anywhere.
    from tinylm.corpus import files as files_module
    from tinylm.corpus import readers

    monkeypatch.setattr(files_module, "CHUNK_SIZE", chunk)
    monkeypatch.setattr(readers, "ZSTD_INPUT_BYTES", chunk)
    documents = make_documents(6, 8)
    path = tmp_path / f"docs.{form}"
    if form.startswith("jsonl"):
        write_jsonl(path, documents)
    else:
        data = END_OF_TEXT.join(documents).encode("utf-8")
        compress = gzip.compress if form.endswith(".gz") else zstandard.ZstdCompressor().compress
        # .zst: two frames, cut inside a document
        path.write_bytes(
            compress(data) if form.endswith(".gz") else compress(data[:100]) + compress(data[100:])
        )
    (tmp_path / "v.txt").write_text("held out")
    train, _, stats = run(tmp_path, "out", train_files=[str(path)], valid_files=[str(tmp_path / "v.txt")])
    assert train == END_OF_TEXT.join(documents) and stats["train_documents"] == 8
