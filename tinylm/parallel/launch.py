"""Start one process per rank, give each a process group, and end the whole job if one rank fails.

`launch(fn, args, world_size, ...)` runs `fn(ctx, *args)` once per rank, in one of three ways:

- Under torchrun or srun (RANK, WORLD_SIZE and LOCAL_RANK are set in the environment) this process
  already is one rank: the process group is created from the environment (`env://`) and `fn` runs
  in place. A WORLD_SIZE other than the requested `world_size` is refused with a ValueError.
- With `world_size == 1` and no such environment, `fn` runs in place with no process group at all
  (`ctx.backend is None`). DDP and ShardedOptimizer also work there: they see a world of one and
  do no communication.
- Otherwise `world_size` processes are started with `torch.multiprocessing` (start method
  "spawn"), so `fn` and `args` must be picklable: `fn` has to be a module-level function.

Each rank gets `torch.set_num_threads(threads_per_rank)`, its device (`cuda:{local_rank % count}`
with nccl, the CPU with gloo), a process group whose collectives give up after `timeout_s`, and
`ctx.store`, the rendezvous store, for waits that are not collectives (long file I/O, see
tinylm/pretrain/heartbeat.py).
Processes started here meet through a file in a fresh temporary folder, so two runs on one machine
never collide; a MASTER_ADDR/MASTER_PORT passed in or set in the environment is used instead when
given. A rank that finishes waits at a final barrier for the others before the group is destroyed.

Failure: if any rank raises, exits non-zero or is killed, the remaining ranks are terminated and
`launch` raises RankFailedError naming the rank that failed first and carrying its traceback
(not the error of a peer whose next collective failed because of it). A rank that
hangs outside a collective makes the others fail in their next collective after `timeout_s` (or,
while they wait for it through the store, once it has made no progress for `timeout_s`), which
ends the job the same way. No process of the job is left running when `launch` returns or raises.

`resolve_backend`, `ranks_on_this_machine` and `limit_compile_threads` fit a job to the machine:
the backend to the CUDA devices there are, torch.compile's workers to each rank's share of cores.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinylm.io import exit_now


@dataclass(frozen=True)
class RankContext:
    """What a rank function needs to know about itself.

    rank: global rank in [0, world_size); local_rank: index of this process on its machine;
    device: where this rank's tensors live; backend: "gloo", "nccl", or None when no process group
    was created (a single process run in place); store: a key-value store shared by the ranks
    (the rendezvous store, under the prefix "tinylm/"), None without a process group; timeout_s:
    the collective timeout, also the bound on a rank that stops making progress.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None
    store: dist.Store | None = None
    timeout_s: float = 300.0

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and logs."""
        return self.rank == 0


class RankFailedError(RuntimeError):
    """A rank of a launched job raised, exited non-zero or was killed; the job was ended.

    `rank` is the failed rank and `detail` says how it failed (its traceback when it raised).
    """

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed: {detail.strip()}")


def default_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank uses: `cuda:{local_rank % device_count}` with nccl, the CPU otherwise."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def is_global_rank0() -> bool:
    """Whether this process is global rank 0: the launching process, or rank 0 under torchrun."""
    return int(os.environ.get("RANK", "0")) == 0


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when set by torchrun or srun, else None."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if not all(name in os.environ for name in names):
        return None
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    return rank, local_rank, world_size


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    world_size: int = 2,
    backend: str | None = None,
    threads_per_rank: int = 1,
    timeout_s: float = 300.0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> None:
    """Run `fn(ctx, *args)` once on each of `world_size` ranks; see the module docstring.

    backend: "gloo" or "nccl"; None picks `default_backend()`. timeout_s bounds every collective
    (and the rendezvous). Raises RankFailedError when a spawned rank fails, ValueError for a bad
    world size. Under torchrun an exception of `fn` propagates as is, and torchrun ends the job.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be at least 1, got {threads_per_rank}")
    backend = backend or default_backend()

    env = torchrun_env()
    if env is not None:
        rank, local_rank, env_world_size = env
        if env_world_size != world_size:
            raise ValueError(
                f"the environment (torchrun/srun) sets WORLD_SIZE={env_world_size} but the config "
                f"asks for world_size={world_size}; make them agree"
            )
        _run_rank(fn, args, rank, local_rank, world_size, backend, threads_per_rank, timeout_s, "env://")
        return

    if world_size == 1:
        torch.set_num_threads(threads_per_rank)
        fn(RankContext(0, 0, 1, device_for(backend, 0), None, timeout_s=timeout_s), *args)
        return

    rendezvous_dir = None
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    master_port = master_port or (int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
    if master_port is not None:
        init_method = f"tcp://{master_addr or '127.0.0.1'}:{master_port}"
    else:
        rendezvous_dir = tempfile.mkdtemp(prefix="tinylm-rendezvous-")
        init_method = "file://" + os.path.join(rendezvous_dir, "store")
    try:
        _spawn_and_join(
            _spawned_rank,
            (fn, args, world_size, backend, threads_per_rank, timeout_s, init_method),
            world_size,
        )
    finally:
        if rendezvous_dir is not None:
            shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _spawned_rank(local_rank: int, fn, args, world_size, backend, threads_per_rank, timeout_s, init_method):
    """Entry point of a process started by `launch` (on one machine, rank == local_rank)."""
    _run_rank(fn, args, local_rank, local_rank, world_size, backend, threads_per_rank, timeout_s, init_method)


def _run_rank(fn, args, rank, local_rank, world_size, backend, threads_per_rank, timeout_s, init_method):
    """Join the process group, run `fn`, meet the other ranks at a barrier, leave the group.

    When `fn` raises, the exception propagates without the barrier or the teardown: the peers
    would wait at the barrier until the timeout, while the launcher (or torchrun) ends them at once.
    """
    torch.set_num_threads(threads_per_rank)
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # The rendezvous store, made here rather than inside init_process_group, so that the ranks can
    # also use it for waits that are not collectives (see tinylm/pretrain/heartbeat.py).
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # The device, given on CUDA, binds NCCL's communicator to it at once (no guess from the
    # current device, no lazy init in the first collective).
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    ctx = RankContext(
        rank, local_rank, world_size, device, backend, dist.PrefixStore("tinylm/", store), timeout_s
    )
    fn(ctx, *args)
    dist.barrier()
    dist.destroy_process_group()


def _spawn_and_join(entry: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """Start `nprocs` processes running `entry(i, *args)` and wait for all of them.

    torch's ProcessContext.join terminates the others as soon as one process fails; the finally
    block also ends them when this process is interrupted while waiting (Ctrl-C), so no rank is
    left behind either way. The error raised is the first failure's (see `_first_failure`), not
    necessarily the one torch noticed first: a rank whose peer died fails in its next collective
    a moment later, and both can be seen in the same poll.
    """
    failures = tempfile.mkdtemp(prefix="tinylm-failures-")
    context = mp.start_processes(
        _recording_failure,
        args=(os.getpid(), failures, entry, args),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    previous = _raise_on_sigterm()
    try:
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        raise _first_failure(context.processes, error, failures) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        shutil.rmtree(failures, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm():
    """Make SIGTERM (what `kill`, schedulers and Snakemake send) a SystemExit in this process, so
    that the finally block above ends the ranks; returns the previous handler (None off the main
    thread, where Python cannot set one). A SIGKILL is covered by the ranks themselves
    (`_die_with_parent`)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _die_with_parent(launcher_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when the launcher dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's finally block and SIGTERM handler still apply
    if os.getppid() != launcher_pid:  # the launcher died before the call: nothing will signal us
        os._exit(1)


def _recording_failure(
    index: int, launcher_pid: int, failures: str, entry: Callable[..., Any], args: tuple
) -> None:
    """Run `entry(index, *args)`; if it raises, first write when (monotonic clock) and the traceback."""
    _die_with_parent(launcher_pid)
    try:
        entry(index, *args)
    except BaseException:
        with open(os.path.join(failures, f"{index}.tmp"), "w", encoding="utf-8") as f:
            f.write(f"{time.monotonic()!r}\n{traceback.format_exc()}")
        os.replace(os.path.join(failures, f"{index}.tmp"), os.path.join(failures, str(index)))
        raise
    exit_now(0)  # done and out of the process group: the launcher need not wait for the teardown


def _first_failure(processes: list, error: Exception, failures: str) -> RankFailedError:
    """The failure that came first, as a RankFailedError.

    A rank that exited non-zero or was killed (by anything but the launcher's own SIGTERM) without
    raising is the cause: its peers only fail after it. Otherwise, the rank that raised first.
    """
    for index, process in enumerate(processes):
        if (
            index != error.error_index
            and not os.path.exists(os.path.join(failures, str(index)))
            and process.exitcode not in (None, 0, -signal.SIGTERM)
        ):
            return RankFailedError(index, _exit_detail(process.exitcode, process.pid))
    raised = {}
    for path in Path(failures).iterdir():
        if path.name.isdigit():
            when, _, text = path.read_text(encoding="utf-8").partition("\n")
            raised[int(path.name)] = (float(when), text)
    if isinstance(error, mp.ProcessExitedException):
        return RankFailedError(error.error_index, _exit_detail(error.exit_code, error.error_pid))
    if not raised:  # the rank raised before our wrapper ran (while unpickling its arguments)
        return RankFailedError(error.error_index, _annotate(_strip_spawn_header(error.msg)))
    index = min(raised, key=lambda r: raised[r][0])
    return RankFailedError(index, _annotate(raised[index][1]))


def _exit_detail(exit_code: int, pid: int) -> str:
    if exit_code < 0:
        return f"killed by signal {signal.Signals(-exit_code).name} (pid {pid})"
    return f"exited with code {exit_code} (pid {pid})"


def _annotate(detail: str) -> str:
    if "timed out" in detail.lower():
        detail += "\n(a collective timed out: another rank may have hung or died before reaching it)"
    return detail


def _strip_spawn_header(message: str) -> str:
    """Drop torch's '-- Process i terminated with the following error:' line, keep the traceback."""
    marker = "terminated with the following error:\n"
    return message.split(marker, 1)[1] if marker in message else message


def resolve_backend(backend: str, world_size: int) -> tuple[str, str | None]:
    """The process-group backend for `train.backend`, checked against this machine's CUDA devices,
    and a line for the user when "auto" chose the CPU although the machine has GPUs (else None).

    nccl needs one CUDA device per rank on this machine (under torchrun: per rank started here).
    "auto" is nccl when there are enough devices and gloo on the CPU otherwise, so that the default
    config runs (and reproduces its figures) anywhere. A forced "nccl" with too few devices is
    refused before any process starts.
    """
    if backend == "gloo":
        return "gloo", None
    count = torch.cuda.device_count()
    ranks_here = ranks_on_this_machine(world_size)
    if backend == "nccl":
        if count == 0:
            raise ValueError(
                "train.backend: 'nccl' needs CUDA devices, and none is available here "
                "(use 'auto' or 'gloo' on a CPU machine)"
            )
        if ranks_here > count:
            raise ValueError(
                f"train.world_size: {ranks_here} ranks on this machine with train.backend 'nccl' "
                f"need {ranks_here} CUDA devices, but it has {count} (set train.world_size to "
                f"{count} or fewer, or use backend 'gloo')"
            )
        return "nccl", None
    if count == 0:
        return "gloo", None
    if ranks_here > count:
        return "gloo", (
            f"train.world_size {ranks_here} is more ranks than this machine's {count} CUDA devices: "
            f"training on the CPU with gloo (set train.world_size: {count} to use the GPUs)"
        )
    return "nccl", None


def ranks_on_this_machine(world_size: int) -> int:
    """Ranks sharing this machine: LOCAL_WORLD_SIZE under torchrun, else all (mp.spawn starts them here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def limit_compile_threads(ranks_here: int) -> int:
    """Give this rank's torch.compile workers its share of the machine: cores // ranks_here, at least 1.

    Inductor sizes its pool of compile workers to the whole machine in every process, so 8 ranks
    on a node would start 8 pools of that size. TORCHINDUCTOR_COMPILE_THREADS, if set, wins. Call
    before anything compiles; returns the thread count.
    """
    import torch._inductor.config as inductor_config

    threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", 0)) or max(
        1, len(os.sched_getaffinity(0)) // max(1, ranks_here)
    )
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    inductor_config.compile_threads = threads
    return threads
