"""Local text files (and downloaded ones), streamed: never held whole in memory.

Each file is used as it is; a file boundary is a document boundary. `train_files` are joined into
train.txt and `valid_files` into valid.txt; with no `valid_files`, the last `valid_fraction` of the
documents of the train files is held out instead.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from tinylm.corpus.format import SEPARATOR, CorpusError, Writer

# Bytes read at a time; small enough that no input is ever held whole in memory.
CHUNK_SIZE = 1 << 20

def files_writer(train_files: list, valid_files: list, valid_fraction: float) -> Writer:
    """The writer of the `files` (and `url`) source; FileNotFoundError naming a missing file."""
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
