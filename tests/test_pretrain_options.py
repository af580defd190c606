"""The model options through the whole pretrain stage: every world size and accumulation trains the
same float64 weights with every option on, a killed run with every option (dropout included)
resumes bit for bit, Muon trains a tied model with value embeddings, and evaluate and sample read
such checkpoints (evaluate's loss against a brute-force loss of the loaded model)."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ROOT,
    assert_layouts_agree,
    assert_same,
    final_payload,
    logged_losses,
    pretrain,
    pretrain_ok,
    train_float64_layouts,
    write_tiny_config,
)

from tinylm.checkpoint import load_model
from tinylm.generate import generate_reference
from tinylm.pretrain.steps import committed_steps
from tinylm.tokenizer import Tokenizer

# Every option on; two layers, so that one of them has a value-embedding table.
OPTIONS = dict(
    num_layers=2,
    qk_norm=True,
    mlp="relu2",
    logit_softcap=15.0,
    zero_init_output=True,
    tie_embeddings=True,
    value_embeddings=True,
    embedding_norm=True,
)


@pytest.mark.slow
def test_every_layout_trains_the_same_float64_weights_with_every_option(tiny_data, tmp_path):
    layouts = [(1, 1), (2, 1), (1, 4)]  # (world_size, grad_accum_steps) at batch 8
    finals = train_float64_layouts(tiny_data, tmp_path, layouts, model=OPTIONS, train={"schedule": "wsd"})
    reference = finals[0]["model"]
    assert [name for name in reference if "value_embedding" in name]
    assert "token_embeddings.weight" in reference  # tied: saved under both names, one tensor
    assert reference["layers.0.ffn.w_out.weight"].abs().max() > 0  # zero-initialised, then trained
    assert_layouts_agree(finals, layouts)


@pytest.fixture(scope="module")
def options_run(tiny_data, tmp_path_factory):
    """Every option and dropout 0.1, world size 2 (sharded AdamW), 12 steps."""
    folder = tmp_path_factory.mktemp("options")
    config = write_tiny_config(folder / "config.yaml", model={**OPTIONS, "dropout": 0.1})
    stderr = pretrain_ok(tiny_data, config, folder / "state")
    return {"config": config, "state": folder / "state", "stderr": stderr, "folder": folder}


@pytest.mark.slow
def test_a_killed_run_with_every_option_and_dropout_resumes_bit_identically(tiny_data, options_run, tmp_path):
    state = tmp_path / "state"
    crashed = pretrain(tiny_data, options_run["config"], state, fault="rank=1,step=9,action=kill")
    assert crashed.returncode != 0 and committed_steps(state) == [4, 8]
    resumed = pretrain_ok(tiny_data, options_run["config"], state)
    full, again = logged_losses(options_run["stderr"]), logged_losses(resumed)
    assert sorted(again) == [9, 10, 11, 12] and all(again[s] == full[s] for s in again)
    a, b = final_payload(options_run["state"]), final_payload(state)
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_evaluate_and_sample_read_a_checkpoint_with_every_option(tiny_data, options_run, tmp_path):
    checkpoints = options_run["state"].parent / "state_ckpt"
    out = tmp_path / "eval.csv"
    args = ["--config", str(options_run["config"]), "--tokenizer", str(tiny_data["tokenizer"])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", "evaluate", *args, "--checkpoint-dir", str(checkpoints),
         "--valid-tokens", str(tiny_data["valid"]), "--output", str(out), "--plot", str(tmp_path / "e.png"),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    row = pd.read_csv(out).iloc[-1]
    # Brute force: the loaded model (tied, eval mode: no dropout) on every window of the valid tokens.
    model, step = load_model(checkpoints)
    assert step == row.step == 12 and model.lm_head.weight is model.token_embeddings.weight
    model.eval()
    tokens = torch.from_numpy(np.load(tiny_data["valid"]).astype(np.int64))
    context, losses = model.context_length, []
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, context):
            window = tokens[start : start + context + 1]
            logits = model(window[None, :-1])[0]
            losses.append(F.cross_entropy(logits, window[1:], reduction="none"))
    assert math.isclose(row.val_loss, torch.cat(losses).mean().item(), rel_tol=1e-5)

    sampled = subprocess.run(
        [sys.executable, "-m", "tinylm", "sample", *args, "--checkpoint-dir", str(checkpoints),
         "--prompt", "KING:", "--max-new-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    # Greedy: the streamed completion is the recompute oracle's, with the KV cache of every option.
    tokenizer = Tokenizer.load(tiny_data["tokenizer"])
    eos = tokenizer.special_ids["<|endoftext|>"]
    expected = generate_reference(model, tokenizer.encode("KING:"), 8, context, temperature=0.0, eos_id=eos)
    assert sampled.stdout == tokenizer.decode(expected) + "\n"


@pytest.mark.slow
def test_muon_trains_a_tied_model_with_value_embeddings_sharded(tiny_data, tmp_path):
    config = write_tiny_config(
        tmp_path / "c.yaml",
        model=OPTIONS,
        train={"optimizer": "muon", "max_iters": 4, "muon_weight_decay": 0.1},
    )
    stderr = pretrain_ok(tiny_data, config, tmp_path / "state")
    losses = logged_losses(stderr)
    assert sorted(losses) == [1, 2, 3, 4] and float(losses[4]) < float(losses[1])
    optimizer = final_payload(tmp_path / "state")["optimizer"]
    names = [group["name"] for group in optimizer["param_groups"]]
    assert names == ["matrices", "embedding", "gains"]  # tied: no head group
