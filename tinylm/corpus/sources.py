"""Downloads of the `url` source: a URL checked against its sha256.

Files land in the corpus cache folder (`corpus.cache_dir`) and are reused from there when their hash
matches, so a second run needs no network. A download is streamed to a temporary file, its hash
checked, and only then renamed into place: a failed or corrupt download never leaves a file behind.
"""

from __future__ import annotations

import http.client
import os
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from tinylm.corpus.format import CorpusError
from tinylm.io import atomic_path, sha256_file
from tinylm.progress import Progress

DOWNLOAD_TIMEOUT_S = 60
DOWNLOAD_CHUNK_BYTES = 1 << 20  # streamed to disk this much at a time


def _verify_sha256(path: Path, expected: str, origin: str) -> None:
    """Raise CorpusError (and delete `path`) unless the file's sha256 is `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise CorpusError(
            f"sha256 mismatch for {origin}: expected {expected}, got {actual}; the file was deleted"
        )


def download(url: str, sha256: str, cache_dir: str | os.PathLike) -> Path:
    """Download `url` into `cache_dir` and return the path of the verified file.

    `sha256` is the expected hex digest (any case). A cached file whose hash matches is reused
    without touching the network. Otherwise the body is streamed to a temporary file (progress bar
    on stderr), its sha256 checked, and only then renamed into place. A failed download or a hash
    mismatch raises CorpusError naming the URL (and both hashes), and leaves no file behind.
    """
    expected = sha256.strip().lower()
    name = PurePosixPath(urllib.parse.urlparse(url).path).name or "download"
    path = Path(cache_dir) / f"{expected[:16]}-{name}"
    if path.exists() and sha256_file(path) == expected:
        return path

    with atomic_path(path) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, open(tmp, "wb") as out:
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                bar = Progress(f"[corpus] download {url}", total, "B")
                while chunk := response.read(DOWNLOAD_CHUNK_BYTES):
                    out.write(chunk)
                    bar.update(len(chunk))
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise CorpusError(
                f"download of {url} failed: {error}; without a network, put the file at {path} "
                f"(its sha256 must be {expected}) and run again"
            ) from error
        _verify_sha256(tmp, expected, url)
    return path
