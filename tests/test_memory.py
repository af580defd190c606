"""tinylm.pretrain.memory: the memory plan against real models, real optimizer state, a real step's
peak resident memory and brute force; `pretrain --plan`, `grad_accum_steps: auto` and the refusal
of a run that does not fit."""

import dataclasses
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import ROOT, pretrain, write_tiny_config

from tinylm.checkpoint import Manifest
from tinylm.config import TrainConfig, from_dict
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.pretrain import memory
from tinylm.pretrain.memory import plan_memory, smallest_fitting_accumulation, step_memory
from tinylm.pretrain.optimizer import build_optimizer
from tinylm.tokenizer import Tokenizer

SHAPE = dict(vocab_size=300, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=176)


def train_config(**keys) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **{"world_size": 1, "batch_size": 8, **keys})


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_parameters_gradients_and_optimizer_state_are_those_of_a_real_model_after_a_step(optimizer):
    config = {**SHAPE, "tie_embeddings": True, "value_embeddings": True}
    train = train_config(optimizer=optimizer)
    plan = plan_memory(config, train, 1)
    model = Transformer(**config)
    opt = build_optimizer(model, train, world_size=1)
    ids = torch.randint(0, 300, (2, 33))
    cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.local_state().values()
        for name, t in s.items()
        if isinstance(t, torch.Tensor) and name != "step"
    )
    assert plan.parts["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert plan.parts["gradients"] == sum(p.grad.numel() * 4 for p in model.parameters())
    assert plan.parts["optimizer"] == state_bytes


def test_views_and_aliases_count_no_new_bytes():
    """The counter against a brute-force count of the distinct storages (by data pointer) that the
    tensors made inside it hold: views, a detach, an in-place op and a reshape that must copy."""
    base = torch.ones(64, 32)  # made before: its views count nothing
    with memory._LiveBytes() as tracker:
        a = torch.ones(256, 128)
        made = [a, a.t(), a.view(-1), a.detach(), a[1:], a.mul_(2), a.t().reshape(-1), base.t(), base + 1]
        ours = made[:-2] + made[-1:]  # base.t() is a view of a storage made before
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ours}
        assert tracker.live == tracker.peak == sum(storages.values())
        del made, ours, a
        assert tracker.live == 0


def test_the_step_estimate_covers_the_bytes_a_real_step_holds():
    """The fake step against the same step on real tensors, counted the same way: never below it,
    and at most a quarter above (fake tensors are freed a little later than real ones)."""
    torch.manual_seed(0)
    model = Transformer(**SHAPE)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, 300, (8, 33))
    with memory._LiveBytes() as tracker:
        logits = model(ids[:, :-1])
        loss = cross_entropy(logits, ids[:, 1:])
        del logits
        loss.backward()
        del loss
    assert tracker.peak <= step_memory(SHAPE, 8, torch.float32, "none").peak <= 1.25 * tracker.peak
    full = step_memory(SHAPE, 8, torch.float32, "full").peak
    assert full < step_memory(SHAPE, 8, torch.float32, "selective").peak < tracker.peak


def _allocator_peak(events, heap_below: int) -> tuple[int, int]:
    """(the most bytes torch's CPU allocator held at once, of them those in allocations below
    `heap_below` bytes), from a profile's allocation events."""
    from torch._C._profiler import _EventType  # the profiler's event tree: its allocation records

    allocations, stack = [], list(events.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    sizes, live, heap, peak, heap_at_peak = {}, 0, 0, 0, 0
    for _, size, ptr in sorted(allocations):
        if size > 0:
            sizes[ptr] = size
        else:  # a free is a negative size
            size = -sizes.pop(ptr, -size)
        live += size
        heap += size if abs(size) < heap_below else 0
        if live > peak:
            peak, heap_at_peak = live, heap
    return peak, heap_at_peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_the_step_estimate_is_the_peak_torchs_allocator_sees(dtype, activation_checkpointing, monkeypatch):
    """The fake step's peak against the real step's as torch's CPU allocator records it (every
    allocation, kernels' scratch included; torch.profiler with profile_memory): equal within 2 % (the
    kernels' few scalars beside the peak are a few bytes). Without checkpointing, also the part of
    the peak in allocations below glibc's mmap ceiling (set low here, so that the small step has
    allocations on both sides of it)."""
    monkeypatch.setattr(memory, "GLIBC_MMAP_CEILING", 256 * 1024)
    shape = {**SHAPE, "context_length": 64, "d_model": 128, "d_ff": 344}
    torch.manual_seed(0)
    model = Transformer(**shape)
    model.set_activation_checkpointing(activation_checkpointing)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, 300, (8, 65))
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        del loss
    real, real_heap = _allocator_peak(prof.profiler.kineto_results, 256 * 1024)
    planned = step_memory(shape, 8, dtype, activation_checkpointing)
    assert 0 < real_heap < real
    assert 0.98 * real <= planned.peak <= 1.02 * real, (planned, real)
    if activation_checkpointing == "none":  # recomputation frees its tensors at other moments
        assert 0.98 * real_heap <= planned.heap_at_peak <= 1.02 * real_heap, (planned, real_heap)


