"""Runs that start from another run's checkpoint (`train.init_from`): the parent's exact weights,
the same bits at any world size and on resume, the lineage in every manifest, and every bad parent
refused in one line before anything is written."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_layouts_agree,
    assert_same,
    final_payload,
    logged_losses,
    pretrain,
    train_float64_layouts,
    write_tiny_config,
)

from tinylm.checkpoint import load_model, published_manifest
from tinylm.config import ConfigError, load_config, run_configs
from tinylm.model import Transformer
from tinylm.pretrain.init import find_init, load_init_state
from tinylm.pretrain.steps import committed_steps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parent(tiny_data, tmp_path_factory):
    """The tiny config's 12 steps (checkpoints at 4, 8 and 12, the loss logged every step)."""
    folder = tmp_path_factory.mktemp("parent")
    config = write_tiny_config(folder / "config.yaml")
    proc = pretrain(tiny_data, config, folder / "state")
    assert proc.returncode == 0, proc.stderr
    return {"config": config, "checkpoints": folder / "state_ckpt", "stderr": proc.stderr}


def branch_config(path: Path, parent_checkpoints: Path, **train) -> Path:
    """The parent's config, from its step 8, trained on to step 16 (its own cosine to 16)."""
    return write_tiny_config(
        path, train={"init_from": str(parent_checkpoints), "init_step": 8, "max_iters": 16, **train}
    )


@pytest.fixture(scope="module")
def branch(tiny_data, parent, tmp_path_factory):
    folder = tmp_path_factory.mktemp("branch")
    config = branch_config(folder / "config.yaml", parent["checkpoints"])
    proc = pretrain(tiny_data, config, folder / "state")
    assert proc.returncode == 0, proc.stderr
    return {
        "config": config,
        "state": folder / "state",
        "checkpoints": folder / "state_ckpt",
        "stderr": proc.stderr,
    }


def test_the_parent_checkpoint_is_read_into_the_model_exactly(tiny_data, parent, tmp_path):
    cfg = load_config(branch_config(tmp_path / "config.yaml", parent["checkpoints"]))
    expected, _ = load_model(parent["checkpoints"], 8)
    manifest = published_manifest(parent["checkpoints"], 8)
    init = find_init(cfg, None, manifest.tokenizer_sha256, expected.config)
    assert (init.step, init.weights_sha256) == (8, manifest.weights_sha256)
    torch.manual_seed(123)
    model = Transformer(**expected.config)  # random weights first
    load_init_state(init, model)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.slow
def test_a_branch_trains_on_from_the_parent_step_and_records_its_lineage(parent, branch):
    assert f"starts from {parent['checkpoints'] / 'step_8.pt'} (step 8): train.init_from" in branch["stderr"]
    losses, parents = logged_losses(branch["stderr"]), logged_losses(parent["stderr"])
    assert sorted(losses) == list(range(9, 17))
    # Step 9's loss is computed before its update, from the weights it starts with and step 9's batch:
    # the parent's own step 9 started from the same weights and the same batch.
    assert losses[9] == parents[9]
    assert losses[10] != parents[10]  # then its own schedule and a fresh optimizer state
    published = sorted(int(p.stem.removeprefix("step_")) for p in branch["checkpoints"].glob("*.pt"))
    assert published == [12, 16]
    weights = published_manifest(parent["checkpoints"], 8).weights_sha256
    for step in published:
        manifest = published_manifest(branch["checkpoints"], step)
        assert manifest.parent == {"step": 8, "weights_sha256": weights}
        assert manifest.parent_checkpoint == str(parent["checkpoints"] / "step_8.pt")
        assert manifest.tokens_seen == step * 8 * 16  # counted from the parent's first step


