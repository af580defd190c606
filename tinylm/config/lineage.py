"""Runs that start from another run's checkpoint (`train.init_from`): who the parent is, and the
rules a branch keeps, checked over all the runs of a config before anything trains.

A branch names its parent by run name (`default`, a run of `runs:`; under `seeds:` the parent's run
of the same seed) or by a folder of published checkpoints (a path with a `/`, checked when the run
starts: tinylm/pretrain/init.py). Against a parent of the config it must: name a run that exists,
close no cycle, keep the parent's tokenizer section, change no model key that changes a weight's
shape, start from a step the parent publishes, and train past it. It may train on another corpus:
the workflow then encodes that corpus with the tokenizer of its first ancestor (`tokenizer_run`),
whose ids the weights were trained on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tinylm.config.constants import DEFAULT_RUN
from tinylm.config.sections import Config
from tinylm.keys import ConfigError

# Model keys a branch may change: none of them changes the shape of a weight.
SHAPE_FREE_MODEL_KEYS = frozenset(
    {"context_length", "rope_theta", "dropout", "logit_softcap", "zero_init_output"}
)


def names_a_folder(init_from: str) -> bool:
    """Whether `init_from` is a folder of checkpoints (a path with a `/`) rather than a run's name."""
    return "/" in init_from or "\\" in init_from


def parent_of(name: str, cfg: Config, configs: dict[str, Config]) -> str | None:
    """The run `name` starts from, among `configs`: `train.init_from` itself, or under `seeds:` its run
    of `name`'s seed (`const.s1` for the branch `cool.s1` of `init_from: const`); None when the run
    starts from random weights or from a folder. A name that is no run is a ConfigError."""
    init_from = cfg.train.init_from
    if init_from is None or names_a_folder(init_from):
        return None
    seeded = name.rsplit(".", 1)[1] if "." in name and name != DEFAULT_RUN else None
    for candidate in ([f"{init_from}.{seeded}"] if seeded else []) + [init_from]:
        if candidate in configs:
            return candidate
    raise ConfigError(
        f"train.init_from: {init_from!r} is no run of the config (runs: {', '.join(configs)}); a folder "
        f"of checkpoints is written with a '/', e.g. ./{init_from}"
    )


def tokenizer_run(name: str, configs: dict[str, Config]) -> str:
    """The run whose tokenizer `name` uses: the first run of its lineage within `configs` (itself
    when it starts from random weights or from a folder), since a branch keeps its parent's ids."""
    parent = parent_of(name, configs[name], configs)
    return name if parent is None else tokenizer_run(parent, configs)


def published_steps_of(cfg: Config) -> list[int]:
    """The steps a run of `cfg` publishes: every `checkpoint_interval`, and `max_iters`."""
    train = cfg.train
    steps = list(range(train.checkpoint_interval, train.max_iters + 1, train.checkpoint_interval))
    return steps if steps and steps[-1] == train.max_iters else [*steps, train.max_iters]


