"""The byte-level BPE tokenizer: encode, decode, and its files.

Encoding splits the text on special tokens (longest match wins), cuts the rest into pre-tokens with
the GPT-2 regex, and turns each pre-token into ids by applying merges in order of rank (the order in
which training created them): repeatedly merge every occurrence of the adjacent pair with the lowest
rank. This is the algorithm of GPT-2, Hugging Face `tokenizers` and (for BPE-trained vocabularies)
tiktoken.

Two engines give the same ids (`engine=`):
- "python", the readable reference: pre-tokens repeat a lot, so their ids are cached, as the bytes
  of an array of ids: the ids of a whole text are then one `bytes.join`, with no Python int per
  token. The pre-tokens of a text that miss the cache are encoded first, all at once with arrays
  when there are many.
- "tiktoken": tiktoken's compiled core with our ranks, used only after `tiktoken_engine` has checked
  that it gives exactly the reference's ids on every text (true of every vocabulary our trainer
  makes). "auto" (the default) takes it where that check passes, the reference elsewhere.

Files:
- `save` / `load`: one JSON file (`tokenizer.json`, format "tinylm.tokenizer", version 1). Token
  bytes are written with GPT-2's byte-to-character map, which is lossless and keeps text readable.
- `from_gpt2_files`: GPT-2's published `vocab.json` + `merges.txt`.
- `tiktoken_ranks` / `save_tiktoken`: tiktoken's mergeable ranks (bytes -> rank), in memory or as a
  `.tiktoken` file, so tiktoken (`tiktoken.Encoding` with `GPT2_PATTERN`) can load our tokenizer.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from itertools import chain, pairwise, repeat
from pathlib import Path
from typing import NamedTuple

import numpy as np
import regex
import tiktoken

from tinylm.io import atomic_write_text
from tinylm.tokenizer.pretokenize import (
    check_special_tokens,
    find_pretokens,
    find_split,
    special_token_regex,
    split_on_special,
    unicode_version,
)
from tinylm.tokenizer.tiktoken_engine import specials_agree, tiktoken_encoding

FORMAT = "tinylm.tokenizer"
FORMAT_VERSION = 1

# encode_iterable encodes its input in pieces of about this many characters.
STREAM_CHUNK_CHARS = 1 << 16
# From this many new pre-tokens on, they are encoded together with arrays (`_encode_together`).
TOGETHER_PIECES = 256
ENGINES = ("auto", "tiktoken", "python")


class Tokenizer:
    """Byte-level BPE tokenizer over `vocab` (id -> bytes) and `merges` (byte pairs, by rank).

    Special tokens missing from `vocab` are added with new ids. Every merge must join two tokens of
    the vocabulary into a third one; ValueError otherwise. The ids of up to 2 * `cache_size`
    distinct pre-tokens are remembered (see `_PieceCache`), which bounds the memory of encoding.

    `engine` chooses how ordinary text is encoded (see the module docstring): "python" always uses
    the reference; "tiktoken" uses tiktoken's core and raises ValueError (naming the failed
    condition) on first use if the vocabulary cannot be expressed in it; "auto" uses tiktoken where
    it can and the reference elsewhere. The ids are the same whatever the engine.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
        cache_size: int = 1 << 19,
        engine: str = "auto",
    ):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine = engine
        self.vocab = dict(vocab)
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens = check_special_tokens(special_tokens)

        # Where several ids hold the same bytes (a one-character special token), ordinary text
        # uses the lowest id and the special token its own, highest, id.
        token_ids: dict[bytes, int] = {}
        for i in sorted(self.vocab):
            token_ids.setdefault(self.vocab[i], i)
        self.special_ids: dict[str, int] = {}
        for token in self.special_tokens:
            raw = token.encode("utf-8")
            ids = [i for i, t in self.vocab.items() if t == raw]
            if not ids:
                ids = [max(self.vocab, default=-1) + 1]
                self.vocab[ids[0]] = raw
            self.special_ids[token] = max(ids)

        missing = [b for b in range(256) if bytes([b]) not in token_ids]
        if missing:
            raise ValueError(
                f"vocab lacks {len(missing)} single bytes (e.g. {bytes(missing[:3])!r}); not byte-level"
            )
        self._byte_ids = [token_ids[bytes([b])] for b in range(256)]
        # (left id, right id) -> rank of its merge, and rank -> id of the merged token
        self._rank_of: dict[tuple[int, int], int] = {}
        self._merged_id: list[int] = []
        for rank, (a, b) in enumerate(self.merges):
            if a not in token_ids or b not in token_ids or a + b not in token_ids:
                raise ValueError(f"merge {rank} ({a!r}, {b!r}) uses or makes a token missing from vocab")
            self._rank_of.setdefault((token_ids[a], token_ids[b]), rank)
            self._merged_id.append(token_ids[a + b])

        self._special_re = special_token_regex(self.special_tokens)
        self._special_bytes = {t: array("I", [i]).tobytes() for t, i in self.special_ids.items()}
        self._cache_size = cache_size
        self._cache = _PieceCache(cache_size)
        self._table: _MergeTable | None = None
        self._tiktoken: tiktoken.Encoding | None = None
        self._tiktoken_checked = False
        self._tiktoken_splits_specials = specials_agree(self.special_tokens)
        self.tiktoken_refusal = ""  # why tiktoken cannot be the engine (after the check)

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: special tokens map to their ids, everything else goes through BPE."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as a 1-D array of C unsigned ints (no Python int per token)."""
        encoding = self.tiktoken_engine()
        if encoding is None:
            return self.encode_array_reference(text)
        if self._tiktoken_splits_specials:
            return encoding.encode_to_numpy(text, allowed_special="all").astype(np.uintc, copy=False)
        parts = split_on_special(text, self._special_re)
        out = [np.zeros(0, dtype=np.uintc)]
        for i, part in enumerate(parts):
            if i % 2:
                out.append(np.array([self.special_ids[part]], dtype=np.uintc))
            elif part:
                out.append(np.array(encoding.encode_ordinary(part), dtype=np.uintc))
        return np.concatenate(out)

    def tiktoken_engine(self) -> tiktoken.Encoding | None:
        """The tiktoken Encoding that encodes ordinary text, or None where the reference does it.

        Built and checked (`tiktoken_engine.tiktoken_encoding`) on first use; ValueError with
        engine="tiktoken" if the vocabulary cannot be expressed in tiktoken.
        """
        if self.engine == "python":
            return None
        if not self._tiktoken_checked:
            self._tiktoken, reason = tiktoken_encoding(
                self.vocab, self.merges, self.special_ids, self._encode_many_bytes
            )
            self._tiktoken_checked = True
            self.tiktoken_refusal = reason
        if self._tiktoken is None and self.engine == "tiktoken":
            raise ValueError(f"this vocabulary cannot be encoded by tiktoken: {self.tiktoken_refusal}")
        return self._tiktoken

    def encode_array_reference(self, text: str) -> np.ndarray:
        """`encode_array` with the readable reference engine, whatever `engine` says.

        The ids of each distinct pre-token are kept in the cache as the bytes of an array of C
        unsigned ints, so that the ids of the whole text are one `bytes.join`; the pre-tokens not
        in the cache are encoded first.
        """
        parts = split_on_special(text, self._special_re)
        pieces = [find_pretokens(part) if i % 2 == 0 and part else [] for i, part in enumerate(parts)]
        lookup = self._cache.fill(chain.from_iterable(pieces), self._encode_pieces)
        out = []
        for i, part in enumerate(parts):
            out.append(self._special_bytes[part] if i % 2 else b"".join(map(lookup, pieces[i])))
        return np.frombuffer(b"".join(out), dtype=np.uintc)

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily encode an iterable of strings (lines, or a text file handle) as one text.

        Yields exactly `encode("".join(iterable))`. Text is buffered only until a safe split point
        (a special token, or a lone space or newline between visible characters) lets the buffer
        be encoded independently, so memory stays bounded for ordinary text.
        """
        specials = self.special_tokens
        margin = max((len(t) for t in specials), default=1)
        pending: list[str] = []
        pending_chars = 0
        buffer = ""
        for piece in iterable:
            pending.append(piece)
            pending_chars += len(piece)
            if pending_chars < STREAM_CHUNK_CHARS:
                continue
            buffer += "".join(pending)
            pending, pending_chars = [], 0
            # Cut in the second half, and far enough from the end to see every special token
            # that could straddle the cut.
            cut = find_split(buffer, len(buffer) // 2, len(buffer) - margin, specials)
            if cut is not None:
                yield from self.encode(buffer[:cut])
                buffer = buffer[cut:]
        yield from self.encode(buffer + "".join(pending))

    def _encode_pieces(self, pieces: list[str]) -> dict[str, bytes]:
        """{pre-token: the bytes of its ids as C unsigned ints} for distinct `pieces`.

        A few go one by one (`_encode_piece`), many all at once (`_encode_together`): same ids.
        """
        if len(pieces) < TOGETHER_PIECES:
            return {piece: array("I", self._encode_piece(piece)).tobytes() for piece in pieces}
        return self._encode_together(pieces)

    def _encode_together(self, pieces: list[str]) -> dict[str, bytes]:
        """`_encode_piece` for many pre-tokens at once (see `_encode_together_bytes`)."""
        encoded = self._encode_together_bytes([piece.encode("utf-8") for piece in pieces])
        return dict(zip(pieces, encoded, strict=True))

    def _encode_together_bytes(self, encoded: list[bytes]) -> list[bytes]:
        """`_encode_bytes` for many byte strings at once, with arrays: one merge per string per round.

        Returns the ids of each as the bytes of an array of C unsigned ints.

        All pieces sit in one array of ids. Each round looks up the rank of every adjacent pair
        within a piece, and in every piece merges the leftmost pair of lowest rank, exactly the
        step `_encode_piece` takes; pieces with no pair left to merge are done and leave the
        arrays. The rounds are as many as the most merges one piece needs, not one per merge.
        """
        table = self._merge_table()
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = table.byte_ids[np.frombuffer(b"".join(encoded), dtype=np.uint8)]
        owner = np.repeat(np.arange(len(encoded)), lengths)  # the piece of each position
        rank = table.rank_of_pairs(ids, owner, np.arange(len(ids)))  # of the pair starting there
        done_owner, done_ids = [], []
        while len(ids):
            starts = np.flatnonzero(rank < _NO_MERGE)
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
            ids[at] = table.merged[best_rank]
            keep = ~finished
            keep[at + 1] = False
            new_at = np.cumsum(keep)[at] - 1
            ids, owner, rank = ids[keep], owner[keep], rank[keep]
            # Only the pairs that start at the merged token and just before it change.
            changed = np.concatenate([new_at - 1, new_at])
            changed = changed[changed >= 0]
            rank[changed] = table.rank_of_pairs(ids, owner, changed)
        owner, ids = np.concatenate(done_owner), np.concatenate(done_ids)
        order = np.argsort(owner, kind="stable")  # each piece's ids in order, pieces in order
        data = ids[order].astype(np.uintc).tobytes()
        ends = np.cumsum(np.bincount(owner, minlength=len(encoded))) * np.dtype(np.uintc).itemsize
        return [data[start:end] for start, end in zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)]

    def _merge_table(self) -> _MergeTable:
        """The merges as arrays (built on first use by `_encode_together`)."""
        if self._table is None:
            self._table = _MergeTable.build(
                max(self.vocab) + 1, self._rank_of, self._merged_id, self._byte_ids
            )
        return self._table

    def _encode_many_bytes(self, strings: list[bytes]) -> list[tuple[int, ...]]:
        """The ids of each byte string: `_encode_bytes` of each, computed together with arrays."""
        if not strings:
            return []
        return [tuple(array("I", data)) for data in self._encode_together_bytes(strings)]

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-token (see `_encode_bytes`)."""
        return self._encode_bytes(piece.encode("utf-8"))

    def _encode_bytes(self, data: bytes) -> tuple[int, ...]:
        """Ids of the bytes of a pre-token: merge the adjacent pair of lowest rank until none has a merge.

        `ranks[i]` is the rank of the pair (ids[i], ids[i + 1]); a merge at i changes only the
        ranks of its two neighbours. Merging the leftmost best pair one at a time gives the same
        result as merging all its occurrences left to right at once (as training does).
        """
        rank_of, merged_id, no_merge = self._rank_of.get, self._merged_id, _NO_MERGE
        ids = list(map(self._byte_ids.__getitem__, data))
        ranks = list(map(rank_of, pairwise(ids), repeat(no_merge)))
        while ranks:
            best = min(ranks)
            if best == no_merge:
                break
            i = ranks.index(best)
            new = merged_id[best]
            ids[i : i + 2] = (new,)
            del ranks[i]
            if i > 0:
                ranks[i - 1] = rank_of((ids[i - 1], new), no_merge)
            if i < len(ranks):
                ranks[i] = rank_of((new, ids[i + 1]), no_merge)
        return tuple(ids)

    # --- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        try:
            raw = b"".join(map(self.vocab.__getitem__, ids))
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the vocabulary") from None
        return raw.decode("utf-8", errors="replace")

    # --- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file, atomically (see the module docstring).

        One vocabulary entry or merge per line, so that the file reads and diffs well.
        """

        def dumps(value) -> str:
            return json.dumps(value, ensure_ascii=False)

        to_text = _bytes_to_text
        vocab = ",\n".join(f"  {dumps(str(i))}: {dumps(to_text(self.vocab[i]))}" for i in sorted(self.vocab))
        merges = ",\n".join(f"  [{dumps(to_text(a))}, {dumps(to_text(b))}]" for a, b in self.merges)
        text = (
            f'{{\n "format": {dumps(FORMAT)},\n "version": {FORMAT_VERSION},\n'
            f' "unicode_version": {dumps(unicode_version())},\n'
            f' "special_tokens": {dumps(self.special_tokens)},\n'
            f' "vocab": {{\n{vocab}\n }},\n "merges": [\n{merges}\n ]\n}}\n'
        )
        atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a file written by `save`; ValueError naming the file if it is not one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer file not found: {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read tokenizer file {path}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: unsupported {FORMAT} version {data.get('version')!r} (expected {FORMAT_VERSION})"
            )
        saved_unicode = data.get("unicode_version")
        if saved_unicode is not None and saved_unicode != unicode_version():
            print(
                f"warning: {path} was trained with the Unicode {saved_unicode} tables of `regex`; the installed "
                f"regex {regex.__version__} has Unicode {unicode_version()}, so text with characters assigned "
                f"in between may be split (and encoded) differently",
                file=sys.stderr,
            )
        try:
            vocab = {int(i): _text_to_bytes(t) for i, t in data["vocab"].items()}
            merges = [(_text_to_bytes(a), _text_to_bytes(b)) for a, b in data["merges"]]
            return cls(vocab, merges, data["special_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed tokenizer file: {e}") from None

    @classmethod
    def from_gpt2_files(
        cls,
        vocab_json: str | os.PathLike,
        merges_txt: str | os.PathLike,
        special_tokens: Sequence[str] | None = None,
    ) -> Tokenizer:
        """Read GPT-2's published format: `vocab.json` (token text -> id) and `merges.txt`."""
        with open(vocab_json, encoding="utf-8") as f:
            vocab = {int(i): _text_to_bytes(t) for t, i in json.load(f).items()}
        merges = []
        with open(merges_txt, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                a, b = line.split(" ")
                merges.append((_text_to_bytes(a), _text_to_bytes(b)))
        return cls(vocab, merges, special_tokens)

    def tiktoken_ranks(self) -> dict[bytes, int]:
        """tiktoken's mergeable ranks: token bytes -> id, for every token except special ones.

        Use with `tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=...,
        special_tokens=tokenizer.special_ids)`. Token ids grow with merge rank, as tiktoken needs.
        """
        special = set(self.special_ids.values())
        return {t: i for i, t in sorted(self.vocab.items()) if i not in special}

    def save_tiktoken(self, path: str | os.PathLike) -> None:
        """Write the mergeable ranks as a `.tiktoken` file (`tiktoken.load.load_tiktoken_bpe` reads it)."""
        lines = [f"{base64.b64encode(t).decode('ascii')} {i}\n" for t, i in self.tiktoken_ranks().items()]
        atomic_write_text(path, "".join(lines))

    # Workers receive a tokenizer by pickling: send the definition, rebuild the tables there.
    def __getstate__(self) -> dict:
        return {"vocab": self.vocab, "merges": self.merges, "special_tokens": self.special_tokens,
                "cache_size": self._cache_size, "engine": self.engine}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["vocab"], state["merges"], state["special_tokens"], state.get("cache_size", 1 << 19),
                      state.get("engine", "auto"))  # fmt: skip

    def __len__(self) -> int:
        return len(self.vocab)


