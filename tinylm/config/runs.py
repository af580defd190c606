"""Named runs (`runs:` sweeps, each repeated per seed with `seeds:`) and the hashes and weight configs that
identify a run."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

from tinylm.config.loading import from_dict, read_config_file
from tinylm.config.sections import Config, ModelConfig
from tinylm.config.train import TrainConfig
from tinylm.keys import ConfigError

DEFAULT_RUN = "default"
RESULTS = "results"  # where the workflow and the stages put their artifacts, relative to the project
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SEEDS_KEY = "seeds"  # the top-level key that repeats every run once per seed
SEED_KEY = "train.seed"


def run_configs(raw: Any) -> dict[str, Config]:
    """Every run of a raw config: the main config as "default", then each entry of `runs:` in order.

    A run is the main config with its overrides applied: `{"train.lr_max": 0.003}` sets that key.
    Each run is validated like the main config, and an error names the run and the key. A run name
    must be a safe path component (letters, digits, `_ . -`, starting with a letter or digit, at
    most 64 characters), not "default", and distinct from the others also when case is ignored (it
    names a folder).

    With `seeds: [s0, s1, ...]` (see `read_seeds`) every run, "default" included, is repeated once
    per seed with `train.seed` set to it, as the run `<run>.s<seed>` (`seed_run_name`), in the order
    run by run, then seed by seed. The main config stays the run "default" at its own seed, first:
    the stages run by hand and the default target use it. A run that sets `train.seed` itself is an
    error under `seeds:`.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    seeds = read_seeds(raw)
    raw = dict(raw)
    raw.pop(SEEDS_KEY, None)
    runs = raw.pop("runs", None) or {}
    configs = {DEFAULT_RUN: from_dict(raw)}
    if not isinstance(runs, dict):
        raise ConfigError(f"runs: expected a mapping of run names to overrides, got {runs!r}")
    for name, overrides in runs.items():
        if not isinstance(name, str) or not RUN_NAME.match(name) or name == DEFAULT_RUN:
            raise ConfigError(
                f"runs: {name!r} is not a valid run name (letters, digits, '_', '.', '-', starting "
                f"with a letter or digit, at most 64 characters, not {DEFAULT_RUN!r})"
            )
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError(f"runs.{name}: expected a mapping of dotted keys to values, got {overrides!r}")
    named: dict[str, tuple[str, dict]] = {}  # run name -> (the run of `runs:` it is, its overrides)
    if seeds is None:
        named = {name: (name, overrides or {}) for name, overrides in runs.items()}
    else:
        for run, overrides in {DEFAULT_RUN: {}, **runs}.items():
            if SEED_KEY in (overrides or {}):
                raise ConfigError(
                    f"runs.{run}: {SEED_KEY} is set here and by {SEEDS_KEY}: {seeds} (under {SEEDS_KEY}: "
                    f"every run takes each seed in turn); remove one of the two"
                )
            for seed in seeds:
                name = seed_run_name(run, seed)
                if not RUN_NAME.match(name):
                    raise ConfigError(
                        f"runs: {run!r} at {SEEDS_KEY}: {seed} is the run {name!r}, longer than a run "
                        f"name may be (64 characters); shorten the run's name"
                    )
                named[name] = (run, {**(overrides or {}), SEED_KEY: seed})
    folded: dict[str, str] = {}
    for name, (run, overrides) in named.items():
        if name.lower() in folded:
            raise ConfigError(
                f"runs: {name!r} and {folded[name.lower()]!r} name the same folder on a "
                f"case-insensitive file system"
            )
        folded[name.lower()] = name
        configs[name] = _apply_overrides(raw, run, overrides)
    return configs


def _apply_overrides(raw: dict, name: str, overrides: dict[str, Any]) -> Config:
    merged = copy.deepcopy(raw)
    sections = [f.name for f in dataclasses.fields(Config)]
    for key, value in overrides.items():
        section, _, field_name = str(key).partition(".")
        if section not in sections or not field_name:
            raise ConfigError(
                f"runs.{name}: {key!r} is not a dotted key 'section.key' of the config "
                f"(sections: {', '.join(sections)})"
            )
        merged.setdefault(section, {})
        if merged[section] is None:
            merged[section] = {}
        merged[section][field_name] = value
    try:
        return from_dict(merged)
    except ConfigError as e:
        raise ConfigError(f"runs.{name}: {e}") from None


def run_overrides(raw: Any) -> dict[str, dict[str, Any]]:
    """The overrides of every run of `run_configs` (`{}` for "default"), as given in `runs:`.

    A seeded run `<run>.s<seed>` has its run's overrides; its `train.seed` is not listed (see
    `seed_runs`).
    """
    runs = {name: dict(overrides or {}) for name, overrides in ((raw or {}).get("runs") or {}).items()}
    seeded = {name: runs.get(run.config, {}) for name, run in seed_runs(raw).items()}
    return {DEFAULT_RUN: {}, **(seeded or runs)}


