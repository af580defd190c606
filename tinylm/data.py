"""Token arrays on disk and the random training batches drawn from them.

Token files are 1-D uint16 .npy arrays, opened as read-only memory maps, so a corpus larger than
memory costs only the pages that batches actually touch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch


def load_tokens(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """Open a token file as a read-only memory map: a 1-D uint16 array.

    Raises ValueError naming the file if it is not a plain .npy array of that dtype and shape, or,
    given the tokenizer's `vocab_size`, if it holds an id outside it (one streaming pass).
    """
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy token file ({e})") from e
    if tokens.dtype != np.uint16:
        raise ValueError(f"{path}: token file must hold uint16, found {tokens.dtype}")
    if tokens.ndim != 1:
        raise ValueError(f"{path}: token file must be 1-D, found shape {tokens.shape}")
    if vocab_size is not None and len(tokens) and (largest := int(tokens.max())) >= vocab_size:
        raise ValueError(
            f"{path}: token id {largest} is outside the tokenizer's vocabulary of {vocab_size} "
            f"(was it encoded with another tokenizer.json?)"
        )
    return tokens


def get_batch(
    x: np.ndarray,
    batch_size: int,
    context_length: int,
    device: str | torch.device,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `batch_size` random windows of `context_length + 1` consecutive tokens from `x`.

    x: 1-D integer array (a read-only np.memmap is fine; only the sampled windows are read).
    Window starts are uniform over every valid position 0 .. len(x) - context_length - 1, drawn with
    torch.randint from `generator` (a CPU generator), so a seeded generator gives the same batches.
    Returns (inputs, targets), each int64 [batch_size, context_length] on `device`, with
    targets[b, t] = inputs[b, t + 1] the next token.
    """
    starts = torch.randint(0, num_window_starts(x, context_length), (batch_size,), generator=generator)
    return get_windows(x, starts, context_length, device)


def num_window_starts(x: np.ndarray, context_length: int) -> int:
    """How many windows of context_length + 1 tokens `x` holds (their starts are 0 .. this - 1)."""
    num_starts = len(x) - context_length
    if num_starts < 1:
        raise ValueError(f"need more than context_length={context_length} tokens, got {len(x)}")
    return num_starts


def get_windows(
    x: np.ndarray, starts: torch.Tensor, context_length: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows x[s : s + context_length + 1] for each s of `starts` [B], as (inputs, targets) [B, T].

    On CUDA the copy goes through pinned memory and does not block the host.
    """
    # A [B, context_length + 1] fancy index copies exactly the sampled windows.
    index = starts.numpy()[:, None] + np.arange(context_length + 1)
    windows = torch.from_numpy(x[index].astype(np.int64))
    inputs = windows[:, :-1].contiguous()
    targets = windows[:, 1:].contiguous()
    device = torch.device(device)
    if device.type == "cuda":
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    return inputs.to(device), targets.to(device)


def batch_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator that depends only on (seed, step, stream): batches survive a resume.

    stream 0 draws the training batches, stream 1 the validation estimates.
    """
    mixed = np.random.SeedSequence([seed, step, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


def global_batch_starts(seed: int, step: int, batch_size: int, num_starts: int) -> torch.Tensor:
    """Window starts of the global batch of update `step` (0-based): [batch_size], a function of (seed, step).

    Rank r takes micro-batches r * grad_accum_steps ... (r + 1) * grad_accum_steps - 1 of it, each a
    contiguous slice (see micro_batch_starts), so every world size and accumulation trains on the
    very same tokens in every step.
    """
    return torch.randint(0, num_starts, (batch_size,), generator=batch_generator(seed, step))


def mixture_batch_starts(
    seed: int, step: int, batch_size: int, num_starts: list[int], weights: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source [batch_size], window start [batch_size]) of update `step`'s global batch drawn from
    several token files: each sequence's source by `weights` (normalised), then its start uniform
    over that source's `num_starts`; a function of (seed, step) only, sliced per rank and micro-step
    as `global_batch_starts` is. The sources come from a stream of their own (2)."""
    sources = torch.multinomial(
        torch.tensor(weights, dtype=torch.float64),
        batch_size,
        replacement=True,
        generator=batch_generator(seed, step, stream=2),
    )
    uniform = torch.rand(batch_size, dtype=torch.float64, generator=batch_generator(seed, step))
    limits = torch.tensor(num_starts, dtype=torch.float64)[sources]
    return sources, (uniform * limits).long().clamp_(max=limits.long() - 1)


def micro_batch_size(batch_size: int, world_size: int, grad_accum_steps: int) -> int:
    """Sequences per micro-batch: the global batch cut into world_size * grad_accum_steps slices."""
    return batch_size // (world_size * grad_accum_steps)


def micro_batch_starts(
    starts: torch.Tensor, rank: int, micro_step: int, world_size: int, grad_accum_steps: int
) -> torch.Tensor:
    """Rank `rank`'s micro-batch `micro_step` of the global batch `starts`."""
    micro = micro_batch_size(len(starts), world_size, grad_accum_steps)
    index = rank * grad_accum_steps + micro_step
    return starts[index * micro : (index + 1) * micro]


@dataclass
class TrainBatches:
    """One rank's micro-batches: update `step` (1-based) trains on the global batch that
    `global_batch_starts` draws for step - 1 (with several token files, `mixture_batch_starts` by
    their `weights`), of which this rank takes its `grad_accum_steps` slices.

    `prefetch(step)` makes a step's first micro-batch ahead of time (on CUDA its copy to the device
    then overlaps the work already queued); `get` hands it out once, and makes any other."""

    tokens: list[np.ndarray]  # one token file, or the files of a mixture
    weights: list[float]  # one per token file (train.mixture), [1.0] for one
    seed: int
    batch_size: int  # the global batch, in sequences
    context_length: int
    rank: int
    world_size: int
    grad_accum_steps: int
    device: torch.device
    _ahead: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def prefetch(self, step: int) -> None:
        """Make the first micro-batch of update `step` now, for `get` to hand out."""
        self._ahead[step, 0] = self._make(step, 0)

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of micro-batch `micro_step` of update `step`, each int64 [B, T] on the device."""
        ahead = self._ahead.pop((step, micro_step), None)
        return ahead if ahead is not None else self._make(step, micro_step)

    def _make(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_starts = [num_window_starts(tokens, self.context_length) for tokens in self.tokens]

        def mine(batch: torch.Tensor) -> torch.Tensor:
            return micro_batch_starts(batch, self.rank, micro_step, self.world_size, self.grad_accum_steps)

        if len(self.tokens) == 1:
            starts = global_batch_starts(self.seed, step - 1, self.batch_size, num_starts[0])
            return get_windows(self.tokens[0], mine(starts), self.context_length, self.device)
        sources, starts = mixture_batch_starts(self.seed, step - 1, self.batch_size, num_starts, self.weights)
        sources, starts = mine(sources), mine(starts)
        inputs, targets = (torch.empty(len(starts), self.context_length, dtype=torch.int64) for _ in range(2))
        for source, tokens in enumerate(self.tokens):
            rows = (sources == source).nonzero().flatten()
            if len(rows):
                inputs[rows], targets[rows] = get_windows(tokens, starts[rows], self.context_length, "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
