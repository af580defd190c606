"""Byte-level BPE training (GPT-2 style), and the `train-tokenizer` stage.

Training starts from the 256 single bytes. Every distinct pre-token ("word") of the corpus is a
sequence of tokens with a count. Each step merges the most frequent adjacent pair of tokens into a
new token; ties go to the lexicographically greater pair of byte strings.

The merge loop is built for corpora of gigabytes, where there are tens of millions of distinct
pre-tokens; its memory grows with their total length, not with the text (see `PairIndex`):

- All words sit in one flat array of token ids, a sentinel between words, with no Python object
  per word. A token occupies the array positions of its bytes: it starts where its first byte
  was, so the position after it is its start plus its byte length, and `back` maps the last
  position of every token to its start. Merging a pair is a few vectorized writes.
- Pair counts (weighted by word counts) are kept up to date incrementally in a dict, and a heap of
  plain ints yields the best pair. Counts of existing pairs only ever go down (every new pair
  contains the new token), so a popped heap entry whose count is out of date is pushed back with
  its current count.
- Where a pair occurs is known without scanning: a pair of two bytes from a table built once, a
  pair (x, t) or (t, y) with a merged token t from what merge t recorded about the neighbours of
  the tokens it made. A pair only ever gains occurrences in the merge that makes its newer token,
  so these two sources are complete; entries that went out of date are skipped by a check, and a
  token's record is dropped once no occurrence of the token is left.
"""

from __future__ import annotations

import heapq
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

import numpy as np
from tqdm import tqdm

from tinylm.tokenizer.pretokenize import check_readable, check_special_tokens, count_pretokens
from tinylm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# uint16 token files hold ids 0..65535.
MAX_UINT16_VOCAB = 1 << 16

# Array values that are not tokens: between words, and the positions inside a merged token.
_SENTINEL = -1
_INSIDE = -2


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
            f"train_bpe {path}: pre-tokenized in {counted - start:.1f} s ({num_words:,} distinct pre-tokens), "
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
            f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} special tokens = {smallest}"
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
    for _ in tqdm(range(num_merges), desc="bpe merges", disable=not progress):
        best = _pop_best(heap, pair_counts, vocab, index)
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


def _pop_best(heap: list[int], pair_counts: dict[int, int], vocab: dict[int, bytes], index: PairIndex):
    """Pop the key of the pair with the highest current count, ties to the greatest pair of bytes.

    None when no pair is left. Entries whose count went down are pushed back with their count.
    """
    shift, mask = index.key_bits, (1 << index.key_bits) - 1
    while heap:
        count = -heap[0] >> shift
        tied = []
        while heap and -heap[0] >> shift == count:
            key = -heapq.heappop(heap) & mask
            current = pair_counts.get(key, 0)
            if current == count:
                tied.append(key)
            elif current > 0:
                heapq.heappush(heap, -(current << shift | key))
        if tied:
            best = max(tied, key=lambda k: tuple(vocab[t] for t in index.split_key(k)))
            for key in tied:
                if key != best:
                    heapq.heappush(heap, -(count << shift | key))
            return best
    return None


def pack_words(word_counts: Mapping[str, int]) -> tuple[list[bytes], np.ndarray]:
    """The words of two or more bytes (the others hold no pair) in a compact form, and their counts.

    Words are UTF-8 encoded and joined in batches by the byte 0xff, which UTF-8 never contains:
    about one byte per byte of text instead of a Python object per word, so that the Counter can be
    freed before the arrays of `PairIndex` are built.
    """
    batches, counts = [], []
    batch, batch_counts = [], []
    for word, count in word_counts.items():
        raw = word.encode("utf-8")
        if len(raw) > 1:
            batch.append(raw)
            batch_counts.append(count)
        if len(batch) == 1 << 16:
            batches.append(b"\xff".join(batch))
            counts.append(np.array(batch_counts, dtype=np.int64))
            batch, batch_counts = [], []
    if batch:
        batches.append(b"\xff".join(batch))
        counts.append(np.array(batch_counts, dtype=np.int64))
    return batches, np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)