def read_seeds(raw: Any) -> list[int] | None:
    """The `seeds:` of a raw config, checked: None when it has none, else a non-empty list of distinct
    integers >= 0. Anything else is a ConfigError of one line naming `seeds`."""
    if not isinstance(raw, dict) or SEEDS_KEY not in raw:
        return None
    seeds = raw[SEEDS_KEY]
    ok = (
        isinstance(seeds, list)
        and len(seeds) > 0
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        and len(set(seeds)) == len(seeds)
    )
    if not ok:
        raise ConfigError(
            f"{SEEDS_KEY}: expected a non-empty list of distinct integers >= 0 (each run is trained once "
            f"per seed), got {seeds!r}"
        )
    return list(seeds)


class SeedRun(NamedTuple):
    """A run of a sweep with `seeds:`: the run it repeats (its configuration) and its `train.seed`."""

    config: str
    seed: int


def seed_run_name(run: str, seed: int) -> str:
    """The name of `run` at `seed` under `seeds:`: `<run>.s<seed>` ("default.s0", "r1_wd0.1.s2")."""
    return f"{run}.s{seed}"


def seed_runs(raw: Any) -> dict[str, SeedRun]:
    """The seeded runs of a raw config in `run_configs`' order, by name; {} without `seeds:`.

    The names are not checked here: `run_configs` does that.
    """
    seeds = read_seeds(raw)
    if seeds is None:
        return {}
    runs = [DEFAULT_RUN, *(raw.get("runs") or {})]
    return {seed_run_name(run, seed): SeedRun(run, seed) for run in runs for seed in seeds}


def config_hash(*sections: Any) -> str:
    """A stable short hash of config sections (dataclasses or plain data)."""
    data = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s for s in sections]
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _keys_with(section_cls: type, role: str) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(section_cls) if f.metadata.get(role))


# Train keys that decide how a run is executed, logged, kept or waited for, never which updates it
# makes (declared with `execution=True` beside each key, tinylm/config/train.py): a run may be
# resumed with other values of these.
EXECUTION_TRAIN_KEYS = _keys_with(TrainConfig, "execution")


def weight_config(cfg: Config) -> dict[str, Any]:
    """The model and train keys that decide the trained weights: every key of the two sections but
    the execution keys and the keys whose `applies_if` condition does not hold (tinylm/keys.py)."""
    return {name: _deciding(getattr(cfg, name)) for name in ("model", "train")}


def _deciding(section: Any) -> dict[str, Any]:
    values = dataclasses.asdict(section)
    deciding = {}
    for f in dataclasses.fields(section):
        condition = f.metadata.get("applies_if")
        if f.metadata.get("execution") or (condition and values[condition[0]] != condition[1]):
            continue
        deciding[f.name] = values[f.name]
    return deciding


def default_weight_config() -> dict[str, dict[str, Any]]:
    """Every key a weight config may hold, at its default: what one that leaves a key out means by it."""
    train = {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k not in EXECUTION_TRAIN_KEYS}
    return {"model": dataclasses.asdict(ModelConfig()), "train": train}


def weight_config_differences(
    saved: dict[str, Any], current: dict[str, Any], sections: tuple[str, ...] | None = None
) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for every key of two weight configs that differs.

    A key one side leaves out (a key its writer did not have yet, or one that does not apply there)
    is at its default on that side. `sections` (default: every section of either side) limits the
    comparison. Keys come in the config's order (so `train.optimizer` comes before the keys that
    depend on it), then any unknown keys in sorted order.
    """
    defaults = default_weight_config()
    names = sections if sections is not None else tuple(dict.fromkeys([*defaults, *current, *saved]))
    out = []
    for section in names:
        saved_values, values = saved.get(section), current.get(section)
        if not isinstance(saved_values, dict) or not isinstance(values, dict):
            continue
        section_defaults = defaults.get(section, {})
        known = [k for k in section_defaults if k in values or k in saved_values]
        for key in dict.fromkeys([*known, *sorted(values.keys() | saved_values.keys())]):
            default = section_defaults.get(key)
            before, now = saved_values.get(key, default), values.get(key, default)
            if before != now:
                out.append((f"{section}.{key}", before, now))
    return out


def run_state_dir(cfg: Config, run_dir: str = "") -> str:
    """The resume state folder of the run `cfg`: results/<run_dir>state/<run hash>.

    Outside the workflow's declared outputs (Snakemake deletes those before a job runs and after it
    fails), so a killed run rerun resumes from there. `run_dir` is "" for the main config and
    "runs/<name>/" for a named run.
    """
    return f"{RESULTS}/{run_dir}state/{run_hash(cfg)}"


def run_hash(cfg: Config) -> str:
    """Identifies one training run: everything that decides the trained weights."""
    return config_hash(cfg.corpus, cfg.tokenizer, weight_config(cfg))


def data_hash(cfg: Config) -> str:
    """Identifies the data stages' outputs (corpus, tokenizer, token files): runs with equal ones share them.

    `num_workers` never changes an output, so it is left out.
    """
    tokenizer = {k: v for k, v in dataclasses.asdict(cfg.tokenizer).items() if k != "num_workers"}
    return config_hash(cfg.corpus, tokenizer)


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file (its `runs:` too); errors name the file and the key.

    Returns the main config (the run "default"); see `run_configs` for the named runs.
    """
    try:
        return run_configs(read_config_file(path))[DEFAULT_RUN]
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(f"{path}: ") else f"{path}: {message}") from None