@pytest.mark.slow
def test_a_branch_that_carries_the_optimizer_state_goes_on_exactly_as_the_parent_would(
    tiny_data, parent, tmp_path
):
    """A run of the parent's schedule stopped at step 8 (its cosine cycle still 12), then a branch
    from there to 12 with its optimizer state: the 12-step parent's step 12, bit for bit (no dropout:
    nothing else is random). Started with a fresh optimizer state, it is not."""
    first = write_tiny_config(tmp_path / "first.yaml", train={"max_iters": 8, "cos_cycle_iters": 12})
    assert pretrain(tiny_data, first, tmp_path / "first").returncode == 0
    finals = {}
    for carry in (True, False):
        config = branch_config(
            tmp_path / f"{carry}.yaml", tmp_path / "first_ckpt", max_iters=12, init_optimizer=carry
        )
        proc = pretrain(tiny_data, config, tmp_path / f"state_{carry}")
        assert proc.returncode == 0, proc.stderr
        finals[carry] = final_payload(tmp_path / f"state_{carry}")
    reference = torch.load(parent["checkpoints"] / "step_12.pt", weights_only=True)
    assert_same(finals[True]["model"], reference["model"], "model")
    assert_same(finals[True]["optimizer"]["state"], reference["optimizer"]["state"], "optimizer")
    assert not torch.equal(finals[False]["model"]["lm_head.weight"], reference["model"]["lm_head.weight"])


@pytest.mark.slow
def test_a_killed_branch_resumes_bit_for_bit(tiny_data, parent, branch, tmp_path):
    state = tmp_path / "state"
    crashed = pretrain(tiny_data, branch["config"], state, fault="rank=1,step=14,action=kill")
    assert crashed.returncode != 0 and committed_steps(state) == [12]
    resumed = pretrain(tiny_data, branch["config"], state)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 12" in resumed.stderr and "starts from" in resumed.stderr
    a, b = final_payload(branch["state"]), final_payload(state)
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_a_branch_at_world_size_2_equals_world_size_1(tiny_data, tmp_path):
    layouts = [(1, 1), (2, 1), (2, 2)]
    (tmp_path / "parent").mkdir()
    (tmp_path / "branch").mkdir()
    train_float64_layouts(tiny_data, tmp_path / "parent", layouts=[(1, 1)])  # 6 steps, published 4 and 6
    parent_checkpoints = tmp_path / "parent" / "state_1_1_ckpt"
    finals = train_float64_layouts(
        tiny_data,
        tmp_path / "branch",
        layouts=layouts,
        train={"init_from": str(parent_checkpoints), "init_step": 4},
    )
    assert_layouts_agree(finals, layouts)
    for final in finals:
        assert final["iteration"] == 6


@pytest.mark.slow
def test_steps_from_another_parent_checkpoint_are_set_aside_and_the_branch_starts_afresh(
    tiny_data, parent, tmp_path
):
    parent_copy = tmp_path / "parent_ckpt"
    shutil.copytree(parent["checkpoints"], parent_copy)
    config = branch_config(tmp_path / "config.yaml", parent_copy, max_iters=12)
    state = tmp_path / "state"
    assert pretrain(tiny_data, config, state).returncode == 0
    # The parent is trained again with another seed: the branch's steps are of another parent.
    other = write_tiny_config(tmp_path / "other.yaml", train={"seed": 1})
    assert (
        pretrain(
            tiny_data, other, tmp_path / "other_state", checkpoint_dir=tmp_path / "other_ckpt"
        ).returncode
        == 0
    )
    shutil.rmtree(parent_copy)
    shutil.copytree(tmp_path / "other_ckpt", parent_copy)
    again = pretrain(tiny_data, config, state, checkpoint_dir=tmp_path / "again_ckpt")
    assert again.returncode == 0, again.stderr
    assert "started from another checkpoint than" in again.stderr and "the run starts afresh" in again.stderr
    assert sorted(p.name for p in state.glob("*.other-parent*"))
    new_weights = published_manifest(parent_copy, 8).weights_sha256
    assert published_manifest(tmp_path / "again_ckpt", 12).parent["weights_sha256"] == new_weights


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train": {"init_step": 5}}, "train.init_step: 5 is not in {parent} (steps 4, 8, 12)"),
        (
            {"model": {"d_ff": 96}},
            "train.init_from: {parent}/step_8.pt: model.d_ff: 64 in the parent, 96 here",
        ),
        (
            {"train": {"init_step": 12, "max_iters": 12}},
            "train.max_iters: 12 is not past the step it starts from",
        ),
        ({"train": {"init_from": "{missing}/ckpt"}}, "train.init_from: {missing}/ckpt does not exist"),
        ("another tokenizer", "was trained with another tokenizer (sha256"),
        (
            {"train": {"init_optimizer": True}},  # only the newest published step keeps its state
            "train.init_optimizer: {parent}/step_8.pt holds the weights only, no optimizer state to carry",
        ),
        (
            {"train": {"init_optimizer": True, "optimizer": "muon", "init_step": 12}},
            "train.init_optimizer: {parent}/step_12.pt holds the state of train.optimizer 'adamw', this run "
            "uses 'muon'",
        ),
    ],
)
def test_a_bad_parent_is_one_line_before_anything_is_written(tiny_data, parent, tmp_path, change, message):
    config = branch_config(tmp_path / "config.yaml", parent["checkpoints"])
    data = dict(tiny_data)
    if change == "another tokenizer":  # the same vocabulary in another file: another sha256
        other = tmp_path / "tokenizer.json"
        other.write_text(Path(tiny_data["tokenizer"]).read_text() + "\n")
        data["tokenizer"] = other
    else:
        cfg = yaml.safe_load(config.read_text())
        for section, values in change.items():
            cfg[section].update(
                {k: v.format(missing=tmp_path) if isinstance(v, str) else v for k, v in values.items()}
            )
        config.write_text(yaml.safe_dump(cfg))
    state = tmp_path / "state"
    proc = pretrain(data, config, state)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    assert message.format(parent=parent["checkpoints"], missing=tmp_path) in errors[0], proc.stderr
    assert not state.exists() and not (tmp_path / "state_ckpt").exists()