def shape_differences(parent_model: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The model keys, other than SHAPE_FREE_MODEL_KEYS, whose values differ: 'model.KEY: A in the
    parent, B here'."""
    return [
        f"model.{key}: {parent_model.get(key)!r} in the parent, {value!r} here"
        for key, value in model.items()
        if key not in SHAPE_FREE_MODEL_KEYS and parent_model.get(key) != value
    ]


def init_step_of(cfg: Config, parent: Config) -> int:
    """The parent's step a branch starts from: `init_step`, or the parent's last."""
    return cfg.train.init_step if cfg.train.init_step is not None else parent.train.max_iters


def check_lineage(configs: dict[str, Config]) -> None:
    """Every run's `init_from` against its parent among `configs`, and its `mixture` against the
    runs it names; a ConfigError naming the run and the key otherwise (see the module docs)."""
    for name, cfg in configs.items():
        where = "" if name == DEFAULT_RUN else f"runs.{name}: "
        try:
            _check_branch(name, cfg, configs)
            _check_mixture(name, cfg, configs)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None


def mixture_order(mixture: dict[str, float] | None) -> list[tuple[str, float]]:
    """`train.mixture`'s (run, weight) pairs in their one order, by run name: the order of the
    token files a run is given and of the weights its batches are drawn by (a config's mappings
    reach the stages sorted, so the order written in the file cannot be it)."""
    return sorted((mixture or {}).items())


def mixture_runs(name: str, cfg: Config, configs: dict[str, Config]) -> dict[str, float]:
    """{run: weight} of `train.mixture` among `configs` in `mixture_order` (under `seeds:`, each
    named run's run of `name`'s seed where there is one); {} without a mixture. A name that is no
    run is a ConfigError."""
    seeded = name.rsplit(".", 1)[1] if "." in name and name != DEFAULT_RUN else None
    out = {}
    for run, weight in mixture_order(cfg.train.mixture):
        candidates = [c for c in ([f"{run}.{seeded}"] if seeded else []) + [run] if c in configs]
        if not candidates:
            raise ConfigError(f"train.mixture: {run!r} is no run of the config (runs: {', '.join(configs)})")
        out[candidates[0]] = weight
    return out


def tokenizer_section(cfg: Config) -> dict[str, Any]:
    """The tokenizer keys that decide its file: all but `num_workers`, which changes no output."""
    return {k: v for k, v in dataclasses.asdict(cfg.tokenizer).items() if k != "num_workers"}


def _tokenizer_data(cfg: Config) -> tuple[dict, dict]:
    """What decides a tokenizer file: the corpus it is trained on and the tokenizer section."""
    return dataclasses.asdict(cfg.corpus), tokenizer_section(cfg)


def _check_mixture(name: str, cfg: Config, configs: dict[str, Config]) -> None:
    mixed = mixture_runs(name, cfg, configs)
    if cfg.train.mixture is not None and not mixed:
        raise ConfigError("train.mixture: names no run; give `{run: weight, ...}` or null")
    mine = _tokenizer_data(configs[tokenizer_run(name, configs)])
    for run, weight in mixed.items():
        if weight <= 0:
            raise ConfigError(f"train.mixture: {run}: the weight {weight} must be positive")
        if _tokenizer_data(configs[tokenizer_run(run, configs)]) != mine:
            raise ConfigError(
                f"train.mixture: run {run!r} is encoded with another tokenizer than this run's (its first "
                f"ancestor {tokenizer_run(run, configs)!r}, this run's {tokenizer_run(name, configs)!r}): "
                f"mixed runs must share one tokenizer"
            )


def _check_branch(name: str, cfg: Config, configs: dict[str, Config]) -> None:
    train = cfg.train
    if train.init_from is None:
        if train.init_step is not None:
            raise ConfigError("train.init_step: applies with train.init_from only; set it to null")
        if train.init_optimizer:
            raise ConfigError("train.init_optimizer: applies with train.init_from only; set it to false")
        return
    parent_name = parent_of(name, cfg, configs)
    if parent_name is None:  # a folder: checked when the run starts
        return
    chain, current = [name], parent_name
    while current is not None:
        seen = current in chain
        chain.append(current)
        if seen:
            raise ConfigError(f"train.init_from: the runs start from each other: {' -> '.join(chain)}")
        current = parent_of(current, configs[current], configs)
    parent = configs[parent_name]
    mine, theirs = tokenizer_section(cfg), tokenizer_section(parent)
    for key in mine:
        if mine[key] != theirs[key]:
            raise ConfigError(
                f"tokenizer.{key}: {mine[key]!r} here, {theirs[key]!r} in the parent run {parent_name!r}: "
                f"a run that starts from another keeps its tokenizer (its corpus may differ)"
            )
    differences = shape_differences(dataclasses.asdict(parent.model), dataclasses.asdict(cfg.model))
    if differences:
        raise ConfigError(
            f"{differences[0]} (run {parent_name!r}): it changes a weight's shape, so the parent's weights "
            f"cannot start this run"
        )
    if train.init_optimizer and train.optimizer != parent.train.optimizer:
        raise ConfigError(
            f"train.init_optimizer: run {parent_name!r} trains with train.optimizer "
            f"{parent.train.optimizer!r}, this run with {train.optimizer!r}: its state cannot be carried "
            f"(set train.init_optimizer: false)"
        )
    step, published = init_step_of(cfg, parent), published_steps_of(parent)
    if step not in published:
        listed = published if len(published) <= 8 else [*published[:3], "...", *published[-2:]]
        raise ConfigError(
            f"train.init_step: {step} is not a step run {parent_name!r} publishes "
            f"({', '.join(map(str, listed))})"
        )
    if train.max_iters <= step:
        raise ConfigError(
            f"train.max_iters: {train.max_iters} is not past the step it starts from ({parent_name!r} at "
            f"{step}): the run would train no step"
        )
