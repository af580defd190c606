"""Sampling text from a trained model: temperature, top-p (nucleus), a seeded generator, a KV cache.

Two generation paths give the same ids for the same generator:
- `generate_reference`, the oracle: the whole (cropped) context is run through the model for every
  new token;
- `stream_generate` / `generate`, the fast path: the prompt is run once and each new token is one
  more position, with the keys and values of the earlier ones kept in a KVCache.
`stream_text` turns ids into text as they come, never splitting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

import torch

from tinylm.checkpoint import load_model
from tinylm.config import END_OF_TEXT
from tinylm.eval_table import read_eval
from tinylm.io import atomic_write_text
from tinylm.model import Transformer
from tinylm.nn_utils import softmax
from tinylm.tokenizer import Tokenizer

# Most likely tokens `nucleus` tries first; when their mass is below top_p it sorts all tokens.
NUCLEUS_CANDIDATES = 64


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches `top_p`: (ids [n], probs [n]).

    probs: [V] probabilities. Tokens are taken in the order of a stable descending sort (ties:
    the lower id first); a token is kept while the mass before it is below `top_p`, so the most
    likely token always is. The returned probabilities are not renormalized. Only the top
    candidates are sorted: every token outside them is less likely than all of them, so once their
    mass reaches `top_p` the rest cannot be kept (the cumulative mass never decreases).
    """
    vocab_size = probs.shape[-1]
    if top_p >= 1.0:
        return torch.arange(vocab_size), probs
    candidates = [torch.arange(vocab_size)]
    if vocab_size > NUCLEUS_CANDIDATES:
        threshold = torch.topk(probs, NUCLEUS_CANDIDATES, sorted=False).values.min()
        candidates.insert(0, torch.nonzero(probs >= threshold).squeeze(1))  # ascending ids, ties included
    for ids in candidates:
        kept, order = torch.sort(probs[ids], descending=True, stable=True)
        mass = torch.cumsum(kept, dim=0)
        if mass[-1] >= top_p:  # the tokens after these are not kept
            break
    mass_before = torch.cat((mass.new_zeros(1), mass[:-1]))  # never decreases, so a prefix is kept
    n = int((mass_before < top_p).sum())
    return ids[order[:n]], kept[:n]


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """One token id from the last-position logits [V]; temperature 0 means greedy (argmax)."""
    logits = logits.float()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    ids, probs = nucleus(softmax(logits / temperature, dim=-1), top_p)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


@torch.no_grad()
def generate_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    context_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The oracle: recompute the whole context for every new id; returns only the new ids.

    The context is the last `context_length` ids, at positions 0 .. len - 1. Generation stops after
    `eos_id` (which is included in the result) or after `max_new_tokens`.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt encodes to no tokens; give at least one character")
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-context_length:]], dtype=torch.long, device=device)
        next_id = sample_next(model(context)[0, -1].cpu(), temperature, top_p, generator)
        ids.append(next_id)
        new.append(next_id)
        if next_id == eos_id:
            break
    return new


@torch.no_grad()
def stream_generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    context_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield the ids of `generate_reference`, one at a time, computing each with a KV cache.

    The prompt is run once (prefill), then each new id is one more position. Once the ids outgrow
    `context_length`, the reference's rule holds: the last `context_length` ids at positions 0 ..
    again, so every key changes and the window is recomputed for each further id (no cache).
    The same `generator` draws the same ids as the reference.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt encodes to no tokens; give at least one character")
    model.eval()
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    cache = model.new_kv_cache(batch_size=1)
    for _ in range(max_new_tokens):
        if len(ids) > context_length:
            logits = model(torch.tensor([ids[-context_length:]], dtype=torch.long, device=device))
        else:  # the ids not yet in the cache: the whole prompt first, then the newest id
            logits = model(
                torch.tensor([ids[cache.length :]], dtype=torch.long, device=device), kv_cache=cache
            )
        next_id = sample_next(logits[0, -1].cpu(), temperature, top_p, generator)
        ids.append(next_id)
        yield next_id
        if next_id == eos_id:
            return


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    context_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The new ids (the KV-cache path of `stream_generate`); `eos_id`, if drawn, is the last one."""
    return list(
        stream_generate(
            model, prompt_ids, max_new_tokens, context_length, temperature, top_p, eos_id, generator
        )
    )


def stream_text(tokenizer: Tokenizer, ids: Iterable[int]) -> Iterator[str]:
    """Decode `ids` as they come: yield text as soon as it holds whole UTF-8 characters.

    A character whose bytes are split over several tokens comes out with the token that completes
    it, never in halves; "".join(stream_text(tokenizer, ids)) == tokenizer.decode(ids).
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i in ids:
        try:
            raw = tokenizer.vocab[i]
        except KeyError:
            raise ValueError(f"token id {i} is not in the vocabulary") from None
        if text := decoder.decode(raw):
            yield text
    if text := decoder.decode(b"", final=True):
        yield text


