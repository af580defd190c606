"""The `encode` stage: a UTF-8 text file -> a uint16 `.npy` of token ids, in parallel.

Each chunk is encoded by `Tokenizer.encode_array` (tiktoken's core where the tokenizer can be
expressed in it, which is checked, else the reference encoder: the same ids either way).
The file is cut into chunks at safe split points (special tokens, else line or word boundaries;
see `pretokenize.find_split`), so encoding chunks separately gives exactly the ids of the whole
text, whatever the number of workers. Each worker encodes its chunk into a temporary raw uint16
file; the final `.npy` is then allocated at its full size (a full disk fails here, before any
copying) under a temporary name, filled by copying the parts in order (never mapped into memory, so
memory stays bounded whatever the size), and renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from itertools import pairwise
from pathlib import Path

import numpy as np

from tinylm.config.constants import UINT16_VOCAB_LIMIT
from tinylm.io import atomic_path
from tinylm.progress import Progress
from tinylm.tokenizer.pretokenize import (
    check_readable,
    default_num_workers,
    find_chunk_boundaries,
    map_in_processes,
    read_text_chunk,
)
from tinylm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bytes of text per task: enough to amortize the work, small enough to bound a worker's memory.
ENCODE_CHUNK_BYTES = 4 << 20
# The parts are joined into the .npy this many bytes at a time.
COPY_BYTES = 1 << 20


def encode_corpus(
    tokenizer: Tokenizer,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    num_workers: int | None = None,
    *,
    errors: str = "strict",
    progress: bool = True,
) -> int:
    """Encode `input_path` into a uint16 `.npy` at `output_path`; return the number of tokens.

    `np.load(output_path, mmap_mode="r")` reads the result. Uses `num_workers` processes (default:
    all cores); the output does not depend on it. Raises ValueError for a vocabulary with ids that
    do not fit in uint16, FileNotFoundError / ValueError naming the file for a missing or unreadable
    input or invalid UTF-8 (unless errors="replace"). On any error `output_path` is untouched.
    """
    largest_id = max(tokenizer.vocab)
    if largest_id >= UINT16_VOCAB_LIMIT:
        raise ValueError(
            f"the tokenizer has ids up to {largest_id}; uint16 token files hold at most "
            f"{UINT16_VOCAB_LIMIT} ids"
        )
    input_path = check_readable(input_path)
    output_path = Path(output_path)
    num_workers = num_workers or default_num_workers()
    size = os.path.getsize(input_path)
    num_chunks = max(num_workers, -(-size // ENCODE_CHUNK_BYTES))
    # Check once here (forked workers inherit the engine) whether tiktoken's core can encode.
    tokenizer.tiktoken_engine()
    bounds = find_chunk_boundaries(input_path, num_chunks, tokenizer.special_tokens)

    output_path.parent.mkdir(parents=True, exist_ok=True)
    parts_dir = Path(tempfile.mkdtemp(prefix=f".{output_path.name}.", dir=output_path.parent))
    try:
        tasks = [
            (str(input_path), start, end, errors, str(parts_dir / f"{i:06d}.u16"))
            for i, (start, end) in enumerate(pairwise(bounds))
        ]
        bar = Progress(f"[encode] {input_path}", size, "B", enabled=progress)
        lengths = []
        replaced = 0
        chunks = map_in_processes(_encode_chunk, tasks, num_workers, _set_worker_tokenizer, (tokenizer,))
        for length, chunk_bytes, chunk_replaced in chunks:
            lengths.append(length)
            replaced += chunk_replaced
            bar.update(chunk_bytes)
        total = sum(lengths)
        if replaced:
            log.warning("%s: replaced %d invalid UTF-8 bytes with U+FFFD", input_path, replaced)

        with atomic_path(output_path, suffix=".npy") as tmp, open(tmp, "wb") as out:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint16)), "fortran_order": False,
                      "shape": (total,)}  # fmt: skip
            np.lib.format.write_array_header_1_0(out, header)
            _reserve_disk_space(out, out.tell() + 2 * total)
            for *_, part_path in tasks:  # copied, not mapped: memory stays small for any size
                with open(part_path, "rb") as part:
                    shutil.copyfileobj(part, out, COPY_BYTES)
    except OSError as e:
        raise OSError(e.errno, f"{output_path}: cannot write the token file: {e.strerror or e}") from e
    finally:
        _set_worker_tokenizer(None)
        shutil.rmtree(parts_dir, ignore_errors=True)
    return total


# The tokenizer of this worker process, sent once per worker rather than once per chunk, so that its
# cache of encoded pre-tokens carries over from chunk to chunk.
_worker_tokenizer: Tokenizer | None = None


def _set_worker_tokenizer(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_chunk(task: tuple[str, int, int, str, str]) -> tuple[int, int, int]:
    """Encode bytes [start, end) of the input into a raw uint16 file.

    Returns (number of tokens, bytes read, invalid bytes replaced).
    """
    path, start, end, errors, part_path = task
    text, replaced = read_text_chunk(path, start, end, errors)
    ids = _worker_tokenizer.encode_array(text).astype(np.uint16)  # (the vocabulary fits: checked)
    with open(part_path, "wb") as f:  # (ndarray.tofile hides ENOSPC behind a short-write message)
        f.write(ids.tobytes())
    return len(ids), end - start, replaced


def _reserve_disk_space(f, size: int) -> None:
    """Allocate `size` bytes for the open file `f` now, so a full disk raises OSError here, not later."""
    if hasattr(os, "posix_fallocate") and size > 0:
        os.posix_fallocate(f.fileno(), 0, size)
