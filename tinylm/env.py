"""`python -m tinylm env`: the machine as tinylm sees it, as a block to paste into a bug report.

    report = environment_lines(cfg, config_name, timed_steps=5)

The block has two parts. The machine: versions, the CPU (model, torch's capability, native
bfloat16), the cores, whether torch.compile finds its C++ compiler, CUDA, NCCL and each GPU (its
memory and bfloat16 peak from tinylm/throughput.py). Then the config resolved on this machine:
the dtype, world size, backend, threads and accumulation a run would take, the memory plan's
verdict, and an estimate of the training time from a few steps timed here.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
import time
from importlib import metadata

import torch

from tinylm.config import Config
from tinylm.parallel.launch import ranks_on_this_machine, resolve_backend
from tinylm.precision import autocast, native_bf16, resolve_dtype_with_reason
from tinylm.throughput import gpu_entry


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers on x86 (/proc/cpuinfo on Linux, else
    what the platform module says)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpp_compiler() -> str:
    """The C++ compiler torch.compile's CPU backend would use, or 'none found'."""
    from torch._inductor import config as inductor_config

    candidates = inductor_config.cpp.cxx
    for name in candidates if isinstance(candidates, tuple | list) else [candidates]:
        if name and (path := shutil.which(name)):
            return path
    return f"none found (looked for {', '.join(str(c) for c in candidates if c)})"


def machine_lines() -> list[str]:
    """Versions, CPU, cores, compiler, CUDA and GPUs."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    cuda = torch.version.cuda
    native, why = native_bf16("cpu")
    lines = [
        f"tinylm         {version('tinylm')} ({os.path.dirname(__file__)})",
        f"python         {platform.python_version()} ({sys.executable})",
        f"torch          {torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU build'})",
        f"numpy          {version('numpy')}; snakemake {version('snakemake')}",
        f"platform       {platform.platform()}",
        f"cpu            {cpu_model()}; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}",
        f"cpu bfloat16   {'native' if native else 'not native'}: {why}",
        f"cores          {usable_cores()} usable; torch uses {torch.get_num_threads()} threads by default"
        + (f"; load average {os.getloadavg()[0]:.1f} (1 min)" if hasattr(os, "getloadavg") else ""),
        f"torch.compile  C++ compiler: {cpp_compiler()}",
    ]
    if not torch.cuda.is_available():
        lines.append("cuda           no CUDA device" + ("" if cuda else " (a CPU build of torch)"))
        return lines
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    lines.append(f"cuda           {cuda}; NCCL {nccl}; {torch.cuda.device_count()} devices")
    for index in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(index)
        memory = torch.cuda.get_device_properties(index).total_memory / 2**30
        entry = gpu_entry(name)
        peak = entry[1].get("bfloat16") if entry else None
        peak_text = f"bfloat16 peak {peak / 1e12:.0f} TFLOP/s" if peak else "bfloat16 peak not in the table"
        lines.append(
            f"gpu {index}          {name}, {memory:.1f} GiB, {peak_text}, "
            f"{'native' if native_bf16(torch.device('cuda', index))[0] else 'no native'} bfloat16"
        )
    return lines


def config_lines(cfg: Config, config_name: str, timed_steps: int) -> list[str]:
    """The config resolved on this machine, its memory plan's verdict, and the estimated training time."""
    from tinylm.pretrain.memory import plan_memory, smallest_fitting_accumulation
    from tinylm.pretrain.run import model_config_of, run_device

    train = cfg.train
    backend, _ = resolve_backend(train.backend, train.world_size)
    device = run_device(backend, train.world_size)
    torch_device = torch.device(device.name)
    dtype, why = resolve_dtype_with_reason(train.dtype, torch_device)
    model_config = model_config_of(cfg, cfg.tokenizer.vocab_size)
    accum = train.grad_accum_steps
    if accum == "auto":
        accum = smallest_fitting_accumulation(model_config, train, train.world_size, device) or 1
    train = dataclasses.replace(train, grad_accum_steps=accum)
    ranks = ranks_on_this_machine(train.world_size)
    lines = [
        f"config         {config_name}",
        f"  {why}",
        f"  train.world_size {train.world_size} ({ranks} ranks here), backend {backend} on {device.name}, "
        f"train.threads_per_rank {train.threads_per_rank}, train.grad_accum_steps {accum}",
    ]
    if ranks * train.threads_per_rank > usable_cores():
        lines.append(f"  {ranks} ranks x {train.threads_per_rank} threads exceed the {usable_cores()} cores")
    plan = plan_memory(model_config, train, train.world_size, device)
    verdict = "fits" if plan.fits() else f"does not fit: {plan.problem()}"
    lines.append(f"  memory plan    {plan.total / 2**20:,.0f} MiB per rank; {verdict}")
    if timed_steps > 0 and plan.fits():
        seconds = time_steps(cfg, train, torch_device, dtype, timed_steps)
        slowdown = max(1.0, ranks * train.threads_per_rank / usable_cores())
        tokens = train.batch_size * cfg.model.context_length
        total = seconds * slowdown * train.max_iters
        lines.append(
            f"  estimate       {tokens / (seconds * slowdown):,.0f} tokens/s, so {train.max_iters} steps in "
            f"about {total / 60:.1f} min (an estimate: {timed_steps} steps of one rank's share timed "
            f"alone; communication, validation and checkpoints not counted)"
        )
    return lines


def time_steps(cfg: Config, train, device: torch.device, dtype: torch.dtype, steps: int) -> float:
    """Seconds of one training step of one rank (forward, backward, optimizer) on random tokens, at
    the rank's micro-batch and threads: the median of `steps` steps after two untimed ones."""
    from tinylm.data import micro_batch_size
    from tinylm.model import Transformer
    from tinylm.pretrain.optimizer import build_optimizer
    from tinylm.pretrain.run import model_config_of

    threads = torch.get_num_threads()
    torch.set_num_threads(train.threads_per_rank)
    try:
        generator = torch.Generator().manual_seed(0)
        model = Transformer(**model_config_of(cfg, cfg.tokenizer.vocab_size), device=device)
        optimizer = build_optimizer(model, train, world_size=1)
        micro = micro_batch_size(train.batch_size, train.world_size, train.grad_accum_steps)
        shape = (micro, cfg.model.context_length + 1)
        times = []
        for step in range(steps + 2):
            ids = torch.randint(0, cfg.tokenizer.vocab_size, shape, generator=generator).to(device)
            start = time.perf_counter()
            for _ in range(train.grad_accum_steps):
                with autocast(device, dtype):
                    loss = model(ids[:, :-1], targets=ids[:, 1:])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= 2:
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(threads)


def environment_lines(cfg: Config, config_name: str, timed_steps: int = 5) -> list[str]:
    """The whole block: the machine, then `cfg` resolved here (see the module docs)."""
    return [*machine_lines(), *config_lines(cfg, config_name, timed_steps)]
