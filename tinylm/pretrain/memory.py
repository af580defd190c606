"""The memory plan of a run: what one rank will hold at its peak, worked out before launch.

    plan = plan_memory(model_config, train, world_size, device)
    print("\n".join(plan.lines()))          # one line per part, and one with the word `total`
    problem = plan.problem()                 # None, or one line naming the keys to change

Per rank, in bytes:

    parameters      every parameter in float32 (counted on a model built on the meta device)
    gradients       one float32 gradient per trainable parameter: DDP's buckets hold them all
    optimizer       AdamW's two moments (Muon: one momentum buffer for its matrices) for the
                    parameters this rank steps: all of them, or with train.shard_optimizer its
                    ZeRO-1 slices (the largest rank's, laid out as ShardedOptimizer does)
    activations     the peak of one micro-batch's (batch_size / (world_size * grad_accum_steps)
                    sequences) forward, loss and backward beyond the parameters and gradients: what
                    autograd saves, the logits, the loss's float32 chunks, backward's temporaries.
                    Measured, not modelled: the step runs on fake tensors (shapes only, no data, no
                    memory) with the run's autocast dtype and activation checkpointing, and every
                    tensor it makes is counted while it lives (step_memory)
    allocator       CPU only: the free chunks glibc's heap keeps resident beside the step's tensors,
                    from how much of the step's peak and of its traffic the heap serves
                    (glibc_heap_slack; measured against glibc's defaults, see GLIBC_FREE_PER_LIVE)
    framework       CPU: this process's resident memory with torch loaded, and what a training rank
                    loads besides (RANK_LIBRARY_BYTES); CUDA: 500 MiB for the context and the caching
                    allocator (an estimate)

The total is compared with the device's memory (CUDA: total and free; CPU: available RAM). The
device is this machine's (`local_device`) or one named (`named_device`: a GPU of
throughput.PLAN_GPUS such as "h100-80gb", or "cpu:64gb"), so that a run can be planned on a laptop
for a GPU it does not have.
`smallest_fitting_accumulation` tries train.grad_accum_steps from 1 up, and `problem()` says by how
much a plan misses and which keys make it fit. Checked against the peak resident memory of real
runs on the CPU (bench/memory_plan.py; bench/RESULTS.md, "Models that fit").
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tinylm.config import TrainConfig
from tinylm.data import micro_batch_size
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy, loss_chunk_bytes
from tinylm.parallel.launch import ranks_on_this_machine
from tinylm.parallel.shard_layout import plan_shards
from tinylm.precision import autocast, native_bf16, resolve_dtype
from tinylm.pretrain.optimizer import parameter_specs
from tinylm.throughput import GPU_PEAK_FLOPS, PLAN_GPUS, gpu_entry

GIB = 2**30
CUDA_CONTEXT_BYTES = 500 * 2**20  # CUDA context and allocator slack: an estimate, not measured here

# glibc's heap on the CPU, measured (bench/memory_plan.py; bench/RESULTS.md, "Models that fit").
# glibc gives an allocation its own mapping, unmapped when freed, only above its mmap threshold,
# which rises to the largest such block freed, up to this ceiling: after the first step every
# tensor below it comes from the heap, and the heap keeps freed chunks resident for reuse.
GLIBC_MMAP_CEILING = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
# At a step's peak the heap holds, beside its live tensors, free chunks that no request of the step
# reuses: a fixed part, 0.45 of the heap's live bytes at the peak (the free chunks between them),
# and 5.5 % of every byte the step passes through the heap (what its short-lived tensors split off
# and leave). Fitted as an upper bound to ten shapes' resident peaks under glibc 2.36's defaults
# less those of the same runs with the mmap threshold pinned (which hold the tensors alone), over
# bfloat16 and float32, with and without activation checkpointing, at world sizes 1 and 2, and the
# default run's peak over a whole run (the heap creeps over a run, past its first steps); how far
# above each shape's runs the bound lies is in bench/RESULTS.md, "Models that fit".
GLIBC_FREE_FIXED = 64 * 2**20
GLIBC_FREE_PER_LIVE = 0.45
GLIBC_FREE_PER_MADE = 0.055
# What a training rank has resident beyond the planning process: the kernels' code pages it
# touches, TensorBoard's writer, gloo's buffers (measured by bench/memory_plan.py).
RANK_LIBRARY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class PlanDevice:
    """The device a plan is made for, here or named (see `local_device`, `named_device`)."""

    type: str  # "cpu" or "cuda"
    name: str  # "cpu", "cuda:0", or the name it was given ("h100-80gb", "cpu:64gb")
    available: int | None  # bytes the run may use: free GPU memory, available RAM (None: unknown)
    total: int | None  # a GPU's total memory (None on the CPU)
    ranks_sharing: int = 1  # ranks whose totals share `available` (one machine's RAM); 1 on a GPU
    bf16: bool = False  # bfloat16 autocast is what train.dtype auto takes there
    peak_bf16: float | None = None  # dense bfloat16 FLOP/s of one device, where known


def local_device(device: torch.device | str, world_size: int) -> PlanDevice:
    """This machine's `device`: CUDA's free and total memory, or the CPU's available RAM shared by
    this machine's ranks."""
    device = torch.device(device)
    available, total = device_memory(device)
    if device.type == "cuda":
        entry = gpu_entry(torch.cuda.get_device_name(device))
        return PlanDevice(
            "cuda",
            str(device),
            available,
            total,
            bf16=native_bf16(device)[0],
            peak_bf16=entry[1]["bfloat16"] if entry else None,
        )
    return PlanDevice(
        "cpu", "cpu", available, None, ranks_on_this_machine(world_size), bf16=native_bf16(device)[0]
    )


