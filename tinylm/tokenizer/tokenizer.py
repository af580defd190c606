"""The byte-level BPE tokenizer: encode, decode, and its files.

Encoding splits the text on special tokens (longest match wins), cuts the rest into pre-tokens with
the GPT-2 regex, and turns each pre-token into ids by applying merges in order of rank (the order in
which training created them): repeatedly merge every occurrence of the adjacent pair with the lowest
rank. This is the algorithm of GPT-2, Hugging Face `tokenizers` and (for BPE-trained vocabularies)
tiktoken. Pre-tokens repeat a lot, so their ids are cached.

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
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from itertools import chain, pairwise, repeat
from pathlib import Path

import numpy as np

from tinylm.io import atomic_write_text
from tinylm.tokenizer.pretokenize import (
    check_special_tokens,
    find_pretokens,
    find_split,
    special_token_regex,
    split_on_special,
)

FORMAT = "tinylm.tokenizer"
FORMAT_VERSION = 1

# encode_iterable encodes its input in pieces of about this many characters.
STREAM_CHUNK_CHARS = 1 << 16


class Tokenizer:
    """Byte-level BPE tokenizer over `vocab` (id -> bytes) and `merges` (byte pairs, by rank).

    Special tokens missing from `vocab` are added with new ids. Every merge must join two tokens of
    the vocabulary into a third one; ValueError otherwise. `cache_size` bounds the number of
    pre-tokens whose ids are remembered (the cache is emptied when it is full).
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
        cache_size: int = 1 << 18,
    ):
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
        self._cache = _PieceCache(cache_size)

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: special tokens map to their ids, everything else goes through BPE."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as a 1-D array of C unsigned ints (no Python int per token).

        The ids of each distinct pre-token are kept in the cache as the bytes of such an array, so
        that the ids of the whole text are one `bytes.join`; the pre-tokens not in the cache are
        encoded first.
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
        """{pre-token: the bytes of its ids as C unsigned ints} for distinct `pieces`."""
        return {piece: array("I", self._encode_piece(piece)).tobytes() for piece in pieces}

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-token: merge the adjacent pair of lowest rank until no pair has a merge.

        `ranks[i]` is the rank of the pair (ids[i], ids[i + 1]); a merge at i changes only the
        ranks of its two neighbours. Merging the leftmost best pair one at a time gives the same
        result as merging all its occurrences left to right at once (as training does).
        """
        rank_of, merged_id, no_merge = self._rank_of.get, self._merged_id, _NO_MERGE
        ids = list(map(self._byte_ids.__getitem__, piece.encode("utf-8")))
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
        return {"vocab": self.vocab, "merges": self.merges, "special_tokens": self.special_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["vocab"], state["merges"], state["special_tokens"])

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
