"""What only a CUDA device can show; every test here skips on a machine without one.

Run with the GPU bench as one prepared script: `bash bench/gpu_session.sh`. The CPU tests cover the
same code paths wherever the CPU can run them.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import pretrain as helpers_pretrain
from helpers import write_tiny_config

from tinylm.pretrain.steps import committed_steps, step_dir
from tinylm.throughput import peak_flops

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pretrain(data: dict, config: Path, state: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return helpers_pretrain(data, config, state, fault, timeout=600)


def final(state: Path) -> dict:
    payload = torch.load(
        step_dir(state, committed_steps(state)[-1]) / "checkpoint.pt", map_location="cpu", weights_only=True
    )
    return payload


def test_bf16_compiled_training_on_one_gpu(tiny_data, tmp_path):
    config = write_tiny_config(
        tmp_path / "c.yaml",
        train={"world_size": 1, "compile": True, "deterministic": False, "dtype": "bfloat16"},
    )
    proc = pretrain(tiny_data, config, tmp_path / "state")
    assert proc.returncode == 0, proc.stderr
    assert "device cuda, autocast bfloat16 (parameters float32)" in proc.stderr  # really bf16 on the GPU
    assert "torch.compile: the first step took" in proc.stderr
    assert "peak mem" in proc.stderr
    if peak_flops(torch.device("cuda", 0), torch.bfloat16, tf32=True) is not None:
        assert "MFU" in proc.stderr  # a GPU of the peak table
    payload = final(tmp_path / "state")
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in payload["model"].values())
    losses = [
        float(line.split(" loss ")[1].split()[0]) for line in proc.stderr.splitlines() if "/12 loss" in line
    ]
    assert losses[-1] < losses[0] - 0.5


def test_killed_and_resumed_cuda_run_is_bit_identical_under_deterministic(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "c.yaml", train={"world_size": 1, "dtype": "bfloat16"})
    full = pretrain(tiny_data, config, tmp_path / "full")
    assert full.returncode == 0, full.stderr
    crashed = pretrain(tiny_data, config, tmp_path / "resumed", fault="rank=0,step=9,action=kill")
    assert crashed.returncode != 0 and committed_steps(tmp_path / "resumed") == [4, 8]
    resumed = pretrain(tiny_data, config, tmp_path / "resumed")  # the CUDA resume path: RNG states, moments
    assert resumed.returncode == 0, resumed.stderr
    a, b = final(tmp_path / "full"), final(tmp_path / "resumed")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][name]), (index, name)


def test_device_count_rules_with_the_real_count():
    from tinylm.parallel.launch import resolve_backend

    count = torch.cuda.device_count()
    assert resolve_backend("auto", count)[0] == "nccl"
    assert resolve_backend("auto", count + 1)[0] == "gloo"
    with pytest.raises(ValueError, match=f"need {count + 1} CUDA devices, but it has {count}"):
        resolve_backend("nccl", count + 1)


def test_at_most_one_host_sync_per_step(tiny_data, tmp_path):
    """torch's sync debug mode warns at every synchronizing call; count them over 10 and 20 steps."""
    counts = []
    for steps in (10, 20):
        config = write_tiny_config(
            tmp_path / f"c{steps}.yaml",
            train={
                "world_size": 1,
                "max_iters": steps,
                "checkpoint_interval": steps,
                "val_interval": steps,
                "log_interval": 1000,
                "warmup_iters": 2,
            },
        )
        script = textwrap.dedent(f"""
            import warnings, torch
            from tinylm.config import load_config
            from tinylm.pretrain import train
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train(load_config({str(config)!r}), {str(tiny_data["tokenizer"])!r},
                      {str(tiny_data["train"])!r}, {str(tiny_data["valid"])!r},
                      {str(tmp_path / f"s{steps}")!r}, {str(tmp_path / f"k{steps}")!r})
            print(sum("synchroniz" in str(w.message) for w in caught))
        """)
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        counts.append(int(proc.stdout.strip().splitlines()[-1]))
    assert counts[1] - counts[0] <= 10, counts  # 10 more steps cost at most 10 more syncs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_ddp_and_sharded_optimizer_match_one_gpu(tiny_data, tmp_path):
    losses = {}
    for world_size in (1, 2):
        config = write_tiny_config(
            tmp_path / f"w{world_size}.yaml",
            train={"world_size": world_size, "backend": "nccl", "dtype": "float32", "shard_optimizer": True},
        )
        proc = pretrain(tiny_data, config, tmp_path / f"s{world_size}")
        assert proc.returncode == 0, proc.stderr
        losses[world_size] = [
            line.split(" loss ")[1].split()[0] for line in proc.stderr.splitlines() if "/12 loss" in line
        ]
    assert len(losses[1]) == 12
    assert all(abs(float(a) - float(b)) < 1e-4 for a, b in zip(losses[1], losses[2], strict=True))


