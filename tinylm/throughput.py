"""What a training log line reports besides the loss: tokens/s, model FLOPs utilisation, peak memory.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s of the devices, where the model
FLOPs of one token are tinylm/flops.py's count (6 per matmul weight, plus attention).

Peak FLOP/s come from a small table of common GPUs (dense, no sparsity), per dtype: bfloat16 / float16
tensor cores, TF32 tensor cores (float32 matmuls when TF32 is allowed) or plain float32. On the CPU, or
a GPU not in the table, MFU is reported only when `train.peak_flops` gives the peak of one device.
"""

from __future__ import annotations

import re
import resource

import torch

# (entry name, pattern matched against torch.cuda.get_device_name as whole words) -> peak FLOP/s of one
# device, dense (no sparsity), from the vendors' data sheets, per matmul kind; None: no such unit.
# Variants of one chip differ in clocks and power, so each has its own row (H100 SXM / PCIe / NVL,
# H200 / H200 NVL, L4 / L40 / L40S, A10 / A10G); the first matching row wins.
GPU_PEAK_FLOPS: list[tuple[str, str, dict[str, float | None]]] = [
    (name, pattern, dict(bfloat16=half, float16=half, tf32=tf32, float32=fp32))
    for name, pattern, half, tf32, fp32 in [
        ("B200", r"B200", 2250e12, 1100e12, 80e12),
        ("H200 NVL", r"H200 NVL", 835e12, 418e12, 60e12),
        ("H200 SXM", r"H200", 989e12, 494e12, 67e12),
        ("H100 NVL", r"H100 NVL", 835e12, 418e12, 60e12),
        ("H100 PCIe", r"H100 PCIe", 756e12, 378e12, 51e12),
        ("H100 SXM", r"H100", 989e12, 494e12, 67e12),
        ("A100", r"A100", 312e12, 156e12, 19.5e12),
        ("L40S", r"L40S", 362e12, 183e12, 91.6e12),
        ("L40", r"L40", 181e12, 90.5e12, 90.5e12),
        ("L4", r"L4", 121e12, 60e12, 30.3e12),
        ("A10G", r"A10G", 70e12, 35e12, 31.2e12),
        ("A10", r"A10", 125e12, 62.5e12, 31.2e12),
        ("RTX 4090", r"RTX 4090", 165e12, 82.6e12, 82.6e12),
        ("RTX 3090", r"RTX 3090", 71e12, 35.6e12, 35.6e12),
    ]
] + [("V100", r"V100", dict(bfloat16=None, float16=125e12, tf32=None, float32=15.7e12))]


# GPUs a run can be planned for by name (`pretrain --plan --plan-device NAME`): the GPU_PEAK_FLOPS row
# of the chip and the card's memory in GB (10^9 bytes, as sold; CUDA reports a little more, so a plan
# against these errs on the side of "does not fit").
PLAN_GPUS: dict[str, tuple[str, float]] = {
    "b200-180gb": ("B200", 180),
    "h200-141gb": ("H200 SXM", 141),
    "h100-80gb": ("H100 SXM", 80),
    "h100-pcie-80gb": ("H100 PCIe", 80),
    "a100-80gb": ("A100", 80),
    "a100-40gb": ("A100", 40),
    "l40s-48gb": ("L40S", 48),
    "l4-24gb": ("L4", 24),
    "a10g-24gb": ("A10G", 24),
    "rtx4090-24gb": ("RTX 4090", 24),
    "rtx3090-24gb": ("RTX 3090", 24),
    "v100-32gb": ("V100", 32),
    "v100-16gb": ("V100", 16),
}


def gpu_entry(device_name: str) -> tuple[str, dict[str, float | None]] | None:
    """(entry name, peaks) of the first GPU_PEAK_FLOPS row whose pattern is in `device_name` as whole
    words ("NVIDIA L4" is an L4, not an L40; "A10G" is not an A10), or None."""
    for name, pattern, peaks in GPU_PEAK_FLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){pattern}(?![A-Za-z0-9])", device_name):
            return name, peaks
    return None


def peak_flops(
    device: torch.device, dtype: torch.dtype, tf32: bool, override: float | None = None
) -> float | None:
    """Peak FLOP/s of one device for matmuls in `dtype` (None when unknown).

    `override` (train.peak_flops) wins; otherwise CUDA devices are looked up in GPU_PEAK_FLOPS: the
    bfloat16/float16 column for those dtypes, the TF32 column for float32 when TF32 is allowed, else
    the float32 one. The CPU has no table entry.
    """
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    entry = gpu_entry(torch.cuda.get_device_name(device))
    if entry is None:
        return None
    peaks = entry[1]
    kind = "tf32" if dtype == torch.float32 and tf32 else str(dtype).removeprefix("torch.")
    return peaks.get(kind) or (peaks["float32"] if dtype == torch.float32 else None)


def mfu(
    tokens_per_s: float, model_flops_per_token: float, peak_per_device: float | None, num_devices: int
) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the peak is unknown)."""
    if peak_per_device is None:
        return None
    return tokens_per_s * model_flops_per_token / (peak_per_device * num_devices)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA memory allocated by torch, or on the CPU the peak RSS.

    On Linux the RSS peak is VmHWM of /proc/self/status: ru_maxrss survives exec, so a process
    started by a larger one (a spawned rank, a stage under pytest) would report its parent's peak.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


class StepMeter:
    """Tokens/s, MFU and the time left, measured over training steps only.

    The loop adds each step's wall time (data, forward, backward, sync, update); validation and
    checkpoint writes are not steps, so they never dilute the rate (the loop times them on their
    own). `report()` gives the rate since the previous report and the ETA from the mean step time.
    """

    def __init__(
        self,
        tokens_per_step: int,
        model_flops_per_token: float,
        peak_per_device: float | None,
        num_devices: int,
        device: torch.device,
    ):
        self.tokens_per_step = tokens_per_step
        self.model_flops_per_token = model_flops_per_token
        self.peak_per_device = peak_per_device
        self.num_devices = num_devices
        self.device = device
        self.last_step_s = 0.0
        self.restart()

    def restart(self) -> None:
        """Forget the steps so far (the first step of a compiled model is mostly compilation)."""
        self._window_s = self._total_s = 0.0
        self._window_steps = self._total_steps = 0

    def add_step(self, seconds: float) -> None:
        self.last_step_s = seconds
        self._window_s += seconds
        self._total_s += seconds
        self._window_steps += 1
        self._total_steps += 1

    def report(self, steps_left: int) -> str:
        """'N tok/s [MFU x%] peak mem M MiB ETA Ts' since the previous report; starts a new window."""
        tok_s = self._window_steps * self.tokens_per_step / max(self._window_s, 1e-9)
        utilisation = mfu(tok_s, self.model_flops_per_token, self.peak_per_device, self.num_devices)
        eta = steps_left * self._total_s / max(self._total_steps, 1)
        self._window_s, self._window_steps = 0.0, 0
        return (
            f"{tok_s:,.0f} tok/s"
            + ("" if utilisation is None else f" MFU {100 * utilisation:.1f}%")
            + f" peak mem {peak_memory_mib(self.device):,.0f} MiB ETA {eta:.0f}s"
        )
