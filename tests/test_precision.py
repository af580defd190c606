"""train.dtype resolved per device, and its autocast: what runs in low precision and what does not."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinylm.checkpoint import CheckpointError, Manifest
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.precision import autocast, bf16_cost, resolve_dtype, resolve_dtype_with_reason
from tinylm.pretrain.resume import check_resumable

X86 = platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the Linux kernel lists them in /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def force_cpu(monkeypatch, avx512_bf16: bool, amx: bool, onednn: bool) -> None:
    """Make this process's torch answer the CPU questions as a CPU of that kind would."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def test_auto_is_bfloat16_on_a_cuda_device_that_has_it_natively(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    # A GPU that only emulates bfloat16 (before Ampere) answers True only with emulation.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", "cuda:0") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="train.dtype: 'fp8'"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize(
    "avx512_bf16, amx, onednn, expected, said",
    [
        (True, False, True, torch.bfloat16, "AVX-512 BF16"),
        (False, True, True, torch.bfloat16, "AMX"),
        (True, True, True, torch.bfloat16, "AVX-512 BF16 and AMX"),
        (False, False, True, torch.float32, "no AVX-512 BF16 or AMX"),  # AVX-512 only: emulated
        (False, False, False, torch.float32, "no AVX-512 BF16 or AMX"),  # AVX2
        (True, False, False, torch.float32, "oneDNN does not use it"),  # ONEDNN_MAX_CPU_ISA below it
    ],
)
def test_auto_on_the_cpu_is_bfloat16_only_with_native_instructions(
    monkeypatch, avx512_bf16, amx, onednn, expected, said
):
    force_cpu(monkeypatch, avx512_bf16, amx, onednn)
    dtype, line = resolve_dtype_with_reason("auto", "cpu")
    assert dtype == expected and said in line
    assert line.startswith(f"train.dtype auto: {str(expected).removeprefix('torch.')} (")
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # an explicit name is taken as it is


