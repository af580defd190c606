"""Checkpoints: exact round trip, weights_only loading, clear errors, atomic writes."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from helpers import assert_same, read_all

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


def test_round_trip_restores_model_optimizer_and_iteration(tmp_path):
    model, optimizer = _trained()
    path = tmp_path / "ckpt" / "step_3.pt"
    save_checkpoint(model, optimizer, 3, path)

    fresh_model, fresh_optimizer = _trained(steps=1, seed=1)  # different weights and state
    iteration = load_checkpoint(path, fresh_model, fresh_optimizer)
    assert iteration == 3
    assert_same(fresh_model.state_dict(), model.state_dict())
    assert_same(fresh_optimizer.state_dict(), optimizer.state_dict())


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
    assert_same(fresh.state_dict(), model.state_dict())


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
    assert_same(fresh.state_dict(), model.state_dict())


# ------------------------------------------------------------------------------------------------
# Large files, piece by piece (tinylm/checkpoint/pieces.py: plan_file, write_tensors, CheckpointReader)


def _mixed_payload() -> dict:
    torch.manual_seed(3)
    tied = torch.randn(7, 5)
    return {
        "model": {
            "embed": tied,
            "head": tied,
            "norm": torch.randn(5).to(torch.bfloat16),
            "empty": torch.zeros(0, 3),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 5)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
        },
        "iteration": 7,
        "rng": [{"torch": torch.get_rng_state(), "python": (3, [1, 2], None)}, {"ids": torch.arange(9)}],
    }


def _offsets(layout, payload):
    from tinylm.checkpoint import tensor_leaves

    return [(layout.records[path][0], tensor) for path, tensor in tensor_leaves(payload)]


def test_a_planned_and_filled_file_is_an_ordinary_torch_save_file(tmp_path, monkeypatch):
    from tinylm.checkpoint import pieces as ckpt

    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 48)  # several pieces per tensor
    payload = _mixed_payload()
    path = tmp_path / "big.pt"
    layout = ckpt.plan_file(path, payload)
    assert layout.records[("model", "embed")] == layout.records[("model", "head")]  # tied: one record
    entry = layout.entry(ckpt.write_tensors(path, _offsets(layout, payload)))
    read_all(path, entry)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert_same(loaded, payload)
        assert loaded["model"]["embed"].data_ptr() == loaded["model"]["head"].data_ptr()
    # The manifest's byte ranges cover the file exactly once.
    ranges = sorted([*entry["records"], *entry["other"]])
    assert [r[0] for r in ranges] == [0] + [r[0] + r[1] for r in ranges[:-1]]
    assert ranges[-1][0] + ranges[-1][1] == path.stat().st_size == entry["bytes"]


def test_ranks_fill_their_own_tensors_of_one_planned_file(tmp_path):
    """Rank 0 plans with placeholders (meta tensors) for what another rank holds; both write in place."""
    from tinylm.checkpoint import pieces as ckpt

    payload = _mixed_payload()
    theirs = payload["optimizer"]["state"][0]
    planned = {
        **payload,
        "optimizer": {
            **payload["optimizer"],
            "state": {
                0: {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in theirs.items()}
            },
        },
    }
    path = tmp_path / "shared.pt"
    layout = ckpt.plan_file(path, planned)
    mine = [(o, t) for o, t in _offsets(layout, planned) if t.device.type != "meta"]
    other = [(layout.records[("optimizer", "state", 0, name)][0], t) for name, t in theirs.items()]
    with pytest.raises(RuntimeError, match="no rank wrote"):
        layout.entry(ckpt.write_tensors(path, mine))
    hashes = ckpt.write_tensors(path, mine) | ckpt.write_tensors(path, other)
    read_all(path, layout.entry(hashes))
    assert_same(torch.load(path, weights_only=True), payload)


def test_a_tensor_written_in_pieces_reads_whole_and_by_range_and_a_missing_piece_is_refused(tmp_path):
    """A sharded optimizer's state tensor is written by its ranks in pieces (tinylm/pretrain/state.py):
    the manifest lists each piece, the whole tensor and any range of it read back (checked against
    the slices of the original, brute force over every range), and a gap or a damaged piece fails."""
    from tinylm.checkpoint import pieces as ckpt

    payload = _mixed_payload()
    exp_avg = payload["optimizer"]["state"][0]["exp_avg"]  # 35 float32 elements
    path = tmp_path / "pieces.pt"
    layout = ckpt.plan_file(path, payload)
    offset = layout.records[("optimizer", "state", 0, "exp_avg")][0]
    flat = exp_avg.reshape(-1)
    cuts = [0, 12, 13, 35]  # three pieces, as three ranks hold them
    pieces = [(offset + a * 4, flat[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    whole = [(o, t) for o, t in _offsets(layout, payload) if o != offset]
    with pytest.raises(RuntimeError, match="no rank wrote"):
        layout.entry(ckpt.write_tensors(path, whole + pieces[:1] + pieces[2:]))
    entry = layout.entry(ckpt.write_tensors(path, whole + pieces))
    assert [r[:2] for r in entry["records"] if offset <= r[0] < offset + 140] == [
        [offset, 48],
        [offset + 48, 4],
        [offset + 52, 88],
    ]
    assert_same(torch.load(path, weights_only=True), payload)
    with ckpt.CheckpointReader(path, entry) as reader:
        meta = reader.structure["optimizer"]["state"][0]["exp_avg"]
        assert torch.equal(reader.read(meta), exp_avg)
        for start in range(36):
            for stop in range(start, 36):
                assert torch.equal(reader.read_range(meta, start, stop), flat[start:stop]), (start, stop)
    data = bytearray(path.read_bytes())
    data[offset + 60] ^= 0x01  # inside the third piece
    path.write_bytes(bytes(data))
    with ckpt.CheckpointReader(path, entry) as reader:
        meta = reader.structure["optimizer"]["state"][0]["exp_avg"]
        assert torch.equal(reader.read_range(meta, 0, 13), flat[:13])  # the first two pieces are intact
        with pytest.raises(CheckpointError, match="do not match the sha256"):
            reader.read_range(meta, 10, 20)


def test_the_reader_reads_and_checks_only_the_tensors_asked_for(tmp_path, monkeypatch):
    from tinylm.checkpoint import pieces as ckpt

    payload = _mixed_payload()
    path = tmp_path / "r.pt"
    layout = ckpt.plan_file(path, payload)
    entry = layout.entry(ckpt.write_tensors(path, _offsets(layout, payload)))
    exp_avg_offset = layout.records[("optimizer", "state", 0, "exp_avg")][0]
    data = bytearray(path.read_bytes())
    data[exp_avg_offset + 3] ^= 0x10  # damage one tensor only
    path.write_bytes(bytes(data))

    read_bytes = []
    real_preadv = os.preadv
    monkeypatch.setattr(
        ckpt.os, "preadv", lambda fd, bufs, off: read_bytes.append(len(bufs[0])) or real_preadv(fd, bufs, off)
    )
    with ckpt.CheckpointReader(path, entry) as reader:
        saved = reader.structure
        assert saved["model"]["embed"].device.type == "meta" and not read_bytes  # nothing read yet
        out = torch.empty(7, 5)
        reader.read_into(saved["model"]["embed"], out)
        assert torch.equal(out, payload["model"]["embed"]) and sum(read_bytes) == out.numel() * 4
        assert torch.equal(reader.read(saved["model"]["norm"]), payload["model"]["norm"])
        with pytest.raises(CheckpointError, match=f"r.pt: the bytes at offset {exp_avg_offset} do not match"):
            reader.read(saved["optimizer"]["state"][0]["exp_avg"])
        with pytest.raises(CheckpointError, match="shape"):
            reader.read_into(saved["model"]["embed"], torch.empty(5, 7))
    with pytest.raises(CheckpointError, match="r.pt.*sha256"):
        read_all(path, entry)


def test_the_manifest_type_reads_what_earlier_writers_wrote_and_round_trips(tmp_path):
    import json

    from tinylm.checkpoint import FORMAT, Manifest, read_manifest
    from tinylm.checkpoint.manifest import write_manifest

    # A manifest as the writer before the Manifest type wrote it (a dict, no machine record), plus an
    # entry of a newer writer: the known fields are read, the unknown one is left out.
    earlier = {
        "config": {"model": {"d_model": 16}, "train": {"seed": 0}},
        "files": {"checkpoint.pt": {"bytes": 10, "other": [[0, 10, "ab"]], "records": []}},
        "format": FORMAT,
        "model_config": {"vocab_size": 40},
        "seed": 0,
        "step": 500,
        "structural_hash": "abc",
        "tokenizer_sha256": "t" * 64,
        "tokens_seen": 64000,
        "torch_version": "2.13.0+cpu",
        "train_seconds": 12.5,
        "weights_sha256": "w" * 64,
        "world_size": 2,
        "threads_per_rank": 1,
        "from_the_future": [1, 2],
    }
    (tmp_path / "m.json").write_text(json.dumps(earlier))
    manifest = read_manifest(tmp_path / "m.json")
    assert isinstance(manifest, Manifest)
    assert (manifest.step, manifest.tokens_seen, manifest.train_seconds, manifest.machine) == (
        500,
        64000,
        12.5,
        None,
    )
    assert manifest.files == earlier["files"] and manifest.config == earlier["config"]
    # The one writer writes exactly the recorded fields; reading them back gives the same record.
    write_manifest(tmp_path / "again.json", manifest)
    written = json.loads((tmp_path / "again.json").read_text())
    assert written == {k: v for k, v in earlier.items() if k != "from_the_future"}
    assert read_manifest(tmp_path / "again.json") == manifest
    for broken, words in [
        ({**earlier, "format": 1}, "manifest of format 1, this tinylm reads format"),
        ({k: v for k, v in earlier.items() if k != "files"}, "manifest has no 'files' table"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=words):
            read_manifest(tmp_path / "bad.json")
