"""Byte-level BPE training (GPT-2 style), and the `train-tokenizer` stage.

Training starts from the 256 single bytes. Every distinct pre-token ("word") of the corpus is a
sequence of token ids with a count. Each step merges the most frequent adjacent pair of tokens into a
new token; ties go to the lexicographically greater pair of byte strings.

Only the words that contain the merged pair change, so pair counts are kept up to date
incrementally: `pair_counts` holds the count of every pair, `words_with` maps a pair to the words
that (may) contain it, and a heap yields the best pair. Heap entries are checked lazily: counts of
existing pairs only ever go down (every new pair contains the new token), so a popped entry whose
count is out of date is pushed back with its current count.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise

from tqdm import tqdm

from tinylm.tokenizer.pretokenize import check_readable, check_special_tokens, count_pretokens
from tinylm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# uint16 token files hold ids 0..65535.
MAX_UINT16_VOCAB = 1 << 16


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
    counts = count_pretokens(path, special_tokens, num_workers, errors=errors, progress=progress)
    if not any(not word.isspace() for word in counts):
        raise ValueError(
            f"{path}: the corpus has no text to train on (empty or only whitespace/special tokens)"
        )

    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    words = [list(word.encode("utf-8")) for word in counts]
    merges = merge_pairs(words, list(counts.values()), vocab, vocab_size - len(vocab), progress)
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
    words: list[list[int]],
    counts: list[int],
    vocab: dict[int, bytes],
    num_merges: int,
    progress: bool = True,
) -> list[tuple[bytes, bytes]]:
    """Run up to `num_merges` BPE merges over `words` (token-id lists with `counts`), in place.

    `vocab` holds ids 0..len(vocab)-1; each merge adds the next id. Returns the merged byte pairs
    in order. `words_with[pair]` may still list words that lost the pair since; scanning such a
    word finds nothing to merge, which is cheaper than keeping the index exact.
    """
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    words_with: dict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, count) in enumerate(zip(words, counts, strict=True)):
        for pair in pairwise(word):
            pair_counts[pair] += count
            words_with[pair].add(w)

    # heapq pops the smallest entry: (-count, key) puts the largest count first and, among equal
    # counts, the lexicographically greatest pair of byte strings first (see `descending_key`).
    keys = {i: descending_key(token) for i, token in vocab.items()}
    heap = [(-n, keys[a] + keys[b], a, b) for (a, b), n in pair_counts.items()]
    heapq.heapify(heap)

    merges = []
    for _ in tqdm(range(num_merges), desc="bpe merges", disable=not progress):
        best = _pop_best(heap, pair_counts)
        if best is None:
            break
        a, b = best
        new = len(vocab)
        vocab[new] = vocab[a] + vocab[b]
        keys[new] = descending_key(vocab[new])
        merges.append((vocab[a], vocab[b]))

        # Rewrite each word in place. Per occurrence of (a, b) with neighbours x and y, the pairs
        # (x, a) and (b, y) become (x, new) and (new, y). Scanning left to right with the word
        # already rewritten handles runs like "a b a b": x is then the `new` just made.
        new_pairs = set()
        for w in words_with.pop(best):
            word = words[w]
            count = counts[w]
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
    """Pop the pair with the highest current count (ties: greatest bytes); None when none is left."""
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
    makes a prefix sort after its extensions. Concatenated keys of pairs (a, b) then sort in reverse
    order of (bytes a, bytes b), because the terminator ends the first key before any comparison
    can reach the second.
    """
    return "".join(chr(255 - c) for c in token) + chr(256)


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
