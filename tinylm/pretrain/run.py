"""`train()`: every check that can fail before training, the resume rule, the launch, publishing.

Checks run in the launching process, so that a bad file or value is one clear error rather than
one per rank; then `launch` starts one `train_rank` per rank (mp.spawn, or in place under
torchrun), and rank 0 publishes the committed steps. A killed run resumes from its newest
committed step, bit-identically at the same world size.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint import Manifest
from tinylm.config import Config, config_hash, run_hash, weight_config
from tinylm.config.lineage import mixture_order
from tinylm.data import load_tokens, micro_batch_size
from tinylm.flops import flops_per_token
from tinylm.io import sha256_file
from tinylm.model import Transformer
from tinylm.parallel import launch
from tinylm.parallel.comm_plan import Link, default_link, plan_communication
from tinylm.parallel.launch import is_global_rank0, ranks_on_this_machine, resolve_backend
from tinylm.precision import bf16_cost, dtype_name, native_bf16, resolve_dtype_with_reason
from tinylm.pretrain.init import Init, find_init
from tinylm.pretrain.lock import StateLock
from tinylm.pretrain.log import log_line, set_run_name
from tinylm.pretrain.loop import RunSpec, train_rank
from tinylm.pretrain.memory import PlanDevice, local_device, plan_memory, smallest_fitting_accumulation
from tinylm.pretrain.optimizer import parameter_specs
from tinylm.pretrain.publish import check_checkpoint_dir, publish
from tinylm.pretrain.resume import check_resumable
from tinylm.pretrain.state import OTHER_PARENT_SUFFIX, newest_intact_step, set_aside
from tinylm.pretrain.steps import committed_steps, step_manifest
from tinylm.tokenizer import Tokenizer


def model_config_of(cfg: Config, vocab_size: int) -> dict[str, Any]:
    """The Transformer's constructor arguments of a run: `Transformer(**model_config_of(cfg, V))`,
    as its checkpoints record them (a capability off left out, see ModelOptions.recorded)."""
    return {"vocab_size": vocab_size, **cfg.model.recorded()}


def run_device(backend: str, world_size: int) -> PlanDevice:
    """The device rank 0 trains on, for its plan: its first GPU with nccl, else the CPU."""
    return local_device(torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu"), world_size)


def plan_run(
    cfg: Config, vocab_size: int, device: PlanDevice, is_rank0: bool, resumed_accumulation: int | None = None
) -> Config:
    """The run's memory plan on `device` (see `run_device`, or a named one), logged, and the run's
    config with `train.grad_accum_steps: auto` resolved.

    `auto` takes `resumed_accumulation` (what the run being resumed chose) when given, else the
    smallest accumulation whose plan fits. A run that does not fit, or an `auto` that nothing fits,
    is a ValueError saying by how much and what would fit.
    """
    model_config, train = model_config_of(cfg, vocab_size), cfg.train
    if train.grad_accum_steps == "auto":
        accum = resumed_accumulation or smallest_fitting_accumulation(
            model_config, train, train.world_size, device
        )
        if accum is None:
            raise ValueError(
                "train.grad_accum_steps: auto: "
                + plan_memory(
                    model_config, replace(train, grad_accum_steps=1), train.world_size, device
                ).problem()
            )
        cfg = replace(cfg, train=replace(train, grad_accum_steps=accum))
    plan = plan_memory(model_config, cfg.train, cfg.train.world_size, device)
    for line in plan.lines():
        log_line(is_rank0, line)
    if train.grad_accum_steps == "auto":
        how = "the run's own, resumed" if resumed_accumulation else "the fewest that fit"
        log_line(is_rank0, f"train.grad_accum_steps auto: {cfg.train.grad_accum_steps} ({how})")
    problem = plan.problem()
    if problem:
        raise ValueError(f"the run does not fit in memory: {problem}")
    return cfg


def model_summary(model_config: dict[str, Any], train, device: PlanDevice) -> list[str]:
    """What `pretrain --plan` says of the model besides its memory: the parameter count, the
    training FLOPs per token (as MFU counts them, tinylm/throughput.py) and, on a device whose
    bfloat16 peak is known, the shortest time one update can take there."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Transformer(**model_config).parameters())
    flops = flops_per_token(model_config)
    lines = [
        f"model: {parameters:,} parameters; {flops:.3g} training FLOPs per token (forward and backward, "
        f"as the log's MFU counts them)"
    ]
    if device.peak_bf16:
        tokens = train.batch_size * model_config["context_length"]
        seconds = tokens * flops / (train.world_size * device.peak_bf16)
        lines.append(
            f"one update ({tokens:,} tokens) on {train.world_size} x {device.name}: at least "
            f"{seconds:.3g} s at the bfloat16 peak ({device.peak_bf16 / 1e12:.0f} TFLOP/s each), "
            f"{seconds / 0.4:.3g} s at 40 % MFU"
        )
    return lines