class PairIndex:
    """The words of a corpus as one flat token array, and where each pair of tokens occurs.

    Layout: `tokens[0]` is a sentinel, then every word of two or more bytes followed by a sentinel;
    a token's id sits at its start position and the other positions it covers hold _INSIDE.
    `back[p]` is the start of the token whose last position is p. Word w starts at `word_starts[w]`
    and occurs `word_counts[w]` times in the corpus.

    Memory, per byte of the distinct words: 4 bytes of tokens, 4 of `back` and 4 of the byte-pair
    table (compacted once most bytes are merged), plus 8 bytes per occurrence a merge records
    (compacted once most of a record is out of date, dropped when its token no longer occurs).
    Building works in slices of words and positions, so its temporary arrays stay small.
    """

    # Positions handled at a time while building (bounds the temporary arrays).
    BUILD_POSITIONS = 1 << 21
    # A record is compacted once it holds more than 4 entries per occurrence left, plus this many.
    COMPACT_MIN = 4096

    def __init__(self, words: list[bytes], counts: np.ndarray, vocab_size: int):
        """`words`, `counts`: from `pack_words`. Ids of merged tokens stay below `vocab_size`."""
        self.vocab_size = vocab_size
        self.key_bits = max(1, (vocab_size * vocab_size - 1).bit_length())
        self.token_bytes = np.zeros(vocab_size, dtype=np.int64)
        self.token_bytes[:256] = 1
        self._build_arrays(words, counts)
        self._build_byte_pair_table()
        # merged token t -> (left neighbours x, positions of (x, t), right neighbours y, positions of
        # (t, y)), each sorted by neighbour: where these pairs occurred when t was made.
        self.records: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.live = np.zeros(vocab_size, dtype=np.int64)  # positions holding each token
        for lo in range(0, len(self.tokens), self.BUILD_POSITIONS):
            chunk = self.tokens[lo : lo + self.BUILD_POSITIONS]
            self.live[:256] += np.bincount(chunk[chunk >= 0], minlength=256)

    def split_key(self, key: int) -> tuple[int, int]:
        return divmod(key, self.vocab_size)

    # --- building

    def _build_arrays(self, words: list[bytes], counts: np.ndarray) -> None:
        """Fill tokens, back, word_starts and word_counts from the batches of `pack_words`."""
        size = sum(len(batch) + 1 for batch in words) + 1
        self.position_dtype = np.int32 if size < 2**31 else np.int64
        self.tokens = np.full(size, _SENTINEL, dtype=np.int32)
        start = 1
        for batch in words:
            region = self.tokens[start : start + len(batch)]
            region[:] = np.frombuffer(batch, dtype=np.uint8)
            region[region == 0xFF] = _SENTINEL
            start += len(batch) + 1
        self.word_starts = (np.flatnonzero(self.tokens[:-1] == _SENTINEL) + 1).astype(self.position_dtype)
        self.word_counts = counts
        self.back = np.arange(size, dtype=self.position_dtype)

    def _byte_pairs(self, lo: int) -> tuple[np.ndarray, np.ndarray]:
        """(pair ids a << 8 | b, start positions) of the pairs of two bytes starting in a slice."""
        hi = min(lo + self.BUILD_POSITIONS, len(self.tokens) - 1)
        first, second = self.tokens[lo:hi], self.tokens[lo + 1 : hi + 1]
        starts = np.flatnonzero((first >= 0) & (second >= 0))
        pair_ids = (first[starts] << 8 | second[starts]).astype(np.uint16)
        return pair_ids, (starts + lo).astype(self.position_dtype)

    def _build_byte_pair_table(self) -> None:
        """Positions of every pair of two bytes grouped by pair id (`byte_pair_offsets`: 65536 + 1),
        and the count of every such pair (`byte_pair_counts`), in two passes over slices."""
        sizes = np.zeros(65536, dtype=np.int64)
        weighted = np.zeros(65536, dtype=np.float64)  # exact: sums of counts stay far below 2**53
        slices = range(0, len(self.tokens) - 1, self.BUILD_POSITIONS)
        for lo in slices:
            pair_ids, starts = self._byte_pairs(lo)
            sizes += np.bincount(pair_ids, minlength=65536)
            weighted += np.bincount(pair_ids, self.word_counts[self._word_of(starts)], minlength=65536)
        self.byte_pair_counts = weighted.astype(np.int64)
        self.byte_pair_offsets = np.zeros(65537, dtype=np.int64)
        np.cumsum(sizes, out=self.byte_pair_offsets[1:])
        self.byte_pair_positions = np.empty(int(self.byte_pair_offsets[-1]), dtype=self.position_dtype)
        filled = self.byte_pair_offsets[:-1].copy()
        for lo in slices:  # a counting sort, slice by slice
            pair_ids, starts = self._byte_pairs(lo)
            order = np.argsort(pair_ids, kind="stable")
            pair_ids = pair_ids[order]
            slice_sizes = np.bincount(pair_ids, minlength=65536)
            rank = np.arange(len(pair_ids)) - (np.cumsum(slice_sizes) - slice_sizes)[pair_ids]
            self.byte_pair_positions[filled[pair_ids] + rank] = starts[order]
            filled += slice_sizes

    def initial_pair_counts(self) -> dict[int, int]:
        """{pair key: count} of every pair of two bytes."""
        pairs = np.flatnonzero(self.byte_pair_counts)
        keys = (pairs >> 8) * self.vocab_size + (pairs & 255)
        return dict(zip(keys.tolist(), self.byte_pair_counts[pairs].tolist(), strict=True))

    # --- lookups

    def _word_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.word_starts, positions, side="right") - 1

    def _occurrences(self, a: int, b: int) -> np.ndarray:
        """Positions where the pair (a, b) may occur (a superset of where it does)."""
        parts = []
        if a < 256 and b < 256:
            pair = a << 8 | b
            parts.append(self.byte_pair_positions[self.byte_pair_offsets[pair] : self.byte_pair_offsets[pair + 1]])
        if a in self.records:  # (a, y) recorded by merge a, y = b
            _, _, right, right_positions = self.records[a]
            lo, hi = np.searchsorted(right, [b, b + 1])
            parts.append(right_positions[lo:hi])
        if b in self.records:  # (x, b) recorded by merge b, x = a
            left, left_positions, _, _ = self.records[b]
            lo, hi = np.searchsorted(left, [a, a + 1])
            parts.append(left_positions[lo:hi])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.position_dtype)

    # --- one merge

    def merge(self, a: int, b: int, new: int) -> tuple[np.ndarray, np.ndarray]:
        """Merge every occurrence of (a, b) into `new`, left to right within each word.

        Returns (pair keys, count changes) of the pairs whose counts changed. A key may repeat
        among the decreases; each pair with the new token appears once, with its whole count.
        """
        tokens, back, size_a, size_b = self.tokens, self.back, self.token_bytes[a], self.token_bytes[b]
        starts = self._occurrences(a, b)
        starts = starts[tokens[starts] == a]
        starts = starts[tokens[starts + size_a] == b]
        if a == b:  # in a run "a a a" only the first, third, ... occurrence is merged
            starts = self._every_other_in_runs(np.sort(starts), size_a)
        counts = self.word_counts[self._word_of(starts)]
        seconds = starts + size_a
        after = seconds + size_b  # the position after the merged token: a token or a sentinel
        has_left = tokens[starts - 1] != _SENTINEL
        right_before = tokens[after]

        tokens[starts] = new
        tokens[seconds] = _INSIDE
        back[after - 1] = starts
        self.token_bytes[new] = size_a + size_b
        self._update_live(a, b, new, len(starts))

        # Left neighbours x: (x, a) becomes (x, new). A left neighbour that is itself a new token
        # ("a b a b", or a run of a) was the b of the occurrence before, whose right pair it is.
        lefts = back[starts[has_left] - 1]
        left_counts = counts[has_left]
        unchained = tokens[lefts] != new
        lefts, left_counts = lefts[unchained], left_counts[unchained]
        left_tokens, lefts, x, x_sums = self._group(tokens[lefts], lefts, left_counts)
        # Right neighbours y: (b, y) becomes (new, y); y is the new token where occurrences chain.
        has_right = right_before >= 0
        right_counts = counts[has_right]
        _, _, y_old, y_old_sums = self._group(right_before[has_right], None, right_counts)
        right_tokens, right_starts, y_new, y_new_sums = self._group(
            tokens[after[has_right]], starts[has_right], right_counts
        )
        self.records[new] = (left_tokens, lefts, right_tokens, right_starts)

        v = self.vocab_size
        keys = [np.array([a * v + b]), x.astype(np.int64) * v + a, b * v + y_old.astype(np.int64),
                x.astype(np.int64) * v + new, new * v + y_new.astype(np.int64)]  # fmt: skip
        deltas = [-counts.sum(keepdims=True), -x_sums, -y_old_sums, x_sums, y_new_sums]
        return np.concatenate(keys), np.concatenate(deltas)

    @staticmethod
    def _group(values: np.ndarray, positions: np.ndarray | None, counts: np.ndarray):
        """(values sorted, positions in that order, the distinct values, summed counts per value)."""
        order = np.argsort(values, kind="stable")
        values, counts = values[order], counts[order]
        if positions is not None:
            positions = positions[order]
        if not len(values):
            return values, positions, values, counts
        firsts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
        return values, positions, values[firsts], np.add.reduceat(counts, firsts)

    @staticmethod
    def _every_other_in_runs(starts: np.ndarray, size: int) -> np.ndarray:
        """From ascending starts of (a, a), keep the 1st, 3rd, ... of each run of chained ones."""
        if len(starts) < 2:
            return starts
        chained = np.concatenate([[False], starts[1:] == starts[:-1] + size])
        run_start = np.maximum.accumulate(np.where(chained, 0, np.arange(len(starts))))
        return starts[(np.arange(len(starts)) - run_start) % 2 == 0]

    def _update_live(self, a: int, b: int, new: int, count: int) -> None:
        """Keep the number of positions holding each token; prune the records of a and b."""
        self.live[new] = count
        self.live[a] -= count
        self.live[b] -= count
        for token in (a, b):
            record = self.records.get(token)
            if record is None:
                continue
            if self.live[token] == 0:
                del self.records[token]
            elif len(record[1]) + len(record[3]) > 4 * self.live[token] + self.COMPACT_MIN:
                self._compact_record(token)  # at most 2 entries per occurrence can still be right
        if self.live[:256].sum() * 4 < len(self.byte_pair_positions):
            self._compact_byte_pair_table()

    def _compact_record(self, token: int) -> None:
        """Keep only the entries of a record whose pair still occurs there."""
        tokens, size, last = self.tokens, self.token_bytes, len(self.tokens) - 1
        left_tokens, lefts, right_tokens, right_starts = self.records[token]
        ok = (tokens[lefts] == left_tokens) & (tokens[np.minimum(lefts + size[left_tokens], last)] == token)
        ok_right = (tokens[right_starts] == token) & (tokens[np.minimum(right_starts + size[token], last)] == right_tokens)
        self.records[token] = (left_tokens[ok], lefts[ok], right_tokens[ok_right], right_starts[ok_right])

    def _compact_byte_pair_table(self) -> None:
        """Keep only the entries of the byte-pair table whose two bytes are still single tokens."""
        positions, tokens = self.byte_pair_positions, self.tokens
        pair_ids = np.repeat(np.arange(65536, dtype=np.uint16), np.diff(self.byte_pair_offsets))
        kept, sizes = [], np.zeros(65536, dtype=np.int64)
        for lo in range(0, len(positions), self.BUILD_POSITIONS):
            p, ids = positions[lo : lo + self.BUILD_POSITIONS], pair_ids[lo : lo + self.BUILD_POSITIONS]
            ok = (tokens[p] == ids >> 8) & (tokens[p + 1] == ids & 255)
            kept.append(p[ok])
            sizes += np.bincount(ids[ok], minlength=65536)
        self.byte_pair_positions = np.concatenate(kept) if kept else positions
        np.cumsum(sizes, out=self.byte_pair_offsets[1:])


def train_tokenizer(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    num_workers: int | None = None,
    *,
    errors: str = "strict",
    progress: bool = True,
) -> Tokenizer:
    """The `train-tokenizer` stage: train BPE on `input_path`, write `output_path` atomically.

    All input is validated before anything is written; on any error `output_path` is untouched.
    Also refuses `vocab_size` above 65536, the most ids a uint16 token file holds.
    """
    if isinstance(vocab_size, int) and vocab_size > MAX_UINT16_VOCAB:
        raise ValueError(
            f"vocab_size {vocab_size} is above {MAX_UINT16_VOCAB}, the most ids a uint16 token file can hold"
        )
    vocab, merges = train_bpe(
        input_path, vocab_size, special_tokens, num_workers, errors=errors, progress=progress
    )
    tokenizer = Tokenizer(vocab, merges, special_tokens)
    tokenizer.save(output_path)
    return tokenizer
