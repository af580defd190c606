"""tinylm.pretrain.publish: the published folder (the newest step's full checkpoint, older steps'
weights), republishing after an interruption."""

import json

import torch
from helpers import IDENTITY, assert_same, read_checked, small_checkpoint

from tinylm.checkpoint import FORMAT, published_steps
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
        assert published["contents"] == "weights" and "optimizer" not in weights
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
    assert read_checked(out[0])[1]["contents"] == "weights"
