"""Bad files, bad config and a full disk: a clear error naming the culprit, exit 1, nothing half-written.

Each case runs the real CLI (`python -m tinylm <stage>`) the way a user or Snakemake would. The
table in config/README.md ("When the input is bad") lists these cases with their messages.
"""

import errno
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import manifest_for, write_tiny_config

from tinylm.checkpoint import Manifest
from tinylm.config import load_config, weight_config
from tinylm.data import load_tokens
from tinylm.io import sha256_file
from tinylm.model import Transformer
from tinylm.pretrain import model_config_of, structural_hash
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish

ROOT = Path(__file__).resolve().parents[1]


def tinylm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tinylm", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def pretrain_args(config, tiny_data, tmp_path, train=None, valid=None, tokenizer=None):
    return [
        "pretrain",
        "--config",
        config,
        "--tokenizer",
        tokenizer or tiny_data["tokenizer"],
        "--train-tokens",
        train or tiny_data["train"],
        "--valid-tokens",
        valid or tiny_data["valid"],
        "--state-dir",
        tmp_path / "state",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--tensorboard-dir",
        tmp_path / "tb",
    ]


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("stage", ["evaluate", "generate", "export"])
def test_a_checkpoint_folder_that_does_not_exist_is_named_as_missing(tmp_path, stage):
    missing = tmp_path / "no_such_run"
    proc = tinylm(stage, "--checkpoint-dir", missing)
    assert_refused(proc, f"--checkpoint-dir {missing} does not exist")
    assert "no committed checkpoints" not in proc.stderr and not missing.exists()


def make_checkpoints(folder: Path, vocab_size: int = 300, steps=(2,)) -> Path:
    """A published checkpoint folder holding an untrained model (what evaluate and generate read)."""
    torch.manual_seed(0)
    config = dict(
        vocab_size=vocab_size,
        context_length=16,
        d_model=32,
        num_layers=1,
        num_heads=2,
        d_ff=64,
        rope_theta=10000.0,
    )
    model = Transformer(**config)
    for step in steps:
        payload = {
            "model": model.state_dict(),
            "optimizer": {},
            "iteration": step,
            "tokens_seen": step * 128,
            "model_config": config,
            "rng": [],
        }
        manifest = Manifest(world_size=1, tokens_seen=step * 128, model_config=config)  # as the trainer's
        state_lib.commit(folder / "state", step, payload, manifest)
    publish(folder / "state", folder / "ckpt")
    return folder / "ckpt"


# ------------------------------------------------------------------------------------------------
# token files


def test_truncated_token_file_is_refused_naming_it(tiny_data, tmp_path):
    truncated = tmp_path / "train.npy"
    data = Path(tiny_data["train"]).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    config = write_tiny_config(tmp_path / "c.yaml")
    assert_refused(tinylm(*pretrain_args(config, tiny_data, tmp_path, train=truncated)), str(truncated))
    assert not (tmp_path / "ckpt").exists()
    assert_refused(
        tinylm(
            "evaluate",
            "--config",
            config,
            "--tokenizer",
            tiny_data["tokenizer"],
            "--checkpoint-dir",
            make_checkpoints(tmp_path),
            "--valid-tokens",
            truncated,
            "--output",
            tmp_path / "eval.csv",
            "--plot",
            tmp_path / "eval.png",
        ),
        str(truncated),
    )
    assert not (tmp_path / "eval.csv").exists()


@pytest.mark.parametrize("array", [np.arange(100, dtype=np.int64), np.zeros((10, 10), dtype=np.uint16)])
def test_token_file_of_wrong_dtype_or_shape_is_refused(tiny_data, tmp_path, array):
    bad = tmp_path / "train.npy"
    np.save(bad, array)
    config = write_tiny_config(tmp_path / "c.yaml")
    assert_refused(tinylm(*pretrain_args(config, tiny_data, tmp_path, train=bad)), str(bad))


