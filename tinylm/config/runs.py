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

from tinylm.config.constants import DEFAULT_RUN
from tinylm.config.ladder import LADDER_KEY, LadderPlan, ladder_plan
from tinylm.config.lineage import check_lineage, tokenizer_section
from tinylm.config.loading import from_dict, read_config_file
from tinylm.config.sections import Config, ModelConfig
from tinylm.config.train import TrainConfig
from tinylm.keys import ConfigError

RESULTS = "results"  # where the workflow and the stages put their artifacts, relative to the project
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SEEDS_KEY = "seeds"  # the top-level key that repeats every run once per seed
SEED_KEY_KEY = "seed_key"  # the top-level key that names the key `seeds:` sets
# The keys a sweep may repeat, with the suffix of the run names: the initialisation and the data order
# together (train.seed; train.data_seed follows it while null), or the data order alone.
SEED_KEYS = {"train.seed": "s", "train.data_seed": "d"}


def run_configs(raw: Any) -> dict[str, Config]:
    """Every run of a raw config: the main config as "default", then each entry of `runs:` in order.

    A run is the main config with its overrides applied: `{"train.lr_max": 0.003}` sets that key.
    Each run is validated like the main config, and an error names the run and the key. A run name
    must be a safe path component (letters, digits, `_ . -`, starting with a letter or digit, at
    most 64 characters), not "default", and distinct from the others also when case is ignored (it
    names a folder).

    With `seeds: [s0, s1, ...]` (see `read_seeds`) every run, "default" included, is repeated once
    per seed with `train.seed` set to it, as the run `<run>.s<seed>` (`seed_run_name`), in the order
    run by run, then seed by seed; with `seed_key: train.data_seed` the seeds set the data order
    alone, as the runs `<run>.d<seed>`. The main config stays the run "default" at its own seed,
    first: the stages run by hand and the default target use it. A run that sets the seeded key
    itself is an error under `seeds:`.

    A `ladder:` section (tinylm/config/ladder.py) adds its runs to those of `runs:`.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    seeds, seed_key = read_seeds(raw), read_seed_key(raw)
    runs = named_runs(raw)
    raw = main_config(raw)
    configs = {DEFAULT_RUN: from_dict(raw)}
    named: dict[str, tuple[str, dict]] = {}  # run name -> (the run of `runs:` it is, its overrides)
    if seeds is None:
        named = {name: (name, overrides or {}) for name, overrides in runs.items()}
    else:
        for run, overrides in {DEFAULT_RUN: {}, **runs}.items():
            if seed_key in (overrides or {}):
                raise ConfigError(
                    f"runs.{run}: {seed_key} is set here and by {SEEDS_KEY}: {seeds} (under {SEEDS_KEY}: "
                    f"every run takes each seed in turn); remove one of the two"
                )
            for seed in seeds:
                name = seed_run_name(run, seed, seed_key)
                if not RUN_NAME.match(name):
                    raise ConfigError(
                        f"runs: {run!r} at {SEEDS_KEY}: {seed} is the run {name!r}, longer than a run "
                        f"name may be (64 characters); shorten the run's name"
                    )
                named[name] = (run, {**(overrides or {}), seed_key: seed})
    folded: dict[str, str] = {}
    for name, (run, overrides) in named.items():
        if name.lower() in folded:
            raise ConfigError(
                f"runs: {name!r} and {folded[name.lower()]!r} name the same folder on a "
                f"case-insensitive file system"
            )
        folded[name.lower()] = name
        configs[name] = _apply_overrides(raw, f"runs.{run}", overrides)
    check_lineage(configs)
    return configs


def main_config(raw: dict) -> dict:
    """The main config of a raw one: its sections, without the keys that name runs."""
    return {k: v for k, v in raw.items() if k not in (SEEDS_KEY, SEED_KEY_KEY, "runs")}


def named_runs(raw: Any) -> dict[str, dict[str, Any] | None]:
    """The named runs of a raw config before seeding, by name: `runs:`, then the `ladder:` runs.

    A run name must be a safe path component (RUN_NAME), not "default"; a ladder run may not take
    the name of a run of `runs:`.
    """
    runs = (raw or {}).get("runs") or {}
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
        for dotted in overrides or {}:
            if str(dotted).startswith(f"{LADDER_KEY}."):
                raise ConfigError(
                    f"runs.{name}: {dotted}: the ladder is the main config's; a run cannot set it"
                )
    plan, shared = ladder_of(raw)
    for run in plan.runs:
        if run.name in runs:
            raise ConfigError(f"runs.{run.name}: is also a run of {LADDER_KEY}:; rename the run")
    return {**runs, **{run.name: {**shared, **run.overrides} for run in plan.runs}}


def ladder_of(raw: Any) -> tuple[LadderPlan, dict[str, Any]]:
    """The `ladder:` plan of a raw config (tinylm/config/ladder.py) and the overrides its runs share
    (`ladder.overrides`), checked like a run's: the plan counts FLOPs at the overridden sizes."""
    main = main_config(raw or {})
    shared = dict(from_dict(main).ladder.overrides)
    for dotted in shared:
        if str(dotted).startswith(f"{LADDER_KEY}."):
            raise ConfigError(f"ladder.overrides: {dotted}: a ladder run cannot set the ladder's own keys")
    cfg = _apply_overrides(main, "ladder.overrides", shared)
    plan = ladder_plan(cfg.ladder, cfg.train.batch_size, cfg.model.context_length, cfg.tokenizer.vocab_size)
    return plan, shared


