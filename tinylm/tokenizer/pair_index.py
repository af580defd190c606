"""The words of a corpus as flat arrays, where each pair of tokens occurs, and one BPE merge.

Used by BPE training (bpe.py). Built for tens of millions of distinct words:

- All words sit in one flat array of token ids, a sentinel between words, with no Python object
  per word. A token occupies the array positions of its bytes: it starts where its first byte
  was, so the position after it is its start plus its byte length, and `back` maps the last
  position of every token to its start. Merging a pair is a few vectorized writes.
- Where a pair occurs is known without scanning: a pair of two bytes from a table built once, a
  pair (x, t) or (t, y) with a merged token t from what merge t recorded about the neighbours of
  the tokens it made. A pair only ever gains occurrences in the merge that makes its newer token,
  so these two sources are complete. Entries that went out of date are skipped by a check, and
  pruned: a record is compacted once most of it is out of date and dropped when its token no
  longer occurs, the byte-pair table once most bytes are merged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# Array values that are not tokens: between words, and the positions inside a merged token.
SENTINEL = -1
INSIDE = -2


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
    a token's id sits at its start position and the other positions it covers hold INSIDE.
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
        self.tokens = np.full(size, SENTINEL, dtype=np.int32)
        start = 1
        for batch in words:
            region = self.tokens[start : start + len(batch)]
            region[:] = np.frombuffer(batch, dtype=np.uint8)
            region[region == 0xFF] = SENTINEL
            start += len(batch) + 1
        self.word_starts = (np.flatnonzero(self.tokens[:-1] == SENTINEL) + 1).astype(self.position_dtype)
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
            parts.append(
                self.byte_pair_positions[self.byte_pair_offsets[pair] : self.byte_pair_offsets[pair + 1]]
            )
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
        """Merge every occurrence of (a, b) into the new token `new`, left to right within each word.

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
        has_left = tokens[starts - 1] != SENTINEL
        right_before = tokens[after]

        tokens[starts] = new
        tokens[seconds] = INSIDE
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
        ok_right = (tokens[right_starts] == token) & (
            tokens[np.minimum(right_starts + size[token], last)] == right_tokens
        )
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