def load_for_sampling(
    checkpoint_dir: str | os.PathLike, tokenizer_path: str | os.PathLike, step: int | None = None
) -> tuple[Transformer, Tokenizer, int, int]:
    """(model, tokenizer, step, id of END_OF_TEXT) of a published checkpoint, on CUDA if there is one.

    The model's vocabulary must be the tokenizer's, and the tokenizer must have END_OF_TEXT.
    """
    tokenizer = Tokenizer.load(tokenizer_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, step = load_model(checkpoint_dir, step, device, tokenizer)
    if END_OF_TEXT not in tokenizer.special_ids:
        raise ValueError(f"{tokenizer_path}: has no {END_OF_TEXT} special token to end samples with")
    return model, tokenizer, step, tokenizer.special_ids[END_OF_TEXT]


def say_if_cropped(name: str, num_ids: int, context_length: int) -> None:
    """One line on stderr when a prompt has more tokens than the model's context (it sees the last ones)."""
    if num_ids > context_length:
        print(
            f"{name}: {num_ids} tokens, longer than the model's context of {context_length}: the model "
            f"sees its last {context_length} tokens",
            file=sys.stderr,
            flush=True,
        )


def write_samples(
    gen_cfg,
    checkpoint_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    output_path: str | os.PathLike,
    eval_path: str | os.PathLike | None = None,
) -> str:
    """Sample a completion for every configured prompt from the newest checkpoint; write them all.

    One generator seeded with `gen_cfg.seed` draws every sample, so the file is reproducible. With
    `eval_path` (eval.csv) the header quotes the checkpoint's exact validation loss. An empty prompt
    is an error naming it (`generate.prompts[i]`), raised before the model is read.
    """
    for i, prompt in enumerate(gen_cfg.prompts):
        if not prompt:
            raise ValueError(f"generate.prompts[{i}]: the prompt is empty; give the text to continue")
    torch.set_num_threads(gen_cfg.threads)
    model, tokenizer, step, eos_id = load_for_sampling(checkpoint_dir, tokenizer_path)
    generator = torch.Generator().manual_seed(gen_cfg.seed)

    parts = [
        f"# tinylm samples: checkpoint step {step}, temperature {gen_cfg.temperature}, "
        f"top_p {gen_cfg.top_p}, seed {gen_cfg.seed}\n"
    ]
    if eval_path is not None:
        rows = read_eval(eval_path)
        row = rows[rows["step"] == step]
        if row.empty:
            raise ValueError(f"{eval_path}: has no row for step {step}; rerun the evaluate stage")
        parts.append(
            f"# exact validation loss {row['val_loss'].iloc[0]:.4f} nats per token, "
            f"{row['bits_per_byte'].iloc[0]:.4f} bits per byte\n"
        )
    for i, prompt in enumerate(gen_cfg.prompts, start=1):
        prompt_ids = tokenizer.encode(prompt)
        say_if_cropped(f"[generate] generate.prompts[{i - 1}]", len(prompt_ids), model.context_length)
        new = generate(
            model,
            prompt_ids,
            gen_cfg.max_new_tokens,
            model.context_length,
            gen_cfg.temperature,
            gen_cfg.top_p,
            eos_id,
            generator,
        )
        ended = f"stopped at {END_OF_TEXT}" if new and new[-1] == eos_id else f"{len(new)} tokens"
        completion = tokenizer.decode([t for t in new if t != eos_id])
        parts.append(
            f"\n===== sample {i} ({ended}) =====\n----- prompt -----\n{prompt}\n"
            f"----- completion -----\n{completion}\n"
        )
    text = "".join(parts)
    atomic_write_text(output_path, text)
    return text


def sample(
    gen_cfg,
    checkpoint_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    prompt: str,
    out: TextIO,
    step: int | None = None,
) -> list[int]:
    """Write the completion of `prompt` to `out` as it is generated; return its ids.

    `gen_cfg` gives max_new_tokens, temperature, top_p, seed and threads (the generate section,
    with any overrides). Text is written (and flushed) whole UTF-8 characters at a time; the
    completion stops at <|endoftext|>, which is not written. With the same settings, the ids are
    those of the first sample of `write_samples` for this prompt.
    """
    torch.set_num_threads(gen_cfg.threads)
    model, tokenizer, step, eos_id = load_for_sampling(checkpoint_dir, tokenizer_path, step)
    generator = torch.Generator().manual_seed(gen_cfg.seed)
    new: list[int] = []
    prompt_ids = tokenizer.encode(prompt)
    say_if_cropped("[sample] --prompt", len(prompt_ids), model.context_length)

    def ids() -> Iterator[int]:
        for i in stream_generate(
            model,
            prompt_ids,
            gen_cfg.max_new_tokens,
            model.context_length,
            gen_cfg.temperature,
            gen_cfg.top_p,
            eos_id,
            generator,
        ):
            new.append(i)
            if i != eos_id:
                yield i

    for text in stream_text(tokenizer, ids()):
        out.write(text)
        out.flush()
    return new