def named_device(name: str, world_size: int) -> PlanDevice:
    """A device by name, for a plan made anywhere: a GPU of throughput.PLAN_GPUS (its memory, as
    sold in GB of 10^9 bytes, is the run's; one rank per GPU), or "cpu:<N>gb" (N GB of RAM shared by
    all `world_size` ranks on one machine). An unknown name is a ValueError listing the known ones."""
    if name.startswith("cpu:"):
        size = name.removeprefix("cpu:").lower().removesuffix("gb")
        try:
            available = int(float(size) * 1e9)
        except ValueError:
            available = 0
        if available <= 0:
            raise ValueError(f"--plan-device {name!r}: a CPU is named cpu:<GB of RAM>, e.g. cpu:64gb")
        return PlanDevice("cpu", name, available, None, world_size)
    if name not in PLAN_GPUS:
        known = ", ".join([*PLAN_GPUS, "cpu:<N>gb"])
        raise ValueError(f"--plan-device {name!r}: not a device this plan knows; one of {known}")
    chip, memory_gb = PLAN_GPUS[name]
    peaks = next(peaks for entry, _, peaks in GPU_PEAK_FLOPS if entry == chip)
    memory = int(memory_gb * 1e9)
    bf16 = peaks["bfloat16"] is not None
    return PlanDevice("cuda", name, memory, memory, bf16=bf16, peak_bf16=peaks["bfloat16"])


@dataclass
class MemoryPlan:
    """Bytes per rank of each part of a run's peak (see the module docs), and the device's memory."""

    parts: dict[str, int]
    device: PlanDevice
    train: TrainConfig
    world_size: int
    model_config: dict = field(repr=False)
    traced: bool = True  # False: the parameters, gradients and optimizer state alone do not fit

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self) -> bool:
        available = self.device.available
        return available is None or self.total * self.device.ranks_sharing <= available

    def lines(self) -> list[str]:
        """The plan as lines for a log: one per part, the total, and the device's memory."""
        train = self.train
        micro = micro_batch_size(train.batch_size, self.world_size, train.grad_accum_steps)
        out = [
            f"memory plan per rank (micro-batch {micro} x {self.model_config['context_length']}, "
            f"activation checkpointing {train.activation_checkpointing}, optimizer {train.optimizer}"
            f"{', sharded' if train.shard_optimizer and self.world_size > 1 else ''}):"
        ]
        out += [f"  {name:<12} {_gib(size)}" for name, size in self.parts.items()]
        if not self.traced:
            out.append(f"  {'activations':<12} not planned: what is above does not fit already")
        out.append(f"  {'total':<12} {'at least ' if not self.traced else ''}{_gib(self.total)}")
        device = self.device
        if device.total is not None and device.total == device.available:  # a named GPU
            out.append(f"  {device.name} has {_gib(device.total)}")
        elif device.total is not None:
            out.append(f"  {device.name} has {_gib(device.total)}, {_gib(device.available)} free")
        elif device.available is not None:
            sharing = f" for {device.ranks_sharing} ranks" if device.ranks_sharing > 1 else ""
            out.append(f"  {device.name}: {_gib(device.available)} available{sharing}")
        return out

    def problem(self) -> str | None:
        """None when the plan fits; else one line: how much it needs of how much, and what fits."""
        if self.fits():
            return None
        options = []
        train = self.train
        if train.activation_checkpointing != "full":
            full = self.replan(activation_checkpointing="full")
            if full.fits():
                options.append("train.activation_checkpointing: full")
        accum = smallest_fitting_accumulation(self.model_config, train, self.world_size, self.device)
        if accum is not None:
            options.append(f"train.grad_accum_steps: {accum}")
        device = self.device
        needs = (
            f"needs {'at least ' if not self.traced else ''}{_gib(self.total * device.ranks_sharing)} of "
            f"{_gib(device.available)} on {device.name}"
        )
        if device.ranks_sharing > 1:
            needs += f" ({device.ranks_sharing} ranks of {_gib(self.total)})"
        if options:
            return f"{needs}: set {' or '.join(options)}"
        return (
            f"{needs}, and does not fit even with train.grad_accum_steps at the per-rank batch "
            f"({train.batch_size // self.world_size}) and full activation checkpointing: lower "
            f"model.context_length, the model's size or train.batch_size, or add ranks (train.world_size)"
        )

    def replan(self, **train_changes) -> MemoryPlan:
        """The plan of the same run with other train keys."""
        train = dataclasses.replace(self.train, **train_changes)
        return plan_memory(self.model_config, train, self.world_size, self.device)