def sweep(runs: dict, **main) -> dict:
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw["train"].update(main)
    return {**raw, "runs": runs}


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        (
            {"cool": {"train.init_from": "const"}},
            "runs.cool: train.init_from: 'const' is no run of the config",
        ),
        (
            {"a": {"train.init_from": "b"}, "b": {"train.init_from": "a"}},
            "runs.a: train.init_from: the runs start from each other: a -> b -> a",
        ),
        (
            {"a": {"train.init_from": "default", "tokenizer.vocab_size": 2048, "train.max_iters": 2000}},
            "runs.a: tokenizer.vocab_size: 2048 here, 4096 in the parent run 'default'",
        ),
        (
            {"a": {"train.init_from": "default", "model.d_ff": 96, "train.max_iters": 2000}},
            "runs.a: model.d_ff: 344 in the parent, 96 here (run 'default'): it changes a weight's shape",
        ),
        (
            {"a": {"train.init_from": "default", "train.init_step": 260, "train.max_iters": 2000}},
            "runs.a: train.init_step: 260 is not a step run 'default' publishes",
        ),
        ({"a": {"train.init_from": "default"}}, "runs.a: train.max_iters: 1400 is not past the step"),
        ({"a": {"train.init_step": 200}}, "runs.a: train.init_step: applies with train.init_from only"),
        (
            {"a": {"train.init_optimizer": True}},
            "runs.a: train.init_optimizer: applies with train.init_from only",
        ),
        ({"a": {"train.mixture": {"docs": 1.0}}}, "runs.a: train.mixture: 'docs' is no run of the config"),
        (
            {"a": {"train.mixture": {"default": 0.0}}},
            "runs.a: train.mixture: default: the weight 0.0 must be",
        ),
        (
            {"docs": {"corpus.source": "python_docs"}, "a": {"train.mixture": {"default": 1.0, "docs": 1.0}}},
            "runs.a: train.mixture: run 'docs' is encoded with another tokenizer than this run's",
        ),
        (
            {
                "a": {
                    "train.init_from": "default",
                    "train.init_optimizer": True,
                    "train.optimizer": "muon",
                    "train.max_iters": 2000,
                }
            },
            "runs.a: train.init_optimizer: run 'default' trains with train.optimizer 'adamw', this run with "
            "'muon'",
        ),
    ],
)
def test_a_bad_lineage_in_a_sweep_is_one_line_naming_the_run_and_the_key(runs, message):
    with pytest.raises(ConfigError) as e:
        run_configs(sweep(runs))
    assert str(e.value).startswith(message), str(e.value)


