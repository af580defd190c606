"""Input files by glob and by format: plain text, JSON Lines and Parquet, optionally compressed.

A file's format comes from its name: `.jsonl` and `.json` are JSON Lines (one JSON object per
line, the text under `text_field`), `.parquet` is Parquet (the `text_field` column), anything else
is UTF-8 text (as `.txt`). `.gz` (gzip) or `.zst` (zstandard) after the name compresses JSON Lines
and text; Parquet compresses its own pages, so `.parquet.gz` / `.parquet.zst` are refused.

Everything is streamed: compressed data a chunk at a time, JSON Lines a line at a time, Parquet a
batch of rows at a time (`ParquetFile.iter_batches`, row group by row group), so no file is ever
held whole in memory. Bad input raises CorpusError with one line naming the file and what is
wrong: a truncated or corrupt compressed or Parquet file, invalid UTF-8, invalid JSON, a missing
key or column (naming those that exist), a record whose text is not a string (its line or row).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from tinylm.corpus.format import CorpusError

COMPRESSIONS = (".gz", ".zst")
# Compressed bytes fed to the zstandard decoder at a time; bounds the text one call returns.
ZSTD_INPUT_BYTES = 1 << 16
# Parquet rows converted to Python strings at a time.
PARQUET_BATCH_ROWS = 1024
# Parquet column data is read this many bytes at a time, with no read-ahead (pyarrow's pre_buffer
# reads the column chunks of many row groups ahead: about the whole of a 190 MB shard).
PARQUET_BUFFER_BYTES = 1 << 20


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (Arrow's span several)."""
    return " ".join(str(error).split())


def matching_files(patterns: list[str]) -> list[Path]:
    """The existing files named by `patterns` (paths or glob patterns), in order, each pattern's matches
    sorted; names that match nothing are left out (`expand_paths` refuses them)."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = glob.glob(os.path.expanduser(pattern), recursive=True)
            paths.extend(Path(p) for p in sorted(matches) if os.path.isfile(p))
        elif Path(pattern).is_file():
            paths.append(Path(pattern))
    return paths


def expand_paths(patterns: list[str], key: str) -> list[Path]:
    """The files named by `patterns` (paths or glob patterns), in order; each pattern's matches sorted.

    `**` matches any number of folders. Raises FileNotFoundError naming `corpus.<key>` for a
    missing path and CorpusError for a pattern that matches no file.
    """
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(
                p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
            )
            if not matches:
                raise CorpusError(f"corpus.{key}: the pattern {pattern!r} matches no file")
            paths.extend(Path(p) for p in matches)
        else:
            if not Path(pattern).is_file():
                raise FileNotFoundError(f"corpus.{key}: file not found: {pattern}")
            paths.append(Path(pattern))
    return paths


def file_format(path: str | os.PathLike) -> tuple[str, str]:
    """(format, compression) of a file by its name: ("text" | "jsonl" | "parquet", "" | ".gz" | ".zst")."""
    name = Path(path).name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    name = name.removesuffix(compression) if compression else name
    if name.endswith((".jsonl", ".json")):
        return "jsonl", compression
    if name.endswith(".parquet"):
        if compression:
            raise CorpusError(
                f"{path}: Parquet compresses its own pages; give the .parquet file uncompressed"
            )
        return "parquet", ""
    return "text", compression


def byte_chunks(path: str | os.PathLike, chunk_size: int) -> Iterator[bytes]:
    """The (decompressed) bytes of a file, in chunks of about `chunk_size` bytes.

    Raises CorpusError naming the file if its .gz or .zst data is truncated or corrupt.
    """
    compression = file_format(path)[1]
    if compression == ".zst":
        yield from _zstd_chunks(path)
        return
    opener = gzip.open if compression == ".gz" else open
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise CorpusError(f"{path}: truncated or corrupt gzip data ({_one_line(error)})") from None


def _zstd_chunks(path: str | os.PathLike) -> Iterator[bytes]:
    """The decompressed bytes of a .zst file of one or more frames; CorpusError if one is cut short."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, fed = decompressor.decompressobj(), False
    try:
        with open(path, "rb") as f:
            while data := f.read(ZSTD_INPUT_BYTES):
                while data:
                    out = frame.decompress(data)
                    fed = True
                    if out:
                        yield out
                    if frame.eof:  # the next frame starts in what is left
                        data, frame, fed = frame.unused_data, decompressor.decompressobj(), False
                    else:
                        data = b""
    except zstandard.ZstdError as error:
        raise CorpusError(f"{path}: corrupt zstandard data ({_one_line(error)})") from None
    if fed and not frame.eof:
        raise CorpusError(f"{path}: truncated zstandard data (the last frame is cut short)")


def lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream, without their b"\\n"."""
    pending: list[bytes] = []
    for chunk in chunks:
        *complete, rest = chunk.split(b"\n")
        if complete:
            complete[0] = b"".join([*pending, complete[0]])
            pending = []
            yield from complete
        pending.append(rest)
    last = b"".join(pending)
    if last:
        yield last


def jsonl_texts(path: str | os.PathLike, text_field: str, chunk_size: int) -> Iterator[str]:
    """The `text_field` string of every JSON object (one per line; blank lines skipped) of a file."""
    for number, line in enumerate(lines(byte_chunks(path, chunk_size)), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise CorpusError(
                f"{path}: line {number}: not valid UTF-8 (byte {error.start} of the line)"
            ) from None
        except json.JSONDecodeError as error:
            raise CorpusError(
                f"{path}: line {number}: not valid JSON ({error.msg}, column {error.colno})"
            ) from None
        if not isinstance(record, dict):
            raise CorpusError(
                f"{path}: line {number}: expected one JSON object per line, got {type(record).__name__}"
            )
        if text_field not in record:
            keys = ", ".join(map(repr, record)) or "none"
            raise CorpusError(
                f"{path}: line {number}: no key {text_field!r} (keys: {keys}); set corpus.text_field"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise CorpusError(
                f"{path}: line {number}: {text_field!r} holds {type(text).__name__}, not a string"
            )
        yield text


def parquet_texts(path: str | os.PathLike, text_field: str) -> Iterator[str]:
    """The `text_field` column of a Parquet file, row by row, read a batch of rows at a time.

    The column must hold strings (or binary data, decoded as UTF-8); a null is refused with its row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
    except (pa.ArrowException, OSError) as error:
        raise CorpusError(
            f"{path}: not a readable Parquet file, truncated or corrupt? ({_one_line(error)})"
        ) from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        columns = ", ".join(map(repr, schema.names)) or "none"
        raise CorpusError(f"{path}: no column {text_field!r} (columns: {columns}); set corpus.text_field")
    kind = schema.field(text_field).type
    is_binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_binary):
        raise CorpusError(f"{path}: column {text_field!r} holds {kind}, not strings (row 0)")
    row = 0
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field])
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            values = batch.column(0).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise CorpusError(
                f"{path}: cannot read the rows from {row} on, truncated or corrupt? ({_one_line(error)})"
            ) from None
        except UnicodeDecodeError:
            raise CorpusError(f"{path}: not valid UTF-8 in column {text_field!r}, rows {row} on") from None
        for value in values:
            if value is None:
                raise CorpusError(f"{path}: row {row}: {text_field!r} is null, not a string")
            if is_binary:
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise CorpusError(
                        f"{path}: row {row}: not valid UTF-8 (byte {error.start} of {text_field!r})"
                    ) from None
            yield value
            row += 1
