"""Committed checkpoints: manifest last, every byte checked before use, hostile pickles refused,
the disk a run keeps bounded."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import IDENTITY, SMALL_MODEL, assert_same, manifest_for, read_checked, small_checkpoint

from tinylm.checkpoint import CheckpointError
from tinylm.model import Transformer
from tinylm.optim import AdamW
from tinylm.parallel import ShardedOptimizer
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish
from tinylm.pretrain.state import commit
from tinylm.pretrain.steps import committed_steps

ROOT = Path(__file__).resolve().parents[1]


def test_a_folder_without_manifest_does_not_exist_and_the_next_commit_removes_it(tmp_path):
    commit(tmp_path, 10, small_checkpoint(10), IDENTITY)
    half = tmp_path / "step_0000020"
    half.mkdir()
    torch.save(small_checkpoint(20), half / "checkpoint.pt")
    assert committed_steps(tmp_path) == [10]
    with pytest.raises(CheckpointError, match="manifest not found"):
        read_checked(half / "checkpoint.pt")
    commit(tmp_path, 30, small_checkpoint(30), IDENTITY)
    assert not half.exists()


@pytest.mark.parametrize("damage", ["flip tensor", "flip pickle", "truncate"])
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage):
    commit(tmp_path, 10, small_checkpoint(10), IDENTITY)
    path = tmp_path / "step_0000010" / "checkpoint.pt"
    entry = json.loads((tmp_path / "step_0000010" / "manifest.json").read_text())["files"]["checkpoint.pt"]
    data = bytearray(path.read_bytes())
    if damage == "flip tensor":
        offset, length, _ = max(entry["records"], key=lambda r: r[1])  # inside the largest tensor
        data[offset + length // 2] ^= 0x01
    elif damage == "flip pickle":
        data[entry["other"][0][0] + 100] ^= 0x01
    else:
        data = data[: len(data) // 2]
    os.unlink(path)  # break the hard link to the published copy
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*(sha256|truncated)"):
        read_checked(path)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*(sha256|truncated)"):
        model = Transformer(**SMALL_MODEL)
        state_lib.restore_step(_one_rank(), tmp_path, model, ShardedOptimizer(model.parameters(), AdamW))


def _one_rank():
    from tinylm.parallel import RankContext

    return RankContext(0, 0, 1, torch.device("cpu"), None)


def test_restore_reads_a_plain_optimizers_state_into_the_model_and_the_runs_optimizer(tmp_path):
    saved = small_checkpoint(30)  # a plain AdamW's state dict
    commit(tmp_path, 30, saved, IDENTITY)
    torch.manual_seed(1)
    model = Transformer(**SMALL_MODEL)
    optimizer = ShardedOptimizer(model.parameters(), AdamW, lr=0.5)  # a world of one: every parameter
    rest = state_lib.restore_step(_one_rank(), tmp_path, model, optimizer)
    assert_same(model.state_dict(), saved["model"])
    assert_same(optimizer.state_dict()["state"], saved["optimizer"]["state"])
    plain = AdamW(Transformer(**SMALL_MODEL).parameters())
    plain.load_state_dict(optimizer.state_dict())  # and it goes back into a plain one
    assert_same(plain.state_dict(), saved["optimizer"])
    assert all(state["step"].device.type == "cpu" for state in optimizer.local_state().values())
    assert_same(rest, {key: saved[key] for key in ("iteration", "tokens_seen", "model_config", "rng")})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_of_a_cuda_model_is_written_from_and_read_into_the_device(tmp_path):
    """Tensors on the device travel through the host one piece at a time; `step` stays on the CPU."""
    saved = small_checkpoint(30)
    model = Transformer(**SMALL_MODEL, device="cuda")
    model.load_state_dict(saved["model"])
    optimizer = AdamW(model.parameters())
    optimizer.load_state_dict(saved["optimizer"])
    on_device = {**saved, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    commit(tmp_path, 30, on_device, IDENTITY)
    assert_same(torch.load(tmp_path / "step_0000030" / "checkpoint.pt", weights_only=True), saved)
    fresh = Transformer(**SMALL_MODEL, device="cuda")
    fresh_optimizer = ShardedOptimizer(fresh.parameters(), AdamW)
    state_lib.restore_step(_one_rank(), tmp_path, fresh, fresh_optimizer)
    assert_same({k: v.cpu() for k, v in fresh.state_dict().items()}, saved["model"])
    for state in fresh_optimizer.local_state().values():
        assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "cuda"


class _Exploit:
    """Pickles into a call of os.system: loading it with plain pickle would run a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_checkpoint(folder: Path, marker: Path) -> Path:
    """A checkpoint whose manifest is valid (an attacker can write both) but whose pickle runs code."""
    folder.mkdir(parents=True)
    path = folder / "checkpoint.pt"
    torch.save({"model": {}, "iteration": 1, "x": _Exploit(marker)}, path)
    (folder / "manifest.json").write_text(json.dumps(manifest_for(path, **IDENTITY.to_json(), step=1)))
    return path


