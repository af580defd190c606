"""Byte-level BPE training (GPT-2 style), and the `train-tokenizer` stage.

Training starts from the 256 single bytes. Every distinct pre-token ("word") of the corpus is a
sequence of tokens with a count. Each step merges the most frequent adjacent pair of tokens into a
new token; ties go to the lexicographically greater pair of byte strings.

Built for corpora of gigabytes, where there are tens of millions of distinct pre-tokens:

- Pre-tokens are counted in parallel, chunk by chunk (pretokenize.py); memory grows with the
  distinct pre-tokens, not with the text. The Counter is packed into bytes and freed before the
  merges start.
- The words live in flat arrays, and where each pair occurs is recorded as merges make it, with
  no Python object per word or per occurrence (pair_index.py).
- Pair counts (weighted by word counts) are kept up to date incrementally in a dict, and a heap of
  plain ints yields the best pair. Counts of existing pairs only ever go down (every new pair
  contains the new token), so a popped heap entry whose count is out of date is pushed back with
  its current count. The pairs tied at the highest count wait, sorted by their bytes, in a list
  beside the heap (`_Ties`), so that a run of merges at one count does not pop and push the whole
  tied group again for each merge (late merges of a small corpus tie by the thousand).
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from tinylm.config.constants import END_OF_TEXT, UINT16_VOCAB_LIMIT
from tinylm.progress import Progress
from tinylm.tokenizer.pair_index import PairIndex, pack_words
from tinylm.tokenizer.pretokenize import check_readable, check_special_tokens, count_pretokens
from tinylm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    num_workers: int | None = None,
    *,
    errors: str = "strict",
    progress: bool = True,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on a UTF-8 text file.

    Returns (vocab, merges): vocab maps ids to token bytes, with ids 0..255 the single bytes, then
    the special tokens in the given order, then one id per merge in creation order; merges lists
    the merged pairs in creation order. Deterministic, and independent of `num_workers` (processes
    used for pre-tokenization; default: all cores). If the corpus runs out of pairs, the vocabulary
    stays smaller than `vocab_size` (logged as a warning).

    Raises FileNotFoundError / ValueError (naming the file) for a missing or unreadable file and for
    invalid UTF-8 (unless errors="replace"), and ValueError for a `vocab_size` below 256 + the
    number of special tokens and for a corpus without any non-whitespace text.
    """
    special_tokens = check_special_tokens(special_tokens)
    check_vocab_size(vocab_size, special_tokens)
    path = check_readable(input_path)
    start = time.perf_counter()
    counts = count_pretokens(path, special_tokens, num_workers, errors=errors, progress=progress)
    if not any(not word.isspace() for word in counts):
        raise ValueError(
            f"{path}: the corpus has no text to train on (empty or only whitespace/special tokens)"
        )
    num_words = len(counts)
    counted = time.perf_counter()

    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    words, word_counts = pack_words(counts)
    del counts  # the packed words are a fraction of the Counter's memory
    index = PairIndex(words, word_counts, vocab_size=max(vocab_size, len(vocab)))
    del words
    built = time.perf_counter()
    merges = merge_pairs(index, vocab, vocab_size - len(vocab), progress)
    if progress:
        print(
            f"train_bpe {path}: pre-tokenized in {counted - start:.1f} s ({num_words:,} distinct "
            f"pre-tokens), "
            f"index of {len(index.tokens):,} positions built in {built - counted:.1f} s, "
            f"{len(merges):,} merges in {time.perf_counter() - built:.1f} s",
            file=sys.stderr,
        )
    if len(vocab) < vocab_size:
        log.warning(
            "%s: no pairs left to merge; vocabulary has %d of %d tokens", path, len(vocab), vocab_size
        )
    return vocab, merges


def check_vocab_size(vocab_size: int, special_tokens: Sequence[str]) -> None:
    """Raise ValueError unless the vocabulary has room for the 256 bytes and the special tokens."""
    smallest = 256 + len(special_tokens)
    if not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} special tokens "
            f"= {smallest}"
        )


def merge_pairs(
    index: PairIndex, vocab: dict[int, bytes], num_merges: int, progress: bool = True
) -> list[tuple[bytes, bytes]]:
    """Run up to `num_merges` BPE merges on the words of `index`; return the merged byte pairs.

    `vocab` holds ids 0..len(vocab)-1; each merge adds the next id (below index.vocab_size).
    """
    # Heap entries are ints, -(count << shift | pair key), so the largest count comes first; the
    # pairs tied at that count are then compared by their bytes (see `_pop_best`).
    pair_counts = index.initial_pair_counts()
    shift = index.key_bits
    heap = [-(count << shift | key) for key, count in pair_counts.items()]
    heapq.heapify(heap)

    merges = []
    ties = _Ties()
    shown = Progress("[train-tokenizer] merges", num_merges, "merges", enabled=progress)
    for _ in range(num_merges):
        shown.update()
        best = _pop_best(heap, pair_counts, vocab, index, ties)
        if best is None:
            break
        a, b = index.split_key(best)
        new = len(vocab)
        vocab[new] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        keys, deltas = index.merge(a, b, new)
        for key, delta in zip(keys.tolist(), deltas.tolist(), strict=True):
            count = pair_counts.get(key, 0) + delta
            if count > 0:
                pair_counts[key] = count
                if delta > 0:  # a pair with the new token: its count is final until it decreases
                    heapq.heappush(heap, -(count << shift | key))
            else:
                pair_counts.pop(key, None)
    return merges


class _Ties:
    """The pairs popped from the heap at the highest count, `level`: (pair bytes, key), ascending.

    Every pair whose current count is `level` is in `group` or still in the heap; some in `group`
    may have gone down since (they are checked when they reach its end).
    """

    def __init__(self):
        self.level = 0
        self.group: list[tuple[tuple[bytes, bytes], int]] = []


