"""The recipes for real corpora (config/tinystories.yaml, config/fineweb-edu.yaml) load, validate and
dry-run through the workflow; they are not run here (no network, no GPU). The Muon recipe
(config/muon.yaml) is the default with the recipe lab's best Muon run."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinylm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["tinystories.yaml", "fineweb-edu.yaml"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_what_its_header_says(name):
    """The parameter count and the tokens of training that the recipe's header states are those of
    its config: the model built from it (on the meta device) and batch x context x steps."""
    import torch

    from tinylm.model import Transformer

    text = (ROOT / "config" / name).read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "NOT RUN HERE" in header
    assert f"snakemake --cores all results/samples.txt --configfile config/{name}" in header
    cfg = load_config(ROOT / "config" / name)
    assert cfg.corpus.source == "files" and cfg.corpus.train_files
    with torch.device("meta"):
        model = Transformer(vocab_size=cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model))
    stated = float(re.search(r"(\d+)M parameters", header).group(1)) * 1e6
    assert model.num_parameters() == pytest.approx(stated, rel=0.03)
    tokens = cfg.train.batch_size * cfg.model.context_length * cfg.train.max_iters
    stated_steps = re.search(r"([\d,]+) (?:training )?steps", header) or re.search(
        r"x ([\d,]+) steps", header
    )
    assert cfg.train.max_iters == int(stated_steps.group(1).replace(",", ""))
    stated_tokens = [int(n.replace(",", "")) for n in re.findall(r"([\d,]{7,}) (?:training )?tokens", header)]
    per_step = [int(n.replace(",", "")) for n in re.findall(r"steps of ([\d,]+) tokens", header)]
    assert tokens in stated_tokens or cfg.train.batch_size * cfg.model.context_length in per_step


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_dry_runs_every_stage(tmp_path, name):
    # As a user runs it: the default config, with the recipe given by --configfile on top.
    (tmp_path / "config").mkdir()
    shutil.copy(ROOT / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    shutil.copy(ROOT / "config" / name, tmp_path / "config" / name)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
         "--directory", str(tmp_path), "--cores", "2", "results/samples.txt", "--dry-run", "--printshellcmds",
         "--configfile", str(tmp_path / "config" / name)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    planned = {line.split()[1].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("rule ")}
    assert {"corpus", "train_tokenizer", "encode", "pretrain", "evaluate", "generate"} <= planned
    corpus_command = proc.stdout[proc.stdout.index("python -m tinylm corpus") :].splitlines()[0]
    given = json.loads((tmp_path / corpus_command.split("--config-json @", 1)[1].split()[0]).read_text())
    cfg = load_config(tmp_path / "config" / name)
    assert given["corpus"]["train_files"] == cfg.corpus.train_files  # the recipe's corpus


def test_the_muon_recipe_is_the_default_with_the_labs_muon_run():
    """config/muon.yaml holds only what differs from the default, and that is the lab sweep's run of
    Muon with QK-norm, ReLU^2 and value embeddings, on the default's data and tokenizer."""
    from tinylm.config import from_dict, read_config_file, run_configs

    muon = load_config(ROOT / "config" / "muon.yaml")
    default = load_config(ROOT / "config" / "config.yaml")
    assert muon.train.optimizer == "muon" and default.train.optimizer == "adamw"
    assert all(getattr(muon, s) == getattr(default, s) for s in ("corpus", "tokenizer", "encode"))
    best = run_configs(read_config_file(ROOT / "config" / "sweep_lab.yaml"))["muon_ve_qk_relu2_1275.s0"]
    assert best == muon == from_dict(read_config_file(ROOT / "config" / "muon.yaml"))
    # Its Muon settings are those the Muon sweep tuned on the plain model.
    tuned = run_configs(read_config_file(ROOT / "config" / "sweep_muon.yaml"))["r6_x900"].train
    keys = ("muon_lr", "muon_weight_decay", "embedding_lr", "lr_min", "compile")
    assert all(getattr(muon.train, k) == getattr(tuned, k) for k in keys)
    # The sweeps start from the default recipe at 1,000 steps, its length when they ran.
    at_1000 = dataclasses.replace(default, train=dataclasses.replace(default.train, max_iters=1000))
    for sweep in ("sweep_muon.yaml", "sweep_default_recipe.yaml", "sweep_lab.yaml"):
        runs = run_configs(read_config_file(ROOT / "config" / sweep))
        assert runs["default"] == at_1000 and len(runs) > 2, sweep


@pytest.mark.parametrize(
    "files, runs",
    [(["ladder.yaml"], 38), (["fineweb-edu.yaml", "ladder_fineweb.yaml"], 24)],
)
def test_the_ladders_plan_the_runs_their_headers_say(tmp_path, files, runs):
    (tmp_path / "config").mkdir()
    shutil.copy(ROOT / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    for name in files:
        shutil.copy(ROOT / "config" / name, tmp_path / "config" / name)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
         "--directory", str(tmp_path), "--cores", "2", "results/scaling_laws/fits.csv", "--dry-run",
         "--configfile", *(str(tmp_path / "config" / name) for name in files)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, flags=re.MULTILINE))
    assert int(jobs["pretrain"]) == int(jobs["evaluate"]) == runs
    assert jobs["scaling_laws"] == "1"
    header = (ROOT / "config" / files[-1]).read_text()
    assert f"{runs} runs" in header
