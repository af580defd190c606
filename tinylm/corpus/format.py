"""The corpus format shared by every source: documents joined by END_OF_TEXT, and its errors.

train.txt and valid.txt hold plain UTF-8 text: documents joined by `<|endoftext|>`, GPT-2 style,
with no newline added around the separator (`doc<|endoftext|>doc`) and none after the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

from tinylm.config.constants import END_OF_TEXT

__all__ = ["END_OF_TEXT", "CorpusError", "Writer"]


class CorpusError(ValueError):
    """Bad corpus input: a failed download or checksum, invalid UTF-8, an empty file, ..."""


# A writer fills the two open output files and returns (train_documents, valid_documents).
Writer = Callable[[BinaryIO, BinaryIO], tuple[int, int]]