def plan_memory(
    model_config: dict, train: TrainConfig, world_size: int, device: PlanDevice | torch.device | str = "cpu"
) -> MemoryPlan:
    """The per-rank memory plan of training Transformer(**model_config) under `train` on `device`
    (a PlanDevice, or a device of this machine)."""
    if not isinstance(device, PlanDevice):
        device = local_device(device, world_size)
    with torch.device("meta"):
        model = Transformer(**model_config)
    parts = _state_bytes(model, train, world_size)
    state_only = MemoryPlan(parts, device, train, world_size, dict(model_config), traced=False)
    if not state_only.fits():  # the weights and optimizer state decide it: no step is traced
        return state_only
    micro = micro_batch_size(train.batch_size, world_size, train.grad_accum_steps)
    if train.dtype == "auto":  # the device need not be here, so not resolve_dtype's question to it
        dtype = torch.bfloat16 if device.bf16 else torch.float32
    else:
        dtype = resolve_dtype(train.dtype, "cpu")
    step = step_memory(model_config, micro, dtype, train.activation_checkpointing, device.type)
    parts["activations"] = step.peak
    if device.type == "cuda":
        parts["framework"] = CUDA_CONTEXT_BYTES
    else:
        parts["allocator"] = glibc_heap_slack(step)
        parts["framework"] = _resident_bytes() + RANK_LIBRARY_BYTES
    return MemoryPlan(parts, device, train, world_size, dict(model_config))


def _state_bytes(model: Transformer, train: TrainConfig, world_size: int) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer"}: bytes on the rank that holds the most.

    Unsharded: every parameter and gradient in float32, and per element 8 bytes of optimizer state
    (AdamW's two moments) or 4 (Muon's momentum). With train.shard_optimizer, laid out as
    ShardedOptimizer lays them out (tinylm/parallel/shard_layout.py): parameters and gradients in
    buckets (their alignment and slot padding counted), the state of the largest rank's slices.
    """
    specs = parameter_specs(model, train)
    per_element = [4 if spec.whole else 8 for spec in specs]  # Muon's momentum, AdamW's two moments
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    if world_size == 1 or not train.shard_optimizer:
        return {
            "parameters": frozen + sum(p.numel() * 4 for p in trainable),
            "gradients": sum(p.numel() * 4 for p in trainable),
            "optimizer": sum(b * spec.numel for b, spec in zip(per_element, specs, strict=True)),
        }
    buckets = plan_shards(specs, world_size, train.bucket_size_mb * 2**20)
    laid_out = sum(bucket.numel * 4 for bucket in buckets)
    state = [
        sum(per_element[piece.index] * piece.numel for bucket in buckets for piece in bucket.pieces(r))
        for r in range(world_size)
    ]
    return {"parameters": frozen + laid_out, "gradients": laid_out, "optimizer": max(state)}


class _LiveBytes(TorchDispatchMode):
    """The largest number of bytes held at once by the storages that ops make while it is active.

    A storage is counted when an op first returns it and uncounted when the last tensor on it that
    this mode saw is freed. Views and aliases (a transpose, a reshape that needs no copy, a detach)
    share their input's storage and count nothing new; nor do views of storages made before (the
    parameters, the input); in-place ops make nothing new.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        # The same for storages below GLIBC_MMAP_CEILING (those glibc serves from its heap), and
        # the bytes of all such storages made (what the step passes through the heap).
        self.heap_live = self.heap_at_peak = self.heap_made = 0
        self._sizes: dict[int, int] = {}  # storage -> its bytes
        self._holders: dict[int, int] = {}  # storage -> live tensors seen on it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            key = _storage_key(tensor)
            if key not in self._holders:
                if key in inputs:  # a view of a storage made before this mode began
                    continue
                size = tensor.untyped_storage().nbytes()
                self._holders[key], self._sizes[key] = 0, size
                self.live += size
                if size < GLIBC_MMAP_CEILING:
                    self.heap_live += size
                    self.heap_made += size
            self._holders[key] += 1
            weakref.finalize(tensor, self._release, key)
        if self.live > self.peak:
            self.peak, self.heap_at_peak = self.live, self.heap_live
        return out

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            size = self._sizes.pop(key)
            self.live -= size
            if size < GLIBC_MMAP_CEILING:
                self.heap_live -= size


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class StepMemory:
    """What one micro-batch's forward, loss and backward do with memory (see `step_memory`), in
    bytes of the storages their ops make."""

    peak: int  # the most held at once: the plan's activations
    heap_at_peak: int  # of `peak`, the storages below GLIBC_MMAP_CEILING (glibc serves them from its heap)
    heap_made: int  # every storage below GLIBC_MMAP_CEILING the step makes, summed over the step


