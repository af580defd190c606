"""One trainer per state folder: an exclusive lock on `state_dir/lock`, held while `pretrain` runs."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from tinylm.pretrain.log import log_line


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
            log_line(
                True,
                f"{self.path.parent}: this filesystem has no flock ({errno.errorcode[e.errno]}); "
                f"locking with the file {self.path.name}.pid instead",
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
