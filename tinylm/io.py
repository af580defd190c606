"""Small file helpers shared by every stage: atomic writes, file hashes and a folder lock.

Every artifact a later stage trusts is written to a temporary file in the same folder, flushed,
fsynced and only then renamed into place, so a crash or a full disk never leaves a half-written
file under the final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import multiprocessing.util
import os
import shutil
import socket
import sys
import tempfile
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


class FolderLockedError(RuntimeError):
    """Another process holds the folder's lock; the message names the folder and the holder."""


class StateLock:
    """An exclusive, non-blocking lock on `state_dir/lock`: one trainer per state folder.

    flock where the filesystem supports it (released by the kernel when the process dies). Where it
    does not (some network filesystems answer ENOSYS or EOPNOTSUPP), a lock file `lock.pid` created
    with O_EXCL instead, said in one line; such a file outlives a killed trainer, so one whose
    process no longer runs on this machine is taken over.
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / "lock"
        self._fd: int | None = None
        self._exclusive: Path | None = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderLockedError(
                f"{self.path.parent}: another trainer (pid {holder}) is using this state folder"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
            print(
                f"[pretrain] {self.path.parent}: this filesystem has no flock ({errno.errorcode[e.errno]}); "
                f"locking with the file {self.path.name}.pid instead",
                file=sys.stderr,
                flush=True,
            )
            self._take_exclusive_file()
            return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _take_exclusive_file(self) -> None:
        path = self.path.with_name("lock.pid")
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = path.read_text(errors="replace").strip()
                host, _, pid = holder.partition(":")
                if host == socket.gethostname() and pid.isdigit() and not _process_exists(int(pid)):
                    path.unlink(missing_ok=True)  # left by a trainer that died: take it over
                    continue
                raise FolderLockedError(
                    f"{self.path.parent}: another trainer ({holder or 'unknown'}) is using this "
                    f"state folder (delete {path} if no trainer runs)"
                ) from None
            os.write(fd, f"{socket.gethostname()}:{os.getpid()}\n".encode())
            os.close(fd)
            self._exclusive = path
            return
        raise FolderLockedError(f"{self.path.parent}: could not take the lock file {path}")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._exclusive is not None:
            self._exclusive.unlink(missing_ok=True)
            self._exclusive = None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_now(code: int) -> None:
    """End this process with `code` without the interpreter's teardown of torch's modules (about
    half a second per process). For a process whose work is done: every file it wrote is closed,
    so only the standard streams need flushing; multiprocessing's exit handler still runs (it
    releases semaphores, such as those torch.compile's workers make)."""
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
