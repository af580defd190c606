"""Checkpoints: exact round trip, weights_only loading, clear errors, atomic writes."""

from __future__ import annotations

import pickle

import pytest
import torch

from tinylm.checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.optim import AdamW

CONFIG = dict(vocab_size=40, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)


def _trained(steps: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(**CONFIG)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["context_length"] + 1))
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def _assert_nested_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_nested_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_nested_equal(x, y)
    else:
        assert a == b


def test_round_trip_restores_model_optimizer_and_iteration(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt" / "step_3.pt"
    save_checkpoint(model, optimizer, 3, path)

    fresh_model, fresh_optimizer = _trained(steps=1, seed=1)  # different weights and state
    iteration = load_checkpoint(path, fresh_model, fresh_optimizer)
    assert iteration == 3
    _assert_nested_equal(fresh_model.state_dict(), model.state_dict())
    _assert_nested_equal(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_checkpoint_is_a_plain_dictionary_loadable_with_weights_only(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, optimizer, 7, path, extra={"model_config": model.config, "note": ["a", 1, None]})
    state = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "iteration", "model_config", "note"} <= state.keys()
    assert state["iteration"] == 7
    # Enough to rebuild the model with no conversion step.
    rebuilt = Transformer(**state["model_config"])
    rebuilt.load_state_dict(state["model"])
    assert read_checkpoint(path)["note"] == ["a", 1, None]


def test_loading_without_an_optimizer(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, optimizer, 3, path)
    fresh, _ = _trained(steps=0, seed=5)
    assert load_checkpoint(path, fresh) == 3
    _assert_nested_equal(fresh.state_dict(), model.state_dict())


def test_missing_file_is_named(tmp_path):
    model, optimizer = _trained(steps=0)
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint(path, model, optimizer)


def test_truncated_file_is_named(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, optimizer, 3, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ckpt.pt"):
        load_checkpoint(path, model, optimizer)


class _Payload:
    """An object whose unpickling would run code; weights_only loading must refuse it."""

    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_file_needing_arbitrary_unpickling_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "iteration": 0, "payload": _Payload()}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        read_checkpoint(path)
    assert "must never run" not in capsys.readouterr().out

    plain_pickle = tmp_path / "plain.pt"
    plain_pickle.write_bytes(pickle.dumps({"model": {}, "optimizer": {}, "iteration": 0}))
    with pytest.raises(CheckpointError, match="plain.pt"):
        read_checkpoint(plain_pickle)


def test_file_without_required_entries_is_refused(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="partial.pt.*optimizer"):
        read_checkpoint(path)


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, optimizer = _trained()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, optimizer, 3, path)
    before = path.read_bytes()

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")  # save_checkpoint hands torch.save an open file
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, optimizer, 4, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"], "temporary file left behind"


def test_extra_entries_must_be_plain_and_not_shadow_required_ones(tmp_path):
    model, optimizer = _trained(steps=0)
    with pytest.raises(TypeError, match="payload"):
        save_checkpoint(model, optimizer, 0, tmp_path / "a.pt", extra={"payload": _Payload()})
    with pytest.raises(ValueError, match="iteration"):
        save_checkpoint(model, optimizer, 0, tmp_path / "b.pt", extra={"iteration": 5})
    assert not list(tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch when dynamo loads
def test_compiled_model_is_saved_under_its_plain_parameter_names(tmp_path):
    model, optimizer = _trained()
    compiled = torch.compile(model)  # only wrapped here, never run, so nothing is compiled
    path = tmp_path / "ckpt.pt"
    save_checkpoint(compiled, optimizer, 3, path)
    assert set(read_checkpoint(path)["model"]) == set(model.state_dict())
    fresh, _ = _trained(steps=0, seed=5)
    load_checkpoint(path, torch.compile(fresh))
    _assert_nested_equal(fresh.state_dict(), model.state_dict())
