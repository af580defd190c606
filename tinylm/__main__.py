"""`python -m tinylm <stage>`: one subcommand per stage, in flow order.

Each stage reads the config (a YAML file with --config, or the JSON that the Snakemake rules pass
with --config-json @FILE) and explicit input and output paths, so every stage runs without Snakemake too.
Errors that a user can fix (bad config, missing or bad files, a failed rank) print one clear
message and exit with status 1; nothing half-written is left under an output name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.config import RESULTS, Config, ConfigError, from_dict, run_state_dir
from tinylm.config.merging import PROJECT_CONFIG, describe_layers, resolve_config
from tinylm.io import exit_now, stderr_copied_to

SPLITS = ("train", "valid")
DEFAULT_TOKENIZER = f"{RESULTS}/tokenizer/tokenizer.json"


@dataclass(frozen=True)
class Stage:
    """A subcommand: its name, what it does (its help), the command, and its own arguments beside
    the config's (`--config` or `--config-json`, unless `reads_config` is False)."""

    name: str
    help: str
    command: Callable[[Config | None, argparse.Namespace], None]
    arguments: Callable[[argparse.ArgumentParser], None]
    reads_config: bool = True


STAGES: list[Stage] = []  # in the order `--help` lists them: the flow's


def stage(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None], reads_config=True):
    """Declare the decorated function as the command of stage `name` (see `Stage`)."""

    def register(command):
        STAGES.append(Stage(name, help, command, arguments, reads_config))
        return command

    return register


