"""Numeric precision of the forward pass: `train.dtype` resolved for a device, and its autocast.

Parameters and optimizer state always stay float32; only the forward pass (matmuls, attention) runs
in the autocast dtype, and the loss is computed in float32 (tinylm.nn_utils.cross_entropy upcasts).

    dtype = resolve_dtype("auto", device)      # bfloat16 where the device computes it natively
    with autocast(device, dtype):
        logits = model(x)

`native_bf16(device)` answers whether the device computes bfloat16 natively, and why.

Also here: `LossScaler`, float16's loss scaling, `configure_kernels`, the choice between
bit-identical and fastest kernels, `choose_attention_backend`, the fused attention kernel that
is fastest on this GPU at the run's shape, and `machine`, what besides the config decides the last bits of a
run's numbers (torch's version, the device kind, the CPU's vector instructions or the GPU).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def machine(device: torch.device | str) -> dict[str, Any]:
    """What made the numbers, besides the config and the package versions it pins: torch's version,
    the device kind, the CPU's vector instruction set that torch's kernels use
    (`torch.backends.cpu.get_cpu_capability()`, e.g. "AVX512"), the GPU's name on CUDA, and torch's
    threads in this process. Two runs of one config agree bit for bit only where these do."""
    device = torch.device(device)
    return {
        "torch": torch.__version__,
        "device": device.type,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
    }


def machine_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: A there, B here' for each of torch's version, the device kind, and the CPU capability
    (both on the CPU) or the GPU (both on CUDA) in which two `machine` records differ; threads are
    left out (a stage's are its own)."""
    keys = ["torch", "device"]
    if recorded.get("device") == current.get("device"):
        keys.append("gpu" if current.get("device") == "cuda" else "cpu_capability")
    return [
        f"{key} {recorded.get(key)!r} there, {current.get(key)!r} here"
        for key in keys
        if key in recorded and recorded.get(key) != current.get(key)
    ]


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` computes bfloat16 matmuls natively, and why, as a phrase for the log.

    CUDA: `torch.cuda.is_bf16_supported(including_emulation=False)` (Ampere and newer).
    CPU: torch runs bfloat16 matmuls through oneDNN, which has bfloat16 kernels only for some
    instruction sets; elsewhere they take a reference path that is an order of magnitude slower
    than float32. Native means oneDNN has a bfloat16 kernel here (`_is_mkldnn_bf16_supported`, which
    honours `ONEDNN_MAX_CPU_ISA`) and, on x86, the CPU has AVX-512 BF16 or AMX: oneDNN's
    AVX-512-only bfloat16 emulates the instructions and is slower than float32. torch has no public
    API for the question, so these are its private probes (torch.cpu, torch.ops.mkldnn).
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} computes bfloat16 natively"
        return False, f"{name} has no native bfloat16"
    if device.type != "cpu":
        return False, f"no bfloat16 check for device {device.type!r}"
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        if onednn:
            return True, "the CPU has bfloat16 matmul instructions"
        return False, "the CPU has no bfloat16 matmul instructions that torch uses"
    instructions = [
        name
        for name, present in (
            ("AVX-512 BF16", torch.cpu._is_avx512_bf16_supported()),
            ("AMX", torch.cpu._is_amx_tile_supported()),
        )
        if present
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    if not instructions:
        return False, f"the CPU has no AVX-512 BF16 or AMX (torch's CPU capability: {capability})"
    if not onednn:
        limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
        return (
            False,
            f"the CPU has {' and '.join(instructions)}, but oneDNN does not use it here "
            f"(ONEDNN_MAX_CPU_ISA={limit})",
        )
    return True, f"the CPU has {' and '.join(instructions)}"


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The autocast dtype for `train.dtype` = name on `device`.

    "auto" is bfloat16 where the device computes it natively (`native_bf16`) and float32 elsewhere.
    The explicit names are taken as they are.
    """
    return resolve_dtype_with_reason(name, device)[0]


def resolve_dtype_with_reason(name: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """`resolve_dtype` and a line for the log saying what was chosen and why, e.g.
    "train.dtype auto: bfloat16 (the CPU has AVX-512 BF16)"."""
    if name == "auto":
        native, why = native_bf16(device)
        dtype = torch.bfloat16 if native else torch.float32
        return dtype, f"train.dtype auto: {dtype_name(dtype)} ({why})"
    if name not in DTYPES:
        raise ValueError(f"train.dtype: {name!r} is not one of {['auto', *DTYPES]}")
    return DTYPES[name], f"train.dtype {name}"


def bf16_cost(shape: tuple[int, int, int], repeats: int = 3) -> float:
    """How many times float32's time one bfloat16 matmul of `shape` (m, k, n) takes on this CPU,
    at this process's threads: the fastest of `repeats` each. A second or so where bfloat16 is not
    native; what the line of an explicit `train.dtype: bfloat16` there says."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # first call: oneDNN's kernel is made
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - start)
        seconds[dtype] = min(times)
    return seconds[torch.bfloat16] / max(seconds[torch.float32], 1e-9)


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16' or 'float16'."""
    return str(dtype).removeprefix("torch.")


def autocast(device: torch.device | str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device`'s type; no autocast at all for float32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al., 2018), torch.amp.GradScaler's rule.

    float16 gradients of small magnitude underflow to 0, so the loss is multiplied by `scale` before
    backward and the gradients are divided by it before they are clipped and used:

        (loss * scaler.scale).backward(); ...; scaler.unscale_(grads)
        overflow = not finite(global gradient norm)      # the same decision on every rank
        if not overflow: optimizer.step()
        scaler.update(overflow)

    A step whose gradients overflowed is skipped and the scale multiplied by `backoff_factor`;
    after `growth_interval` steps in a row without overflow it is multiplied by `growth_factor`.
    The decision is taken by the caller from the global gradient norm, which every rank computes
    alike, so every rank skips the same steps even when each holds only its share of the gradients
    (ZeRO-1). Disabled (float32, bfloat16): the scale is 1 and nothing changes.
    `state_dict()` has GradScaler's keys and values.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # steps in a row without overflow

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale, in place (non-finite values stay non-finite)."""
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled or not state:
            return
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])


def configure_kernels(device: torch.device, deterministic: bool) -> None:
    """Deterministic kernels (bit-identical reruns on one machine) or the fastest ones.

    Deterministic: torch.use_deterministic_algorithms(True), so an op without a deterministic
    kernel is an error rather than a warning; the flash and memory-efficient attention backward then
    run their deterministic variants, cuDNN attention (not covered by that switch) is turned off,
    cuBLAS gets a fixed workspace, and float32 matmuls stay in full float32 (no TF32).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS is first used
    torch.use_deterministic_algorithms(deterministic)
    torch.set_float32_matmul_precision("highest" if deterministic else "high")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = not deterministic
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cuda.enable_cudnn_sdp(not deterministic)


