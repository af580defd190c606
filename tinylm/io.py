"""Small file helpers shared by every stage: atomic writes, file hashes, and ending a process.

Every artifact a later stage trusts is written to a temporary file in the same folder, flushed,
fsynced and only then renamed into place, so a crash or a full disk never leaves a half-written
file under the final name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` if the block succeeds.

    The caller writes the temporary file however it likes (np.save, torch.save, open(...)).
    On success the file is fsynced and renamed over `path`; on any exception it is removed and
    `path` is left as it was. `suffix` keeps the extension for writers that append one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + suffix, dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts get the usual permissions
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; rename it onto `path` if the block succeeds.

    On success every file in it gets the usual permissions and is fsynced, and the folder is
    renamed into place (a folder already at `path` is moved aside first, then deleted); on any
    exception the temporary folder is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                file.chmod(0o666 & ~_umask())  # some writers make 0600 files
                with open(file, "rb+") as f:
                    os.fsync(f.fileno())
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700
        old = tmp.with_name(tmp.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file, fsync, rename)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically (temp file, fsync, rename)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (replacing it), falling back to an atomic copy across devices."""
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(src, tmp)


@contextlib.contextmanager
def stderr_copied_to(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, everything written to this process's standard error, and to that of the
    processes it starts (they inherit descriptor 2), still reaches it and is also written to `path`
    (a log file, rewritten).

    A pipe takes descriptor 2's place and a thread copies it to both. Unlike `cmd 2>&1 | tee log`,
    the copier lives in this process, so a Ctrl-C or SIGTERM sent to the whole process group, which
    ends `tee` at once, does not cut off what this process says while it stops.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "wb")  # noqa: SIM115 (closed below, after the copier has finished)
    read_end, write_end = os.pipe()
    original = os.dup(2)

    def copy() -> None:
        terminal = True  # a closed terminal must not stop the log, nor block the writers
        while chunk := os.read(read_end, 1 << 16):
            log.write(chunk)
            log.flush()
            rest = memoryview(chunk)
            while terminal and rest:
                try:
                    rest = rest[os.write(original, rest) :]
                except OSError:
                    terminal = False

    copier = threading.Thread(target=copy, name="stderr-copy", daemon=True)
    copier.start()
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last writer here; a child still running keeps it open
        copier.join(timeout=5.0)
        if not copier.is_alive():  # else a process started here still writes: leave the copier be
            os.close(read_end)
            os.close(original)
            log.close()


def exit_now(code: int) -> None:
    """End this process with `code` without the interpreter's teardown of torch's modules (about
    half a second per process). For a process whose work is done: every file it wrote is closed,
    so only the standard streams need flushing; multiprocessing's exit handler still runs (it
    releases semaphores, such as those torch.compile's workers make)."""
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
