"""Exact validation metrics of every checkpoint: fixed, non-overlapping windows over the validation tokens.

The scored tokens (the first `max_tokens` of valid.npy, default all of them) are cut into
consecutive windows of `context_length + 1` tokens that share their boundary token (window i covers
tokens[i*T : i*T + T + 1]), so every token after the first is predicted exactly once, with as much
context as its window gives; only the last window can be shorter. No sampling: the numbers are
exact and reproducible.

- `val_loss`: the mean cross-entropy (nats) over every predicted token, special tokens included.
- `bits_per_byte`: the summed loss in bits over the predicted tokens that are not special tokens,
  divided by their UTF-8 bytes. Special tokens (`<|endoftext|>`, which the corpus stage inserts
  between documents) are not text: they count 0 bytes and their loss is left out (the convention
  of nanochat), which makes the figure comparable across tokenizers and corpora.
- `unigram_entropy`: the entropy of the scored tokens' empirical distribution, the loss of the
  best context-free model; `gap_to_unigram` = unigram_entropy - val_loss.

On a CUDA device the forward pass runs under autocast in the checkpoint's training dtype
(`train.dtype`, resolved for the device); on the CPU always in float32. Per-token losses are
computed in float32 and summed in float64.

A checkpoint already scored (same weights, same scored tokens, same settings) is not scored
again: its sums are kept in a cache folder outside Snakemake's declared outputs (Snakemake deletes
those before a rerun), one small JSON file per checkpoint, written atomically. So evaluating after
more training costs only the new checkpoints, and a rerun with nothing new reads no checkpoint at
all. The key is the weights' identity recorded in the checkpoint's manifest (`weights_sha256`,
hashed while the tensors were written), not the file: a step's published file changes when a newer
step is published (the full state is cut to its weights), while its weights do not. A checkpoint
is read for its model tensors only (`tinylm.checkpoint.load_model`), never for its optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from tinylm.checkpoint import CheckpointError, load_model, published_manifest, published_steps
from tinylm.data import load_tokens
from tinylm.eval_table import COLUMNS
from tinylm.flops import flops_per_token
from tinylm.io import atomic_write_text
from tinylm.nn_utils import row_chunks
from tinylm.precision import DTYPES, autocast, dtype_name, machine, resolve_dtype
from tinylm.progress import Progress
from tinylm.tokenizer import Tokenizer

# Bumped whenever the scoring changes, so that older cache entries are not reused.
CACHE_VERSION = 3

# Tokens read at a time when scanning the validation file (bounds the memory of the scan).
SCAN_TOKENS = 1 << 24


@dataclass
class Scores:
    """Sums over the predicted tokens of a token sequence (see `score_tokens`)."""

    loss_sum: float  # nats, every predicted token
    count: int  # predicted tokens
    text_loss_sum: float  # nats, the predicted tokens that are not special tokens


@dataclass
class TokenStats:
    """What the metrics need from the scored tokens themselves, found in one pass (see `scan_tokens`)."""

    num_tokens: int
    sha256: str  # of the scored tokens as uint16 bytes: identifies them for the cache
    text_bytes: int  # UTF-8 bytes of the predicted tokens, special tokens counting 0
    unigram_entropy: float


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 byte length of every token id, with 0 for the special tokens (they are not text)."""
    lengths = np.zeros(max(tokenizer.vocab) + 1, dtype=np.int64)
    for i, b in tokenizer.vocab.items():
        lengths[i] = len(b)
    lengths[list(tokenizer.special_ids.values())] = 0
    return lengths


def scan_tokens(tokens: np.ndarray, byte_lengths: np.ndarray) -> TokenStats:
    """Hash, predicted bytes and unigram entropy of `tokens` (1-D uint16), reading it in slices."""
    digest = hashlib.sha256()
    counts = np.zeros(len(byte_lengths), dtype=np.int64)
    for lo in range(0, len(tokens), SCAN_TOKENS):
        chunk = np.asarray(tokens[lo : lo + SCAN_TOKENS], dtype=np.uint16)
        digest.update(chunk.tobytes())
        counts += np.bincount(chunk, minlength=len(counts))
    text_bytes = int(counts @ byte_lengths)
    if len(tokens):
        text_bytes -= int(byte_lengths[int(tokens[0])])  # the first token is never predicted
    p = counts[counts > 0] / max(1, counts.sum())
    return TokenStats(len(tokens), digest.hexdigest(), text_bytes, float(-(p * np.log(p)).sum()))


