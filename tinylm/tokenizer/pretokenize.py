"""Pre-tokenization: the GPT-2 regex, special-token splitting, safe chunk boundaries, parallel counting.

Text is cut into pieces in two steps before any BPE merge happens:

1. Special tokens (e.g. ``<|endoftext|>``) split the text. Where special tokens overlap, the longest
   match at the leftmost position wins. Special tokens are never merged with anything.
2. Each stretch of ordinary text between special tokens is cut into pre-tokens by the GPT-2 regex
   (words with their leading space, numbers, punctuation runs, whitespace runs). Merges never cross
   a pre-token boundary.

Large files are processed in chunks. A chunk boundary is *safe* when pre-tokenizing (or encoding)
the two sides separately gives exactly the pieces of the whole text; `find_split` finds such
positions, so every result here is independent of how a file is chunked or how many processes run.
"""

from __future__ import annotations

import codecs
import logging
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import regex

from tinylm.progress import Progress

log = logging.getLogger(__name__)

# The pre-tokenizer of GPT-2 (and of tiktoken's "gpt2" encoding and Hugging Face's ByteLevel).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_REGEX = regex.compile(GPT2_PATTERN)

# A letter first assigned in each Unicode version: the newest one that `regex` calls a letter tells
# which tables it was built with. Pre-tokens depend on them (\p{L}, \p{N}), so token ids do too.
_NEW_LETTERS = [("17.0", "\ua7ce"), ("16.0", "\u1c89"), ("15.1", "\U0002ebf0"), ("15.0", "\U00011f04")]


def unicode_version() -> str:
    """The Unicode version of the installed `regex` module's tables ("15.0" to "17.0", or "older")."""
    for version, letter in _NEW_LETTERS:
        if regex.match(r"\p{L}", letter):
            return version
    return "older"


# The same pattern spelled for ASCII-only text, where letters are [A-Za-z], numbers [0-9], and the
# `regex` module's \s is exactly these six characters (unlike the standard `re`, which also counts
# \x1c-\x1f). The standard `re` engine runs it about twice as fast; possessive quantifiers (++)
# only skip backtracking that could never succeed.
_WS = r"\t\n\x0b\x0c\r "
ASCII_PATTERN = (
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]++| ?[0-9]++| ?[^{_WS}A-Za-z0-9]++|[{_WS}]+(?![^{_WS}])|[{_WS}]++"""
)
ASCII_REGEX = re.compile(ASCII_PATTERN)

# A single space or newline between two visible ASCII characters. Cutting just before it is safe:
# in the whole text and in the left part alike, the pre-token holding the visible character before
# the cut ends there, and the GPT-2 regex has no look-behind, so the right part splits just as the
# rest of the whole text does. (Whitespace before the cut would not do: "  <|endoftext|>" holds the
# one pre-token "  ", while " " | " <|endoftext|>" would give two.)
_WHITESPACE_SPLIT = r"(?<=[!-~])[\n ](?=[!-~])"
_WHITESPACE_SPLIT_STR = regex.compile(_WHITESPACE_SPLIT)
_WHITESPACE_SPLIT_BYTES = regex.compile(_WHITESPACE_SPLIT.encode("ascii"))

# Text is read and decoded this many bytes at a time (bounds a worker's memory for the text).
CHUNK_BYTES = 1 << 20
# Counting: a task counts at most this many chunks into one Counter and returns it. Fewer, larger
# results mean less pickling and merging in the main process, which runs beside the workers.
TASK_CHUNKS = 64
# ... and each worker gets at least this many tasks, so that all finish at about the same time.
TASKS_PER_WORKER = 4


def default_num_workers() -> int:
    """The number of CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_special_tokens(special_tokens: Sequence[str] | None) -> list[str]:
    """Return the special tokens as a list; raise ValueError for empty or repeated ones."""
    tokens = list(special_tokens or [])
    for token in tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"special tokens listed more than once: {repeated}")
    return tokens


def special_token_regex(special_tokens: Sequence[str]) -> regex.Pattern | None:
    """A regex with one capturing group matching any special token, longest first; None if none.

    `pattern.split(text)` then alternates ordinary text (even indices) and special tokens (odd).
    Trying longer tokens first makes the longest token win where several match at one position.
    """
    if not special_tokens:
        return None
    ordered = sorted(special_tokens, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(t) for t in ordered) + ")")