def test_compiled_blocks_run_their_matmuls_in_bf16_on_the_gpu():
    """Each Transformer block compiled as the trainer does it, under bf16 autocast: the logits are
    bf16, the compiled block rounds as bf16 matmuls do, the parameters and their gradients stay
    float32, and the compiled model matches the eager one within bf16 rounding."""
    from tinylm.model import Transformer
    from tinylm.nn_utils import cross_entropy
    from tinylm.precision import autocast

    torch.manual_seed(0)
    eager = Transformer(
        vocab_size=512, context_length=64, d_model=128, num_layers=2, num_heads=4, d_ff=256, device="cuda"
    )
    compiled = Transformer(
        vocab_size=512, context_length=64, d_model=128, num_layers=2, num_heads=4, d_ff=256, device="cuda"
    )
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    ids = torch.randint(0, 512, (4, 65), device="cuda")
    losses = []
    for model in (eager, compiled):
        with autocast(torch.device("cuda"), torch.bfloat16):
            logits = model(ids[:, :-1])
        assert logits.dtype == torch.bfloat16
        loss = cross_entropy(logits, ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in compiled.parameters())
    assert abs(losses[0] - losses[1]) < 2e-2
    # The residual stream stays float32 (a block adds its bf16 branches to it), so a block's own
    # output shows its matmuls' dtype only by its rounding: under autocast the compiled block departs
    # from the float32 block as far as the eager bf16 block does, where float32 matmuls would agree.
    x = torch.randn(4, 64, 128, device="cuda")
    with torch.no_grad():
        exact = eager.layers[0](x)
        with autocast(torch.device("cuda"), torch.bfloat16):
            eager_bf16, compiled_bf16 = eager.layers[0](x), compiled.layers[0](x)
    assert exact.dtype == eager_bf16.dtype == compiled_bf16.dtype == torch.float32
    bf16_rounding = (eager_bf16 - exact).abs().max().item()
    assert bf16_rounding > 1e-3
    assert (compiled_bf16 - exact).abs().max().item() > bf16_rounding / 4


def test_float16_overflow_is_skipped_and_lowers_the_scale_on_the_gpu(tiny_data, tmp_path):
    config = write_tiny_config(
        tmp_path / "c.yaml", train={"world_size": 1, "dtype": "float16", "deterministic": False}
    )
    proc = pretrain(tiny_data, config, tmp_path / "state", fault="rank=0,step=5,action=overflow")
    assert proc.returncode == 0, proc.stderr
    assert "step 6: float16 gradients overflowed; update skipped, loss scale now 32768" in proc.stderr
    payload = final(tmp_path / "state")
    assert payload["grad_scaler"]["scale"] == 32768.0


def test_muon_matches_torch_muon_on_cuda_and_a_muon_run_trains(tiny_data, tmp_path):
    """Our Muon (with AdamW beside it) against torch.optim.Muon + AdamW on the GPU for 100 steps,
    then a Muon pretrain run on CUDA (bf16 autocast, blocks compiled) that learns."""
    import copy

    from tinylm.model import Transformer
    from tinylm.muon import Muon
    from tinylm.nn_utils import cross_entropy

    config = dict(vocab_size=50, context_length=8, d_model=64, num_layers=2, num_heads=2, d_ff=96)
    torch.manual_seed(0)
    ours_model = Transformer(**config, device="cuda")
    torch_model = copy.deepcopy(ours_model)

    def split(model):
        named = list(model.named_parameters())
        return (
            [p for n, p in named if n.startswith("layers.") and p.dim() == 2],
            [p for n, p in named if not (n.startswith("layers.") and p.dim() == 2)],
        )

    adamw = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}  # torch's AdamW decays 0.01 by default
    matrices, others = split(ours_model)
    ours = [Muon([{"params": matrices}, {"params": others, "use_muon": False, **adamw}], lr=0.02)]
    torch_matrices, torch_others = split(torch_model)
    theirs = [
        torch.optim.Muon(torch_matrices, lr=0.02),
        torch.optim.AdamW(torch_others, **adamw, foreach=True),
    ]
    for model, optimizers in ((ours_model, ours), (torch_model, theirs)):
        g = torch.Generator().manual_seed(1)
        for _ in range(100):
            tokens = torch.randint(
                0, config["vocab_size"], (4, config["context_length"] + 1), generator=g
            ).cuda()
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            loss.backward()
            for o in optimizers:
                o.step()
    for (name, p), q in zip(ours_model.named_parameters(), torch_model.parameters(), strict=True):
        err = ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
        assert err <= 1e-6, f"{name}: relative difference {err:.2e}"

    cfg = write_tiny_config(
        tmp_path / "config.yaml",
        train={"optimizer": "muon", "world_size": 1, "dtype": "bfloat16", "compile": True},
    )
    proc = pretrain(tiny_data, cfg, tmp_path / "state")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final(tmp_path / "state")["optimizer"]["param_groups"][0]["use_muon"] is True