@pytest.mark.slow
def test_the_plan_covers_a_real_runs_peak_resident_memory_by_at_most_30_percent(tiny_data, tmp_path):
    """A pretrain run where activations dominate (micro-batch 32 x 256), under glibc's default
    allocator: rank 0's peak RSS from the log against the plan's total from `pretrain --plan`.

    The RSS holds the tensors and the free chunks glibc's heap keeps for reuse (the plan's allocator
    line); the plan must not promise less than the run takes, and not much more."""
    config = write_tiny_config(
        tmp_path / "c.yaml",
        model={"context_length": 256, "d_model": 128, "num_layers": 3, "num_heads": 4, "d_ff": 344},
        train={"world_size": 1, "batch_size": 32, "max_iters": 8, "dtype": "auto"},
    )
    planned = pretrain(tiny_data, config, tmp_path / "plan_state", extra=("--plan",))
    assert planned.returncode == 0, planned.stderr
    number, unit = re.search(r"\] +total +([\d.]+) (GiB|MiB)", planned.stderr).groups()
    total_mib = float(number) * (1024 if unit == "GiB" else 1)
    assert re.search(r"\] +allocator +[\d.]+ MiB", planned.stderr)  # the CPU's plan counts glibc's heap
    assert not (tmp_path / "plan_state").exists()  # --plan trains nothing
    run = pretrain(tiny_data, config, tmp_path / "state")
    assert run.returncode == 0, run.stderr
    assert "memory plan per rank" in run.stderr  # the log's header has it too
    peak_mib = float(re.findall(r"peak mem ([\d,]+) MiB", run.stderr)[-1].replace(",", ""))
    assert 1.0 <= total_mib / peak_mib <= 1.3, (total_mib, peak_mib)


def test_the_smallest_fitting_accumulation_is_the_brute_force_one(monkeypatch):
    train = train_config(batch_size=48)
    plans = {
        a: plan_memory(SHAPE, dataclasses.replace(train, grad_accum_steps=a), 1) for a in (1, 2, 3, 4, 6)
    }
    budget = (plans[3].total + plans[4].total) // 2  # 3 does not fit, 4 does
    monkeypatch.setattr(memory, "device_memory", lambda device: (budget, None))
    assert plans[1].total > plans[3].total > budget > plans[4].total
    assert smallest_fitting_accumulation(SHAPE, train, 1, "cpu") == min(
        a for a in range(1, 49) if 48 % a == 0 and plans.get(a, plans[6]).total <= budget
    )
    plan = plan_memory(SHAPE, train, 1)
    assert re.fullmatch(
        r"needs [\d.]+ (G|M)iB of [\d.]+ (G|M)iB on cpu: set train\.activation_checkpointing: full or "
        r"train\.grad_accum_steps: 4",
        plan.problem(),
    ) or re.fullmatch(r"needs .* on cpu: set train\.grad_accum_steps: 4", plan.problem())
    monkeypatch.setattr(memory, "device_memory", lambda device: (10, None))
    assert smallest_fitting_accumulation(SHAPE, train, 1, "cpu") is None
    assert (
        "does not fit even with train.grad_accum_steps at the per-rank batch (48)"
        in plan_memory(SHAPE, train, 1).problem()
    )


def test_weights_and_optimizer_state_that_do_not_fit_are_refused_without_tracing_a_step(monkeypatch):
    """A model whose float32 weights, gradients and AdamW moments (16 bytes a parameter) exceed the
    device is refused from those alone: the fake step, which takes minutes at such sizes, never runs."""
    from tinylm.pretrain.memory import named_device

    def no_trace(*args, **kwargs):
        raise AssertionError("the step was traced")

    monkeypatch.setattr(memory, "step_memory", no_trace)
    shape = dict(SHAPE, d_model=8192, num_heads=64, d_ff=22016, num_layers=48)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Transformer(**shape).parameters())
    device = named_device("l4-24gb", 1)
    assert 16 * parameters > device.available
    plan = plan_memory(shape, train_config(), 1, device)
    assert not plan.fits() and not plan.traced and plan.total == 16 * parameters
    assert re.match(
        rf"needs at least {16 * parameters / 2**30:.2f} GiB of [\d.]+ GiB on l4-24gb", plan.problem()
    )
    assert "does not fit even with" in plan.problem()
    assert any("not planned" in line for line in plan.lines())
    with pytest.raises(AssertionError, match="the step was traced"):  # state that fits: the step is traced
        plan_memory(SHAPE, train_config(), 1, device)