# The rank of a pair without a merge: after every real merge.
_NO_MERGE = 1 << 62


class _PieceCache:
    """pre-token -> the bytes of its ids, in two generations, so that memory stays bounded.

    When the current generation holds `max_size` pieces (checked at the start of each `fill`), it
    becomes the old one and a new one starts; pieces found in the old generation move to the new
    one, so frequent pieces are never encoded twice.
    """

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.current: dict[str, bytes] = {}
        self.old: dict[str, bytes] = {}

    def fill(self, pieces: Iterable[str], encode: Callable[[list[str]], dict[str, bytes]]) -> Callable:
        """Make sure every piece is in the current generation; return its lookup function."""
        if len(self.current) >= self.max_size:
            self.old, self.current = self.current, {}
        missing = set(pieces).difference(self.current)
        if missing:
            found = missing.intersection(self.old)
            self.current.update((piece, self.old[piece]) for piece in found)
            missing -= found
            if missing:
                self.current.update(encode(list(missing)))
        return self.current.__getitem__


class _MergeTable(NamedTuple):
    """The merges for `_encode_together`: ranks by pair in an open-addressing hash table."""

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
        mask = (1 << bits) - 1
        for key, slot, rank in zip(
            keys.tolist(), cls._slots(keys, bits).tolist(), rank_of.values(), strict=True
        ):
            while slot_keys[slot] != -1:  # linear probing
                slot = (slot + 1) & mask
            slot_keys[slot], slot_ranks[slot] = key, rank
        return cls(
            size,
            slot_keys,
            slot_ranks,
            bits,
            np.array(merged or [0], dtype=np.int64),
            np.array(byte_ids, dtype=np.int64),
        )

    @staticmethod
    def _slots(keys: np.ndarray, bits: int) -> np.ndarray:
        """Fibonacci hashing: the top `bits` bits of key * 2**64 / golden ratio."""
        return ((keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)).astype(
            np.int64
        )

    def rank_of_pairs(self, ids: np.ndarray, owner: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The merge rank of the pair (ids[p], ids[p + 1]) for p in `starts`; _NO_MERGE where the
        pair has no merge or p + 1 is in another piece (or past the end)."""
        nexts = np.minimum(starts + 1, len(ids) - 1)
        keys = ids[starts] * self.size + ids[nexts]
        ranks = np.full(len(starts), _NO_MERGE, dtype=np.int64)
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


@cache
def gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable characters (bytes_to_unicode in its encoder.py).

    Printable Latin-1 bytes map to themselves; the others (controls, space, ...) to chr(256 + n).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


@cache
def gpt2_char_to_byte() -> dict[str, int]:
    """The inverse of `gpt2_byte_to_char`."""
    return {c: b for b, c in gpt2_byte_to_char().items()}


def _bytes_to_text(token: bytes) -> str:
    table = gpt2_byte_to_char()
    return "".join(table[b] for b in token)


def _text_to_bytes(text: str) -> bytes:
    table = gpt2_char_to_byte()
    try:
        return bytes(table[c] for c in text)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} in token {text!r} is not in GPT-2's byte map") from None
