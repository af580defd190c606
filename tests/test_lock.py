"""tinylm.pretrain.lock: the state folder's lock (one trainer per folder, also where flock is missing)."""

import os
import subprocess
import sys

import pytest

from tinylm.pretrain.lock import FolderLockedError, StateLock


def test_lock_stops_a_second_trainer(tmp_path):
    code = (
        "import sys, time; from tinylm.pretrain.lock import StateLock\n"
        "with StateLock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(30)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderLockedError, match=f"another trainer \\(pid {holder.pid}\\)"):
            with StateLock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with StateLock(tmp_path):  # released when its holder died
        pass


def test_a_filesystem_without_flock_locks_with_an_exclusive_file(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with StateLock(tmp_path):
        assert "no flock (ENOSYS)" in capsys.readouterr().err
        assert (tmp_path / "lock.pid").read_text().strip().endswith(f":{os.getpid()}")
        with pytest.raises(FolderLockedError, match=r"another trainer \(.*:\d+\) is using this state folder"):
            with StateLock(tmp_path):
                pass
    assert not (tmp_path / "lock.pid").exists()  # released on exit
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    import socket

    (tmp_path / "lock.pid").write_text(f"{socket.gethostname()}:{dead.stdout.strip()}\n")
    with StateLock(tmp_path):  # left by a process that no longer runs: taken over
        pass
    (tmp_path / "lock.pid").write_text("another-host:1\n")
    with pytest.raises(FolderLockedError, match="delete .*lock.pid if no trainer runs"):
        with StateLock(tmp_path):
            pass
