"""BPE of many pre-tokens at once, with arrays: the reference's ids, one merge per pre-token per round.

All pre-tokens sit in one array of ids. Each round looks up the rank of every adjacent pair within
a pre-token, and in every pre-token merges the leftmost pair of lowest rank, exactly the step the
reference (`Tokenizer._encode_bytes`) takes; pre-tokens with no pair left to merge are done and
leave the arrays. The rounds are as many as the most merges one pre-token needs, not one per merge.
The ranks of pairs are looked up in an open-addressing hash table of arrays.
"""

from typing import NamedTuple

import numpy as np

# The rank of a pair without a merge: after every real merge.
NO_MERGE = 1 << 62


class MergeTable(NamedTuple):
    """The merges as arrays: ranks by pair in an open-addressing hash table."""

    size: int  # ids are below this; a pair's key is left * size + right
    slot_keys: np.ndarray  # 2**bits slots: a key, or -1 for an empty slot
    slot_ranks: np.ndarray  # the rank of the merge of that key
    bits: int
    merged: np.ndarray  # rank -> id of the merged token
    byte_ids: np.ndarray  # byte value -> its id

    @classmethod
    def build(cls, size: int, rank_of: dict[tuple[int, int], int], merged: list[int], byte_ids: list[int]):
        bits = max(4, (4 * len(rank_of)).bit_length())  # at most a quarter of the slots in use
        slot_keys = np.full(1 << bits, -1, dtype=np.int64)
        slot_ranks = np.zeros(1 << bits, dtype=np.int64)
        keys = np.array([a * size + b for a, b in rank_of] or [0], dtype=np.int64)[: len(rank_of)]
        mask, slots = (1 << bits) - 1, cls._slots(keys, bits).tolist()
        for key, slot, rank in zip(keys.tolist(), slots, rank_of.values(), strict=True):
            while slot_keys[slot] != -1:  # linear probing
                slot = (slot + 1) & mask
            slot_keys[slot], slot_ranks[slot] = key, rank
        merged_ids = np.array(merged or [0], dtype=np.int64)
        return cls(size, slot_keys, slot_ranks, bits, merged_ids, np.array(byte_ids, dtype=np.int64))

    @staticmethod
    def _slots(keys: np.ndarray, bits: int) -> np.ndarray:
        """Fibonacci hashing: the top `bits` bits of key * 2**64 / golden ratio."""
        hashed = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return (hashed >> np.uint64(64 - bits)).astype(np.int64)

    def rank_of_pairs(self, ids: np.ndarray, owner: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The merge rank of the pair (ids[p], ids[p + 1]) for p in `starts`; NO_MERGE where the
        pair has no merge or p + 1 is in another piece (or past the end)."""
        nexts = np.minimum(starts + 1, len(ids) - 1)
        keys = ids[starts] * self.size + ids[nexts]
        ranks = np.full(len(starts), NO_MERGE, dtype=np.int64)
        pending = np.flatnonzero((owner[starts] == owner[nexts]) & (starts + 1 < len(ids)))
        slots = self._slots(keys[pending], self.bits)
        mask = (1 << self.bits) - 1
        while len(pending):  # probe until the key or an empty slot is found
            found = self.slot_keys[slots]
            hit = found == keys[pending]
            ranks[pending[hit]] = self.slot_ranks[slots[hit]]
            going_on = ~hit & (found != -1)
            pending, slots = pending[going_on], (slots[going_on] + 1) & mask
        return ranks

    def encode_many(self, encoded: list[bytes]) -> list[bytes]:
        """The ids of each byte string (see the module docstring), as the bytes of an array of C
        unsigned ints."""
        if not encoded:
            return []
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = self.byte_ids[np.frombuffer(b"".join(encoded), dtype=np.uint8)]
        owner = np.repeat(np.arange(len(encoded)), lengths)  # the piece of each position
        rank = self.rank_of_pairs(ids, owner, np.arange(len(ids)))  # of the pair starting there
        done_owner, done_ids = [], []
        while len(ids):
            starts = np.flatnonzero(rank < NO_MERGE)
            merging = np.zeros(len(encoded), dtype=bool)
            merging[owner[starts]] = True
            finished = ~merging[owner]
            done_owner.append(owner[finished])
            done_ids.append(ids[finished])
            if not len(starts):
                break
            # The leftmost pair of lowest rank of each piece: the smallest rank * n + position.
            n = len(ids)
            groups = np.flatnonzero(np.concatenate([[True], owner[starts][1:] != owner[starts][:-1]]))
            best = np.minimum.reduceat(rank[starts] * n + starts, groups)
            at, best_rank = best % n, best // n
            ids[at] = self.merged[best_rank]
            keep = ~finished
            keep[at + 1] = False
            new_at = np.cumsum(keep)[at] - 1
            ids, owner, rank = ids[keep], owner[keep], rank[keep]
            # Only the pairs that start at the merged token and just before it change.
            changed = np.concatenate([new_at - 1, new_at])
            changed = changed[changed >= 0]
            rank[changed] = self.rank_of_pairs(ids, owner, changed)
        owner, ids = np.concatenate(done_owner), np.concatenate(done_ids)
        order = np.argsort(owner, kind="stable")  # each piece's ids in order, pieces in order
        data = ids[order].astype(np.uintc).tobytes()
        ends = np.cumsum(np.bincount(owner, minlength=len(encoded))) * np.dtype(np.uintc).itemsize
        return [data[start:end] for start, end in zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)]
