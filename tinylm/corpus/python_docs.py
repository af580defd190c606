"""A second corpus that every machine with Python has: the Python Language Reference's topics.

CPython ships the reference manual's sections that `help("for")` shows as plain text in the module
`pydoc_data.topics` (79 topics, about 465 KB at Python 3.11; the Python Software Foundation
License). They are technical English prose with grammar and code, far from Shakespeare's verse: a
second domain for continued pretraining with no download. One topic is one document, in the order
of its name; the last `valid_fraction` of them are held out as validation. The text is that of the
running Python, so it can differ between Python releases (the corpus stage's line says which).
"""

from __future__ import annotations

import platform
from typing import BinaryIO

from tinylm.corpus.format import END_OF_TEXT, CorpusError, Writer


def read_topics() -> dict[str, str]:
    """{topic name: its text}, sorted by name, from the running Python's pydoc_data; each text
    stripped of surrounding whitespace. CorpusError in one line when this Python has none."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise CorpusError(
            f"corpus.source 'python_docs': this Python ({platform.python_version()}) has no "
            "pydoc_data.topics (a build without its documentation); use another corpus.source"
        ) from None
    return {name: topics[name].strip() for name in sorted(topics) if topics[name].strip()}


def python_docs_writer(valid_fraction: float) -> Writer:
    """The writer of the `python_docs` source: every topic a document, the last `valid_fraction`
    of them (at least one) the validation split."""
    documents = list(read_topics().values())
    held_out = max(1, round(len(documents) * valid_fraction))

    def write(train_out: BinaryIO, valid_out: BinaryIO) -> tuple[int, int]:
        train, valid = documents[:-held_out], documents[-held_out:]
        train_out.write(END_OF_TEXT.join(train).encode("utf-8"))
        valid_out.write(END_OF_TEXT.join(valid).encode("utf-8"))
        return len(train), len(valid)

    return write
