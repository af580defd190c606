"""The tokenizer's files, as the methods of `TokenizerFiles`, a base class of `Tokenizer`.

- `save` / `load`: one JSON file (`tokenizer.json`, format "tinylm.tokenizer", version 1). Token
  bytes are written with GPT-2's byte-to-character map, which is lossless and keeps text readable.
- `from_gpt2_files`: GPT-2's published `vocab.json` + `merges.txt`.
- `tiktoken_ranks` / `save_tiktoken`: tiktoken's mergeable ranks (bytes -> rank), in memory or as a
  `.tiktoken` file, so tiktoken (`tiktoken.Encoding` with `GPT2_PATTERN`) can load our tokenizer.
"""

import base64
import json
import os
import sys
from collections.abc import Sequence
from functools import cache, partial
from pathlib import Path
from typing import Self

import regex

from tinylm.io import atomic_write_text
from tinylm.tokenizer.pretokenize import unicode_version

FORMAT = "tinylm.tokenizer"
FORMAT_VERSION = 1


class TokenizerFiles:
    """The file methods of `Tokenizer`: they read `vocab`, `merges`, `special_tokens` and
    `special_ids` (annotated below), and build a tokenizer with `cls(vocab, merges, special_tokens)`."""

    vocab: dict[int, bytes]
    merges: list[tuple[bytes, bytes]]
    special_tokens: list[str]
    special_ids: dict[str, int]

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file, atomically (see the module docstring).

        One vocabulary entry or merge per line, so that the file reads and diffs well.
        """
        dumps, to_text = partial(json.dumps, ensure_ascii=False), bytes_to_text
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
    def load(cls, path: str | os.PathLike) -> Self:
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
                f"warning: {path} was trained with the Unicode {saved_unicode} tables of `regex`; the "
                f"installed regex {regex.__version__} has Unicode {unicode_version()}, so text with "
                f"characters assigned "
                f"in between may be split (and encoded) differently",
                file=sys.stderr,
            )
        try:
            vocab = {int(i): text_to_bytes(t) for i, t in data["vocab"].items()}
            merges = [(text_to_bytes(a), text_to_bytes(b)) for a, b in data["merges"]]
            return cls(vocab, merges, data["special_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed tokenizer file: {e}") from None

    @classmethod
    def from_gpt2_files(
        cls,
        vocab_json: str | os.PathLike,
        merges_txt: str | os.PathLike,
        special_tokens: Sequence[str] | None = None,
    ) -> Self:
        """Read GPT-2's published format: `vocab.json` (token text -> id) and `merges.txt`."""
        with open(vocab_json, encoding="utf-8") as f:
            vocab = {int(i): text_to_bytes(t) for t, i in json.load(f).items()}
        merges = []
        with open(merges_txt, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                a, b = line.split(" ")
                merges.append((text_to_bytes(a), text_to_bytes(b)))
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


def bytes_to_text(token: bytes) -> str:
    """The bytes of a token as text, with GPT-2's byte-to-character map."""
    table = gpt2_byte_to_char()
    return "".join(table[b] for b in token)


def text_to_bytes(text: str) -> bytes:
    """The inverse of `bytes_to_text`; ValueError for a character outside the map."""
    table = gpt2_char_to_byte()
    try:
        return bytes(table[c] for c in text)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} in token {text!r} is not in GPT-2's byte map") from None
