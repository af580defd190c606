"""A second, independent BPE merge loop, for checking the trainer on corpora too big for the naive one.

This is the trainer tinylm had before the array-based one (tinylm/tokenizer/bpe.py): one Python
list per word, a set of words per pair (never pruned) and a heap of (count, descending byte key)
tuples. Slower and heavier, but simple, and its merges on every earlier test were checked against
the naive trainer of test_bpe.py.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from itertools import pairwise


def reference_merges(counts: dict[str, int], num_specials: int, num_merges: int) -> list[tuple[bytes, bytes]]:
    """The merges of BPE training on pre-token `counts` (ids: 256 bytes, then `num_specials`)."""
    vocab = {i: bytes([i]) for i in range(256)}
    for i in range(num_specials):
        vocab[256 + i] = f"<special {i}>".encode()
    words = [list(word.encode("utf-8")) for word in counts]
    word_counts = list(counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    words_with: dict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, count) in enumerate(zip(words, word_counts, strict=True)):
        for pair in pairwise(word):
            pair_counts[pair] += count
            words_with[pair].add(w)

    # (-count, key) puts the largest count first and, among equal counts, the greatest byte pair.
    keys = {i: descending_key(token) for i, token in vocab.items()}
    heap = [(-n, keys[a] + keys[b], a, b) for (a, b), n in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    for _ in range(num_merges):
        best = _pop_best(heap, pair_counts)
        if best is None:
            break
        a, b = best
        new = len(vocab)
        vocab[new] = vocab[a] + vocab[b]
        keys[new] = descending_key(vocab[new])
        merges.append((vocab[a], vocab[b]))
        new_pairs = set()
        for w in words_with.pop(best):
            word, count = words[w], word_counts[w]
            i = 0
            while i < len(word) - 1:
                if word[i] == a and word[i + 1] == b:
                    if i > 0:
                        x = word[i - 1]
                        pair_counts[x, a] -= count
                        pair_counts[x, new] += count
                        new_pairs.add((x, new))
                        words_with[x, new].add(w)
                    if i + 2 < len(word):
                        y = word[i + 2]
                        pair_counts[b, y] -= count
                        pair_counts[new, y] += count
                        new_pairs.add((new, y))
                        words_with[new, y].add(w)
                    word[i : i + 2] = [new]
                i += 1
        del pair_counts[best]
        for pair in new_pairs:
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], keys[pair[0]] + keys[pair[1]], pair[0], pair[1]))
    return merges


def _pop_best(heap: list, pair_counts: dict[tuple[int, int], int]) -> tuple[int, int] | None:
    while heap:
        neg_count, key, a, b = heapq.heappop(heap)
        count = pair_counts.get((a, b), 0)
        if count == -neg_count:
            return a, b
        if count > 0:
            heapq.heappush(heap, (-count, key, a, b))
    return None


def descending_key(token: bytes) -> str:
    """A string that sorts in the reverse order of `token` among all byte strings.

    Each byte c becomes chr(255 - c), and a terminator chr(256), larger than every mapped byte,
    makes a prefix sort after its extensions; concatenated keys of pairs then sort in reverse order
    of (bytes a, bytes b).
    """
    return "".join(chr(255 - c) for c in token) + chr(256)