# torch's fused attention kernels (torch.nn.attention.SDPBackend names); the math backend stays on
# beside the chosen one, for the shapes a fused kernel cannot take (a generation step's mask).
ATTENTION_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def time_attention_backends(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, repeats: int = 5
) -> dict[str, float | str]:
    """{backend: seconds of one causal attention forward and backward, or why it cannot run here}.

    q, k and v are [B, H, T, d_head] = `shape` in `dtype`, drawn from a generator of their own (the
    process's random state is left as it was). Each backend runs twice untimed (its plans and
    autotuning), then `repeats` times between two synchronisations; one that raises is given the
    first line of its error.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_() for _ in range(3)
    )

    def forward_and_backward() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, float | str] = {}
    for name in ATTENTION_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                for _ in range(2):
                    forward_and_backward()
                synchronize()
                start = time.perf_counter()
                for _ in range(repeats):
                    forward_and_backward()
                synchronize()
            times[name] = (time.perf_counter() - start) / repeats
        except RuntimeError as error:
            times[name] = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return times


def use_attention_backend(name: str) -> None:
    """Enable the fused attention backend `name` (one of ATTENTION_BACKENDS) and no other fused one."""
    torch.backends.cuda.enable_flash_sdp(name == "FLASH_ATTENTION")
    torch.backends.cuda.enable_mem_efficient_sdp(name == "EFFICIENT_ATTENTION")
    torch.backends.cuda.enable_cudnn_sdp(name == "CUDNN_ATTENTION")


def choose_attention_backend(
    device: torch.device, shape: tuple[int, int, int, int], dtype: torch.dtype, deterministic: bool
) -> str | None:
    """On CUDA, use the fused attention backend that runs the training shape fastest here; returns
    the log line that says which and what each took (None on other devices, which keep their path).

    Measured rather than left to torch's fixed priority order, which puts flash first and cuDNN
    last, whatever the GPU. Under DDP every rank uses rank 0's choice, so that every rank runs the
    same kernels. With `deterministic` nothing is measured: a choice by timing could differ between
    reruns, and cuDNN's is off (configure_kernels), so torch's order decides.
    """
    if device.type != "cuda":
        return None
    if deterministic:
        return "attention: torch's order of the deterministic backends (train.deterministic: true)"
    times = time_attention_backends(shape, dtype, device)
    runnable = {name: t for name, t in times.items() if isinstance(t, float)}
    chosen = [min(runnable, key=runnable.get) if runnable else ""]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(chosen, src=0)
    described = ", ".join(
        f"{name} {t * 1e3:.2f} ms" if isinstance(t, float) else f"{name} cannot ({t})"
        for name, t in times.items()
    )
    if not chosen[0]:
        return f"attention: no fused backend runs {list(shape)} here, torch's order decides ({described})"
    use_attention_backend(chosen[0])
    return f"attention: {chosen[0]}, the fastest forward and backward at {list(shape)} here ({described})"