def test_a_hostile_pickle_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    path = _hostile_checkpoint(tmp_path / "step_0000001", marker)
    # Even when the environment asks torch to stop defaulting to weights_only.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match="weights_only"):
        read_checked(path)
    model = Transformer(**SMALL_MODEL)
    with pytest.raises(CheckpointError, match="weights_only"):
        state_lib.restore_step(_one_rank(), tmp_path, model, ShardedOptimizer(model.parameters(), AdamW))
    assert not marker.exists()
    # The exploit is real: an unsafe load would have run it.
    with open(path, "rb") as f:
        torch.load(f, weights_only=False)
    assert marker.exists()


def test_every_torch_load_in_the_package_passes_weights_only_true():
    calls = 0
    for path in (ROOT / "tinylm").rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            calls += 1
            # The call's argument list, up to its closing parenthesis.
            depth, i = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            assert "weights_only=True" in text[match.end() : i], (
                f"{path}: torch.load without weights_only=True"
            )
        assert "pickle.load" not in text, f"{path} uses pickle.load"
    assert calls >= 1


# ------------------------------------------------------------------------------------------------
# save_step / restore_step with a ShardedOptimizer: another world size, no rank holding it all


def _read_results(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def saved_at_world_two(tmp_path_factory):
    import _state_ranks as ranks

    from tinylm.parallel import launch

    folder = tmp_path_factory.mktemp("sharded")
    launch(ranks.save_sharded, args=(str(folder / "state"), str(folder), 3), world_size=2, timeout_s=60)
    return folder


def test_a_sharded_save_is_the_plain_optimizers_checkpoint_and_each_rank_wrote_its_share(saved_at_world_two):
    import _state_ranks as ranks
    from helpers import make_toy, param_groups

    state = saved_at_world_two / "state"
    model, reference = ranks.make_trained(range(3), sharded=False)
    out = publish(state, saved_at_world_two / "checkpoints")
    full = torch.load(out[-1], weights_only=True)  # the full checkpoint format, plainly loaded
    assert_same(full["model"], model.state_dict())
    assert_same(full["optimizer"], reference.state_dict())  # both groups, every state tensor, exactly
    plain = make_toy(seed=0)
    plain.load_state_dict(full["model"])
    torch.optim.AdamW(param_groups(plain)).load_state_dict(full["optimizer"])
    assert [entry["rank"] for entry in full["rng"]] == [0, 1] and full["tokens_seen"] == 60

    ranks = _read_results(saved_at_world_two, 2)
    entries = json.loads((state / "step_0000003" / "manifest.json").read_text())["files"]
    tensor_bytes = sum(n for entry in entries.values() for _, n, _ in entry["records"])
    assert sum(r["written"] for r in ranks) == tensor_bytes  # every tensor written once, by one rank
    # Rank 1 wrote the parameters whose first element it holds (into checkpoint.pt and weights.pt)
    # and its pieces of the state, nothing else.
    assert ranks[1]["written"] == 2 * ranks[1]["owned_params"] + ranks[1]["owned_state"]
    assert 0 < ranks[1]["owned_state"] < _state_bytes(reference)


def _state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())