def communication_summary(
    model_config: dict[str, Any], train, device: PlanDevice, link: Link | None = None
) -> list[str]:
    """What `pretrain --plan` says of one update's communication per rank (world_size > 1): the
    collectives and the bytes this rank sends (tinylm/parallel/comm_plan.py), their time at `link`
    (default: NVLink within a node of 8, InfiniBand beyond), and, on a device whose bfloat16 peak
    is known, backward's time beside the gradients' collectives that it can hide."""
    world_size = train.world_size
    if world_size == 1:
        return []
    link = link or default_link(world_size)
    with torch.device("meta"):
        model = Transformer(**model_config)
    sharded = train.shard_optimizer
    plan = plan_communication(
        parameter_specs(model, train), world_size, train.bucket_size_mb * 2**20, sharded
    )
    if sharded:
        kinds = f"reduce-scatters {plan.calls('reduce_scatter')}, all-gathers {plan.calls('all_gather')}"
    else:
        kinds = f"bucket all-reduces {plan.calls('all_reduce', 'backward')}"
    lines = [
        f"communication per rank per update (world size {world_size}, {train.bucket_size_mb:g} MB "
        f"buckets{', sharded' if sharded else ''}): {kinds}, small all-reduces "
        f"{plan.calls(when='step')}; sends {plan.sent_bytes() / 2**20:,.1f} MiB",
    ]
    gradients, parameters = plan.seconds(link, "backward"), plan.seconds(link, "after step")
    timing = f"  at {link.name} ({link.bandwidth / 1e9:g} GB/s per rank, nominal): "
    timing += f"gradients {gradients * 1e3:.3g} ms"
    if sharded:
        timing += f", parameters {parameters * 1e3:.3g} ms (before the next forward)"
    lines.append(timing)
    if device.peak_bf16:
        tokens = train.batch_size * model_config["context_length"] / world_size
        backward = 2 / 3 * tokens * flops_per_token(model_config) / (0.4 * device.peak_bf16)
        verdict = "hides" if gradients <= backward else "cannot hide"
        lines.append(
            f"  backward at 40 % MFU on {device.name}: {backward * 1e3:.3g} ms, which {verdict} the "
            f"gradients' collectives"
        )
    return lines


def structural_hash(model_config: dict[str, Any]) -> str:
    """What a checkpoint's tensors depend on for their shapes."""
    return config_hash(model_config)