def _apply_overrides(raw: dict, where: str, overrides: dict[str, Any]) -> Config:
    merged = copy.deepcopy(raw)
    sections = [f.name for f in dataclasses.fields(Config)]
    for key, value in overrides.items():
        section, _, field_name = str(key).partition(".")
        if section not in sections or not field_name:
            raise ConfigError(
                f"{where}: {key!r} is not a dotted key 'section.key' of the config "
                f"(sections: {', '.join(sections)})"
            )
        merged.setdefault(section, {})
        if merged[section] is None:
            merged[section] = {}
        merged[section][field_name] = value
    try:
        return from_dict(merged)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def run_overrides(raw: Any) -> dict[str, dict[str, Any]]:
    """The overrides of every run of `run_configs` (`{}` for "default"), as given in `runs:`.

    A seeded run `<run>.s<seed>` has its run's overrides; its seed is not listed (see `seed_runs`).
    """
    runs = {name: dict(overrides or {}) for name, overrides in named_runs(raw).items()}
    seeded = {name: runs.get(run.config, {}) for name, run in seed_runs(raw).items()}
    return {DEFAULT_RUN: {}, **(seeded or runs)}


def read_seed_key(raw: Any) -> str:
    """The key `seeds:` repeats (`seed_key:`, default train.seed), checked: one of SEED_KEYS, and
    given only beside `seeds:`."""
    if not isinstance(raw, dict) or SEED_KEY_KEY not in raw:
        return "train.seed"
    seed_key = raw[SEED_KEY_KEY]
    if seed_key not in SEED_KEYS:
        raise ConfigError(
            f"{SEED_KEY_KEY}: {seed_key!r} is not one of {list(SEED_KEYS)} (the key {SEEDS_KEY}: sets)"
        )
    if SEEDS_KEY not in raw:
        raise ConfigError(
            f"{SEED_KEY_KEY}: names the key {SEEDS_KEY}: sets, and this config has no {SEEDS_KEY}:"
        )
    return seed_key


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
    """A run of a sweep with `seeds:`: the run it repeats (its configuration) and its seed (the value
    of the key `seed_key:` names)."""

    config: str
    seed: int


def seed_run_name(run: str, seed: int, seed_key: str = "train.seed") -> str:
    """The name of `run` at `seed` under `seeds:`: `<run>.s<seed>` ("default.s0", "r1_wd0.1.s2"), or
    `<run>.d<seed>` when the seeds set train.data_seed."""
    return f"{run}.{SEED_KEYS[seed_key]}{seed}"


def seed_runs(raw: Any) -> dict[str, SeedRun]:
    """The seeded runs of a raw config in `run_configs`' order, by name; {} without `seeds:`.

    The names are not checked here: `run_configs` does that.
    """
    seeds, seed_key = read_seeds(raw), read_seed_key(raw)
    if seeds is None:
        return {}
    runs = [DEFAULT_RUN, *named_runs(raw)]
    return {seed_run_name(run, seed, seed_key): SeedRun(run, seed) for run in runs for seed in seeds}


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
    the execution keys, the keys whose `applies_if` condition does not hold and the `null_means`
    keys that are null or equal to the key they fall back to (tinylm/keys.py)."""
    return {name: _deciding(getattr(cfg, name)) for name in ("model", "train")}


def _deciding(section: Any) -> dict[str, Any]:
    values = dataclasses.asdict(section)
    deciding = {}
    for f in dataclasses.fields(section):
        condition = f.metadata.get("applies_if")
        if f.metadata.get("execution") or (condition and values[condition[0]] != condition[1]):
            continue
        fallback = f.metadata.get("null_means")
        if fallback and values[f.name] in (None, values[fallback]):
            continue
        left_out_at = f.metadata.get("left_out_at")
        if left_out_at is not None and values[f.name] == left_out_at[0]:
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


def data_hash(cfg: Config, tokenizer_from: str | None = None) -> str:
    """Identifies the data stages' outputs (corpus, tokenizer, token files): runs with equal ones share them.

    `num_workers` never changes an output, so it is left out. `tokenizer_from`: the data hash of the
    data whose tokenizer encodes this corpus (a branch's parent's, tinylm/config/lineage.py); when it
    is another corpus's, the hash says so, and this data never shares a folder with a corpus that
    trains its own tokenizer.
    """
    tokenizer = tokenizer_section(cfg)
    own = config_hash(cfg.corpus, tokenizer)
    return own if tokenizer_from in (None, own) else config_hash(cfg.corpus, tokenizer, tokenizer_from)


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file (its `runs:` too); errors name the file and the key.

    Returns the main config (the run "default"); see `run_configs` for the named runs.
    """
    try:
        return run_configs(read_config_file(path))[DEFAULT_RUN]
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(f"{path}: ") else f"{path}: {message}") from None
