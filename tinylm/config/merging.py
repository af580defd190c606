"""One config rule, by hand and under Snakemake: a config file is merged onto config/config.yaml.

Snakemake loads config/config.yaml (the Snakefile's `configfile:`) and merges each `--configfile
FILE` onto it; a stage run by hand with `--config FILE` does the same (`config_layers`), so the two
resolve one file to the same values. The merge is Snakemake's (`snakemake.utils.update_config`): a
mapping merges key by key, any other value (a list, a number, null) replaces. Outside a project
folder (no config/config.yaml in the working directory) the file is merged onto the built-in
defaults, and the stage says so.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from tinylm.config.loading import read_config_file
from tinylm.config.runs import DEFAULT_RUN, run_configs
from tinylm.config.sections import Config
from tinylm.keys import ConfigError

PROJECT_CONFIG = "config/config.yaml"  # relative to the working directory, as in the Snakefile
DEFAULTS = "the built-in defaults"


def merge_onto(base: Any, over: dict) -> Any:
    """`over` merged onto a copy of `base` as Snakemake merges config files: a mapping in `over`
    merges into the mapping of `base` under the same key (a non-empty one replaces a non-mapping
    there), every other value replaces."""
    if not over:
        return copy.deepcopy(base)
    merged = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in over.items():
        merged[key] = (
            merge_onto(merged.get(key, {}), value) if isinstance(value, dict) else copy.deepcopy(value)
        )
    return merged


def config_layers(path: str | Path) -> list[tuple[str, dict]]:
    """[(name, raw mapping)] from the bottom up: config/config.yaml (when it exists here and `path` is
    not that file), then `path`. The resolved config is their merge, over the built-in defaults."""
    layers = []
    project = Path(PROJECT_CONFIG)
    if project.is_file() and not _same_file(project, Path(path)):
        layers.append((PROJECT_CONFIG, read_config_file(project)))
    layers.append((str(path), read_config_file(path)))
    return layers


def resolve_runs(path: str | Path) -> tuple[dict[str, Config], list[tuple[str, dict]]]:
    """Every run of `path` merged onto config/config.yaml (`run_configs`: the main config is the run
    "default"), validated, and the layers it came from. An error names the file that set the key it
    names."""
    layers = config_layers(path)
    raw: dict = {}
    for name, layer in layers:
        if not isinstance(layer, dict):
            raise ConfigError(f"{name}: expected a mapping of sections, got {type(layer).__name__}")
        raw = merge_onto(raw, layer)
    try:
        return run_configs(raw), layers
    except ConfigError as e:
        raise ConfigError(f"{_file_of(str(e), layers)}: {e}") from None


def resolve_config(path: str | Path) -> tuple[Config, list[tuple[str, dict]]]:
    """The main config (the run "default") of `path` (see `resolve_runs`) and its layers."""
    runs, layers = resolve_runs(path)
    return runs[DEFAULT_RUN], layers


def _file_of(message: str, layers: list[tuple[str, dict]]) -> str:
    """The topmost layer that sets the section and key an error message starts with, else all of them."""
    section, _, key = message.split(":", 1)[0].partition(".")
    for name, layer in reversed(layers):
        given = layer.get(section)
        if given is not None and (not key or not isinstance(given, dict) or key.split("[")[0] in given):
            return name
    return describe_layers(layers)


def describe_layers(layers: list[tuple[str, dict]]) -> str:
    """'partial.yaml over config/config.yaml over the built-in defaults'."""
    return " over ".join([name for name, _ in reversed(layers)] + [DEFAULTS])


def value_sources(layers: list[tuple[str, dict]], cfg: Config) -> list[tuple[str, Any, str]]:
    """(dotted key, resolved value, where it came from) for every key of `cfg`'s sections: the
    topmost layer that sets it, else the built-in defaults."""
    out = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for field in dataclasses.fields(values):
            source = DEFAULTS
            for name, layer in reversed(layers):
                if section.name not in layer:
                    continue
                given = layer[section.name]
                if not isinstance(given, dict):  # the section replaced (null): its keys at the defaults
                    break
                if field.name in given:
                    source = name
                    break
            out.append((f"{section.name}.{field.name}", getattr(values, field.name), source))
    return out


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
