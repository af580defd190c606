"""Which config keys changed since a stage last made its output, said in the stage's first lines.

The Snakemake rules hand each stage its config sections as a file named by its content
(`--config-json @results/configs/<hash>.json`, workflow/rules/common.smk), so an edited key is a
new file and Snakemake's rerun reason names only the two files. The stage names the keys: after it
made an output it records which config file it was made with (`results/configs/made/`, one small
file per output path), and the next time the same output is made with another config file it says
`config since results/samples.txt was made: generate.seed: 0 -> 1`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tinylm.io import atomic_write_text

MADE_DIR = "made"


def _record_path(config_file: Path, output: str) -> Path:
    key = hashlib.sha256(os.path.normpath(output).encode()).hexdigest()[:16]
    return config_file.parent / MADE_DIR / f"{key}.json"


def flat_keys(data: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of nested mappings (lists and other values are leaves)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flat_keys(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_keys(before: dict, after: dict) -> list[str]:
    """'key: old -> new' for every dotted key whose value differs (a key on one side only: absent)."""
    old, new = flat_keys(before), flat_keys(after)
    absent = "(absent)"
    return [
        f"{key}: {json.dumps(old.get(key)) if key in old else absent} -> "
        f"{json.dumps(new.get(key)) if key in new else absent}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, absent) != new.get(key, absent)
    ]


def changes_since_made(config_file: str | os.PathLike, output: str) -> list[str]:
    """The keys that differ between `config_file` and the config file `output` was last made with
    (recorded by `record_made`); [] when it was not recorded, is the same file, or is gone."""
    config_file = Path(config_file)
    try:
        previous = Path(json.loads(_record_path(config_file, output).read_text(encoding="utf-8"))["config"])
        if previous.resolve() == config_file.resolve():
            return []
        before = json.loads(previous.read_text(encoding="utf-8"))
        after = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return changed_keys(before, after)


def record_made(config_file: str | os.PathLike, output: str) -> None:
    """Record that `output` was made with `config_file` (written atomically)."""
    config_file = Path(config_file)
    path = _record_path(config_file, output)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"output": output, "config": str(config_file)}) + "\n")