def step_memory(
    model_config: dict,
    micro_batch: int,
    dtype: torch.dtype,
    activation_checkpointing: str,
    device_type: str = "cpu",
) -> StepMemory:
    """The memory of one micro-batch's forward, loss and backward beyond the parameters and their
    gradients: what autograd saves, the logits, the loss's float32 chunks, backward's temporaries.

    The step runs on fake tensors (shapes only: no data, no memory, no arithmetic), with every
    gradient already allocated, as DDP's buckets hold them, and every new tensor's storage is counted
    while it lives. The kernels are the CPU's (on CUDA, fused attention needs about the same); the
    loss takes the path and the chunks of rows it takes on `device_type` (fused on CUDA). On the CPU
    its peak is that of torch's allocator on the real step (tests/test_memory.py, with the profiler).
    """
    with torch.device("meta"):
        model = Transformer(**model_config)
    model.set_activation_checkpointing(activation_checkpointing)
    model.train()
    context, cpu = model_config["context_length"], torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device=cpu)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ids = torch.zeros(micro_batch, context + 1, dtype=torch.long)
        with _LiveBytes() as tracker:
            with autocast(cpu, dtype):
                logits = model(ids[:, :-1])
            loss = cross_entropy(
                logits, ids[:, 1:], loss_chunk_bytes(device_type), fused=device_type == "cuda"
            )
            del logits
            loss.backward()
            del loss
    return StepMemory(tracker.peak, tracker.heap_at_peak, tracker.heap_made)


def glibc_heap_slack(step: StepMemory) -> int:
    """The free memory glibc's heap keeps resident at the peak of `step` (see GLIBC_FREE_PER_LIVE)."""
    return round(
        GLIBC_FREE_FIXED + GLIBC_FREE_PER_LIVE * step.heap_at_peak + GLIBC_FREE_PER_MADE * step.heap_made
    )


def smallest_fitting_accumulation(
    model_config: dict, train: TrainConfig, world_size: int, device: PlanDevice | torch.device | str
) -> int | None:
    """The smallest train.grad_accum_steps (a divisor of the per-rank batch) whose plan fits the
    device, or None when none does (not even one sequence per micro-step).

    A plan's total only shrinks as the accumulation grows (the micro-batch shrinks, nothing else
    changes), so the divisors are bisected: a few plans, not one per divisor.
    """
    if not isinstance(device, PlanDevice):
        device = local_device(device, world_size)
    per_rank = train.batch_size // world_size
    divisors = [a for a in range(1, per_rank + 1) if per_rank % a == 0]

    def fits(accum: int) -> bool:
        return plan_memory(
            model_config, dataclasses.replace(train, grad_accum_steps=accum), world_size, device
        ).fits()

    low, high = 0, len(divisors)  # the answer is divisors[high] once low == high (none: high == len)
    while low < high:
        middle = (low + high) // 2
        if fits(divisors[middle]):
            high = middle
        else:
            low = middle + 1
    return divisors[high] if high < len(divisors) else None


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(bytes a run may use, the device's total or None): CUDA's free and total memory, or on the
    CPU the available RAM (MemAvailable of /proc/meminfo; None where it cannot be read)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, total
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, None
    except OSError:
        pass
    return None, None


@functools.cache
def _resident_bytes() -> int:
    """This process's resident memory (VmRSS) when first asked: Python, torch and what was loaded by
    then; the same for every plan of a process, so that plans compare."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gib(size: int | None) -> str:
    """A size in GiB, or in MiB below one GiB."""
    if size is None:
        return "?"
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"
