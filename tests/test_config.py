"""Config validation: every bad value is refused with a message naming the key and the value."""

import copy
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.config import Config, ConfigError, TrainConfig, from_dict, load_config, run_hash
from tinylm.config import docs as config_docs
from tinylm.config import key as config_key

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


def test_config_docs_are_generated_from_the_dataclasses():
    """config.yaml's comments and config/README.md's tables are what tinylm/config/ generates."""
    assert config_docs.drift(ROOT) == [], "run `python -m tinylm config-docs` to regenerate them"
    readme = (ROOT / "config" / "README.md").read_text()
    for section, keys in Config().to_dict().items():
        for name in keys:
            assert f"| `{section}.{name}` |" in readme, f"{section}.{name} has no row in config/README.md"


def config_with_train(train_cls: type) -> type:
    """A copy of Config whose train section is `train_cls`."""
    sections = {name: train_cls if name == "train" else cls for name, cls in config_docs.sections(Config)}
    fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections.items()]
    return dataclasses.make_dataclass("Config", fields)


@dataclasses.dataclass
class TrainWithOtherHelp(TrainConfig):
    __doc__ = TrainConfig.__doc__  # the section's comment in config.yaml
    seed: int = config_key(0, lo=0, help="a changed explanation of the seed")


@dataclasses.dataclass
class TrainWithOtherMore(TrainConfig):
    __doc__ = TrainConfig.__doc__  # the section's comment in config.yaml
    seed: int = config_key(
        0, lo=0, help=TrainConfig.__dataclass_fields__["seed"].metadata["help"], more="(changed)"
    )


@dataclasses.dataclass
class TrainWithNewKey(TrainConfig):
    __doc__ = TrainConfig.__doc__  # the section's comment in config.yaml
    label_smoothing: float = config_key(0.0, lo=0.0, help="a key added to the dataclass")


@pytest.mark.parametrize(
    ("train_cls", "drifted"),
    [
        (TrainWithOtherHelp, ["config/config.yaml", "config/README.md"]),
        (TrainWithOtherMore, ["config/README.md"]),  # `more` is the README's only
        (TrainWithNewKey, ["config/config.yaml", "config/README.md"]),
    ],
)
def test_the_docs_check_fails_when_a_help_text_changes_or_a_key_is_added(tmp_path, train_cls, drifted):
    """The check, run against a modified copy of the dataclasses, names the files that drifted; writing
    brings them back in step."""
    modified = config_with_train(train_cls)
    assert config_docs.drift(ROOT, modified) == drifted
    (tmp_path / "config").mkdir()
    for name in ("config.yaml", "README.md"):
        shutil.copy(ROOT / "config" / name, tmp_path / "config" / name)
    assert config_docs.write(tmp_path, modified) == drifted
    assert config_docs.drift(tmp_path, modified) == []
    yaml_text = (tmp_path / "config" / "config.yaml").read_text()
    readme = (tmp_path / "config" / "README.md").read_text()
    if train_cls is TrainWithNewKey:
        assert "  label_smoothing: 0.0       # a key added to the dataclass\n" in yaml_text
        assert "| `train.label_smoothing` | `0.0` | a key added to the dataclass |" in readme
    # The prose around the tables stays as it was written.
    original = (ROOT / "config" / "README.md").read_text()
    assert config_docs.TABLE.sub("", readme) == config_docs.TABLE.sub("", original)


def test_a_readme_without_a_sections_table_markers_is_refused():
    readme = (ROOT / "config" / "README.md").read_text().replace("<!-- keys: model -->", "")
    with pytest.raises(ValueError, match=r"missing: \['model'\]"):
        config_docs.render_readme(readme)


@pytest.mark.parametrize(
    "value",
    [0.1, 6e-4, 1e-8, 2.5e20, 10000.0, 0, None, True, "", "true", "null", "1e3", "a: b", "<|endoftext|>",
     "it's", "é", [], ["ROMEO:\n", "x"], ["hamlet", "richard-ii"]],
)  # fmt: skip
def test_config_yaml_values_read_back_as_the_defaults(value):
    assert yaml.safe_load(f"k: {config_docs.yaml_value(value)}") == {"k": value}


