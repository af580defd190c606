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

Files: `save` / `load` (tokenizer.json), `from_gpt2_files`, `save_tiktoken`: see files.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from itertools import chain, pairwise, repeat

import numpy as np
import tiktoken

from tinylm.tokenizer.files import TokenizerFiles
from tinylm.tokenizer.files import gpt2_byte_to_char as gpt2_byte_to_char  # importable from here too
from tinylm.tokenizer.merge_table import NO_MERGE, MergeTable
from tinylm.tokenizer.pretokenize import (
    check_special_tokens,
    find_pretokens,
    find_split,
    special_token_regex,
    split_on_special,
)
from tinylm.tokenizer.tiktoken_engine import specials_agree, tiktoken_encoding

# encode_iterable encodes its input in pieces of about this many characters.
STREAM_CHUNK_CHARS = 1 << 16
# From this many new pre-tokens on, they are encoded together with arrays (`MergeTable.encode_many`).
TOGETHER_PIECES = 256
ENGINES = ("auto", "tiktoken", "python")


class Tokenizer(TokenizerFiles):
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

        A few go one by one (`_encode_piece`), many all at once with arrays (`MergeTable.encode_many`):
        same ids.
        """
        if len(pieces) < TOGETHER_PIECES:
            return {piece: array("I", self._encode_piece(piece)).tobytes() for piece in pieces}
        encoded = self._merge_table.encode_many([piece.encode("utf-8") for piece in pieces])
        return dict(zip(pieces, encoded, strict=True))

    @cached_property
    def _merge_table(self) -> MergeTable:
        """The merges as arrays (built on first use)."""
        return MergeTable.build(max(self.vocab) + 1, self._rank_of, self._merged_id, self._byte_ids)

    def _encode_many_bytes(self, strings: list[bytes]) -> list[tuple[int, ...]]:
        """The ids of each byte string: `_encode_bytes` of each, computed together with arrays."""
        return [tuple(array("I", data)) for data in self._merge_table.encode_many(strings)]

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """Ids of one pre-token (see `_encode_bytes`)."""
        return self._encode_bytes(piece.encode("utf-8"))

    def _encode_bytes(self, data: bytes) -> tuple[int, ...]:
        """Ids of the bytes of a pre-token: merge the adjacent pair of lowest rank until none has a merge.

        `ranks[i]` is the rank of the pair (ids[i], ids[i + 1]); a merge at i changes only the
        ranks of its two neighbours. Merging the leftmost best pair one at a time gives the same
        result as merging all its occurrences left to right at once (as training does).
        """
        rank_of, merged_id, no_merge = self._rank_of.get, self._merged_id, NO_MERGE
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

    # Workers receive a tokenizer by pickling: send the definition, rebuild the tables there.
    def __getstate__(self) -> dict:
        return {"vocab": self.vocab, "merges": self.merges, "special_tokens": self.special_tokens,
                "cache_size": self._cache_size, "engine": self.engine}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["vocab"],
            state["merges"],
            state["special_tokens"],
            state.get("cache_size", 1 << 19),
            state.get("engine", "auto"),
        )

    def __len__(self) -> int:
        return len(self.vocab)


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