def split_on_special(text: str, special_re: regex.Pattern | None) -> list[str]:
    """Split `text` into [ordinary, special, ordinary, special, ..., ordinary] (even: ordinary)."""
    if special_re is None:
        return [text]
    return special_re.split(text)


def find_pretokens(text: str) -> list[str]:
    """The pre-tokens of `text` (which holds no special tokens): `GPT2_REGEX.findall(text)`."""
    if text.isascii():
        return ASCII_REGEX.findall(text)
    return GPT2_REGEX.findall(text)


def pretokenize(text: str, special_tokens: Sequence[str] = ()) -> list[str]:
    """All pre-tokens of `text` in order, special tokens removed (they are never merged)."""
    parts = split_on_special(text, special_token_regex(special_tokens))
    return [piece for part in parts[::2] for piece in find_pretokens(part)]


# ---------------------------------------------------------------------------------------------
# Safe split points


def find_split(data: str | bytes, lo: int, hi: int, specials: Sequence[str] | Sequence[bytes]) -> int | None:
    """The first safe position in [lo, hi) to cut `data`, preferring the start of a special token.

    `specials` has the same type as `data`. A position is safe when no occurrence of a special token
    straddles it and it is either the start of a special token or just before a single space or
    newline between two visible ASCII characters. `data` must extend at least the longest special
    token past `hi` (or end there), so that occurrences straddling a candidate can be seen.
    Returns None when [lo, hi) holds no safe position.
    """
    best = None
    for token in specials:
        start = lo
        while (p := data.find(token, start, hi + len(token) - 1)) != -1 and p < hi:
            if p > 0 and not _straddles_special(data, p, specials):
                best = p if best is None else min(best, p)
                break
            start = p + 1
    if best is not None:
        return best
    pattern = _WHITESPACE_SPLIT_STR if isinstance(data, str) else _WHITESPACE_SPLIT_BYTES
    for match in pattern.finditer(data, lo, min(hi + 1, len(data))):
        p = match.start()
        if p >= hi:
            break
        if not _straddles_special(data, p, specials):
            return p
    return None


def _straddles_special(data: str | bytes, p: int, specials: Sequence[str] | Sequence[bytes]) -> bool:
    """True if some occurrence of a special token starts before `p` and ends after it."""
    for token in specials:
        q = data.find(token, max(0, p - len(token) + 1), p + len(token) - 1)
        if 0 <= q < p:
            return True
    return False