def config_arguments(p: argparse.ArgumentParser) -> None:
    """--config FILE or --config-json: the config every stage that reads one takes."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"a YAML config file, merged onto {PROJECT_CONFIG} as Snakemake's --configfile is "
        f"(default: {PROJECT_CONFIG} alone; `python -m tinylm config --show FILE` prints the result)",
    )
    g.add_argument(
        "--config-json",
        help="the config (any of its sections) as a JSON string, or @FILE to read that JSON from FILE "
        "(what the Snakemake rules give)",
    )


def checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """--tokenizer, --checkpoint-dir and --state-dir: what evaluate, generate, sample and export read."""
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help=f"published checkpoints (default: {RESULTS}/checkpoints, or "
        f"{RESULTS}/state/<run hash>/published when the run the config describes has newer committed "
        "steps there: it trains or was stopped)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        help=f"the run's resume state folder (default {RESULTS}/state/<hash of the run's config>)",
    )


def _config(args: argparse.Namespace) -> Config:
    """The config of --config-json or --config; sets args.config_name and args.weight_sections (the
    sections that describe trained weights, model, tokenizer and train, that the JSON or the file
    itself gives; without --config, config/config.yaml gives all)."""
    if args.config_json is not None:
        raw = _json_option(args.config_json, "--config-json")
        in_file = args.config_json.startswith("@")
        args.config_name = (
            f"the config in {args.config_json[1:]}" if in_file else "the config given with --config-json"
        )
        args.weight_sections = tuple(
            s for s in ("model", "tokenizer", "train") if isinstance(raw, dict) and s in raw
        )
        return from_dict(raw)
    path = args.config or PROJECT_CONFIG
    cfg, layers = resolve_config(path)
    args.config_name = path
    given = layers[-1][1]  # the file's own sections: a file of generate keys describes no model
    args.weight_sections = tuple(
        s for s in ("model", "tokenizer", "train") if args.config is None or s in given
    )
    if args.config is not None:
        label = " ".join(filter(None, [args.stage, getattr(args, "run_name", None)]))
        print(f"[{label}] config: {describe_layers(layers)}", file=sys.stderr, flush=True)
    return cfg


def _json_option(value: str, option: str) -> Any:
    """The JSON an option gives, inline or as @FILE (what the Snakemake rules give); an error naming
    the option (and the file)."""
    text, where = value, ""
    if value.startswith("@"):
        where = f" {value[1:]}:"
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{option}: cannot read {value[1:]}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}:{where} not valid JSON: {e}") from None


def _checkpoints(
    cfg: Config, args: argparse.Namespace, step: int | None = None, step_option: str = "step"
) -> tuple[str, int | None]:
    """(checkpoint folder, the step to read: `step` or the newest) for evaluate, generate, sample and export.

    --checkpoint-dir given: that folder. Not given: the run the config describes, in
    results/checkpoints or in its state folder (newer committed steps of a run that trains or was
    stopped, or results/checkpoints holding another run; see tinylm/locate.py), said in a line when it
    is not results/checkpoints. Refuses checkpoints trained with other model, tokenizer or train keys
    than the config's (naming the keys), a folder that holds several runs' checkpoints, and a
    --tokenizer other than the one the checkpoints were trained with (by its sha256); says when they
    were trained on another machine kind. With --checkpoint-dir, only the sections the config given
    sets itself are compared (none without a config: the folder's run is read).
    """
    import torch

    from tinylm.checkpoint import check_tokenizer, published_file
    from tinylm.locate import checkpoints_of_config, warn_if_other_machine

    if args.checkpoint_dir is not None and not Path(args.checkpoint_dir).is_dir():
        what = "is not a folder" if Path(args.checkpoint_dir).exists() else "does not exist"
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} {what}")
    explicit = args.checkpoint_dir is not None
    state_dir = None if explicit else (args.state_dir or run_state_dir(cfg))
    if not explicit and args.config_json is None:
        sections = ("model", "tokenizer", "train")  # the run the whole config describes
    elif explicit and args.config is None and args.config_json is None:
        sections = ()  # the folder named, no config given: the folder's run
    else:
        sections = args.weight_sections
    checkpoint_dir = args.checkpoint_dir or f"{RESULTS}/checkpoints"
    folder, step, manifest, lines = checkpoints_of_config(
        checkpoint_dir, state_dir, step, cfg, sections, args.config_name, step_option
    )
    for line in lines:
        print(f"[{args.stage}] {line}", file=sys.stderr, flush=True)
    if manifest is not None:
        check_tokenizer(manifest, args.tokenizer, published_file(folder, step))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        warn_if_other_machine(args.stage, published_file(folder, step), manifest, device)
    return str(folder), step


def _say_threads(stage: str, threads: int) -> None:
    """The stage's first line: the torch threads it computes with, and the key that sets them."""
    print(f"[{stage}] {threads} torch thread{'s' if threads > 1 else ''} ({stage}.threads)", file=sys.stderr)


def corpus_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-out", default=f"{RESULTS}/corpus/train.txt")
    p.add_argument("--valid-out", default=f"{RESULTS}/corpus/valid.txt")


@stage("corpus", "raw text -> train.txt and valid.txt", corpus_arguments)
def cmd_corpus(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.corpus import prepare_corpus

    prepare_corpus(cfg.corpus, args.train_out, args.valid_out)


def train_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", default=f"{RESULTS}/corpus/train.txt")
    p.add_argument("--output", default=DEFAULT_TOKENIZER)


@stage("train-tokenizer", "train.txt -> byte-level BPE tokenizer.json", train_tokenizer_arguments)
def cmd_train_tokenizer(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.tokenizer import train_tokenizer

    t = cfg.tokenizer
    train_tokenizer(
        args.input,
        args.output,
        t.vocab_size,
        t.special_tokens,
        num_workers=t.num_workers,
        max_train_bytes=t.max_train_bytes,
    )


def encode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    p.add_argument("--input", nargs="+", default=[f"{RESULTS}/corpus/{split}.txt" for split in SPLITS])
    p.add_argument("--output", nargs="+", default=[f"{RESULTS}/tokens/{split}.npy" for split in SPLITS])


@stage("encode", "text files -> uint16 .npy token files", encode_arguments)
def cmd_encode(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.tokenizer import Tokenizer, encode_corpus

    tokenizer = Tokenizer.load(args.tokenizer)
    if len(tokenizer.vocab) != cfg.tokenizer.vocab_size:
        raise ValueError(
            f"{args.tokenizer}: has {len(tokenizer.vocab)} tokens but tokenizer.vocab_size is "
            f"{cfg.tokenizer.vocab_size}; retrain the tokenizer"
        )
    for src, dst in zip(args.input, args.output, strict=True):
        encode_corpus(tokenizer, src, dst, num_workers=cfg.encode.num_workers)


class Stopped(KeyboardInterrupt):
    """SIGTERM (what `kill`, schedulers and Snakemake send), raised where the main thread is."""


def pretrain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default=None,
        help=f"the tokenizer the token files were encoded with (default {DEFAULT_TOKENIZER}); --plan "
        "plans with its vocabulary when given, with the config's tokenizer.vocab_size otherwise",
    )
    p.add_argument(
        "--train-tokens",
        nargs="+",
        default=[f"{RESULTS}/tokens/train.npy"],
        help="the training token file, or with train.mixture one per run of it, in the order of their names",
    )
    p.add_argument("--valid-tokens", default=f"{RESULTS}/tokens/valid.npy")
    p.add_argument(
        "--state-dir",
        default=None,
        help=f"resume state folder (default {RESULTS}/state/<hash of the run's config>)",
    )
    p.add_argument("--checkpoint-dir", default=f"{RESULTS}/checkpoints")
    p.add_argument(
        "--tensorboard-dir",
        default=f"{RESULTS}/tensorboard",
        help="TensorBoard's event files go to a folder of the run's own in it, <run name>-<run hash> "
        "(default: %(default)s)",
    )
    p.add_argument("--run-name", default=None, help="label every log line with this name (a sweep's run)")
    p.add_argument(
        "--init-dir",
        default=None,
        help="the published checkpoints of the run train.init_from names (default: train.init_from when it "
        f"is a folder, else {RESULTS}/checkpoints for `default` and {RESULTS}/runs/<run>/checkpoints)",
    )
    p.add_argument(
        "--log",
        default=None,
        help="also write everything this command says (its ranks' too) to this file; it still reaches "
        "the terminal, up to the last line of a stopped run",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the model's size and the memory plan per rank (and refuse a run that would not fit) "
        "without training",
    )
    p.add_argument(
        "--plan-device",
        default=None,
        metavar="NAME",
        help="plan for this device instead of this machine's (implies --plan): a GPU such as h100-80gb, "
        "a100-40gb, l4-24gb (the list: tinylm/throughput.py, PLAN_GPUS), or cpu:<GB>gb such as cpu:64gb",
    )
    p.add_argument(
        "--plan-bandwidth",
        default=None,
        metavar="LINK",
        help="plan one update's communication (world size > 1) at this link (implies --plan): nvlink "
        "(450 GB/s per GPU), infiniband (50 GB/s per GPU), or a bandwidth in GB/s per rank; default "
        "nvlink up to 8 ranks, infiniband beyond (tinylm/parallel/comm_plan.py)",
    )


@stage("pretrain", "token files -> checkpoints (resumes a killed run)", pretrain_arguments)
def cmd_pretrain(cfg: Config, args: argparse.Namespace) -> None:
    """Train; when stopped (Ctrl-C, SIGTERM), say the last committed step and the command that resumes.
    With --plan or --plan-device, only the plan (see print_memory_plan)."""
    import shlex
    import signal

    from tinylm.parallel.launch import is_global_rank0
    from tinylm.pretrain import train
    from tinylm.pretrain.steps import committed_steps

    state_dir = args.state_dir or run_state_dir(cfg)
    if args.plan or args.plan_device or args.plan_bandwidth:
        print_memory_plan(cfg, args.tokenizer, state_dir, args.plan_device, args.plan_bandwidth)
        return
    tokenizer = args.tokenizer or DEFAULT_TOKENIZER

    def on_sigterm(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        train(
            cfg,
            tokenizer,
            args.train_tokens,
            args.valid_tokens,
            state_dir,
            args.checkpoint_dir,
            args.tensorboard_dir,
            run_name=args.run_name,
            init_dir=args.init_dir,
        )
    except (KeyboardInterrupt, SystemExit) as e:
        # The launcher turns SIGTERM into SystemExit(128 + SIGTERM) while it waits for the ranks.
        if isinstance(e, SystemExit) and e.code != 128 + signal.SIGTERM:
            raise
        if is_global_rank0():
            how = "SIGINT (Ctrl-C)" if type(e) is KeyboardInterrupt else "SIGTERM"
            steps = committed_steps(state_dir)
            last = (
                f"last committed step: {steps[-1]} in {state_dir}" if steps else "no step was committed yet"
            )
            print(
                f"tinylm pretrain: stopped by {how}; {last}. Resume with:\n  "
                f"python -m tinylm {shlex.join(sys.argv[1:] if args.argv is None else args.argv)}",
                file=sys.stderr,
                flush=True,
            )
        if type(e) is KeyboardInterrupt:
            raise
        raise Stopped() from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_memory_plan(
    cfg: Config,
    tokenizer_path: str | None,
    state_dir: str,
    plan_device: str | None,
    plan_bandwidth: str | None,
) -> None:
    """`pretrain --plan`: the model's size and FLOPs, the run's memory plan per rank on this
    machine or on `plan_device` (a named device), an error when it would not fit, and (world size
    > 1) the communication of one update at `plan_bandwidth` (a named link or GB/s).

    The vocabulary is the config's tokenizer.vocab_size, or that of the tokenizer file given
    (`tokenizer_path`), never a file another run left; the first line says which. A run with
    committed steps in `state_dir` is planned as it will resume (its own accumulation)."""
    from tinylm.parallel.comm_plan import parse_link
    from tinylm.parallel.launch import resolve_backend
    from tinylm.pretrain.log import log_line
    from tinylm.pretrain.memory import named_device
    from tinylm.pretrain.run import (
        communication_summary,
        model_config_of,
        model_summary,
        plan_run,
        run_device,
    )
    from tinylm.pretrain.steps import committed_steps, step_manifest
    from tinylm.tokenizer import Tokenizer

    if tokenizer_path is None:
        vocab_size = cfg.tokenizer.vocab_size
        log_line(True, f"planned with the config's vocabulary: tokenizer.vocab_size {vocab_size:,}")
    else:
        vocab_size = len(Tokenizer.load(tokenizer_path).vocab)
        log_line(True, f"planned with the vocabulary of {tokenizer_path}: {vocab_size:,} tokens")
    if plan_device:
        device = named_device(plan_device, cfg.train.world_size)
    else:
        backend, note = resolve_backend(cfg.train.backend, cfg.train.world_size)
        if note:
            log_line(True, note)
        device = run_device(backend, cfg.train.world_size)
    steps = committed_steps(state_dir)
    resumed = step_manifest(state_dir, steps[-1]).grad_accum_steps if steps else None
    link = parse_link(plan_bandwidth) if plan_bandwidth else None
    model_config = model_config_of(cfg, vocab_size)
    for line in model_summary(model_config, cfg.train, device):
        log_line(True, line)
    for line in communication_summary(model_config, cfg.train, device, link):
        log_line(True, line)
    plan_run(cfg, vocab_size, device, is_rank0=True, resumed_accumulation=resumed)


def evaluate_arguments(p: argparse.ArgumentParser) -> None:
    checkpoint_arguments(p)
    p.add_argument("--valid-tokens", default=f"{RESULTS}/tokens/valid.npy")
    p.add_argument(
        "--also-valid-tokens",
        nargs="+",
        default=[],
        metavar="RUN=FILE",
        help="other runs' validation tokens, scored too (columns val_loss_on_RUN, bits_per_byte_on_RUN): "
        "what a branch or a mixture learns or forgets of their data",
    )
    p.add_argument("--output", default=f"{RESULTS}/eval.csv")
    p.add_argument("--plot", default=f"{RESULTS}/eval.png")
    p.add_argument(
        "--notes",
        default=None,
        help="how each column of the table is counted (Markdown; default: eval_columns.md beside --output)",
    )
    p.add_argument(
        "--cache-dir",
        default=f"{RESULTS}/eval_cache",
        help="scores of checkpoints already evaluated (outside Snakemake's outputs; default %(default)s)",
    )


@stage("evaluate", "checkpoints -> eval.csv (exact validation loss) and a loss plot", evaluate_arguments)
def cmd_evaluate(cfg: Config, args: argparse.Namespace) -> None:
    import torch

    from tinylm.eval_table import beside_other_data, notes_path_for, write_eval
    from tinylm.evaluate import evaluate_checkpoints
    from tinylm.tokenizer import Tokenizer

    e = cfg.evaluate
    torch.set_num_threads(e.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    processes = e.processes or (1 if device == "cuda" else os.cpu_count() or 1)
    _say_threads("evaluate", e.threads)
    print(f"[evaluate] up to {processes} checkpoints at once (evaluate.processes)", file=sys.stderr)
    checkpoint_dir, _ = _checkpoints(cfg, args)
    tokenizer = Tokenizer.load(args.tokenizer)

    def scores_on(valid_tokens: str):
        return evaluate_checkpoints(
            checkpoint_dir,
            valid_tokens,
            tokenizer,
            e.batch_size,
            device,
            e.max_tokens,
            args.cache_dir,
            progress=sys.stderr.isatty(),
            processes=processes,
            threads=e.threads,
        )

    table = scores_on(args.valid_tokens)
    for entry in args.also_valid_tokens:
        name, valid = entry.split("=", 1) if "=" in entry else (None, entry)
        if not name:
            sys.exit(f"tinylm evaluate: --also-valid-tokens {entry}: expected RUN=FILE")
        print(f"[evaluate] and on the validation set of {name}, {valid}", file=sys.stderr)
        table = beside_other_data(table, name, scores_on(valid), valid)
    write_eval(table, args.output, args.plot, args.notes or notes_path_for(args.output))


def generate_arguments(p: argparse.ArgumentParser) -> None:
    checkpoint_arguments(p)
    p.add_argument(
        "--eval",
        default=None,
        help="eval.csv whose row for the checkpoint's step the samples' header quotes (default: the "
        "eval.csv beside the checkpoint folder, when it has that row and is newer than the checkpoint)",
    )
    p.add_argument("--output", default=f"{RESULTS}/samples.txt")


@stage("generate", "final checkpoint -> samples.txt", generate_arguments)
def cmd_generate(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.eval_table import eval_beside
    from tinylm.generate import write_samples

    _say_threads("generate", cfg.generate.threads)
    checkpoint_dir, step = _checkpoints(cfg, args)
    eval_path = args.eval
    if eval_path is None and step is not None:
        eval_path, note = eval_beside(checkpoint_dir, step)
        if note:
            print(f"[generate] {note}", file=sys.stderr, flush=True)
    write_samples(cfg.generate, checkpoint_dir, args.tokenizer, args.output, eval_path=eval_path)
    print(
        f"[generate] {len(cfg.generate.prompts)} samples from step {step} of {checkpoint_dir} "
        f"written to {args.output}",
        file=sys.stderr,
    )


# `sample`'s options and the generate keys they override.
SAMPLE_OPTIONS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
}


def sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, help="default: generate.max_new_tokens of the config")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: generate.temperature)")
    p.add_argument("--top-p", type=float, help="nucleus threshold (default: generate.top_p)")
    p.add_argument("--seed", type=int, help="sampling seed (default: generate.seed)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    checkpoint_arguments(p)


@stage("sample", "stream the completion of --prompt from a checkpoint to stdout", sample_arguments)
def cmd_sample(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.generate import sample

    raw = cfg.to_dict()
    for key in SAMPLE_OPTIONS:
        value = getattr(args, key)
        if value is not None:
            raw["generate"][key] = value
    try:
        gen = from_dict(raw).generate
    except ConfigError as e:  # name the option, not the config key it overrides
        key = str(e).split(":", 1)[0].removeprefix("generate.")
        raise ConfigError(f"{SAMPLE_OPTIONS.get(key, key)}: {str(e).split(': ', 1)[1]}") from None
    if not args.prompt:
        raise ValueError("--prompt: the prompt is empty; give the text to continue")
    checkpoint_dir, step = _checkpoints(cfg, args, args.step, "--step")
    if step is not None:
        print(f"[sample] step {step} of {checkpoint_dir}", file=sys.stderr, flush=True)
    sample(gen, checkpoint_dir, args.tokenizer, args.prompt, sys.stdout, step)
    sys.stdout.write("\n")


def export_arguments(p: argparse.ArgumentParser) -> None:
    checkpoint_arguments(p)
    p.add_argument("--output", default=f"{RESULTS}/hf")


@stage(
    "export", "a checkpoint and the tokenizer -> Hugging Face Llama folder (config: export)", export_arguments
)
def cmd_export(cfg: Config, args: argparse.Namespace) -> None:
    import torch

    from tinylm.export import export_hf

    torch.set_num_threads(cfg.export.threads)
    _say_threads("export", cfg.export.threads)
    checkpoint_dir, step = _checkpoints(cfg, args, cfg.export.step, "export.step")
    export_hf(checkpoint_dir, args.tokenizer, args.output, step, cfg.export.dtype)
    print(f"[export] step {step} of {checkpoint_dir} exported to {args.output}", file=sys.stderr)


def compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs-json",
        required=True,
        help='the runs as JSON, or @FILE to read it from FILE: [{"name", "eval", "checkpoints", "overrides", '
        '"values"}, ...] (values: each run\'s value of every key that some run overrides)',
    )
    p.add_argument("--output", default=f"{RESULTS}/compare.csv")
    p.add_argument(
        "--seeds-output",
        default=None,
        help="each configuration's mean and spread over its seeds (default: <output stem>_seeds.csv beside "
        "--output)",
    )
    p.add_argument("--plot", default=f"{RESULTS}/compare.png")


@stage("compare", "every run's eval.csv -> compare.csv and compare.png (side by side)", compare_arguments)
def cmd_compare(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.compare import compare_runs, final_figures, markdown_table, write_compare

    runs = _json_option(args.runs_json, "--runs-json")
    table = compare_runs(runs)
    write_compare(table, args.output, args.plot, args.seeds_output)
    print(markdown_table(final_figures(table)), file=sys.stderr)


def scaling_laws_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs-json",
        required=True,
        help='the ladder\'s runs as JSON, or @FILE to read it from FILE: [{"name", "config", "seed", '
        '"budget", "parameters", "tokens", "steps", "eval"}, ...] (what the workflow\'s rule gives)',
    )
    p.add_argument("--train-tokens", default=None, help="train.npy of the runs, to report their epochs")
    p.add_argument("--output-dir", default=f"{RESULTS}/scaling_laws")


@stage(
    "scaling-laws",
    "a ladder's final evaluations -> fits.csv, isoflop.csv, predictions.csv, points.csv and "
    "scaling_laws.png (config: ladder)",
    scaling_laws_arguments,
)
def cmd_scaling_laws(cfg: Config, args: argparse.Namespace) -> None:
    import numpy as np

    from tinylm.scaling_laws import read_points, scaling_laws, summary, write_report

    runs = _json_option(args.runs_json, "--runs-json")
    train_tokens = len(np.load(args.train_tokens, mmap_mode="r")) if args.train_tokens else None
    points = read_points(runs, train_tokens)
    if train_tokens:
        print(
            f"scaling-laws: {len(points)} runs, {points['epochs'].min():.2f} to {points['epochs'].max():.2f} "
            f"epochs of the {train_tokens:,} training tokens",
            file=sys.stderr,
        )
    report = scaling_laws(points, cfg.ladder)
    out = Path(args.output_dir)
    tables = {name: out / f"{name}.csv" for name in ("fits", "isoflop", "predictions", "points")}
    write_report(report, tables, out / "scaling_laws.png")
    print(summary(report), file=sys.stderr)


def env_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timed-steps",
        type=int,
        default=5,
        help="training steps timed for the estimate; 0 = no estimate (default: %(default)s)",
    )


@stage(
    "env",
    "the machine as tinylm sees it and the config resolved here (dtype, ranks, memory, time), "
    "to paste into a bug report",
    env_arguments,
)
def cmd_env(cfg: Config, args: argparse.Namespace) -> None:
    from tinylm.env import environment_lines

    for line in environment_lines(cfg, args.config_name, args.timed_steps):
        print(line, flush=True)


def config_show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--show",
        nargs="?",
        const=PROJECT_CONFIG,
        default=PROJECT_CONFIG,
        metavar="FILE",
        help=f"the config file to resolve (default {PROJECT_CONFIG} alone)",
    )


@stage(
    "config",
    f"print the resolved config: FILE merged onto {PROJECT_CONFIG} as --config and Snakemake's "
    "--configfile merge it, each key with the file it came from",
    config_show_arguments,
    reads_config=False,
)
def cmd_config(cfg: Config | None, args: argparse.Namespace) -> None:
    """`config --show [FILE]`: the resolved config as YAML, each key with where its value came from."""
    from tinylm.config import DEFAULT_RUN
    from tinylm.config.merging import resolve_runs, value_sources

    runs, layers = resolve_runs(args.show)
    cfg = runs[DEFAULT_RUN]
    lines = [f"# {describe_layers(layers)}"]
    rows = value_sources(layers, cfg)
    width = max(len(f"  {key.split('.', 1)[1]}: {json.dumps(value)}") for key, value, _ in rows)
    section = None
    for key, value, source in rows:
        name, field = key.split(".", 1)
        if name != section:
            lines.append(f"{name}:")
            section = name
        lines.append(f"{f'  {field}: {json.dumps(value)}':<{width}}  # {source}")
    named = [run for run in runs if run != DEFAULT_RUN]
    if named:
        lines.append(f"# runs (each the config above with its overrides): {', '.join(named)}")
    print("\n".join(lines))


def config_docs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="only say whether they differ (exit status 1)")
    p.add_argument("--root", default=".", help="the repository root (default: the current folder)")


@stage(
    "config-docs",
    "write config/config.yaml and config/README.md's key tables from tinylm/config/",
    config_docs_arguments,
    reads_config=False,
)
def cmd_config_docs(cfg: Config | None, args: argparse.Namespace) -> None:
    from tinylm.config import docs as config_docs

    if args.check:
        drifted = config_docs.drift(args.root)
        if drifted:
            raise ValueError(
                f"{', '.join(drifted)}: not what tinylm/config/ generates; run `python -m tinylm config-docs`"
            )
        print(
            f"[config-docs] {config_docs.YAML_PATH} and {config_docs.README_PATH} are up to date",
            file=sys.stderr,
        )
        return
    written = config_docs.write(args.root)
    print(f"[config-docs] rewrote: {', '.join(written) or 'nothing (already up to date)'}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per declared stage (`STAGES`), each with its arguments."""
    parser = argparse.ArgumentParser(prog="tinylm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for declared in STAGES:
        p = sub.add_parser(declared.name, help=declared.help, description=declared.help)
        if declared.reads_config:
            config_arguments(p)
        declared.arguments(p)
        p.set_defaults(func=declared.command, reads_config=declared.reads_config)
        for action in p._actions:  # show every path's default in --help
            if action.help is None and action.default is not None:
                action.help = "default: %(default)s"
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given (None: sys.argv), for the resume hint of `pretrain`
    log = getattr(args, "log", None)  # everything said, errors too, also into this file
    with stderr_copied_to(log) if log else contextlib.nullcontext():
        return _run(args)


def _made_output(args: argparse.Namespace) -> tuple[str, str] | None:
    """(the config file of --config-json @FILE, the stage's output path), when both are given: what
    `tinylm.config.changes` records, so that a rerun names the keys that changed."""
    config_json = getattr(args, "config_json", None)
    if not config_json or not config_json.startswith("@"):
        return None
    for name in ("output", "output_dir", "train_out", "checkpoint_dir"):
        value = getattr(args, name, None)
        if value:
            return config_json[1:], str(value[0] if isinstance(value, list) else value)
    return None


def _run(args: argparse.Namespace) -> int:
    """The stage of `args`, its errors as one line each; the exit status."""
    from tinylm.config.changes import changes_since_made, record_made

    try:
        cfg = _config(args) if getattr(args, "reads_config", True) else None
        made = _made_output(args)
        changes = changes_since_made(*made) if made else []
        if changes:
            print(f"[{args.stage}] config since {made[1]} was made: {'; '.join(changes)}", file=sys.stderr)
        args.func(cfg, args)
        if made:
            record_made(*made)
    except Stopped:
        return 128 + 15  # SIGTERM
    except KeyboardInterrupt:
        if args.stage != "pretrain":
            print(f"tinylm {args.stage}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        if os.environ.get("TINYLM_TRACEBACK"):
            raise
        print(f"tinylm {args.stage}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())  # the stage is done: skip the interpreter's teardown of torch
