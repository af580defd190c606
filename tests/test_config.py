"""Config validation: every bad value is refused with a message naming the key and the value."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tinylm.config import Config, ConfigError, from_dict, json_schema, load_config, run_hash

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"


def raw_default() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def with_value(section: str, key: str, value) -> dict:
    raw = raw_default()
    raw[section][key] = value
    return raw


def test_shipped_config_is_valid_and_matches_the_dataclass_defaults():
    cfg = load_config(CONFIG)
    assert cfg.to_dict() == Config().to_dict()


def test_every_config_key_is_documented_in_config_readme():
    readme = (ROOT / "config" / "README.md").read_text()
    for section, keys in Config().to_dict().items():
        for key in keys:
            assert f"`{section}.{key}`" in readme, f"{section}.{key} is not documented in config/README.md"


@pytest.mark.parametrize(
    ("section", "key", "value", "words"),
    [
        ("train", "batch_size", "16", ["train.batch_size", "integer", "'16'"]),
        ("train", "batch_size", 16.5, ["train.batch_size", "integer"]),
        ("train", "shard_optimizer", 1, ["train.shard_optimizer", "boolean"]),
        ("train", "max_iters", True, ["train.max_iters", "integer"]),
        ("train", "lr_max", -1.0, ["train.lr_max", "-1.0", "out of range"]),
        ("train", "lr_max", float("nan"), ["train.lr_max", "finite"]),
        ("train", "backend", "mpi", ["train.backend", "'mpi'", "gloo"]),
        ("train", "batch_size", 15, ["train.batch_size", "15", "world_size"]),
        (
            "train",
            "grad_accum_steps",
            3,
            ["train.batch_size", "32", "train.world_size", "train.grad_accum_steps", "2 * 3"],
        ),
        ("train", "grad_accum_steps", 0, ["train.grad_accum_steps", "0"]),
        ("train", "dtype", "fp8", ["train.dtype", "'fp8'", "bfloat16"]),
        ("train", "compile", "yes", ["train.compile", "boolean"]),
        ("train", "peak_flops", 0.0, ["train.peak_flops", "0.0"]),
        ("train", "lr_min", 1.0, ["train.lr_min", "lr_max"]),
        (
            "train",
            "lr_min",
            "6e-05",
            ["train.lr_min", "'6e-05'", "write 6.0e-05"],
        ),  # YAML 1.1 reads it as text
        ("train", "warmup_iters", 5000, ["train.warmup_iters", "5000"]),
        ("train", "keep_checkpoints", 1, ["train.keep_checkpoints", "1"]),
        ("tokenizer", "vocab_size", 70000, ["tokenizer.vocab_size", "70000", "65536"]),
        ("tokenizer", "vocab_size", 257, ["tokenizer.vocab_size", "257"]),
        ("tokenizer", "special_tokens", ["<|endoftext|>", "<|endoftext|>"], ["tokenizer.special_tokens"]),
        ("tokenizer", "special_tokens", ["<|pad|>"], ["tokenizer.special_tokens", "<|endoftext|>"]),
        ("model", "num_heads", 3, ["model.num_heads", "3", "128"]),
        ("model", "num_heads", 128, ["model.num_heads", "even"]),
        ("model", "context_length", 0, ["model.context_length", "0"]),
        ("generate", "top_p", 0.0, ["generate.top_p", "0.0"]),
        ("corpus", "source", "ftp", ["corpus.source", "'ftp'"]),
        ("corpus", "valid_plays", "hamlet", ["corpus.valid_plays", "list"]),
    ],
)
def test_bad_values_name_the_key_and_value(section, key, value, words):
    with pytest.raises(ConfigError) as err:
        from_dict(with_value(section, key, value))
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_unknown_key_and_section_are_refused():
    raw = with_value("train", "learning_rate", 0.1)
    with pytest.raises(ConfigError, match=r"train\.learning_rate: unknown key"):
        from_dict(raw)
    raw = raw_default()
    raw["optimizer"] = {}
    with pytest.raises(ConfigError, match="optimizer: unknown config section"):
        from_dict(raw)


def test_url_source_requires_urls_and_hashes():
    with pytest.raises(ConfigError, match=r"corpus\.train_url"):
        from_dict(with_value("corpus", "source", "url"))
    with pytest.raises(ConfigError, match=r"corpus\.train_files"):
        from_dict(with_value("corpus", "source", "files"))


def test_load_config_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  batch_size: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("train:\n  max_iters: -3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: train\.max_iters: -3"):
        load_config(bad)
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_run_hash_changes_with_training_keys_only():
    base = run_hash(from_dict(raw_default()))
    assert run_hash(from_dict(with_value("generate", "temperature", 0.5))) == base
    assert run_hash(from_dict(with_value("evaluate", "batch_size", 4))) == base
    assert run_hash(from_dict(with_value("model", "d_model", 64))) != base
    assert run_hash(from_dict(with_value("train", "seed", 1))) != base
    assert run_hash(from_dict(with_value("train", "checkpoint_interval", 100))) != base
    assert run_hash(from_dict(with_value("train", "dtype", "float32"))) != base
    # Logging, validation estimates, retention and timeouts never change the weights; the layout of
    # the batch over ranks and micro-steps, compilation and kernels only within float rounding.
    for key, value in [
        ("log_interval", 7),
        ("timeout_s", 60.0),
        ("world_size", 1),
        ("grad_accum_steps", 2),
        ("compile", True),
        ("deterministic", False),
        ("threads_per_rank", 2),
        ("backend", "gloo"),
    ]:
        assert run_hash(from_dict(with_value("train", key, value))) == base, key


def test_committed_schema_is_generated_from_the_dataclasses():
    committed = json.loads((ROOT / "workflow" / "schemas" / "config.schema.json").read_text())
    assert committed == json_schema(), "run `python -m tinylm schema` to regenerate the schema"


def test_schema_accepts_the_default_config_and_rejects_what_the_dataclasses_reject():
    schema = json_schema()
    jsonschema.validate(raw_default(), schema)
    for section, key, value in [
        ("train", "batch_size", "x"),
        ("train", "lr_max", 0.0),
        ("train", "nonsense", 1),
        ("corpus", "source", "ftp"),
    ]:
        raw = copy.deepcopy(raw_default())
        raw[section][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(raw, schema)
        with pytest.raises(ConfigError):
            from_dict(raw)


def test_cli_reports_a_bad_config_and_exits_nonzero(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump(with_value("train", "batch_size", 15)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinylm",
            "corpus",
            "--config",
            str(bad),
            "--train-out",
            str(tmp_path / "t.txt"),
            "--valid-out",
            str(tmp_path / "v.txt"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "train.batch_size: 15 is not divisible" in proc.stderr
    assert not (tmp_path / "t.txt").exists()


def test_runs_are_the_main_config_with_their_overrides():
    from tinylm.config import DEFAULT_RUN, run_configs, run_overrides

    raw = raw_default()
    raw["runs"] = {
        "lr3e-3": {"train.lr_max": 0.003},
        "wide": {"model.d_model": 192, "model.d_ff": 512},
        "same": None,
    }
    runs = run_configs(raw)
    assert list(runs) == [DEFAULT_RUN, "lr3e-3", "wide", "same"]
    base = from_dict(raw_default())
    assert runs[DEFAULT_RUN] == base and runs["same"] == base
    assert runs["lr3e-3"].train.lr_max == 0.003 and runs["lr3e-3"].model == base.model
    assert (runs["wide"].model.d_model, runs["wide"].model.d_ff) == (192, 512)
    assert runs["wide"].train == base.train
    assert run_overrides(raw)["wide"] == {"model.d_model": 192, "model.d_ff": 512}
    # Cross-key rules hold per run: 4 heads of 48 dims is fine, 5 heads do not divide 192.
    raw["runs"] = {"odd": {"model.d_model": 192, "model.num_heads": 5}}
    with pytest.raises(ConfigError, match="runs.odd: model.num_heads: 5 does not divide"):
        run_configs(raw)


def test_a_duplicate_key_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  lr_max: 0.1\n  batch_size: 8\n  lr_max: 0.2\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 4: 'lr_max' is given twice"):
        load_config(path)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("train", "batch_size", "16", "train.batch_size: expected an integer, got '16' (str)"),
        ("train", "lr_max", "fast", "train.lr_max: expected a number, got 'fast' (str)"),
        ("train", "compile", 1, "train.compile: expected a boolean, got 1 (int)"),
        ("generate", "prompts", "x", "generate.prompts: expected a list of string, got 'x'"),
    ],
)
def test_a_wrong_type_is_named_with_its_article(section, key, value, message):
    with pytest.raises(ConfigError) as error:
        from_dict({section: {key: value}})
    assert str(error.value) == message