def train(
    cfg: Config,
    tokenizer_path: str | os.PathLike,
    train_tokens: str | os.PathLike | list[str | os.PathLike],
    valid_tokens: str | os.PathLike,
    state_dir: str | os.PathLike,
    checkpoint_dir: str | os.PathLike,
    tensorboard_dir: str | os.PathLike | None = None,
    *,
    run_name: str | None = None,
    init_dir: str | os.PathLike | None = None,
) -> list[Path]:
    """Train (or resume) and publish the checkpoints into `checkpoint_dir`; returns their paths.

    `run_name` (a sweep's run) labels every log line. TensorBoard's event files go to a folder of
    the run's own under `tensorboard_dir`, `<run_name>-<run hash[:8]>` (the hash alone without a
    name). A run whose state holds its last step is finished: it says so, trains nothing and
    publishes its checkpoints again. The newest intact committed step is resumed from (corrupt
    newer ones are set aside and said). A `checkpoint_dir` holding another run's checkpoints is
    refused before anything trains. `train_tokens` is one file, or with `train.mixture` one file
    per run of the mixture, in the order of their names. A run with `train.init_from` starts from
    that checkpoint (in `init_dir` when given; tinylm/pretrain/init.py), checked before anything is
    written; steps committed from another parent checkpoint are set aside and the run starts afresh.
    Under torchrun every process runs this function; only global rank 0 scans the token files,
    locks and publishes (the others return []).
    """
    set_run_name(run_name)
    is_rank0 = is_global_rank0()
    train_files = mixture_files(cfg, train_tokens)
    vocab_size = check_inputs(cfg, tokenizer_path, [*train_files, valid_tokens], is_rank0)
    state_dir = Path(state_dir)
    train = cfg.train
    model_config = model_config_of(cfg, vocab_size)
    identity = run_identity(cfg, model_config, tokenizer_path)
    init = find_init(cfg, init_dir, identity.tokenizer_sha256, model_config)
    if init is not None:
        identity.parent, identity.parent_checkpoint = init.identity(), init.checkpoint
        log_line(is_rank0, f"starts from {init.checkpoint} (step {init.step}): train.init_from")
    backend, note = resolve_backend(train.backend, train.world_size)
    if note:
        log_line(is_rank0, note)
    device = run_device(backend, train.world_size)
    identity.dtype = choose_dtype(cfg, device, is_rank0)
    _warn_if_oversubscribed(is_rank0, train)
    if tensorboard_dir is not None:  # each run its own folder, so that runs' curves never interleave
        tensorboard_dir = Path(tensorboard_dir) / "-".join(filter(None, [run_name, run_hash(cfg)[:8]]))
    with StateLock(state_dir) if is_rank0 else contextlib.nullcontext():
        newest = newest_step(state_dir, is_rank0)
        if newest and newest[1].parent != identity.parent:
            set_aside_other_parent(state_dir, init, is_rank0)
            newest = None
        train_seconds = 0.0  # wall time of training so far, over every resume (for comparisons)
        manifest = newest[1] if newest else Manifest()
        if newest:
            train_seconds = manifest.train_seconds or 0.0
            check_resumable(manifest, identity, state_dir)
            _say_resume(is_rank0, manifest, train, state_dir, checkpoint_dir)
        if is_rank0:
            check_checkpoint_dir(checkpoint_dir, identity, state_dir)
        if not newest or newest[0] < train.max_iters:
            cfg = plan_run(cfg, vocab_size, device, is_rank0, manifest.grad_accum_steps)
            identity.grad_accum_steps = cfg.train.grad_accum_steps
            spec = RunSpec(
                cfg=cfg,
                model_config=model_config,
                identity=identity,
                train_tokens=[str(path) for path in train_files],
                valid_tokens=str(valid_tokens),
                state_dir=str(state_dir),
                tensorboard_dir=None if tensorboard_dir is None else str(tensorboard_dir),
                seconds_before=train_seconds,
                run_name=run_name,
                init=init,
            )
            launch(
                train_rank,
                args=(spec,),
                world_size=train.world_size,
                backend=backend,
                threads_per_rank=train.threads_per_rank,
                timeout_s=train.timeout_s,
            )
        return publish_run(state_dir, checkpoint_dir) if is_rank0 else []


def set_aside_other_parent(state_dir: Path, init: Init | None, is_rank0: bool) -> None:
    """Set aside the committed steps of a run that started from another checkpoint than `init` (its
    parent was trained again), said in one line; global rank 0 renames, the others start afresh too."""
    if not is_rank0:
        return
    for step in committed_steps(state_dir):
        set_aside(state_dir, step, OTHER_PARENT_SUFFIX)
    log_line(
        True,
        f"the committed steps in {state_dir} started from another checkpoint than "
        f"{init.checkpoint if init else 'random weights'}: set aside (step_N{OTHER_PARENT_SUFFIX}), the "
        "run starts afresh",
    )


def mixture_files(cfg: Config, train_tokens) -> list[str | os.PathLike]:
    """The training token files as a list: one, or with `train.mixture` one per run of it in
    `mixture_order` (by run name; their count checked against the mixture's, in one line)."""
    files = list(train_tokens) if isinstance(train_tokens, (list, tuple)) else [train_tokens]
    runs = [run for run, _ in mixture_order(cfg.train.mixture)]
    wanted = len(runs) or 1
    if len(files) != wanted:
        named = f"train.mixture's runs ({', '.join(runs)})" if runs else "a run without train.mixture"
        raise ValueError(f"--train-tokens: {len(files)} files for {named}: give {wanted}, in that order")
    return files


def check_inputs(
    cfg: Config,
    tokenizer_path: str | os.PathLike,
    token_files: list[str | os.PathLike],
    is_rank0: bool,
) -> int:
    """The vocabulary size of the tokenizer file (said when it is not tokenizer.vocab_size), after
    checking that every token file holds ids below it (rank 0: one pass) and a window of
    context_length + 1 tokens; errors name the file."""
    vocab_size = len(Tokenizer.load(tokenizer_path).vocab)
    if vocab_size != cfg.tokenizer.vocab_size:
        log_line(
            is_rank0,
            f"{tokenizer_path} has {vocab_size} tokens, tokenizer.vocab_size is {cfg.tokenizer.vocab_size}: "
            f"the model takes the file's {vocab_size}",
        )
    context_length = cfg.model.context_length
    for path in token_files:
        num_tokens = len(load_tokens(path, vocab_size if is_rank0 else None))
        if num_tokens < context_length + 1:
            raise ValueError(
                f"{path}: holds {num_tokens} tokens, fewer than the {context_length + 1} needed "
                f"(model.context_length + 1)"
            )
    return vocab_size