def _pop_best(
    heap: list[int], pair_counts: dict[int, int], vocab: dict[int, bytes], index: PairIndex, ties: _Ties
):
    """Pop the key of the pair with the highest current count, ties to the greatest pair of bytes.

    None when no pair is left. Entries whose count went down are pushed back with their count.

    No count ever exceeds the current level: existing pairs only lose occurrences, and a new pair
    occurs only where the pair just merged (at most `level` times) did. So the best pair is the
    greatest of `ties.group` and of the heap entries stored at `level` whose count is still
    `level`; only when there is none does the level go down to the heap's top.
    """
    shift, mask = index.key_bits, (1 << index.key_bits) - 1

    def pair_bytes(key: int) -> tuple[bytes, bytes]:
        a, b = index.split_key(key)
        return vocab[a], vocab[b]

    while True:
        level = ties.level
        while heap and -heap[0] >> shift == level:  # new arrivals at this level join the group
            key = -heapq.heappop(heap) & mask
            current = pair_counts.get(key, 0)
            if current == level:
                bisect.insort(ties.group, (pair_bytes(key), key))
            elif current > 0:
                heapq.heappush(heap, -(current << shift | key))
        while ties.group:
            _, key = ties.group.pop()
            current = pair_counts.get(key, 0)
            if current == level:
                return key
            if current > 0:  # went down since it joined the group
                heapq.heappush(heap, -(current << shift | key))
        if not heap:
            return None
        ties.level = -heap[0] >> shift


def train_tokenizer(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    num_workers: int | None = None,
    *,
    max_train_bytes: int | None = None,
    errors: str = "strict",
    progress: bool = True,
) -> Tokenizer:
    """The `train-tokenizer` stage: train BPE on `input_path`, write `output_path` atomically.

    With `max_train_bytes`, on the first documents of the file only (`training_sample`): the usual
    practice at corpus scale, where a few GB of text give the merges of the whole. All input is
    validated before anything is written; on any error `output_path` is untouched. Also refuses
    `vocab_size` above 65536, the most ids a uint16 token file holds.
    """
    if isinstance(vocab_size, int) and vocab_size > UINT16_VOCAB_LIMIT:
        raise ValueError(
            f"vocab_size {vocab_size} is above {UINT16_VOCAB_LIMIT}, the most ids a uint16 token file holds"
        )
    if max_train_bytes is not None and max_train_bytes < 1:
        raise ValueError(f"tokenizer.max_train_bytes: {max_train_bytes} must be at least 1 (or null: all)")
    path = check_readable(input_path)
    with training_sample(path, max_train_bytes, Path(output_path).parent) as sample:
        vocab, merges = train_bpe(
            sample, vocab_size, special_tokens, num_workers, errors=errors, progress=progress
        )
    tokenizer = Tokenizer(vocab, merges, special_tokens)
    tokenizer.save(output_path)
    return tokenizer


@contextlib.contextmanager
def training_sample(path: Path, max_bytes: int | None, scratch_dir: Path) -> Iterator[Path]:
    """The file to train on: `path` itself, or a temporary copy of its first documents that fit in
    `max_bytes` (removed afterwards).

    Documents are joined by END_OF_TEXT, so the sample ends where the last separator that starts
    within the first `max_bytes` starts: whole documents only, the same cut on every run. When the
    first document alone is longer, the sample is its first `max_bytes` bytes, cut back to a UTF-8
    character boundary. The file is copied in blocks; only the bytes near the cut are searched.
    """
    size = path.stat().st_size
    if max_bytes is None or size <= max_bytes:
        yield path
        return
    separator = END_OF_TEXT.encode()
    with open(path, "rb") as f:
        cut = _last_separator_start(f, max_bytes, separator)
        whole_documents = cut is not None
        if cut is None:
            cut = max_bytes
            f.seek(cut)
            while cut > 0 and (f.read(1)[0] & 0xC0) == 0x80:  # a UTF-8 continuation byte: back up
                cut -= 1
                f.seek(cut)
        scratch_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".train_sample.", suffix=".txt", dir=scratch_dir)
        sample = Path(name)
        try:
            documents = 1
            with os.fdopen(fd, "wb") as out:
                f.seek(0)
                left, tail = cut, b""
                while left:
                    block = f.read(min(SAMPLE_BLOCK_BYTES, left))
                    left -= len(block)
                    documents += (tail + block).count(separator) - tail.count(separator)
                    tail = (tail + block)[-(len(separator) - 1) :]
                    out.write(block)
            how = f"{documents:,} whole documents" if whole_documents else "part of its first document"
            print(
                f"[train-tokenizer] training on the first {cut:,} of {size:,} bytes of {path} "
                f"({how}; tokenizer.max_train_bytes {max_bytes:,})",
                file=sys.stderr,
                flush=True,
            )
            yield sample
        finally:
            sample.unlink(missing_ok=True)


SAMPLE_BLOCK_BYTES = 16 << 20  # the sample is copied and searched in blocks of this size


def _last_separator_start(f: BinaryIO, limit: int, separator: bytes) -> int | None:
    """The offset of the last `separator` that starts at or before `limit` - 1 and ends by `limit`;
    None when there is none. Searches backwards from `limit`, a block at a time."""
    end = limit
    while end > 0:
        start = max(0, end - SAMPLE_BLOCK_BYTES)
        f.seek(start)
        block = f.read(end - start)
        found = block.rfind(separator)
        if found >= 0:
            return start + found
        if start == 0:
            return None
        end = start + len(separator) - 1  # a separator across the block boundary is found next time
    return None