@pytest.mark.skipif(not (X86 and Path("/proc/cpuinfo").exists()), reason="reads x86 flags from /proc/cpuinfo")
def test_native_bf16_agrees_with_the_kernels_cpu_flags():
    """In a process whose oneDNN is not limited (a developer may run the suite under
    ONEDNN_MAX_CPU_ISA to reproduce another CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    code = "from tinylm.precision import native_bf16; print(native_bf16('cpu')[0])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(bool({"avx512_bf16", "amx_bf16"} & cpu_flags()))


@pytest.mark.skipif(not X86, reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 limit")
def test_onednn_limited_to_avx2_resolves_auto_to_float32_and_makes_bfloat16_slow():
    """How a developer with a bfloat16 CPU reproduces a CPU without it: oneDNN limited to AVX2."""
    code = (
        "import torch; from tinylm.precision import resolve_dtype, bf16_cost; torch.set_num_threads(1); "
        "print(resolve_dtype('auto', 'cpu'), bf16_cost((512, 128, 344)))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    dtype, cost = out.stdout.split()
    assert dtype == "torch.float32"
    assert float(cost) > 2.0  # torch's reference bfloat16 matmul, against oneDNN's float32 kernel


def test_bf16_cost_is_measured_not_assumed(monkeypatch):
    """The ratio comes from timing both matmuls: a bfloat16 matmul made 50 ms slower shows it."""
    import time

    real_matmul = torch.Tensor.__matmul__

    def slow_bf16(a, b):
        if a.dtype == torch.bfloat16:
            time.sleep(0.05)
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", slow_bf16)
    assert bf16_cost((64, 64, 64)) > 10


def test_a_resume_that_would_resolve_to_another_dtype_is_refused(tmp_path):
    saved = Manifest(seed=0, dtype="bfloat16")
    check_resumable(saved, Manifest(seed=0, dtype="bfloat16"), tmp_path)
    check_resumable(Manifest(seed=0), Manifest(seed=0, dtype="float32"), tmp_path)  # not recorded then
    with pytest.raises(CheckpointError, match="autocast dtype.*'bfloat16'.*'float32'"):
        check_resumable(saved, Manifest(seed=0, dtype="float32"), tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_lowers_the_matmuls_but_not_the_parameters_or_the_loss(dtype):
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    ids = torch.randint(0, 64, (2, 9))
    reference = model(ids[:, :-1])
    with autocast("cpu", dtype):
        logits = model(ids[:, :-1])
        loss = cross_entropy(logits, ids[:, 1:])
    assert logits.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(logits.float(), reference, atol=0.1, rtol=0.05)
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    with autocast("cpu", torch.float32):
        assert model(ids[:, :-1]).dtype == torch.float32


def test_loss_scaler_follows_torch_grad_scaler_over_overflows_and_growth():
    """The same overflow sequence gives torch.amp.GradScaler's scales, growth tracker and state dict."""
    from tinylm.precision import LossScaler

    ours = LossScaler(enabled=True, init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    pattern = [False, True, False, False, False, False, True, True, False, False, False, False, False]
    for step, overflow in enumerate(pattern):
        gradient = torch.full((4,), float("inf") if overflow else 3.0)
        weight.grad = gradient * theirs.scale(torch.ones(()))
        theirs.unscale_(optimizer)
        theirs.step(optimizer)
        theirs.update()
        ours_grad = [gradient * ours.scale]
        ours.unscale_(ours_grad)
        if not overflow:
            torch.testing.assert_close(ours_grad[0], weight.grad, rtol=0, atol=0)
        ours.update(overflow)
        assert ours.state_dict() == theirs.state_dict(), f"step {step}"
    restored = LossScaler(enabled=True)
    restored.load_state_dict(theirs.state_dict())
    assert restored.state_dict() == theirs.state_dict()
    disabled = LossScaler(enabled=False)
    disabled.update(True)
    assert (
        disabled.scale == 1.0
        and disabled.state_dict() == {} == torch.amp.GradScaler("cpu", enabled=False).state_dict()
    )


# ---------------------------------------------------------------- the attention backend


def test_each_fused_attention_backend_is_timed_or_says_why_not_and_the_random_state_is_kept():
    from tinylm.precision import ATTENTION_BACKENDS, time_attention_backends

    state = torch.get_rng_state()
    times = time_attention_backends((2, 2, 32, 16), torch.float32, torch.device("cpu"), repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert list(times) == list(ATTENTION_BACKENDS)
    assert isinstance(times["FLASH_ATTENTION"], float) and times["FLASH_ATTENTION"] > 0  # the CPU has it
    for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):  # CUDA's only
        assert isinstance(times[name], str) and times[name], times


@pytest.fixture
def sdp_flags():
    flags = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    yield
    torch.backends.cuda.enable_flash_sdp(flags[0])
    torch.backends.cuda.enable_mem_efficient_sdp(flags[1])
    torch.backends.cuda.enable_cudnn_sdp(flags[2])


def test_the_fastest_runnable_backend_is_enabled_alone_beside_math(monkeypatch, sdp_flags):
    from tinylm import precision

    measured = {"FLASH_ATTENTION": 2e-3, "CUDNN_ATTENTION": 1e-3}
    measured["EFFICIENT_ATTENTION"] = "No available kernel"
    monkeypatch.setattr(precision, "time_attention_backends", lambda *args: measured)
    shape = (4, 12, 1024, 64)
    line = precision.choose_attention_backend(torch.device("cuda"), shape, torch.bfloat16, False)
    fastest = min((t, n) for n, t in measured.items() if isinstance(t, float))[1]
    assert line.startswith(f"attention: {fastest}, the fastest forward and backward at [4, 12, 1024, 64]")
    assert "EFFICIENT_ATTENTION cannot (No available kernel)" in line
    enabled = {
        "FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled(),
        "CUDNN_ATTENTION": torch.backends.cuda.cudnn_sdp_enabled(),
        "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled(),
    }
    assert enabled == {name: name == fastest for name in measured}
    assert torch.backends.cuda.math_sdp_enabled()


def test_no_measurement_on_the_cpu_or_with_deterministic_kernels(monkeypatch):
    from tinylm import precision

    def measured(*args):
        raise AssertionError("measured")

    monkeypatch.setattr(precision, "time_attention_backends", measured)
    shape, dtype = (4, 12, 1024, 64), torch.bfloat16
    assert precision.choose_attention_backend(torch.device("cpu"), shape, dtype, deterministic=False) is None
    line = precision.choose_attention_backend(torch.device("cuda"), shape, dtype, deterministic=True)
    assert "deterministic" in line