def run_identity(cfg: Config, model_config: dict[str, Any], tokenizer_path: str | os.PathLike) -> Manifest:
    """The run's identity and how it executes: the start of every manifest it writes."""
    train = cfg.train
    return Manifest(
        seed=train.seed,
        structural_hash=structural_hash(model_config),
        tokenizer_sha256=sha256_file(tokenizer_path),
        config=weight_config(cfg),
        tokenizer_path=str(tokenizer_path),
        world_size=train.world_size,
        threads_per_rank=train.threads_per_rank,
    )


def newest_step(state_dir: Path, is_rank0: bool) -> tuple[int, Manifest] | None:
    """(step, manifest) of the newest committed step to resume from, or None. Global rank 0 checks
    every byte and sets corrupt newer steps aside (said), before the process group starts; the
    others read what it left."""
    if is_rank0:
        return newest_intact_step(state_dir, lambda line: log_line(True, line))
    steps = committed_steps(state_dir)
    return (steps[-1], step_manifest(state_dir, steps[-1])) if steps else None


def publish_run(state_dir: Path, checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Publish the committed steps into `checkpoint_dir`, said in one line; their paths."""
    published = publish(state_dir, checkpoint_dir)
    steps = [p.stem.removeprefix("step_") for p in published]
    listed = ", ".join(steps if len(steps) <= 6 else [*steps[:2], "...", *steps[-2:]])
    log_line(
        True,
        f"{len(steps)} checkpoints (steps {listed}) published to {checkpoint_dir} "
        f"(resume state: {state_dir})",
    )
    return published


def choose_dtype(cfg: Config, device: PlanDevice, is_rank0: bool) -> str:
    """The autocast dtype `train.dtype` resolves to on the run's device, said in one line; an
    explicit bfloat16 on a CPU that does not compute it natively adds a line with its measured cost."""
    train = cfg.train
    torch_device = torch.device(device.name)
    dtype, why = resolve_dtype_with_reason(train.dtype, torch_device)
    log_line(is_rank0, why)
    if is_rank0 and train.dtype == "bfloat16" and device.type == "cpu":
        native, reason = native_bf16(torch_device)
        if not native:
            accum = train.grad_accum_steps if isinstance(train.grad_accum_steps, int) else 1
            micro = micro_batch_size(train.batch_size, train.world_size, accum)
            shape = (micro * cfg.model.context_length, cfg.model.d_model, cfg.model.d_ff)
            threads = torch.get_num_threads()
            torch.set_num_threads(train.threads_per_rank)
            try:
                cost = bf16_cost(shape)
            finally:
                torch.set_num_threads(threads)
            log_line(
                True,
                f"warning: {reason}, so bfloat16 runs on torch's reference kernels: a matmul of this "
                f"model's shape takes {cost:.1f}x float32's time here; set train.dtype: auto (float32 "
                f"on this CPU) to train faster",
            )
    return dtype_name(dtype)


def _warn_if_oversubscribed(is_rank0: bool, train) -> None:
    """One line when this machine's ranks ask for more threads than it has cores."""
    ranks = ranks_on_this_machine(train.world_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if ranks * train.threads_per_rank > cores:
        log_line(
            is_rank0,
            f"warning: {ranks} ranks x {train.threads_per_rank} threads (train.threads_per_rank) on "
            f"{cores} cores: they will take turns, so each step is slower (the results are the same); "
            f"lower train.world_size or train.threads_per_rank to fit the cores",
        )


def _say_resume(is_rank0: bool, manifest: Manifest, train, state_dir: Path, checkpoint_dir) -> None:
    """One line: the run resumes from its newest committed step, or is finished and only publishes."""
    step, world_size = manifest.step, train.world_size
    if step >= train.max_iters:
        log_line(
            is_rank0,
            f"the run is finished: step {step}/{train.max_iters} is committed in {state_dir}; "
            f"nothing to train, publishing its checkpoints again to {checkpoint_dir}",
        )
        return
    note = ""
    if manifest.world_size != world_size:
        note = (
            f" (written at world size {manifest.world_size}, continued at {world_size}: the "
            f"same batches, equal to an uninterrupted run within float rounding, not bit for bit)"
        )
    log_line(is_rank0, f"resuming from step {step} in {state_dir}{note}")
