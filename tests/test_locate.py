"""Stages run by hand find a running or stopped run's newest committed step without its hash, and say
when the checkpoints were trained with another config than theirs."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import MODEL

from tinylm.__main__ import main
from tinylm.checkpoint import Manifest, published_manifest
from tinylm.config import load_config, run_hash, weight_config
from tinylm.io import sha256_file
from tinylm.locate import config_differences, find_checkpoints
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish
from tinylm.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, **train) -> Path:
    """The shipped config with the tiny_lm model's shape, short samples and one thread."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["tokenizer"]["vocab_size"] = MODEL["vocab_size"]
    cfg["model"].update({k: v for k, v in MODEL.items() if k != "vocab_size"})
    cfg["train"].update(train)
    cfg["evaluate"].update(threads=1, batch_size=64)
    cfg["generate"].update(max_new_tokens=5, threads=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def commit_steps(state_dir: Path, steps, config_path: Path, tiny_lm: dict) -> None:
    """Commit tiny_lm's weights as `steps`, recording the config at `config_path` as training does."""
    payload = torch.load(
        Path(tiny_lm["checkpoints"]) / f"step_{tiny_lm['step']}.pt", map_location="cpu", weights_only=True
    )
    recorded = weight_config(load_config(config_path))
    model_config = published_manifest(tiny_lm["checkpoints"], tiny_lm["step"]).model_config
    for step in steps:
        state_lib.commit(
            state_dir,
            step,
            {**payload, "iteration": step, "tokens_seen": step * 64},
            Manifest(
                world_size=1,
                tokens_seen=step * 64,
                config=recorded,
                model_config=model_config,
                tokenizer_sha256=sha256_file(tiny_lm["tokenizer"]),
            ),
            keep=10,
        )


@pytest.fixture
def workdir(tmp_path, tiny_lm, monkeypatch):
    """A workflow folder with config/config.yaml, the tokenizer and validation tokens; no checkpoints yet."""
    write_config(tmp_path / "config" / "config.yaml")
    (tmp_path / "results" / "tokenizer").mkdir(parents=True)
    shutil.copy(tiny_lm["tokenizer"], tmp_path / "results" / "tokenizer" / "tokenizer.json")
    tokenizer = Tokenizer.load(tiny_lm["tokenizer"])
    (tmp_path / "results" / "tokens").mkdir()
    np.save(
        tmp_path / "results" / "tokens" / "valid.npy",
        np.array(tokenizer.encode(tiny_lm["text"][:3000]), dtype=np.uint16),
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_running_run_is_sampled_and_evaluated_from_its_state_folder(workdir, tiny_lm, capsys):
    state_dir = Path("results/state") / run_hash(load_config("config/config.yaml"))
    commit_steps(state_dir, [50, 100], Path("config/config.yaml"), tiny_lm)
    published = state_dir / "published"

    code, out, err = run_cli(capsys, "sample", "--prompt", "the king")
    assert code == 0, err
    assert (
        f"[sample] using step 100 from {published}: results/checkpoints is published when the run finishes "
        "and it has none yet (the run is training or was stopped)"
    ) in err
    assert f"[sample] step 100 of {published}" in err and out.strip()
    assert "trained with another config" not in err

    code, _, err = run_cli(capsys, "evaluate")
    assert code == 0, err
    assert list(np.genfromtxt("results/eval.csv", delimiter=",", names=True)["step"]) == [50, 100]
    assert f"[evaluate] using step 100 from {published}" in err

    # The run finished up to 100 and was published; a resumed run has committed 150 since.
    publish(state_dir, "results/checkpoints")
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king")
    assert code == 0 and "[sample] step 100 of results/checkpoints" in err and "using step" not in err
    commit_steps(state_dir, [150], Path("config/config.yaml"), tiny_lm)
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king")
    assert code == 0 and f"using step 150 from {published}" in err and "its newest is step 100" in err
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king", "--step", 50)
    assert code == 0 and "[sample] step 50 of results/checkpoints" in err

    # A folder named explicitly is read as it is.
    code, _, err = run_cli(
        capsys, "sample", "--prompt", "the king", "--checkpoint-dir", "results/checkpoints"
    )
    assert code == 0 and "[sample] step 100 of results/checkpoints" in err and "using step" not in err

    code, _, err = run_cli(capsys, "generate", "--output", "results/my_samples.txt")
    assert code == 0, err
    assert f"[generate] 3 samples from step 150 of {published} written to results/my_samples.txt" in err
    assert Path("results/my_samples.txt").read_text().startswith("# tinylm samples: checkpoint step 150")


def test_no_checkpoint_anywhere_names_both_folders(workdir, capsys):
    state_dir = Path("results/state") / run_hash(load_config("config/config.yaml"))
    code, _, err = run_cli(capsys, "sample", "--prompt", "x")
    assert code == 1
    assert (
        f"no committed checkpoints in results/checkpoints nor in the state folder of the run this config "
        f"describes, {state_dir}" in err
    )
    assert "tinylm sample: error: results/checkpoints: no committed checkpoints" in err


def test_checkpoints_of_another_config_are_refused_in_one_line(workdir, tiny_lm, capsys, tmp_path_factory):
    trained_with = write_config(tmp_path_factory.mktemp("other") / "config.yaml")  # seed 0, lr 6e-3
    commit_steps(Path("elsewhere"), [100], trained_with, tiny_lm)
    publish("elsewhere", "results/checkpoints")
    write_config(Path("config/config.yaml"), seed=1, lr_max=0.003)  # then the config was edited
    state_dir = Path("results/state") / run_hash(load_config("config/config.yaml"))
    expected = (
        "results/checkpoints/step_100.pt was trained with another config than config/config.yaml: "
        "train.seed: 0 in the checkpoint, 1 in the config; train.lr_max: 0.006 in the checkpoint, 0.003 "
        f"in the config; the run it describes has no committed step in {state_dir / 'published'}"
    )
    for argv in (["sample", "--prompt", "the king"], ["evaluate"], ["generate"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and not out, err
        (line,) = [line for line in err.splitlines() if "another config" in line]
        assert line.startswith(f"tinylm {argv[0]}: error: {expected}"), err
        assert "[sample] step" not in err
    assert not Path("results/eval.csv").exists() and not Path("results/samples.txt").exists()

    # The folder named explicitly, and no config given: the folder's run, whatever config.yaml says.
    code, out, err = run_cli(
        capsys, "sample", "--prompt", "the king", "--checkpoint-dir", "results/checkpoints"
    )
    assert code == 0 and out.strip() and "another config" not in err, err
    # The folder named explicitly with a config given: the two must agree.
    code, _, err = run_cli(
        capsys,
        "sample",
        "--prompt",
        "the king",
        "--checkpoint-dir",
        "results/checkpoints",
        "--config",
        "config/config.yaml",
    )
    assert code == 1 and "train.seed: 0 in the checkpoint, 1 in the config" in err, err

    write_config(Path("config/config.yaml"))  # the config it was trained with: nothing to say
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king")
    assert code == 0 and "another config" not in err
    # Under Snakemake a stage is given only the sections it depends on (and model and train for this check).
    code, _, err = run_cli(
        capsys, "sample", "--prompt", "the king", "--config-json", '{"generate": {"threads": 1}}'
    )
    assert code == 0 and "another config" not in err


def test_a_config_of_another_model_reads_its_own_run_not_results_checkpoints(workdir, tiny_lm, capsys):
    """results/checkpoints holds the default run (more steps); a smaller model's config trained by hand
    has its committed steps in its own state folder: the stage reads those, and says so."""
    commit_steps(Path("default_state"), [100, 200], Path("config/config.yaml"), tiny_lm)
    publish("default_state", "results/checkpoints")
    small = write_config(Path("small.yaml"), seed=5)
    small_state = Path("results/state") / run_hash(load_config(small))
    code, out, err = run_cli(capsys, "sample", "--prompt", "the king", "--config", small)
    assert code == 1 and not out
    assert (
        "tinylm sample: error: results/checkpoints/step_200.pt was trained with another config than " in err
    )
    assert "train.seed: 0 in the checkpoint, 5 in the config" in err
    commit_steps(small_state, [50], small, tiny_lm)
    code, out, err = run_cli(capsys, "sample", "--prompt", "the king", "--config", small)
    assert code == 0 and out.strip(), err
    assert (
        f"[sample] results/checkpoints holds another run than small.yaml (train.seed: 0 in the "
        f"checkpoint, 5 in the config); reading the run it describes from {small_state / 'published'}"
    ) in err
    assert f"[sample] step 50 of {small_state / 'published'}" in err


def test_a_config_of_another_vocabulary_is_refused_naming_the_key(workdir, tiny_lm, capsys):
    commit_steps(Path("default_state"), [100], Path("config/config.yaml"), tiny_lm)
    publish("default_state", "results/checkpoints")
    other = Path("other_vocab.yaml")
    other.write_text(yaml.safe_dump({"tokenizer": {"vocab_size": MODEL["vocab_size"] + 1}}))
    code, _, err = run_cli(capsys, "evaluate", "--config", other)
    assert code == 1
    assert (
        f"tokenizer.vocab_size: {MODEL['vocab_size']} in the checkpoint, "
        f"{MODEL['vocab_size'] + 1} in the config"
    ) in err, err
    assert not Path("results/eval.csv").exists()


def test_find_checkpoints_prefers_the_published_folder_unless_the_state_is_newer(tmp_path, tiny_lm):
    config = write_config(tmp_path / "config.yaml")
    state, published = tmp_path / "state", tmp_path / "ckpt"
    assert find_checkpoints(published, None) == (published, None)
    commit_steps(state, [1, 2], config, tiny_lm)
    publish(state, published)
    assert find_checkpoints(published, state) == (published, None)
    commit_steps(state, [3], config, tiny_lm)
    folder, note = find_checkpoints(published, state)
    assert folder == state / "published" and "using step 3" in note and "its newest is step 2" in note
    assert find_checkpoints(published, state, step=2) == (published, None)
    folder, note = find_checkpoints(published, state, step=3)
    assert folder == state / "published" and note.startswith(f"step 3 is not in {published}")
    assert find_checkpoints(published, state, step=9) == (published, None)  # the loader names what is missing


def test_config_differences_name_each_key():
    cfg = load_config(ROOT / "config" / "config.yaml")
    recorded = weight_config(cfg)
    assert config_differences(Manifest(config=recorded), cfg) == []
    vocab = cfg.tokenizer.vocab_size
    assert config_differences(Manifest(model_config={"vocab_size": vocab + 8}), cfg) == [
        f"tokenizer.vocab_size: {vocab + 8} in the checkpoint, {vocab} in the config"
    ]
    assert config_differences(Manifest(), cfg) == []  # an older manifest records no config
    recorded["model"]["d_ff"] = 96
    recorded["train"]["seed"] = 3
    assert config_differences(Manifest(config=recorded), cfg) == [
        "model.d_ff: 96 in the checkpoint, 344 in the config",
        "train.seed: 3 in the checkpoint, 0 in the config",
    ]
    assert config_differences(Manifest(config=recorded), cfg, ("train",)) == [
        "train.seed: 3 in the checkpoint, 0 in the config"
    ]


@pytest.mark.slow
def test_a_stopped_run_is_exported_from_its_state_folder(workdir, tiny_lm, capsys):
    pytest.importorskip("transformers")
    state_dir = Path("results/state") / run_hash(load_config("config/config.yaml"))
    commit_steps(state_dir, [50, 100], Path("config/config.yaml"), tiny_lm)
    code, _, err = run_cli(capsys, "export", "--output", "results/hf")
    assert code == 0, err
    assert f"[export] using step 100 from {state_dir / 'published'}" in err
    assert f"[export] step 100 of {state_dir / 'published'} exported to results/hf" in err
    assert (Path("results/hf") / "model.safetensors").is_file() and not Path("results/checkpoints").exists()


def test_a_folder_of_two_runs_is_refused_by_every_stage_naming_the_keys(workdir, tiny_lm, capsys, tmp_path):
    commit_steps(tmp_path / "first", [50, 100], Path("config/config.yaml"), tiny_lm)
    publish(tmp_path / "first", "results/checkpoints")
    other = write_config(tmp_path / "other.yaml", max_iters=300)
    commit_steps(tmp_path / "second", [300], other, tiny_lm)
    # As a publisher that did not check would leave it: another run's step beside the first's.
    for suffix in (".pt", ".json"):
        shutil.copy(
            tmp_path / "second" / "published" / f"step_300{suffix}", f"results/checkpoints/step_300{suffix}"
        )
    for argv in (["sample", "--prompt", "the king"], ["evaluate"], ["generate"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1, err
        (line,) = [line for line in err.splitlines() if "error" in line]
        assert (
            f"tinylm {argv[0]}: error: results/checkpoints: holds the checkpoints of more than one run "
            "(steps 50 and 300 differ in train.max_iters: 1400 at step 50, 300 at step 300)"
        ) in line, err
    assert not Path("results/eval.csv").exists() and not Path("results/samples.txt").exists()


def test_a_tokenizer_other_than_the_trained_one_is_refused(workdir, tiny_lm, capsys, tmp_path):
    from helpers import SPECIALS, mixed_text

    from tinylm.tokenizer import train_bpe

    commit_steps(tmp_path / "state", [100], Path("config/config.yaml"), tiny_lm)
    publish(tmp_path / "state", "results/checkpoints")
    # Another tokenizer of the same vocabulary size, trained on other text: the model's ids would mean
    # other strings, and nothing else tells.
    (tmp_path / "other.txt").write_text(mixed_text(random.Random(7), 3000), encoding="utf-8")
    vocab, merges = train_bpe(
        tmp_path / "other.txt", MODEL["vocab_size"], SPECIALS, num_workers=1, progress=False
    )
    Tokenizer(vocab, merges, SPECIALS).save(tmp_path / "other.json")
    assert sha256_file(tmp_path / "other.json") != sha256_file(tiny_lm["tokenizer"])
    assert len(Tokenizer.load(tmp_path / "other.json").vocab) == MODEL["vocab_size"]
    for argv in (["sample", "--prompt", "the king"], ["evaluate"], ["generate"]):
        code, _, err = run_cli(capsys, *argv, "--tokenizer", tmp_path / "other.json")
        assert code == 1, err
        other_sha = sha256_file(tmp_path / "other.json")[:12]
        assert (
            f"error: {tmp_path / 'other.json'} (sha256 {other_sha}...) is not "
            f"the tokenizer results/checkpoints/step_100.pt was trained with (sha256 "
            f"{sha256_file(tiny_lm['tokenizer'])[:12]}...): give that file with --tokenizer"
        ) in err, err
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king")  # the one it was trained with
    assert code == 0, err


def test_a_corrupt_published_checkpoint_is_one_line_naming_the_file(workdir, tiny_lm, capsys, tmp_path):
    commit_steps(tmp_path / "state", [100], Path("config/config.yaml"), tiny_lm)
    publish(tmp_path / "state", "results/checkpoints")
    path = Path("results/checkpoints/step_100.pt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.unlink()  # a file of its own, not the state's hard link
    path.write_bytes(bytes(data))
    for argv in (["sample", "--prompt", "the king"], ["evaluate"], ["generate"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1, err
        assert err.splitlines()[-1].startswith(f"tinylm {argv[0]}: error: {path}: the bytes at offset "), err
        assert err.splitlines()[-1].endswith("the file is corrupt"), err


def test_checkpoints_of_another_machine_kind_are_said_in_one_line(workdir, tiny_lm, capsys, tmp_path):
    commit_steps(tmp_path / "state", [100], Path("config/config.yaml"), tiny_lm)
    manifest_path = tmp_path / "state" / "published" / "step_100.json"
    # As if trained with another torch on a CPU of another instruction set.
    manifest = json.loads(manifest_path.read_text())
    manifest["machine"] = {
        "torch": "2.10.0",
        "device": "cpu",
        "cpu_capability": "OTHER",
        "gpu": None,
        "threads": 1,
    }
    manifest_path.write_text(json.dumps(manifest))
    publish(tmp_path / "state", "results/checkpoints")
    here = torch.backends.cpu.get_cpu_capability()
    code, _, err = run_cli(capsys, "evaluate")
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if "another machine kind" in line]
    assert line == (
        "[evaluate] results/checkpoints/step_100.pt was trained on another machine kind (torch '2.10.0' "
        f"there, {torch.__version__!r} here; cpu_capability 'OTHER' there, {here!r} here): figures made "
        "here differ from that machine's in the last bits (within the seed spread)"
    )
    notes = Path("results/eval_columns.md").read_text()
    assert f"- evaluated with torch {torch.__version__} on cpu ({here}), torch threads 1\n" in notes
    assert "- trained with torch 2.10.0 on cpu (OTHER), torch threads 1 per rank\n" in notes
    # The same machine kind: nothing to say.
    manifest["machine"] = {
        "torch": torch.__version__,
        "device": "cpu",
        "cpu_capability": here,
        "gpu": None,
        "threads": 4,
    }
    for path in (manifest_path, Path("results/checkpoints/step_100.json")):
        path.unlink()
        path.write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "sample", "--prompt", "the king")
    assert code == 0 and "another machine kind" not in err, err