def test_a_step_saved_at_world_size_two_resumes_at_three_and_at_one_and_three_resaves_for_one(
    saved_at_world_two, tmp_path
):
    import _state_ranks as ranks

    from tinylm.parallel import launch

    state = saved_at_world_two / "state"
    _, saved = ranks.make_trained(range(3), sharded=False)
    reference_model, _ = ranks.make_trained(range(6), sharded=False)

    launch(
        ranks.restore_sharded_and_continue,
        args=(str(state), str(tmp_path), 3, 3),
        world_size=3,
        timeout_s=60,
    )
    resumed = torch.load(tmp_path / "params.pt", weights_only=True)
    assert_same(resumed, reference_model.state_dict())  # bit-identical: the same per-parameter math
    entry = json.loads((state / "step_0000003" / "manifest.json").read_text())["files"]["checkpoint.pt"]
    other = sum(n for _, n, _ in entry["other"])
    model_bytes = (
        sum(t.numel() * t.element_size() for t in reference_model.state_dict().values())
        - reference_model.embed.weight.numel() * 8
    )  # the tied head is one tensor in the file
    rng = sum(n for _, n, _ in entry["records"]) - model_bytes - _state_bytes(saved)
    for r in _read_results(tmp_path, 3):
        # The model, the pieces saved at world size 2 that overlap this rank's slices at world
        # size 3 (its own state and at most a piece more), and the small rest: never the whole state.
        state_read = r["read"] - other - model_bytes - rng
        assert 0 < r["owned_state"] <= state_read < _state_bytes(saved), (r, _state_bytes(saved))

    # One process reads the whole state (no launch: a world of one, holding every parameter).
    model, optimizer = ranks.make_trained([], seed=99)
    rest = state_lib.restore_step(_one_rank(), state, model, optimizer)
    ranks.train_toy(model, optimizer, range(3, 6))
    assert rest["iteration"] == 3
    assert_same(model.state_dict(), reference_model.state_dict())

    # 2 -> 3 -> 1: the step the three ranks saved (their slices, in pieces) resumes in one process.
    model, optimizer = ranks.make_trained([], seed=98)
    rest = state_lib.restore_step(_one_rank(), tmp_path / "state", model, optimizer)
    assert rest["iteration"] == 6
    ranks.train_toy(model, optimizer, range(6, 9))
    reference_model, _ = ranks.make_trained(range(9), sharded=False)
    assert_same(model.state_dict(), reference_model.state_dict())


def test_a_checkpoint_slower_than_the_collective_timeout_still_commits(tmp_path):
    """Rank 0 writes slowly (the usual case: it writes the most); rank 1 waits for it, beyond the timeout."""
    import _state_ranks as ranks

    from tinylm.parallel import launch

    timeout_s = 2.0
    launch(
        ranks.checkpoint_with_a_slow_or_hung_rank,
        args=(str(tmp_path / "state"), str(tmp_path), 0, 0.15),
        world_size=2,
        timeout_s=timeout_s,
    )
    results = _read_results(tmp_path, 2)
    assert all(r["save_s"] > timeout_s for r in results)  # everyone waited longer than a collective may
    assert all(r["sum"] == 2.0 for r in results)
    assert committed_steps(tmp_path / "state") == [2]


def test_a_rank_that_hangs_while_checkpointing_is_reported_within_the_timeout(tmp_path):
    """Rank 1 stops in its first write; rank 0, waiting for it, reports it after train.timeout_s."""
    import time

    import _state_ranks as ranks

    from tinylm.parallel import RankFailedError, launch

    timeout_s = 2.0
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 failed") as info:
        launch(
            ranks.checkpoint_with_a_slow_or_hung_rank,
            args=(str(tmp_path / "state"), str(tmp_path), 1, -1),
            world_size=2,
            timeout_s=timeout_s,
        )
    assert time.monotonic() - start < timeout_s + 30
    assert "rank 1 made no progress for 2 s" in str(info.value)
    assert committed_steps(tmp_path / "state") == []
    for r in range(2):  # no process of the job is left
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid{r}").read_text()), 0)
