"""Model FLOPs per token against torch's own FLOP counter, the GPU peak table, MFU and peak memory."""

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tinylm.flops import flops_per_token, matmul_weights
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.throughput import GPU_PEAK_FLOPS, gpu_entry, mfu, peak_flops


@pytest.mark.parametrize(
    "shape",
    [
        dict(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48),
        dict(vocab_size=300, context_length=24, d_model=48, num_layers=1, num_heads=2, d_ff=128),
    ],
)
def test_flops_per_token_equals_torch_flop_counter_over_a_training_step(shape):
    model = Transformer(**shape)
    model.set_fast_attention(False)  # explicit matmuls for the scores, which the counter sees as such
    ids = torch.randint(0, shape["vocab_size"], (2, shape["context_length"] + 1))
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
    tokens = 2 * shape["context_length"]
    assert counter.get_total_flops() == flops_per_token(shape) * tokens


@pytest.mark.parametrize(
    "shape",
    [
        dict(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48),
        dict(vocab_size=300, context_length=24, d_model=48, num_layers=1, num_heads=2, d_ff=128),
    ],
)
def test_matmul_weights_are_the_models_weight_matrices_but_the_embedding_table(shape):
    model = Transformer(**shape)
    matrices = [
        p for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith("token_embeddings")
    ]
    assert matmul_weights(shape) == sum(p.numel() for p in matrices)


def test_peak_flops_by_device_name_and_dtype(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cuda, torch.bfloat16, tf32=False) == 989e12
    assert peak_flops(cuda, torch.float32, tf32=True) == 494e12
    assert peak_flops(cuda, torch.float32, tf32=False) == 67e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(cuda, torch.float16, tf32=False) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert peak_flops(cuda, torch.bfloat16, tf32=True) is None  # no bf16 units
    assert peak_flops(cuda, torch.float32, tf32=True) == 15.7e12  # no TF32 either: plain float32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(cuda, torch.bfloat16, tf32=False) is None
    assert peak_flops(cuda, torch.bfloat16, tf32=False, override=5e14) == 5e14
    assert peak_flops(torch.device("cpu"), torch.float32, tf32=False) is None
    assert peak_flops(torch.device("cpu"), torch.float32, tf32=False, override=1e11) == 1e11


@pytest.mark.parametrize(
    "device_name, entry",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ],
)
def test_each_gpu_name_finds_its_own_row(device_name, entry):
    assert gpu_entry(device_name)[0] == entry
    # Every row is reached by some name (none is shadowed by an earlier, shorter pattern).
    assert {name for name, _, _ in GPU_PEAK_FLOPS} <= {
        gpu_entry(n)[0]
        for n in (
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 PCIe",
            "NVIDIA H100 NVL",
            "NVIDIA H200",
            "NVIDIA H200 NVL",
            "NVIDIA L4",
            "NVIDIA L40",
            "NVIDIA L40S",
            "NVIDIA A10",
            "NVIDIA A10G",
            "NVIDIA A100-SXM4-80GB",
            "Tesla V100-SXM2-16GB",
            "NVIDIA B200",
            "NVIDIA GeForce RTX 4090",
            "NVIDIA GeForce RTX 3090",
        )
    }
    assert gpu_entry("Some Future GPU") is None


def test_mfu_is_achieved_over_peak_of_all_devices():
    assert mfu(1000.0, 2e9, 1e13, num_devices=2) == pytest.approx(0.1)
    assert mfu(1000.0, 2e9, None, num_devices=1) is None


def test_peak_memory_on_the_cpu_is_the_peak_rss():
    # A fresh process touches and frees 1 GiB: the peak keeps it (less what was already resident).
    script = (
        "import torch; from tinylm.throughput import peak_memory_mib as p; cpu = torch.device('cpu'); "
        "before = p(cpu); block = torch.ones(2**28); del block; print(before, p(cpu))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert 800 <= after - before <= 1100


def test_step_meter_counts_training_steps_only():
    """Tokens/s come from the steps' own durations, whatever else (validation, checkpoints) took time."""
    import time

    from tinylm.throughput import StepMeter

    meter = StepMeter(
        tokens_per_step=1000,
        model_flops_per_token=6e6,
        peak_per_device=1e12,
        num_devices=2,
        device=torch.device("cpu"),
    )
    meter.add_step(0.5)
    time.sleep(0.2)  # a validation pass between the steps: not counted
    meter.add_step(1.5)
    line = meter.report(steps_left=10)
    assert line.startswith("1,000 tok/s MFU 0.3% ")  # 2 steps x 1000 tokens / 2.0 s; 1000 x 6e6 / 2e12
    assert line.endswith("ETA 10s")  # 10 steps x the mean step of 1.0 s
    meter.add_step(0.25)  # a new window: the rate since the previous report only
    assert meter.report(steps_left=0).startswith("4,000 tok/s")
    meter.restart()  # after the compiled first step: the first step is forgotten for the ETA too
    meter.add_step(2.0)
    assert meter.report(steps_left=3).endswith("ETA 6s")