class _CreatesAFileWhenUnpickled:
    """Unpickling this calls open(path, "w"): the file appears only if someone unpickled it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_pickled_token_file_is_refused_and_never_unpickled(tiny_data, tmp_path):
    """A pickle whose loading runs code, named like a token file: refused, and the code never runs.

    A plain pickle, not a .npy holding an object array: np.load memory-maps a .npy and refuses an
    object array before it unpickles anything, so only a file without the .npy header reaches the
    unpickler, and it does whenever the loader allows pickles, memory map or not.
    """
    bad, marker = tmp_path / "train.npy", tmp_path / "unpickled"
    bad.write_bytes(pickle.dumps(_CreatesAFileWhenUnpickled(marker)))
    np.load(bad, mmap_mode="r", allow_pickle=True).close()  # the payload works with pickles allowed
    assert marker.exists()
    marker.unlink()
    config = write_tiny_config(tmp_path / "c.yaml")
    proc = tinylm(*pretrain_args(config, tiny_data, tmp_path, train=bad))
    assert not marker.exists(), "the token file was unpickled"
    assert_refused(proc, str(bad))

    as_array = tmp_path / "objects.npy"  # an object array in a .npy is refused too
    np.save(as_array, np.array([_CreatesAFileWhenUnpickled(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=re.escape(str(as_array))):
        load_tokens(as_array)
    assert not marker.exists(), "the object array was unpickled"


def test_token_file_of_another_vocabulary_is_refused(tiny_data, tmp_path):
    bad = tmp_path / "train.npy"
    np.save(bad, np.array([1, 2, 3, 299, 5000] * 100, dtype=np.uint16))
    config = write_tiny_config(tmp_path / "c.yaml")
    assert_refused(
        tinylm(*pretrain_args(config, tiny_data, tmp_path, train=bad)),
        f"{bad}: token id 5000 is outside the tokenizer's vocabulary of 300",
    )
    assert not (tmp_path / "ckpt").exists()


def test_validation_tokens_shorter_than_the_context_are_refused(tiny_data, tmp_path):
    short = tmp_path / "valid.npy"
    np.save(short, np.arange(10, dtype=np.uint16))
    config = write_tiny_config(tmp_path / "c.yaml")
    assert_refused(
        tinylm(*pretrain_args(config, tiny_data, tmp_path, valid=short)),
        str(short),
        "holds 10 tokens",
        "model.context_length",
    )


def test_tokenizer_of_another_vocabulary_than_the_config_is_refused_by_encode(tiny_data, tmp_path):
    config = write_tiny_config(tmp_path / "c.yaml", tokenizer={"vocab_size": 512})
    proc = tinylm(
        "encode",
        "--config",
        config,
        "--tokenizer",
        tiny_data["tokenizer"],
        "--input",
        tiny_data["train"].with_suffix(".txt"),
        "--output",
        tmp_path / "t.npy",
    )
    assert_refused(proc, str(tiny_data["tokenizer"]), "300", "512")
    assert not (tmp_path / "t.npy").exists()


def test_tokenizer_file_that_is_not_json_is_refused(tiny_data, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(b"\x80\x04\x95 pickle, not json")
    config = write_tiny_config(tmp_path / "c.yaml")
    assert_refused(tinylm(*pretrain_args(config, tiny_data, tmp_path, tokenizer=bad)), str(bad))


# ------------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_of_another_vocabulary_is_refused_by_evaluate_and_generate(tiny_data, tmp_path):
    ckpt = make_checkpoints(tmp_path, vocab_size=400)
    config = write_tiny_config(tmp_path / "c.yaml")
    proc = tinylm(
        "evaluate",
        "--config",
        config,
        "--tokenizer",
        tiny_data["tokenizer"],
        "--checkpoint-dir",
        ckpt,
        "--valid-tokens",
        tiny_data["valid"],
        "--output",
        tmp_path / "e.csv",
        "--plot",
        tmp_path / "e.png",
    )
    assert_refused(proc, "step_2.pt", "400", "300")
    proc = tinylm(
        "generate",
        "--config",
        config,
        "--tokenizer",
        tiny_data["tokenizer"],
        "--checkpoint-dir",
        ckpt,
        "--output",
        tmp_path / "s.txt",
    )
    assert_refused(proc, "step_2.pt", "400", "300")
    assert not (tmp_path / "e.csv").exists() and not (tmp_path / "s.txt").exists()


def test_flipped_byte_in_a_published_checkpoint_is_refused(tiny_data, tmp_path):
    ckpt = make_checkpoints(tmp_path)
    path = ckpt / "step_2.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.unlink()
    path.write_bytes(bytes(data))
    config = write_tiny_config(tmp_path / "c.yaml")
    proc = tinylm(
        "generate",
        "--config",
        config,
        "--tokenizer",
        tiny_data["tokenizer"],
        "--checkpoint-dir",
        ckpt,
        "--output",
        tmp_path / "s.txt",
    )
    assert_refused(proc, str(path), "sha256")


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("stage", ["evaluate", "generate", "pretrain"])
def test_hostile_checkpoint_never_runs_code(tiny_data, tmp_path, stage):
    """A checkpoint with a valid manifest whose pickle calls os.system: refused, and no side effect."""
    marker = tmp_path / "pwned"
    state = tmp_path / "state"
    folder = state / "step_0000002"
    folder.mkdir(parents=True)
    torch.save({"model": {}, "iteration": 2, "x": _Exploit(marker)}, folder / "checkpoint.pt")
    config = write_tiny_config(tmp_path / "c.yaml", train={"world_size": 1})
    # The manifest matches this run, so only the pickle itself stands between it and the loader.
    manifest = manifest_for(folder / "checkpoint.pt", step=2, world_size=1, threads_per_rank=1, seed=0)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    os.link(folder / "checkpoint.pt", tmp_path / "step_2.pt")
    (tmp_path / "step_2.json").write_text(json.dumps(manifest_for(tmp_path / "step_2.pt", step=2)))
    env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    common = ["--config", config, "--tokenizer", tiny_data["tokenizer"]]
    if stage == "evaluate":
        args = [
            "evaluate",
            *common,
            "--checkpoint-dir",
            tmp_path,
            "--valid-tokens",
            tiny_data["valid"],
            "--output",
            tmp_path / "e.csv",
            "--plot",
            tmp_path / "e.png",
        ]
    elif stage == "generate":
        args = ["generate", *common, "--checkpoint-dir", tmp_path, "--output", tmp_path / "s.txt"]
    else:
        args = pretrain_args(config, tiny_data, tmp_path)
        # The resume check needs this run's identity in the manifest.
        cfg = load_config(config)
        manifest.update(
            structural_hash=structural_hash(model_config_of(cfg, 300)),
            tokenizer_sha256=sha256_file(tiny_data["tokenizer"]),
            config=weight_config(cfg),
        )
        (folder / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "tinylm", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "with weights_only=True" in proc.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# config that cannot run here


def test_nccl_without_gpus_is_refused(tiny_data, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    config = write_tiny_config(tmp_path / "c.yaml", train={"backend": "nccl"})
    assert_refused(tinylm(*pretrain_args(config, tiny_data, tmp_path)), "train.backend", "nccl", "CUDA")


# ------------------------------------------------------------------------------------------------
# a full disk


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and mount rights, as on the project's machines)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_full_disk_while_writing_token_files_leaves_nothing(tiny_data, tmp_path, tiny_disk):
    config = write_tiny_config(tmp_path / "c.yaml")
    out = tiny_disk / "train.npy"
    proc = tinylm(
        "encode",
        "--config",
        config,
        "--tokenizer",
        tiny_data["tokenizer"],
        "--input",
        tiny_data["train"].with_suffix(".txt"),
        "--output",
        out,
    )
    assert_refused(proc, "No space left on device")
    assert list(tiny_disk.iterdir()) == []


def test_full_disk_while_writing_token_files_simulated(tiny_data, tmp_path, monkeypatch):
    """The same promise where no tmpfs can be mounted: fallocate reports ENOSPC."""
    from tinylm.__main__ import main

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    config = write_tiny_config(tmp_path / "c.yaml")
    out = tmp_path / "out" / "train.npy"
    code = main(
        [
            "encode",
            "--config",
            str(config),
            "--tokenizer",
            str(tiny_data["tokenizer"]),
            "--input",
            str(tiny_data["train"].with_suffix(".txt")),
            "--output",
            str(out),
        ]
    )
    assert code == 1
    assert list(out.parent.iterdir()) == []


def test_full_disk_while_writing_a_checkpoint_commits_nothing(tmp_path, tiny_disk):
    big = {"model": {"w": torch.zeros(64, 1024)}, "iteration": 1}  # 256 KiB: does not fit
    with pytest.raises((OSError, RuntimeError)):
        state_lib.commit(tiny_disk, 1, big, Manifest(world_size=1))
    assert state_lib.committed_steps(tiny_disk) == []
    assert not (tiny_disk / "step_0000001" / "checkpoint.pt").exists()
    # A small checkpoint still commits once there is room again.
    state_lib.commit(tiny_disk, 2, {"model": {"w": torch.zeros(4)}, "iteration": 2}, Manifest(world_size=1))
    assert state_lib.committed_steps(tiny_disk) == [2]


def test_backend_rules_against_the_cuda_device_count(monkeypatch):
    from tinylm.parallel.launch import resolve_backend

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_backend("auto", 2) == ("gloo", None)  # a CPU machine: nothing to say
    with pytest.raises(ValueError, match="'nccl' needs CUDA devices, and none is available"):
        resolve_backend("nccl", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_backend("nccl", 2) == ("nccl", None) and resolve_backend("auto", 2) == ("nccl", None)
    assert resolve_backend("gloo", 8) == ("gloo", None)
    with pytest.raises(
        ValueError,
        match=r"train\.world_size: 4 ranks on this machine .* need 4 CUDA devices, "
        r"but it has 2 \(set train\.world_size to 2 or fewer",
    ):
        resolve_backend("nccl", 4)
    assert resolve_backend("auto", 4) == (  # the default command works anywhere, and says so
        "gloo",
        "train.world_size 4 is more ranks than this machine's 2 CUDA devices: training on the CPU with gloo "
        "(set train.world_size: 2 to use the GPUs)",
    )
    # Under torchrun the ranks of this machine count, not the whole world.
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_backend("nccl", 8) == ("nccl", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="4 ranks on this machine"):
        resolve_backend("nccl", 8)


# ------------------------------------------------------------------------------------------------
# corpus files, through the CLI


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"fine text \xff\xfe broken", ["not valid UTF-8", "offset 10"]),
        (b"  \n\t ", ["empty or holds only whitespace"]),
    ],
)
def test_bad_corpus_file_is_refused_by_the_corpus_stage(tmp_path, content, words):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    config = write_tiny_config(tmp_path / "c.yaml", corpus={"source": "files", "train_files": [str(bad)]})
    proc = tinylm(
        "corpus",
        "--config",
        config,
        "--train-out",
        tmp_path / "out" / "train.txt",
        "--valid-out",
        tmp_path / "out" / "valid.txt",
    )
    assert_refused(proc, str(bad), *words)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_missing_corpus_file_is_named(tmp_path):
    config = write_tiny_config(
        tmp_path / "c.yaml", corpus={"source": "files", "train_files": [str(tmp_path / "nope.txt")]}
    )
    proc = tinylm(
        "corpus", "--config", config, "--train-out", tmp_path / "t.txt", "--valid-out", tmp_path / "v.txt"
    )
    assert_refused(proc, "nope.txt", "not found")