def find_chunk_boundaries(
    path: str | os.PathLike, num_chunks: int, special_tokens: Sequence[str] = (), block_bytes: int = 1 << 16
) -> list[int]:
    """Byte offsets [0, ..., file size] cutting the file into at most `num_chunks` safe chunks.

    Near each evenly spaced target offset, the file is scanned forward for the first safe split
    (see `find_split`: a special token within the same block is preferred over a line or word
    boundary). Chunks whose boundaries fall on safe splits decode and pre-tokenize exactly like the
    whole file. Without any safe split after a target, the rest of the file is one chunk.
    """
    size = os.path.getsize(path)
    specials = [t.encode("utf-8") for t in special_tokens]
    margin = max((len(t) for t in specials), default=1)
    boundaries = [0]
    with open(path, "rb") as f:
        for i in range(1, num_chunks):
            target = max(size * i // num_chunks, boundaries[-1] + 1)
            split = None
            while split is None and target < size:
                start = max(0, target - margin)
                f.seek(start)
                block = f.read(block_bytes + 2 * margin)
                found = find_split(
                    block, target - start, min(target - start + block_bytes, len(block)), specials
                )
                if found is not None:
                    split = start + found
                target += block_bytes
            if split is None:
                break
            boundaries.append(split)
    boundaries.append(size)
    return boundaries


# ---------------------------------------------------------------------------------------------
# Reading chunks and counting pre-tokens


def check_readable(path: str | os.PathLike) -> Path:
    """Return `path` as a Path; raise FileNotFoundError / ValueError naming it if it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input file not found: {path}")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"cannot read input file {path}: {e.strerror or e}") from e
    return path


def read_text_chunk(path: str | os.PathLike, start: int, end: int, errors: str = "strict") -> tuple[str, int]:
    """Decode bytes [start, end) of a UTF-8 file; return (text, number of invalid bytes replaced).

    errors="strict" raises ValueError naming the file and the byte offset of the first invalid
    byte; errors="replace" turns each invalid sequence into U+FFFD and counts the bytes replaced.
    """
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if errors == "strict":
        try:
            return data.decode("utf-8"), 0
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}: invalid UTF-8 at byte offset {start + e.start} ({e.reason}); "
                "fix the file or pass errors='replace'"
            ) from None
    if errors != "replace":
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    replaced = 0

    def count_and_replace(e: UnicodeDecodeError) -> tuple[str, int]:
        nonlocal replaced
        replaced += e.end - e.start
        return "\ufffd", e.end

    # A codec error handler must be registered by name; it is looked up per call, so the closure
    # above is (re)bound for this call only. Each process decodes one chunk at a time.
    codecs.register_error("tinylm-count-replace", count_and_replace)
    return data.decode("utf-8", errors="tinylm-count-replace"), replaced


def count_chunks(args: tuple[str, list[tuple[int, int]], list[str], str]) -> tuple[Counter, int, int]:
    """Pre-token counts of some chunks of a file: (counts, invalid bytes replaced, bytes read)."""
    path, chunks, special_tokens, errors = args
    special_re = special_token_regex(special_tokens)
    counts: Counter = Counter()
    replaced = 0
    for start, end in chunks:
        text, chunk_replaced = read_text_chunk(path, start, end, errors)
        replaced += chunk_replaced
        for part in split_on_special(text, special_re)[::2]:
            counts.update(find_pretokens(part))
    return counts, replaced, sum(end - start for start, end in chunks)


def count_pretokens(
    path: str | os.PathLike,
    special_tokens: Sequence[str] = (),
    num_workers: int | None = None,
    errors: str = "strict",
    progress: bool = True,
) -> Counter:
    """How often each pre-token occurs in a UTF-8 file, using `num_workers` processes.

    The file is read chunk by chunk (chunks end at safe splits), so memory grows with the number of
    distinct pre-tokens, not with the file. Chunks are grouped into tasks sized by the file and the
    workers (`plan_tasks`); each task returns one Counter. The result does not depend on
    `num_workers`.
    """
    path = check_readable(path)
    special_tokens = check_special_tokens(special_tokens)
    num_workers = num_workers or default_num_workers()
    size = os.path.getsize(path)
    tasks = [
        (str(path), chunks, special_tokens, errors)
        for chunks in plan_tasks(path, num_workers, special_tokens)
    ]

    total: Counter = Counter()
    replaced = 0
    bar = Progress(f"[train-tokenizer] pre-tokenize {path}", size, "B", enabled=progress)
    for counts, task_replaced, task_bytes in map_in_processes(count_chunks, tasks, num_workers):
        if len(counts) > len(total):  # add the smaller Counter into the larger one
            total, counts = counts, total
        total.update(counts)
        del counts
        replaced += task_replaced
        bar.update(task_bytes)
    if replaced:
        log.warning("%s: replaced %d invalid UTF-8 bytes with U+FFFD", path, replaced)
    return total


def plan_tasks(path: str | os.PathLike, num_workers: int, special_tokens: Sequence[str] = ()) -> list[list]:
    """Cut a file into counting tasks, each a list of (start, end) chunks ending at safe splits.

    The task size follows the input and the workers: at least TASKS_PER_WORKER tasks per worker (so
    that the workers finish together, also for a file of a few MB), and at most TASK_CHUNKS chunks
    of CHUNK_BYTES per task (fewer, larger results for the main process to add up). A chunk is at
    most CHUNK_BYTES, smaller when the file is too small to give every task one of that size.
    """
    size = os.path.getsize(path)
    num_chunks = max(-(-size // CHUNK_BYTES), TASKS_PER_WORKER * num_workers)
    chunks = list(pairwise(find_chunk_boundaries(path, num_chunks, special_tokens)))
    num_tasks = min(len(chunks), max(TASKS_PER_WORKER * num_workers, -(-len(chunks) // TASK_CHUNKS)))
    return [
        chunks[i * len(chunks) // num_tasks : (i + 1) * len(chunks) // num_tasks] for i in range(num_tasks)
    ]


def map_in_processes(fn, tasks: list, num_workers: int, initializer=None, initargs: tuple = ()) -> Iterable:
    """`map(fn, tasks)` in order, over `num_workers` processes (in this process when 1 or 1 task).

    `initializer(*initargs)` runs once in each worker first (here, when run in this process).
    """
    if num_workers <= 1 or len(tasks) <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, tasks)
        return
    # fork starts workers in milliseconds; elsewhere (macOS, Windows) the platform default is used.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(min(num_workers, len(tasks)), initializer, initargs) as pool:
        yield from pool.imap(fn, tasks)
