"""tinylm.pretrain.publish: the published folder (the newest step's full checkpoint, older steps'
weights), republishing after an interruption."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import IDENTITY, assert_same, read_checked, small_checkpoint

from tinylm.checkpoint import FORMAT, CheckpointError, published_steps
from tinylm.model import Transformer
from tinylm.optim import AdamW
from tinylm.pretrain.publish import publish
from tinylm.pretrain.state import commit
from tinylm.pretrain.steps import committed_steps


def test_published_newest_is_full_older_are_weights_and_the_disk_is_bounded(tmp_path):
    for step in (10, 20, 30, 40):
        commit(tmp_path, step, small_checkpoint(step), IDENTITY, keep=2)
    assert committed_steps(tmp_path) == [30, 40]
    manifest = json.loads((tmp_path / "step_0000040" / "manifest.json").read_text())
    assert (
        manifest["step"] == 40
        and manifest["format"] == FORMAT
        and manifest["torch_version"] == torch.__version__
    )
    assert set(manifest["files"]) == {"checkpoint.pt", "weights.pt"}

    out = publish(tmp_path, tmp_path / "checkpoints")
    assert [p.name for p in out] == ["step_10.pt", "step_20.pt", "step_30.pt", "step_40.pt"]
    # The newest is in the full checkpoint format ({model, optimizer, iteration}): a plain torch.load
    # into a plain AdamW.
    full = torch.load(out[-1], weights_only=True)
    assert_same(full, small_checkpoint(40))
    model = Transformer(**full["model_config"])
    model.load_state_dict(full["model"])
    AdamW(model.parameters()).load_state_dict(full["optimizer"])
    # Older steps keep what evaluation and generation need.
    for path, step in zip(out[:-1], (10, 20, 30), strict=True):
        weights, published = read_checked(path)
        assert published.contents == "weights" and "optimizer" not in weights
        expected = small_checkpoint(step)
        assert_same(
            weights, {key: expected[key] for key in ("model", "iteration", "tokens_seen", "model_config")}
        )

    # The bytes kept: keep x (checkpoint.pt + weights.pt) + (published steps - keep) x weights.pt.
    sizes = {}
    for path in tmp_path.rglob("*.pt"):
        sizes[path.stat().st_ino] = path.stat().st_size
    full_size = (tmp_path / "step_0000040" / "checkpoint.pt").stat().st_size
    weights_size = (tmp_path / "step_0000040" / "weights.pt").stat().st_size
    assert sum(sizes.values()) == 2 * (full_size + weights_size) + (4 - 2) * weights_size
    assert (tmp_path / "published" / "step_40.pt").samefile(tmp_path / "step_0000040" / "checkpoint.pt")
    assert (tmp_path / "published" / "step_30.pt").samefile(tmp_path / "step_0000030" / "weights.pt")


def test_republishing_after_an_interruption_restores_every_pair(tmp_path):
    for step in (10, 20):
        commit(tmp_path, step, small_checkpoint(step), IDENTITY)
    # As if a commit was killed after taking step 10's manifest away and before writing it again.
    (tmp_path / "published" / "step_10.json").unlink()
    (tmp_path / "published" / "step_10.pt").unlink()
    assert published_steps(tmp_path / "published") == [20]
    out = publish(tmp_path, tmp_path / "checkpoints")
    assert [p.name for p in out] == ["step_10.pt", "step_20.pt"]
    assert read_checked(out[0])[1].contents == "weights"


def test_publishing_into_another_runs_folder_is_refused_and_leaves_it_as_it_was(tmp_path):
    for step in (10, 20):
        commit(tmp_path / "first", step, small_checkpoint(step), IDENTITY)
    publish(tmp_path / "first", tmp_path / "checkpoints")
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in (tmp_path / "checkpoints").iterdir()}
    other = replace(IDENTITY, config={"train": {"max_iters": 30, "lr_max": 0.1}})
    for step in (10, 20, 30):
        commit(tmp_path / "second", step, small_checkpoint(step), other)
    with pytest.raises(CheckpointError) as refused:
        publish(tmp_path / "second", tmp_path / "checkpoints")
    assert str(refused.value).startswith(
        f"{tmp_path / 'checkpoints'}: holds the checkpoints of another run (train.max_iters: 10 there, "
        f"30 in this run); they are left as they are: publish this run into a folder of its own with "
        f"--checkpoint-dir"
    ), refused.value
    after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in (tmp_path / "checkpoints").iterdir()}
    assert after == before
    # The run's own folder, republished (a resume, or a finished run run again), is not another run's.
    assert [p.name for p in publish(tmp_path / "first", tmp_path / "checkpoints")] == [
        "step_10.pt",
        "step_20.pt",
    ]
    seeded = replace(IDENTITY, seed=1)
    commit(tmp_path / "third", 10, small_checkpoint(10), seeded)
    with pytest.raises(CheckpointError, match=r"\(seed: 0 there, 1 in this run\)"):
        publish(tmp_path / "third", tmp_path / "checkpoints")