def test_a_branch_may_train_on_another_corpus_with_its_parents_tokenizer():
    from tinylm.config.lineage import tokenizer_run

    raw = sweep(
        {
            "docs": {"train.init_from": "default", "corpus.source": "python_docs", "train.max_iters": 1600},
            "more": {"train.init_from": "docs", "train.max_iters": 1800},
            "alone": {"corpus.source": "python_docs"},
        }
    )
    configs = run_configs(raw)
    assert [tokenizer_run(name, configs) for name in ("default", "docs", "more", "alone")] == [
        "default",
        "default",
        "default",
        "alone",
    ]


def test_a_cooldown_sweep_is_valid_and_each_seed_branches_from_its_own_seed():
    from tinylm.config.lineage import parent_of

    raw = sweep(
        {
            "const": {"train.schedule": "wsd"},
            "cool": {"train.init_from": "const", "train.init_step": 1000, "train.max_iters": 1200},
            "dropout": {"train.init_from": "default", "train.max_iters": 1600, "model.dropout": 0.1},
        }
    )
    configs = run_configs({**raw, "seeds": [0, 1]})
    assert parent_of("cool.s1", configs["cool.s1"], configs) == "const.s1"
    assert parent_of("dropout.s0", configs["dropout.s0"], configs) == "default.s0"
    assert json.dumps(sorted(configs))  # every run validated, shape-free keys allowed


def test_the_lineage_keys_enter_a_runs_identity_only_when_set():
    """`init_from` and `init_step` are left out of the weight config while null, so every run made
    before them keeps its hash (and its state folder); set, they make another run."""
    from tinylm.config import from_dict, run_hash, weight_config

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    plain = from_dict(raw)
    assert not {"init_from", "init_step"} & set(weight_config(plain)["train"])
    raw["train"].update(init_from="results/checkpoints", max_iters=2000)
    branched = from_dict(raw)
    assert weight_config(branched)["train"]["init_from"] == "results/checkpoints"
    raw["train"].pop("init_from")
    assert run_hash(branched) != run_hash(from_dict(raw))


def test_a_mixture_takes_one_token_file_per_run_in_its_order():
    from tinylm.pretrain.run import mixture_files

    mixture = {"default": 0.7, "docs": 0.3}
    raw = sweep(
        {
            "docs": {"train.init_from": "default", "corpus.source": "python_docs", "train.max_iters": 1600},
            "mix": {"train.init_from": "default", "train.mixture": mixture, "train.max_iters": 1600},
        }
    )
    configs = run_configs(raw)
    assert mixture_files(configs["mix"], ["a.npy", "b.npy"]) == ["a.npy", "b.npy"]
    with pytest.raises(
        ValueError, match=r"^--train-tokens: 1 files for train.mixture's runs \(default, docs\)"
    ):
        mixture_files(configs["mix"], "a.npy")
    with pytest.raises(ValueError, match=r"^--train-tokens: 2 files for a run without train.mixture: give 1"):
        mixture_files(configs["default"], ["a.npy", "b.npy"])


def test_a_mixtures_files_and_weights_are_in_one_order_whatever_order_the_config_writes():
    """The workflow hands the token files in `mixture_runs` order; the stage gets its config as JSON
    with sorted keys and draws by `mixture_order`'s weights. A mixture written out of name order
    must still pair each file with its own weight."""
    import json

    from tinylm.config import from_dict
    from tinylm.config.lineage import mixture_order, mixture_runs

    docs = {"train.init_from": "default", "corpus.source": "python_docs", "train.max_iters": 1600}
    mix = {
        "train.init_from": "default",
        "train.max_iters": 1600,
        "train.mixture": {"zdocs": 0.9, "default": 0.1},
    }
    configs = run_configs(sweep({"zdocs": docs, "mix": mix}))
    files = list(mixture_runs("mix", configs["mix"], configs))  # the rule's --train-tokens order
    as_staged = json.loads(json.dumps({"train": dataclasses.asdict(configs["mix"].train)}, sort_keys=True))
    weights = [w for _, w in mixture_order(from_dict(as_staged).train.mixture)]  # the loop's weights
    assert files == ["default", "zdocs"] and weights == [0.1, 0.9]
