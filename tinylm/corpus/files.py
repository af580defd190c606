"""Local files (and downloaded ones), streamed: never held whole in memory.

`train_files` are joined into train.txt and `valid_files` into valid.txt; with no `valid_files`,
the last `valid_fraction` of the documents of the train files is held out instead. Each file is
read by its format (see `readers`): a text file is used as it is, one document unless it holds
END_OF_TEXT itself; each record of a JSON Lines or Parquet file is one document (records with no
text but whitespace are skipped). A file or record boundary is a document boundary.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from tinylm.corpus.format import END_OF_TEXT, CorpusError, Writer
from tinylm.corpus.readers import byte_chunks, expand_paths, file_format, jsonl_texts, parquet_texts

# Bytes read at a time; small enough that no input is ever held whole in memory.
CHUNK_SIZE = 1 << 20


def files_writer(
    train_files: list, valid_files: list, valid_fraction: float, text_field: str = "text"
) -> Writer:
    """The writer of the `files` (and `url`) source.

    `train_files` / `valid_files` are paths or glob patterns (see `readers.expand_paths`: missing
    files and empty patterns are refused here, before anything is written); `text_field` names the
    key or column of the text in JSON Lines and Parquet files.
    """
    train_files = expand_paths(list(map(str, train_files)), "train_files")
    valid_files = expand_paths(list(map(str, valid_files)), "valid_files")
    for path in [*train_files, *valid_files]:
        file_format(path)  # refuses .parquet.gz and the like before anything is written

    def write(train_out: BinaryIO, valid_out: BinaryIO) -> tuple[int, int]:
        if valid_files:
            train_documents = _write_pieces(_pieces(train_files, text_field), train_out)
            return train_documents, _write_pieces(_pieces(valid_files, text_field), valid_out)
        documents = _count_documents(_pieces(train_files, text_field))
        if documents < 2:
            raise CorpusError(
                f"cannot hold out valid_fraction={valid_fraction} of {', '.join(map(str, train_files))}: "
                f"it has {documents} document(s); give corpus.valid_files or separate documents with "
                f"{END_OF_TEXT}"
            )
        valid_documents = min(documents - 1, max(1, round(documents * valid_fraction)))
        pieces = _pieces(
            train_files, text_field
        )  # one iterator, shared: train takes the head, valid the rest
        train_documents = _write_pieces(pieces, train_out, stop_after=documents - valid_documents)
        return train_documents, _write_pieces(pieces, valid_out)

    return write


def _read_text(path: str | os.PathLike) -> Iterator[str]:
    """Yield the decoded text of a UTF-8 file (decompressed if .gz or .zst) in chunks.

    Raises CorpusError naming the file and the byte offset (in the decompressed data) of the first
    invalid byte, or naming the file if it holds nothing but whitespace.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file passed to the decoder before this chunk
    has_text = False
    chunks = byte_chunks(path, CHUNK_SIZE)
    while True:
        chunk = next(chunks, b"")
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
    """Re-cut a text stream into pieces: exactly END_OF_TEXT, or text that holds no separator.

    Joining the pieces gives the text back. A separator split across two chunks is found because
    the last len(END_OF_TEXT) - 1 characters of each chunk wait for the next one.
    """
    keep = len(END_OF_TEXT) - 1
    pending = ""
    for chunk in chunks:
        *documents, pending = (pending + chunk).split(END_OF_TEXT)
        for document in documents:
            if document:
                yield document
            yield END_OF_TEXT
        if len(pending) > keep:
            yield pending[:-keep]
            pending = pending[-keep:]
    if pending:
        yield pending


def _documents(path: Path, text_field: str) -> Iterator[Iterable[str]]:
    """The documents of one file, each as chunks of its text (see the module docstring)."""
    kind = file_format(path)[0]
    if kind == "text":
        yield _read_text(path)
        return
    texts = jsonl_texts(path, text_field, CHUNK_SIZE) if kind == "jsonl" else parquet_texts(path, text_field)
    has_text = False
    for text in texts:
        if text and not text.isspace():
            has_text = True
            yield (text,)
    if not has_text:
        raise CorpusError(f"{path}: no record holds text (all {text_field!r} values are empty or whitespace)")


def _pieces(paths: list[Path], text_field: str) -> Iterator[str]:
    """The pieces (see _split_separators) of the files' documents joined into one stream.

    A file or record boundary is a document boundary, so END_OF_TEXT is inserted between two
    documents unless the earlier one already ends with it (trailing whitespace aside).
    """
    after_separator, first = True, True
    for path in paths:
        for document in _documents(path, text_field):
            if not first and not after_separator:
                yield END_OF_TEXT
            first = False
            for piece in _split_separators(document):
                if piece == END_OF_TEXT:
                    after_separator = True
                elif not piece.isspace():
                    after_separator = False
                yield piece


def _count_documents(pieces: Iterable[str]) -> int:
    """Number of documents in a piece stream: texts between separators with some non-whitespace."""
    documents, has_text = 0, False
    for piece in pieces:
        if piece == END_OF_TEXT:
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
        if piece == END_OF_TEXT:
            documents += has_text
            has_text = False
            if documents == stop_after:
                return documents
        elif not piece.isspace():
            has_text = True
        out.write(piece.encode("utf-8"))
    return documents + has_text
