"""The launcher: contexts, rendezvous, torchrun, and failures that must end the whole job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import _launch_ranks as ranks
import pytest
import torch
from _faults import FAULT_ENV, maybe_inject_fault, parse_fault

from tinylm.parallel import RankFailedError, launch
from tinylm.parallel.launch import _first_failure

REPO = Path(__file__).resolve().parents[1]
RANKS_SCRIPT = REPO / "tests" / "_launch_ranks.py"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests run as if outside torchrun, with no fixed port and no injected fault."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", FAULT_ENV)}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def read_results(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def assert_all_gone(out_dir: Path, world_size: int) -> None:
    """Every rank wrote its pid; none of those processes may still exist."""
    for r in range(world_size):
        pid = int((out_dir / f"pid{r}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ranks_get_their_context(tmp_path):
    launch(ranks.report_context, args=(str(tmp_path),), world_size=2, backend="gloo", threads_per_rank=1)
    results = read_results(tmp_path, 2)
    for rank, r in enumerate(results):
        assert (r["rank"], r["local_rank"], r["world_size"]) == (rank, rank, 2)
        assert (r["device"], r["backend"], r["threads"]) == ("cpu", "gloo", 1)
        assert r["is_main"] == (rank == 0)
        assert r["sum_of_ranks_plus_one"] == 3.0


def test_world_of_one_runs_in_place_without_a_group(tmp_path):
    threads = torch.get_num_threads()
    try:
        launch(ranks.report_context, args=(str(tmp_path),), world_size=1, backend="gloo", threads_per_rank=1)
    finally:
        torch.set_num_threads(threads)
    (r,) = read_results(tmp_path, 1)
    assert (r["rank"], r["world_size"], r["backend"], r["group_initialized"]) == (0, 1, None, False)


def test_explicit_master_port_is_honoured(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(
        ranks.report_context, args=(str(tmp_path),), world_size=2, master_addr="127.0.0.1", master_port=port
    )
    assert [r["sum_of_ranks_plus_one"] for r in read_results(tmp_path, 2)] == [3.0, 3.0]


def test_torchrun_world_size_mismatch_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3.*world_size=2"):
        launch(ranks.report_context, args=("unused",), world_size=2)


def test_parse_and_inject_fault(monkeypatch):
    assert parse_fault("rank=1, step=3, action=hang") == (1, 3, "hang")
    for bad in ("rank=1,step=3", "rank=1,step=3,action=explode", "rank=1;step=3;action=raise"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            parse_fault(bad)
    assert maybe_inject_fault(1, 3) is None  # unset: nothing happens
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=3,action=raise")
    assert maybe_inject_fault(0, 3) is None
    assert maybe_inject_fault(1, 2) is None
    with pytest.raises(RuntimeError, match="injected fault"):
        maybe_inject_fault(1, 3)
    monkeypatch.setenv(FAULT_ENV, "rank=0,step=5,action=nan")
    assert [maybe_inject_fault(r, s) for r, s in [(0, 4), (1, 5), (0, 5)]] == [None, None, "nan"]
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=2,action=overflow")
    assert [maybe_inject_fault(r, s) for r, s in [(1, 1), (1, 2)]] == [None, "overflow"]


def test_raising_rank_fails_the_job_with_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=2,action=raise")
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(ranks.steps_with_fault, args=(str(tmp_path),), world_size=2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 failed")
    assert "Traceback" in message and "injected fault" in message and "steps_with_fault" in message
    assert_all_gone(tmp_path, 2)


def test_the_first_failure_is_reported_not_the_first_one_seen(tmp_path):
    """torch may notice a rank whose peer died (its collective failed) before the peer itself."""
    seen_first = torch.multiprocessing.ProcessRaisedException("rank 0's collective failed", 0, 100)
    raised = lambda rank, when, text: (tmp_path / str(rank)).write_text(f"{when!r}\n{text}")  # noqa: E731

    raised(0, 20.5, "RuntimeError: Connection closed by peer")
    raised(1, 20.0, "RuntimeError: the real error")
    ended = [SimpleNamespace(exitcode=1, pid=100), SimpleNamespace(exitcode=1, pid=101)]
    error = _first_failure(ended, seen_first, str(tmp_path))
    assert (error.rank, error.detail) == (1, "RuntimeError: the real error")

    (tmp_path / "1").unlink()  # rank 1 exited without raising; rank 2 was ended by the launcher
    ended = [
        SimpleNamespace(exitcode=1, pid=100),
        SimpleNamespace(exitcode=17, pid=101),
        SimpleNamespace(exitcode=-signal.SIGTERM, pid=102),
    ]
    error = _first_failure(ended, seen_first, str(tmp_path))
    assert (error.rank, error.detail) == (1, "exited with code 17 (pid 101)")

    ended[1].exitcode = -signal.SIGKILL
    assert (
        str(_first_failure(ended, seen_first, str(tmp_path)))
        == "rank 1 failed: killed by signal SIGKILL (pid 101)"
    )

    ended[1].exitcode = -signal.SIGTERM  # only rank 0 failed on its own
    error = _first_failure(ended, seen_first, str(tmp_path))
    assert (error.rank, error.detail) == (0, "RuntimeError: Connection closed by peer")


@pytest.mark.parametrize(
    ("action", "expected"), [("exit", "exited with code 17"), ("kill", "killed by signal SIGKILL")]
)
def test_exiting_or_killed_rank_fails_the_job(tmp_path, monkeypatch, action, expected):
    monkeypatch.setenv(FAULT_ENV, f"rank=1,step=1,action={action}")
    with pytest.raises(RankFailedError, match=f"rank 1 failed: {expected}"):
        launch(ranks.steps_with_fault, args=(str(tmp_path),), world_size=2, timeout_s=60)
    assert_all_gone(tmp_path, 2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_launcher_leaves_no_rank_behind(tmp_path, sig):
    """Also where SIGINT is ignored, as in a background job (`nohup snakemake ... &`): torch's own
    parent-death signal to its spawned processes is SIGINT, which such ranks would never see."""
    launcher = subprocess.Popen(
        [sys.executable, str(RANKS_SCRIPT), "--wait", str(tmp_path)],
        env=subprocess_env(),
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and launcher.poll() is None, "the ranks never started"
        time.sleep(0.1)
    launcher.send_signal(sig)
    assert launcher.wait(timeout=30) != 0
    deadline = time.monotonic() + 10  # the kernel's signal to an orphan is not instant
    while True:
        try:
            assert_all_gone(tmp_path, 2)
            break
        except BaseException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_hung_rank_ends_the_job_after_the_timeout(tmp_path):
    timeout_s = 5.0
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 failed") as info:
        launch(ranks.sleep_forever_on_rank1, args=(str(tmp_path),), world_size=2, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert timeout_s <= elapsed < timeout_s + 20
    assert "Traceback" in str(info.value)
    assert_all_gone(tmp_path, 2)


def test_failed_job_exits_non_zero_naming_the_rank(tmp_path):
    env = subprocess_env() | {FAULT_ENV: "rank=1,step=0,action=raise"}
    # train_tiny does not call maybe_inject_fault, so use the fault steps through a tiny script.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _launch_ranks as h; "
        "from tinylm.parallel import launch; launch(h.steps_with_fault, args=(sys.argv[2],), world_size=2)"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script, str(REPO / "tests"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert "RankFailedError: rank 1 failed" in proc.stderr
    assert "injected fault" in proc.stderr
    assert_all_gone(tmp_path, 2)


@pytest.mark.slow
def test_two_launches_at_once_both_succeed(tmp_path):
    outputs = [tmp_path / "a.pt", tmp_path / "b.pt"]
    procs = [
        subprocess.Popen([sys.executable, str(RANKS_SCRIPT), str(out)], env=subprocess_env(), cwd=tmp_path)
        for out in outputs
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0]
    a, b = (torch.load(out, weights_only=True) for out in outputs)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_torchrun_gives_the_same_result_as_spawn(tmp_path):
    spawned = tmp_path / "spawn.pt"
    launch(ranks.train_tiny, args=(str(spawned),), world_size=2, backend="gloo")
    torchrun = tmp_path / "torchrun.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(RANKS_SCRIPT),
        str(torchrun),
    ]
    proc = subprocess.run(
        cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(spawned, weights_only=True), torch.load(torchrun, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_fault_patches_refuse_a_loop_whose_names_changed(monkeypatch):
    """A fault test must not pass because its patch went nowhere: a renamed import in the loop is an error."""
    import _faults

    import tinylm.model.transformer as model_module
    import tinylm.pretrain.loop as training

    monkeypatch.setenv(FAULT_ENV, "rank=0,step=1,action=nan")
    # The training loss is the model's loss region's cross-entropy.
    monkeypatch.setattr(model_module, "cross_entropy", lambda logits, targets: logits.sum())  # not ours
    with pytest.raises(RuntimeError, match=r"tinylm.model.transformer.cross_entropy is not .* any more"):
        _faults.install()
    monkeypatch.delattr(model_module, "cross_entropy")  # the name gone, as after a rename
    with pytest.raises(RuntimeError, match="follow the rename here"):
        _faults.install()
    monkeypatch.undo()
    monkeypatch.setenv(FAULT_ENV, "rank=0,step=1,action=nan")
    monkeypatch.setattr(training, "TrainBatches", object)  # the loop's batches renamed
    with pytest.raises(RuntimeError, match=r"tinylm.pretrain.loop.TrainBatches is not"):
        _faults.install()