def test_activation_checkpointing_on_cuda_saves_memory_and_keeps_the_gradients():
    """Deterministic kernels, bf16 autocast: every mode gives the same gradients bit for bit, and
    full recomputation peaks lower than none (torch.cuda.max_memory_allocated)."""
    from tinylm.model import Transformer
    from tinylm.nn_utils import cross_entropy
    from tinylm.precision import configure_kernels

    device = torch.device("cuda", 0)
    configure_kernels(device, deterministic=True)
    torch.manual_seed(0)
    model = Transformer(
        vocab_size=8192, context_length=512, d_model=256, num_layers=6, num_heads=4, d_ff=688, device=device
    )
    ids = torch.randint(0, 8192, (8, 513), device=device)
    grads, peaks = {}, {}
    for mode in ("none", "selective", "full"):
        model.set_activation_checkpointing(mode)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        cross_entropy(logits, ids[:, 1:]).backward()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated(device)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[mode], strict=True)), mode
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def test_the_memory_plan_covers_max_memory_allocated_within_30_percent():
    """The plan's tensors (parameters, gradients, AdamW's state, one micro-batch's step: its total
    without the CUDA context) against torch.cuda.max_memory_allocated over three training steps of
    the path the trainer takes (bf16 autocast, the loss region, the fused loss and AdamW), with and
    without full activation checkpointing."""
    from tinylm.config import from_dict
    from tinylm.model import Transformer
    from tinylm.optim import AdamW
    from tinylm.pretrain.memory import plan_memory

    device = torch.device("cuda", 0)
    shape = dict(vocab_size=8192, context_length=512, d_model=256, num_layers=6, num_heads=4, d_ff=688)
    for mode in ("none", "full"):
        keys = {"world_size": 1, "batch_size": 16, "dtype": "bfloat16", "activation_checkpointing": mode}
        train = from_dict({"train": keys}).train
        plan = plan_memory(shape, train, 1, device)
        planned = plan.total - plan.parts["framework"]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        model = Transformer(**shape, device=device)
        model.set_activation_checkpointing(mode)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # as DDP's buckets hold them, allocated before the first step
        optimizer = AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 8192, (16, 513), device=device)
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[:, :-1], targets=ids[:, 1:])
            loss.backward()
            del loss
            optimizer.step()
            model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - ids.numel() * 8
        del model, optimizer, ids
        assert 1.0 <= planned / peak <= 1.3, (mode, planned / 2**20, peak / 2**20)