@torch.inference_mode()
def score_tokens(
    model: torch.nn.Module,
    tokens: np.ndarray,
    context_length: int,
    batch_size: int,
    special_ids: list[int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> Scores:
    """Summed loss of every predicted token of `tokens`, in fixed windows (see the module docstring).

    `model(ids[B, T]) -> logits[B, T, V]`; `tokens` is any 1-D integer array (a memory map is read
    one batch of windows at a time). Windows of one batch share their length; the last window of
    the sequence, if shorter, is scored on its own.
    """
    model.eval()
    n = len(tokens)
    num_windows = max(0, -(-(n - 1) // context_length))
    special = torch.tensor(sorted(special_ids), dtype=torch.int64, device=device)
    loss_sum = text_loss_sum = 0.0
    count = 0
    span = np.arange(context_length + 1)
    shown = Progress("[evaluate] windows", num_windows, "windows", enabled=progress)
    for first in range(0, num_windows, batch_size):
        shown.update(min(batch_size, num_windows - first))
        starts = np.arange(first, min(first + batch_size, num_windows)) * context_length
        full = starts[starts + context_length + 1 <= n]
        groups = [tokens[full[:, None] + span]] if len(full) else []
        if len(full) < len(starts):  # the short last window of the sequence
            groups.append(np.asarray(tokens[starts[-1] :])[None, :])
        for windows in groups:
            w = torch.from_numpy(np.asarray(windows, dtype=np.int64)).to(device)
            inputs, targets = w[:, :-1], w[:, 1:]
            with autocast(device, dtype):
                logits = model(inputs)
            losses = token_losses(logits.flatten(0, 1), targets.flatten()).view_as(targets).double()
            is_text = ~torch.isin(targets, special)
            loss_sum += losses.sum().item()
            text_loss_sum += losses[is_text].sum().item()
            count += targets.numel()
    return Scores(loss_sum, count, text_loss_sum)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logsumexp(z) - z[y] per position, in float32: logits [N, V] (any float dtype), targets [N].

    The float32 copy of the logits is made a chunk of rows at a time (nn_utils.row_chunks), so a
    large batch and vocabulary never hold [N, V] float32 temporaries.
    """
    out = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
    for rows in row_chunks(*logits.shape, logits.device):
        z = logits[rows].float()
        out[rows] = torch.logsumexp(z, dim=-1) - z.gather(-1, targets[rows, None]).squeeze(-1)
    return out


def evaluate_checkpoints(
    checkpoint_dir: str | os.PathLike,
    valid_tokens_path: str | os.PathLike,
    tokenizer: Tokenizer,
    batch_size: int = 32,
    device: str = "cpu",
    max_tokens: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    processes: int = 1,
    threads: int = 1,
) -> pd.DataFrame:
    """One row per published checkpoint in `checkpoint_dir` (ascending step); see COLUMNS.

    Scores the first `max_tokens` validation tokens (default: all). Each checkpoint is verified
    against its manifest and loaded with weights_only=True; validation data must use ids of this
    tokenizer. With `cache_dir`, checkpoints scored before with the same settings are read from it.
    With `processes` > 1 the checkpoints to score are shared out over that many processes of
    `threads` torch threads each (spawned; each checkpoint scored exactly as alone), when scoring one
    costs more than starting a process (SPAWN_FLOPS).
    """
    steps = published_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no committed checkpoints (step_N.pt with step_N.json)")
    stats = _scored_token_stats(valid_tokens_path, tokenizer, max_tokens)
    special_ids = sorted(tokenizer.special_ids.values())
    device = torch.device(device)
    here = machine(device)
    manifests = {step: published_manifest(checkpoint_dir, step) for step in steps}
    scored, todo = {}, {}  # step -> (scores, how); step -> (cache key, dtype) of the steps to score
    for step, manifest in manifests.items():
        dtype = _eval_dtype(manifest, device)
        key = _cache_key(manifest, stats, special_ids, batch_size, device, dtype, here)
        cached = _read_cache(cache_dir, key) if _cacheable(key, manifest) else None
        if cached is None:
            todo[step] = (key, dtype)
        else:
            scored[step] = (cached, "cached")
    jobs = [
        ScoreJob(
            str(checkpoint_dir),
            step,
            str(valid_tokens_path),
            max_tokens,
            len(tokenizer.vocab),
            batch_size,
            special_ids,
            str(device),
            dtype_name(dtype),
            threads,
            progress and processes == 1,
        )
        for step, (_, dtype) in todo.items()
    ]
    model_config = manifests[steps[-1]].model_config or {}
    forward_flops = flops_per_token(model_config) / 3 * stats.num_tokens if model_config else 0.0
    if forward_flops < SPAWN_FLOPS:  # a checkpoint scores faster than a process starts
        processes = 1
    for (step, (key, dtype)), scores in zip(todo.items(), _score_all(jobs, processes), strict=True):
        if _cacheable(key, manifests[step]):
            _write_cache(cache_dir, key, scores)
        scored[step] = (scores, f"{stats.num_tokens} tokens, {dtype_name(dtype)} on {device.type}")
    table = _table(checkpoint_dir, manifests, scored, stats)
    newest = manifests[steps[-1]]
    table.attrs["notes"] = _notes(stats, special_ids, tokenizer) + _made_by(here, newest.machine)
    if newest.parent is not None:  # a run that started from another's checkpoint (train.init_from)
        table.attrs["notes"].append(
            f"started from: {newest.parent_checkpoint} (step {newest.parent['step']}, weights sha256 "
            f"{newest.parent['weights_sha256'][:12]}...); its rows are the steps trained after it"
        )
    return table


def _scored_token_stats(
    valid_tokens_path: str | os.PathLike, tokenizer: Tokenizer, max_tokens: int | None
) -> TokenStats:
    """The statistics of the validation tokens that are scored (the first `max_tokens`, default
    all), checked: ids of this tokenizer, at least 2 tokens, some text among them."""
    tokens = load_tokens(valid_tokens_path, len(tokenizer.vocab))
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    if len(tokens) < 2:
        raise ValueError(f"{valid_tokens_path}: {len(tokens)} validation tokens; at least 2 are needed")
    stats = scan_tokens(tokens, token_byte_lengths(tokenizer))
    if stats.text_bytes == 0:
        raise ValueError(f"{valid_tokens_path}: the scored tokens hold no text, only special tokens")
    return stats


def _cacheable(key: dict[str, Any], manifest) -> bool:
    """Whether a checkpoint's scores may be cached: its weights' hash and tokens seen are known."""
    return key["weights_sha256"] is not None and manifest.tokens_seen is not None


def _table(checkpoint_dir, manifests: dict, scored: dict, stats: TokenStats) -> pd.DataFrame:
    """The rows of every step (ascending) from its scores, each said on stderr as it is added."""
    rows = []
    for step, manifest in manifests.items():
        scores, how = scored[step]
        if manifest.tokens_seen is None:  # said after the checkpoint was read (and checked)
            raise CheckpointError(
                f"{Path(checkpoint_dir) / f'step_{step}.json'}: the manifest does not record "
                f"tokens_seen (written by an older tinylm: train again to publish it anew)"
            )
        rows.append(_row(step, int(manifest.tokens_seen), scores, stats))
        print(
            f"[evaluate] step {step}: val_loss {rows[-1]['val_loss']:.4f}, {rows[-1]['bits_per_byte']:.4f} "
            f"bits/byte, unigram entropy {stats.unigram_entropy:.4f} ({how})",
            file=sys.stderr,
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _eval_dtype(manifest, device: torch.device) -> torch.dtype:
    """float32 on the CPU; on CUDA the dtype the run trained in (recorded since train.dtype could be
    `auto`), else its config's."""
    if device.type != "cuda":
        return torch.float32
    return resolve_dtype(
        manifest.dtype or ((manifest.config or {}).get("train") or {}).get("dtype", "float32"), device
    )


def _cache_key(
    manifest, stats, special_ids, batch_size: int, device: torch.device, dtype, here: dict
) -> dict:
    """What decides a checkpoint's scores. The manifest names the weights (recorded while they were
    written), so a checkpoint scored before is found without reading a byte of it."""
    return {
        "version": CACHE_VERSION,
        "weights_sha256": manifest.weights_sha256,
        "tokens_sha256": stats.sha256,
        "num_tokens": stats.num_tokens,
        "special_ids": special_ids,
        "batch_size": batch_size,
        "device": device.type,
        "dtype": dtype_name(dtype),
        "torch": torch.__version__,
        "machine": {k: here[k] for k in ("cpu_capability", "gpu")},  # the kernels decide the bits
    }


class ScoreJob(NamedTuple):
    """One checkpoint to score, in plain values (it may go to another process)."""

    checkpoint_dir: str
    step: int
    tokens_path: str
    max_tokens: int | None
    vocab_size: int
    batch_size: int
    special_ids: list[int]
    device: str
    dtype: str
    threads: int
    progress: bool


# A spawned process costs a few seconds to start (it imports torch): worth it only for checkpoints
# whose scoring costs more, about this many forward FLOPs on one core.
SPAWN_FLOPS = 1e11


def _score_step(job: ScoreJob) -> Scores:
    """Score one checkpoint: load it and its validation tokens, score them."""
    torch.set_num_threads(job.threads)
    tokens = load_tokens(job.tokens_path)
    if job.max_tokens is not None:
        tokens = tokens[: job.max_tokens]
    model, _ = load_model(job.checkpoint_dir, job.step, job.device)
    if model.vocab_size != job.vocab_size:
        raise CheckpointError(
            f"{Path(job.checkpoint_dir) / f'step_{job.step}.pt'}: model vocabulary {model.vocab_size} "
            f"differs from the tokenizer's {job.vocab_size}"
        )
    return score_tokens(
        model,
        tokens,
        model.context_length,
        job.batch_size,
        job.special_ids,
        job.device,
        DTYPES[job.dtype],
        job.progress,
    )


def _score_all(jobs: list[ScoreJob], processes: int) -> list[Scores]:
    """The scores of `jobs` in order: in this process, or shared out over `processes` spawned ones."""
    if processes <= 1 or len(jobs) <= 1:
        return [_score_step(job) for job in jobs]
    with ProcessPoolExecutor(min(processes, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_score_step, jobs))


def _row(step: int, tokens_seen: int, scores: Scores, stats: TokenStats) -> dict:
    loss = scores.loss_sum / scores.count
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "val_loss": loss,
        "val_ppl": math.exp(loss),
        "bits_per_byte": scores.text_loss_sum / math.log(2) / stats.text_bytes,
        "unigram_entropy": stats.unigram_entropy,
        "gap_to_unigram": stats.unigram_entropy - loss,
    }


def _notes(stats: TokenStats, special_ids: list[int], tokenizer: Tokenizer) -> list[str]:
    """How each column is counted, with this evaluation's counts: the lines of the sidecar file."""
    names = ", ".join(t for t, i in tokenizer.special_ids.items() if i in special_ids) or "none"
    return [
        f"scored: {stats.num_tokens} validation tokens in fixed windows of context_length + 1 tokens, "
        f"{stats.num_tokens - 1} predicted exactly once",
        "step: the checkpoint's optimizer step",
        "tokens_seen: training tokens consumed up to that step (step x batch_size x context_length)",
        "val_loss: mean cross-entropy (nats) over every predicted token, special tokens included",
        "val_ppl: exp(val_loss)",
        f"bits_per_byte: summed loss (bits) of the predicted tokens that are not special tokens ({names}) "
        f"divided by their {stats.text_bytes} UTF-8 bytes; special tokens count 0 bytes (nanochat's "
        "convention), so it compares runs of any two tokenizers",
        "unigram_entropy: entropy (nats) of the scored tokens' distribution, the loss of the best "
        "context-free model",
        "gap_to_unigram: unigram_entropy - val_loss",
    ]


def _made_by(here: dict, trained_on: dict | None) -> list[str]:
    """The notes' lines on what made the figures (precision.machine): another CPU's kernels or another
    torch give other last bits, for training and for this evaluation alike."""

    def described(record: dict) -> str:
        kind = record["gpu"] if record.get("gpu") else f"{record['device']} ({record['cpu_capability']})"
        return f"torch {record['torch']} on {kind}"

    lines = [f"evaluated with {described(here)}, torch threads {here['threads']}"]
    if trained_on:
        lines.append(f"trained with {described(trained_on)}, torch threads {trained_on['threads']} per rank")
    lines.append(
        "another CPU instruction set, GPU or torch version gives other last bits (within the seed spread)"
    )
    return lines


def _cache_path(cache_dir: str | os.PathLike, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / f"{digest[:32]}.json"


def _read_cache(cache_dir: str | os.PathLike | None, key: dict) -> Scores | None:
    """The cached scores of `key`; None if not cached."""
    if cache_dir is None:
        return None
    path = _cache_path(cache_dir, key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry["key"] == key:
            return Scores(**entry["scores"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or unreadable: score again (and overwrite it)
    return None


def _write_cache(cache_dir: str | os.PathLike | None, key: dict, scores: Scores) -> None:
    if cache_dir is not None:
        entry = {"key": key, "scores": asdict(scores)}
        atomic_write_text(_cache_path(cache_dir, key), json.dumps(entry, indent=1, sort_keys=True) + "\n")