def test_a_run_that_does_not_fit_is_refused_before_launch_and_auto_says_why(tiny_data, tmp_path):
    # 1.6 billion parameters: with their gradients and AdamW's moments more than this machine holds.
    huge = {"context_length": 2048, "d_model": 4096, "num_layers": 8, "num_heads": 32, "d_ff": 11008}
    config = write_tiny_config(tmp_path / "c.yaml", model=huge, train={"world_size": 1, "batch_size": 64})
    planned = pretrain(tiny_data, config, tmp_path / "p", extra=("--plan",))
    assert planned.returncode == 1
    line = planned.stderr.strip().splitlines()[-1]
    assert line.startswith("tinylm pretrain: error: the run does not fit in memory: needs ")
    refused = pretrain(tiny_data, config, tmp_path / "state")
    assert refused.returncode == 1 and "the run does not fit in memory" in refused.stderr
    assert "step 1/" not in refused.stderr and not list((tmp_path / "state").glob("step_*"))
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["grad_accum_steps"] = "auto"
    config.write_text(yaml.safe_dump(cfg))
    auto = pretrain(tiny_data, config, tmp_path / "auto", extra=("--plan",))
    assert auto.returncode == 1
    assert "train.grad_accum_steps: auto: needs " in auto.stderr
    assert "does not fit even with train.grad_accum_steps at the per-rank batch (64)" in auto.stderr


@pytest.mark.slow
def test_auto_accumulation_is_said_kept_on_resume_and_trains_the_same_tokens(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "c.yaml", train={"grad_accum_steps": "auto"})
    first = pretrain(tiny_data, config, tmp_path / "state", fault="rank=1,step=9,action=kill")
    assert "train.grad_accum_steps auto: 1 (the fewest that fit)" in first.stderr
    resumed = pretrain(tiny_data, config, tmp_path / "state")
    assert resumed.returncode == 0, resumed.stderr
    assert "train.grad_accum_steps auto: 1 (the run's own, resumed)" in resumed.stderr