# ------------------------------------------------------------------------------------------------
# The fast paths outside the blocks, on the device where they are the default (the CPU tests hold
# each to ours with the path forced on: tests/test_nn_utils.py, test_optim.py, test_model.py).


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_cross_entropy_on_cuda_is_ours_up_to_rounding(dtype):
    from tinylm.nn_utils import cross_entropy

    torch.manual_seed(0)
    logits = (torch.randn(8, 128, 50304, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, 50304, (8, 128), device="cuda")
    results = []
    for fused in (True, False):
        leaf = logits.clone().requires_grad_()
        loss = cross_entropy(leaf, targets, fused=fused)
        loss.backward()
        results.append((loss, leaf.grad))
    (loss, grad), (reference_loss, reference_grad) = results
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(grad.double(), reference_grad.double(), rtol=4 * ulp, atol=ulp / (8 * 128))


def test_fused_adamw_and_multi_tensor_clip_on_cuda_are_ours_up_to_rounding():
    import copy

    from tinylm.model import Transformer
    from tinylm.nn_utils import cross_entropy, squared_norms
    from tinylm.optim import AdamW, cos_lr_scheduler, param_groups

    torch.manual_seed(0)
    model = Transformer(vocab_size=256, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=160)
    model = model.cuda()
    twin = copy.deepcopy(model)
    fused = AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))  # the CUDA default: fused
    ours = AdamW(param_groups(twin, 0.1), lr=1e-2, betas=(0.9, 0.95), fused=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    for it in range(20):
        ids = torch.randint(0, 256, (4, 33), device="cuda", generator=g)
        for opt in (fused, ours):
            for group in opt.param_groups:
                group["lr"] = cos_lr_scheduler(it, 4, 20, 1e-3, 1e-2)
        model.zero_grad(set_to_none=True)
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
        grads = [p.grad for p in model.parameters()]
        torch.testing.assert_close(
            squared_norms(grads, torch.device("cuda")),  # the CUDA default: one multi-tensor norm
            squared_norms(grads, torch.device("cuda"), fused=False),
            rtol=1e-5,
            atol=0,
        )
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.grad = p.grad.clone()
        fused.step()
        ours.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert fused.state[p]["step"].device.type == "cpu"
        scale = q.detach().abs().max()
        assert (p.detach() - q.detach()).abs().max() <= 1e-5 * scale


def test_the_optimizer_step_and_the_clip_do_not_sync_with_the_host():
    from tinylm.model import Transformer
    from tinylm.nn_utils import cross_entropy, gradient_clip
    from tinylm.optim import AdamW, param_groups

    model = Transformer(
        vocab_size=256, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=160
    ).cuda()
    optimizer = AdamW(param_groups(model, 0.1), lr=1e-3)
    ids = torch.randint(0, 256, (4, 33), device="cuda")
    for _ in range(2):  # the first step creates the state
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gradient_clip(model.parameters(), 1.0)
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.zero_grad(set_to_none=True)


def test_rms_norm_on_cuda_is_the_formula_up_to_rounding():
    from tinylm.model.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(768).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768) * 0.3 + 1)
    x = (torch.randn(16, 1024, 768, device="cuda") * 3).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = norm(x)
    wide = x.float()
    formula = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    torch.testing.assert_close(ours, formula, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (x, norm.weight), upstream)
    expected = torch.autograd.grad(formula, (x, norm.weight), upstream)
    for mine, theirs in zip(grads, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_the_compiled_loss_region_has_no_graph_break_and_is_the_eager_loss():
    import torch._dynamo

    from tinylm.model import Transformer
    from tinylm.pretrain.loop import compile_model

    torch.manual_seed(0)
    model = Transformer(
        vocab_size=50304,
        context_length=128,
        d_model=256,
        num_layers=1,
        num_heads=4,
        d_ff=512,
        logit_softcap=15.0,
    ).cuda()
    hidden = torch.randn(4, 128, 256, device="cuda")
    targets = torch.randint(0, 50304, (4, 128), device="cuda")
    eager = model.output_loss
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(model, 2, torch.device("cuda"))  # under DDP: the blocks, and the loss region alone
    losses = []
    for region in (model.output_loss, eager):
        leaf = hidden.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = region(leaf, targets)
        loss.backward()
        losses.append((loss, leaf.grad))
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(losses[0][1], losses[1][1], rtol=2e-2, atol=1e-5)


def test_on_one_gpu_the_whole_model_is_one_graph_and_trains_as_eager():
    """At world size 1 compile_model compiles the model with its loss whole: no graph break, and the
    loss and gradients of the eager model up to rounding."""
    import torch._dynamo

    from tinylm.model import Transformer
    from tinylm.pretrain.loop import compile_model

    torch.manual_seed(0)
    shape = dict(vocab_size=1024, context_length=64, d_model=128, num_layers=2, num_heads=4, d_ff=256)
    eager, compiled = Transformer(**shape).cuda(), Transformer(**shape).cuda()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(compiled, 1, torch.device("cuda"))
    ids = torch.randint(0, 1024, (4, 65), device="cuda")
    results = []
    for model in (compiled, eager):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-3, atol=1e-3)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=1e-3)


def test_the_measured_attention_backend_runs_the_training_shape_and_computes_attention():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tinylm.precision import choose_attention_backend

    device, shape = torch.device("cuda"), (4, 12, 1024, 64)
    flags = [getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in ("flash", "mem_efficient", "cudnn")]
    try:
        line = choose_attention_backend(device, shape, torch.bfloat16, deterministic=False)
        assert line.startswith("attention: ") and " ms" in line, line
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
        chosen = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(SDPBackend.MATH):
            reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        torch.testing.assert_close(chosen.float(), reference, rtol=2e-2, atol=2e-2)
    finally:
        for name, flag in zip(("flash", "mem_efficient", "cudnn"), flags, strict=True):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(flag)
