"""Corpus-stage benchmark: the same documents as Parquet, .jsonl.zst and plain text, read into train.txt.

    python bench/corpus_formats.py --size 1GB [--profile web] [--seed 0]

The documents are those of `bench/make_corpus.py` (split at <|endoftext|>), written once under
bench/out/ as: Parquet shards (pyarrow, a `text` column, row groups of 2,000 documents, snappy, as
FineWeb's shards are laid out: several files found by a glob), JSON Lines compressed with zstandard
(several shards), and the plain text itself. Each input goes through the corpus stage
(`prepare_corpus`, source `files`) in its own child process, measured once: wall time, CPU time,
MB/s of train.txt written, and the peak RSS of the process tree (sampled every 0.1 s). Beside them,
the floors of each format in a bare loop (no document handling, no writing): pyarrow's
`iter_batches` with `to_pylist`, and zstandard + `json.loads` per line. The train.txt of every
format is checked to be byte-identical. Prints a Markdown report for bench/RESULTS.md. Run under
`flock /tmp/tinylm-bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer import OUT, corpus_file, measure  # noqa: E402  (bench/tokenizer.py)

SPECIAL = "<|endoftext|>"
SHARDS = 4
ROW_GROUP_DOCUMENTS = 2_000

READ_WITH_TINYLM = """
import json, sys
from tinylm.config import from_dict
from tinylm.corpus import prepare_corpus
keys = json.loads(sys.argv[1])
print(json.dumps(prepare_corpus(from_dict({"corpus": keys}).corpus, sys.argv[2], sys.argv[3])))
"""

PARQUET_FLOOR = """
import glob, sys
import pyarrow.parquet as pq
n = 0
for path in sorted(glob.glob(sys.argv[1])):
    for batch in pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False).iter_batches(
        batch_size=1024, columns=["text"]
    ):
        n += sum(map(len, batch.column(0).to_pylist()))
print(n)
"""

JSONL_ZST_FLOOR = """
import glob, io, json, sys
import zstandard
n = 0
for path in sorted(glob.glob(sys.argv[1])):
    with open(path, "rb") as f:
        for line in io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f)):
            n += len(json.loads(line)["text"])
print(n)
"""


def documents(path: Path):
    """The documents of a generated corpus, streamed (split at the separator)."""
    pending = ""
    with open(path, encoding="utf-8") as f:
        while chunk := f.read(1 << 22):
            *done, pending = (pending + chunk).split(SPECIAL)
            yield from done
    if pending:
        yield pending


def write_formats(text_path: Path, folder: Path) -> None:
    """Parquet and .jsonl.zst shards of the documents of `text_path` (each shard about 1/SHARDS)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = text_path.stat().st_size
    shard, written, rows = 0, 0, []
    parquet = pq.ParquetWriter(folder / "train-00000.parquet", pa.schema([("text", pa.string())]))
    jsonl = zstandard.ZstdCompressor(level=3).stream_writer(open(folder / "train-00000.jsonl.zst", "wb"))

    def flush_rows():
        if rows:
            parquet.write_table(pa.table({"text": pa.array(rows, type=pa.string())}))
            rows.clear()

    for document in documents(text_path):
        if written > (shard + 1) * size / SHARDS:
            flush_rows()
            parquet.close()
            jsonl.close()
            shard += 1
            parquet = pq.ParquetWriter(
                folder / f"train-{shard:05d}.parquet", pa.schema([("text", pa.string())])
            )
            jsonl = zstandard.ZstdCompressor(level=3).stream_writer(
                open(folder / f"train-{shard:05d}.jsonl.zst", "wb")
            )
        rows.append(document)
        if len(rows) == ROW_GROUP_DOCUMENTS:
            flush_rows()
        jsonl.write((json.dumps({"text": document}) + "\n").encode("utf-8"))
        written += len(document.encode("utf-8")) + len(SPECIAL)
    flush_rows()
    parquet.close()
    jsonl.close()
    (folder / "done").write_text("ok")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=["stories", "web"], default="web")
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    text_path = corpus_file(args.profile, args.size, args.seed)
    folder = OUT / f"{args.profile}_{args.size}_seed{args.seed}_formats"
    start = time.perf_counter()
    if not (folder / "done").exists():
        write_formats(text_path, folder)
    print(f"(formats written in {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    load_before = os.getloadavg()
    valid = folder / "valid.txt"
    valid.write_text("a held-out document", "utf-8")
    inputs = {
        "Parquet": str(folder / "train-*.parquet"),
        ".jsonl.zst": str(folder / "train-*.jsonl.zst"),
        "plain text (one file)": str(text_path),
    }
    input_mb = {
        name: sum(os.path.getsize(p) for p in folder.glob(Path(pattern).name)) / 1e6
        for name, pattern in list(inputs.items())[:2]
    } | {"plain text (one file)": text_path.stat().st_size / 1e6}
    rows, digests = [], {}
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        for name, pattern in inputs.items():
            keys = {"source": "files", "train_files": [pattern], "valid_files": [str(valid)]}
            train, valid_out = Path(tmp) / "train.txt", Path(tmp) / "valid.txt"
            run = measure(READ_WITH_TINYLM, json.dumps(keys), str(train), str(valid_out))
            stats = json.loads(run["stdout"])
            digests[name] = sha256_file(train)
            rows.append((f"tinylm corpus stage, {name}", run, stats["train_bytes"] / 1e6, input_mb[name]))
            train.unlink()
        out_mb = rows[0][2]
        for name, code, pattern in [
            ("floor: pyarrow iter_batches + to_pylist, Parquet", PARQUET_FLOOR, inputs["Parquet"]),
            ("floor: zstandard + json.loads per line, .jsonl.zst", JSONL_ZST_FLOOR, inputs[".jsonl.zst"]),
        ]:
            rows.append((name, measure(code, pattern), out_mb, input_mb[name.rsplit(", ", 1)[1]]))
    load_after = os.getloadavg()

    print(
        f"## Corpus formats: {args.profile}, {args.size} of text into train.txt "
        f"({time.strftime('%Y-%m-%d %H:%M')})\n"
    )
    print(
        f"- documents: `python bench/make_corpus.py --profile {args.profile} --size {args.size} "
        f"--seed {args.seed}`, "
        f"written as {SHARDS} Parquet shards (row groups of {ROW_GROUP_DOCUMENTS:,} documents, snappy) and "
        f"{SHARDS} .jsonl.zst shards (level 3)"
    )
    print(
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"pyarrow {pa.__version__}, zstandard {zstandard.__version__}"
    )
    print(f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    print(f"- train.txt identical for all three inputs: {len(set(digests.values())) == 1}")
    print(
        "- each run once, in its own child process; MB/s of text out (train.txt); "
        "memory: peak RSS of the tree\n"
    )
    print(
        "| what | input MB | seconds | CPU seconds | MB/s | peak RSS (MB) |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, run, mb, in_mb in rows:
        print(
            f"| {name} | {in_mb:,.0f} | {run['seconds']:.1f} | {run['cpu']:.1f} | "
            f"{mb / run['seconds']:.1f} | {run['rss_mb']:,.0f} |"
        )


if __name__ == "__main__":
    main()