def test_config_docs_check_command(tmp_path):
    """`tinylm config-docs --check`: exit 0 in step; exit 1 and one line naming the file after an edit."""

    def check(root):
        command = [sys.executable, "-m", "tinylm", "config-docs", "--check", "--root", str(root)]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT)

    assert check(ROOT).returncode == 0
    (tmp_path / "config").mkdir()
    shutil.copy(ROOT / "config" / "README.md", tmp_path / "config" / "README.md")
    yaml_text = (ROOT / "config" / "config.yaml").read_text().replace("# AdamW epsilon", "# epsilon")
    (tmp_path / "config" / "config.yaml").write_text(yaml_text)
    proc = check(tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "tinylm config-docs: error: config/config.yaml: not what tinylm/config/ generates; "
        "run `python -m tinylm config-docs`"
    ]


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
    with pytest.raises(ConfigError, match="optimizer: unknown config section \\(known"):
        from_dict(raw)


@pytest.mark.parametrize(
    "section, key, suggestion",
    [
        ("train", "max_iter", "train.max_iters"),
        ("model", "dmodel", "model.d_model"),
        ("generate", "seeds", "generate.seed"),
    ],
)
def test_a_mistyped_key_gets_the_nearest_known_one(section, key, suggestion):
    with pytest.raises(ConfigError, match=f"{section}.{key}: unknown key; did you mean `{suggestion}`\\?"):
        from_dict(with_value(section, key, 1))
    raw = raw_default()
    raw["trian"] = raw.pop("train")
    with pytest.raises(ConfigError, match="trian: unknown config section; did you mean `train`\\?"):
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
    assert run_hash(from_dict(with_value("model", "pad_vocab_to_multiple", 64))) != base
    # A capability off is left out of the identity: the runs made before it existed keep their hash.
    from tinylm.config.runs import weight_config

    assert "pad_vocab_to_multiple" not in weight_config(from_dict(raw_default()))["model"]
    assert (
        weight_config(from_dict(with_value("model", "pad_vocab_to_multiple", 64)))["model"][
            "pad_vocab_to_multiple"
        ]
        == 64
    )
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


def test_seeds_repeat_every_run_once_per_seed_with_its_overrides():
    from tinylm.config import DEFAULT_RUN, SeedRun, data_hash, run_configs, run_overrides, seed_runs

    raw = raw_default()
    raw["seeds"] = [3, 0, 7]
    raw["runs"] = {"r1_wd0.1": {"train.lr_max": 0.003}, "same": None}
    runs = run_configs(raw)
    seeds = raw["seeds"]
    expected = [f"{run}.s{seed}" for run in [DEFAULT_RUN, "r1_wd0.1", "same"] for seed in seeds]
    assert list(runs) == [DEFAULT_RUN, *expected]
    unseeded = run_configs({k: v for k, v in raw.items() if k != "seeds"})
    main = unseeded[DEFAULT_RUN]
    assert runs[DEFAULT_RUN] == main  # the main config at its own seed, for the default target
    for name in expected:
        run, _, seed = name.rpartition(".s")
        cfg = runs[name]
        assert cfg.train.seed == int(seed), name
        assert seed_runs(raw)[name] == SeedRun(run, int(seed))
        # Only train.seed differs from the run it repeats, so the data stages are shared.
        assert (
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=main.train.seed))
            == (unseeded[run])
        )
        assert data_hash(cfg) == data_hash(main)
        assert run_overrides(raw)[name] == (raw["runs"].get(run) or {})
    assert list(seed_runs(raw)) == expected
    assert seed_runs(raw_default()) == {}