def test_bad_values_are_named():
    for value, words in [
        ("some", "train.grad_accum_steps: 'some' is not a number nor one of ['auto']"),
        (0, "train.grad_accum_steps: 0 is out of range"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            from_dict({"train": {"grad_accum_steps": value}})
    with pytest.raises(ValueError, match=r"train.activation_checkpointing: 'some' is not one of"):
        from_dict({"train": {"activation_checkpointing": "some"}})


def test_the_plan_of_the_cli_has_a_total_line_and_trains_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", "pretrain", "--plan"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "planned with the config's vocabulary: tokenizer.vocab_size 4,096" in proc.stderr
    assert re.search(r"\] +total +[\d.]+ (GiB|MiB)", proc.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", "pretrain", "--plan", "--tokenizer", "/nonexistent/tokenizer.json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1 and "/nonexistent/tokenizer.json" in proc.stderr  # a file given must exist


def plan_cli(capsys, monkeypatch, folder, *argv) -> tuple[int, str]:
    """`python -m tinylm pretrain --plan ...` in `folder` (in this process), its exit code and stderr."""
    from tinylm.__main__ import main

    monkeypatch.chdir(folder)
    code = main(["pretrain", "--plan", *map(str, argv)])
    return code, capsys.readouterr().err


def test_the_plan_works_from_the_config_alone_and_counts_the_model(tmp_path, capsys, monkeypatch, tiny_lm):
    config = write_tiny_config(tmp_path / "c.yaml", tokenizer={"vocab_size": 512})
    # Another run's tokenizer of 320 entries where the default run's would be: never read.
    (tmp_path / "results" / "tokenizer").mkdir(parents=True)
    shutil.copy(tiny_lm["tokenizer"], tmp_path / "results" / "tokenizer" / "tokenizer.json")
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config)
    assert code == 0, err
    assert "[pretrain] planned with the config's vocabulary: tokenizer.vocab_size 512" in err
    cfg = from_dict(yaml.safe_load(config.read_text()))
    model = Transformer(vocab_size=512, **dataclasses.asdict(cfg.model))  # a real one, by another path
    parameters = sum(p.numel() for p in model.parameters())
    # Model FLOPs by brute force over the real weights: 6 per weight of every matrix that multiplies
    # (all 2-D weights but the embedding table), and the attention scores and their sum over values.
    matmul = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "token_embeddings" not in name
    )
    m = cfg.model
    flops = 6 * matmul + 12 * m.num_layers * m.d_model * m.context_length
    assert f"[pretrain] model: {parameters:,} parameters; {flops:.3g} training FLOPs per token" in err
    assert "memory plan per rank" in err
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["tokenizer"]  # nothing written
    # A tokenizer given explicitly: its vocabulary, said so.
    tokenizer = tiny_lm["tokenizer"]
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--tokenizer", tokenizer)
    assert code == 0, err
    vocab = len(Tokenizer.load(tiny_lm["tokenizer"]).vocab)
    assert f"[pretrain] planned with the vocabulary of {tiny_lm['tokenizer']}: {vocab:,} tokens" in err
    with_vocab = Transformer(vocab_size=vocab, **dataclasses.asdict(cfg.model))
    assert f"model: {sum(p.numel() for p in with_vocab.parameters()):,} parameters" in err


def test_a_plan_for_a_named_gpu_chooses_its_accumulation_there(tmp_path, capsys, monkeypatch):
    # Context 4,096 and a GPT-2 vocabulary: 16 sequences' logits and activations outgrow a 24 GB card.
    model = {"context_length": 4096, "d_model": 1024, "num_layers": 2, "num_heads": 16, "d_ff": 2816}
    train = {"world_size": 1, "batch_size": 16, "grad_accum_steps": "auto", "dtype": "auto"}
    config = write_tiny_config(tmp_path / "c.yaml", tokenizer={"vocab_size": 50304}, model=model, train=train)
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--plan-device", "l4-24gb")
    assert code == 0, err
    assert "  l4-24gb has 22.35 GiB" in err  # 24 GB as sold
    assert "framework    500.0 MiB" in err  # the CUDA context's estimate, not this process's memory
    chosen = int(re.search(r"train.grad_accum_steps auto: (\d+) \(the fewest that fit\)", err).group(1))
    # Brute force: the smallest divisor of the batch whose plan on that device fits.
    cfg = from_dict(yaml.safe_load(config.read_text()))
    device = memory.named_device("l4-24gb", 1)
    model_config = {"vocab_size": 50304, **dataclasses.asdict(cfg.model)}

    def fits(a):
        return plan_memory(model_config, dataclasses.replace(cfg.train, grad_accum_steps=a), 1, device).fits()

    assert chosen == min(a for a in range(1, 17) if 16 % a == 0 and fits(a)) > 1
    assert "micro-batch" in err and f"micro-batch {16 // chosen} x 4096" in err
    # bf16 on a GPU that has it: the activations of the bf16 step, not float32's.
    bf16 = plan_memory(model_config, dataclasses.replace(cfg.train, grad_accum_steps=chosen), 1, device)
    fp32 = plan_memory(
        model_config, dataclasses.replace(cfg.train, grad_accum_steps=chosen, dtype="float32"), 1, device
    )
    assert bf16.parts["activations"] < fp32.parts["activations"]
    micro = 16 // chosen
    assert bf16.parts["activations"] == step_memory(model_config, micro, torch.bfloat16, "none", "cuda").peak
    # The loss in a GPU's chunks of rows (256 MiB of float32), not the CPU's 1 MiB: more memory.
    wide = {**SHAPE, "vocab_size": 8192, "context_length": 256}
    on_gpu = step_memory(wide, 8, torch.bfloat16, "none", "cuda").peak
    on_cpu = step_memory(wide, 8, torch.bfloat16, "none", "cpu").peak
    assert on_gpu > on_cpu + 32 * 2**20  # one float32 chunk of all 2,048 rows against 1 MiB ones
    assert "one update (65,536 tokens) on 1 x l4-24gb: at least" in err and "(121 TFLOP/s each)" in err

    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--plan-device", "x100-1gb")
    assert code == 1 and "--plan-device 'x100-1gb': not a device this plan knows; one of b200-180gb" in err
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--plan-device", "cpu:lots")
    assert code == 1 and "a CPU is named cpu:<GB of RAM>, e.g. cpu:64gb" in err


def test_the_plan_of_a_run_to_resume_uses_its_own_accumulation(tmp_path, capsys, monkeypatch):
    from helpers import small_checkpoint

    from tinylm.pretrain.state import commit

    config = write_tiny_config(tmp_path / "c.yaml", train={"grad_accum_steps": "auto"})
    commit(tmp_path / "state", 4, small_checkpoint(4), Manifest(grad_accum_steps=2))
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--state-dir", tmp_path / "state")
    assert code == 0, err
    assert "train.grad_accum_steps auto: 2 (the run's own, resumed)" in err
    code, err = plan_cli(capsys, monkeypatch, tmp_path, "--config", config, "--state-dir", tmp_path / "fresh")
    assert code == 0 and "train.grad_accum_steps auto: 1 (the fewest that fit)" in err
