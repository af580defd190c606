"""Committed checkpoints: manifest last, sha256 checked before parsing, hostile pickles refused."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinylm import state as state_lib
from tinylm.state import CheckpointError, StateLock, check_resumable, commit, committed_steps, load_verified

ROOT = Path(__file__).resolve().parents[1]


def payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 3, generator=g)}, "optimizer": {"state": {}, "param_groups": []},
            "iteration": step, "model_config": {"d_model": 3}, "rng": [{"python": [3, [1, 2], None]}]}


MANIFEST = {"world_size": 2, "threads_per_rank": 1, "seed": 0, "structural_hash": "abc",
            "tokenizer_sha256": "t" * 64, "config": {"train": {"max_iters": 10, "lr_max": 0.1}}}


def test_commit_writes_manifest_last_and_keeps_the_last_two(tmp_path):
    for step in (10, 20, 30):
        commit(tmp_path, step, payload(step), MANIFEST, keep=2)
    assert committed_steps(tmp_path) == [20, 30]
    manifest = json.loads((tmp_path / "step_0000030" / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["world_size"] == 2 and manifest["torch_version"] == torch.__version__
    loaded, _ = load_verified(tmp_path / "step_0000030" / "checkpoint.pt")
    assert torch.equal(loaded["model"]["w"], payload(30)["model"]["w"]) and loaded["iteration"] == 30
    # Every committed step stays published, even those pruned from the resume state.
    assert state_lib.published_steps(tmp_path / "published") == [10, 20, 30]
    out = state_lib.publish(tmp_path, tmp_path / "checkpoints")
    assert [p.name for p in out] == ["step_10.pt", "step_20.pt", "step_30.pt"]
    loaded, _ = load_verified(out[0])
    assert torch.equal(loaded["model"]["w"], payload(10)["model"]["w"])


def test_a_folder_without_manifest_does_not_exist(tmp_path):
    commit(tmp_path, 10, payload(10), MANIFEST)
    half = tmp_path / "step_0000020"
    half.mkdir()
    torch.save(payload(20), half / "checkpoint.pt")
    assert committed_steps(tmp_path) == [10]
    with pytest.raises(CheckpointError, match="manifest not found"):
        load_verified(half / "checkpoint.pt")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage):
    commit(tmp_path, 10, payload(10), MANIFEST)
    path = tmp_path / "step_0000010" / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    os.unlink(path)  # break the hard link to the published copy
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*sha256"):
        load_verified(path)


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
    files = {"checkpoint.pt": state_lib.sha256_file(path)}
    (folder / "manifest.json").write_text(json.dumps({**MANIFEST, "step": 1, "files": files}))
    return path


def test_a_hostile_pickle_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    path = _hostile_checkpoint(tmp_path / "step_0000001", marker)
    # Even when the environment asks torch to stop defaulting to weights_only.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_verified(path)
    assert not marker.exists()
    # The exploit is real: an unsafe load would have run it.
    with open(path, "rb") as f:
        torch.load(f, weights_only=False)
    assert marker.exists()


def test_resume_check_names_the_value_that_differs():
    check_resumable(MANIFEST, dict(MANIFEST), "s")
    # The same batches at any world size or thread count: those may change.
    check_resumable(MANIFEST, {**MANIFEST, "world_size": 3, "threads_per_rank": 2}, "s")
    with pytest.raises(CheckpointError, match="seed differs.*0.*1"):
        check_resumable(MANIFEST, {**MANIFEST, "seed": 1}, "s")
    with pytest.raises(CheckpointError, match="structural_hash differs"):
        check_resumable(MANIFEST, {**MANIFEST, "structural_hash": "zzz"}, "s")
    with pytest.raises(CheckpointError, match=r"train\.lr_max differs \(state has 0\.1, this run has 0\.2\)"):
        check_resumable(MANIFEST, {**MANIFEST, "config": {"train": {"max_iters": 10, "lr_max": 0.2}}}, "s")


def test_lock_stops_a_second_trainer(tmp_path):
    code = ("import sys, time; from tinylm.state import StateLock\n"
            "with StateLock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(30)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=f"another trainer \\(pid {holder.pid}\\)"):
            with StateLock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with StateLock(tmp_path):  # released when its holder died
        pass


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
            assert "weights_only=True" in text[match.end():i], f"{path}: torch.load without weights_only=True"
        assert "pickle.load" not in text, f"{path} uses pickle.load"
    assert calls >= 1