@pytest.mark.parametrize(
    ("seeds", "runs", "message"),
    [
        ([], {}, "seeds: expected a non-empty list of distinct integers >= 0"),
        ([1, 1], {}, r"seeds: .* got \[1, 1\]"),
        ([0, -1], {}, r"seeds: .* got \[0, -1\]"),
        ([True], {}, r"seeds: .* got \[True\]"),
        ([0.5], {}, r"seeds: .* got \[0.5\]"),
        (None, {}, "seeds: .* got None"),
        (3, {}, "seeds: .* got 3"),
        (
            [0, 1],
            {"lr": {"train.lr_max": 0.01, "train.seed": 4}},
            "runs.lr: train.seed is set here and by seeds",
        ),
        ([0], {"x" * 63: {}}, "runs: 'x{63}' at seeds: 0 is the run 'x{63}.s0', longer than"),
        ([0], {"Default": {}}, "runs: 'Default.s0' and 'default.s0' name the same folder"),
        ([0], {"lr": {"train.lr_max": -1}}, r"runs.lr: train.lr_max: -1.0 is out of range"),
    ],
)
def test_bad_seeds_are_one_line_naming_the_key(seeds, runs, message):
    from tinylm.config import run_configs

    raw = raw_default()
    raw["seeds"] = seeds
    raw["runs"] = runs
    with pytest.raises(ConfigError, match=message) as error:
        run_configs(raw)
    assert "\n" not in str(error.value)


def test_a_config_file_with_seeds_loads_as_its_main_config(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**raw_default(), "seeds": [1, 2]}))
    assert load_config(path) == from_dict(raw_default())
    path.write_text(yaml.safe_dump({**raw_default(), "seeds": [1, 1]}))
    with pytest.raises(ConfigError, match=r"sweep.yaml: seeds: .* got \[1, 1\]"):
        load_config(path)


nested = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2)),
    lambda children: st.dictionaries(st.sampled_from("abc"), children, max_size=3),
    max_leaves=8,
)


@given(
    st.dictionaries(st.sampled_from("abc"), nested, max_size=3),
    st.dictionaries(st.sampled_from("abc"), nested, max_size=3),
)
@settings(max_examples=200, deadline=None)
def test_config_files_merge_as_snakemake_merges_them(base, over):
    """`--config FILE` merges FILE onto config/config.yaml as Snakemake merges --configfile onto it."""
    from snakemake.utils import update_config

    from tinylm.config.merging import merge_onto

    expected = copy.deepcopy(base)
    update_config(expected, copy.deepcopy(over))
    before = copy.deepcopy(base)
    assert merge_onto(base, over) == expected
    assert base == before  # the base is not changed


def test_a_config_given_by_hand_merges_onto_the_project_config(tmp_path, monkeypatch, capsys):
    """A partial file by hand takes the rest from config/config.yaml (as Snakemake does); the stage says
    so in its first line, and an error names the file that set the key."""
    from tinylm.__main__ import main
    from tinylm.config.merging import resolve_config

    (tmp_path / "config").mkdir()
    project = yaml.safe_load(CONFIG.read_text())
    project["generate"]["seed"] = 1
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(project))
    (tmp_path / "partial.yaml").write_text("train:\n  max_iters: 300\n")
    (tmp_path / "bad.yaml").write_text("train:\n  max_iter: 30\n")
    monkeypatch.chdir(tmp_path)
    cfg, layers = resolve_config("partial.yaml")
    assert (cfg.generate.seed, cfg.train.max_iters) == (1, 300)
    assert [name for name, _ in layers] == ["config/config.yaml", "partial.yaml"]
    typo = r"^bad.yaml: train.max_iter: unknown key; did you mean `train.max_iters`"
    with pytest.raises(ConfigError, match=typo):
        resolve_config("bad.yaml")
    assert main(["env", "--config", "partial.yaml", "--timed-steps", "0"]) == 0
    said = capsys.readouterr().err
    assert "[env] config: partial.yaml over config/config.yaml over the built-in defaults" in said
    # Outside a project folder, the file alone over the built-in defaults.
    monkeypatch.chdir(tmp_path / "config")
    cfg, layers = resolve_config("../partial.yaml")
    assert (cfg.generate.seed, cfg.train.max_iters) == (0, 300) and len(layers) == 1
