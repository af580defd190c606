"""A deterministic generator of corpus-scale text for the data-stage benchmarks.

    python bench/make_corpus.py --profile stories --size 1GB --out bench/out/stories_1GB.txt
    python bench/make_corpus.py --profile web --size 100MB --out /tmp/web_100MB.txt [--seed 0]

Two profiles, both plain UTF-8 with documents joined by `<|endoftext|>` (no separator after the
last one), as the corpus stage writes them:

- `stories` (TinyStories-like): a small lexicon (a few hundred common words and a few thousand
  made-up ones, Zipf-distributed), a handful of names, short sentences with quoted speech,
  documents of about 1 KB. Tens of thousands of distinct pre-tokens, however large the file.
- `web` (OpenWebText-like): a heavy-tailed lexicon (Zipf over a million made-up words), one-off
  words (typos, codes, handles) whose number grows with the file, numbers, years, prices and
  percentages, mixed case (names, acronyms, words in capitals), many kinds of punctuation, links,
  line breaks and lists, and some non-ASCII (curly quotes, dashes, accented names, Cyrillic, Greek,
  Korean and Chinese words): millions of distinct pre-tokens per GB, documents of about 5 KB.

How it is fast (hundreds of MB/s on one core): every string the generator can emit (a word, its
capitalized form, a separator, a syllable, a number) is one "piece" of a table held as one byte
buffer. A batch draws piece ids with numpy (a word slot is one to six pieces plus the separator
after it), and the bytes of all pieces are gathered with one fancy index, with no Python object per
word. The output is a pure function of (profile, size, seed) for a given numpy version (PCG64).
The file ends at the last document end before `--size`. Write it under bench/out/ (git-ignored)
or /tmp, never into the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

END_OF_TEXT = "<|endoftext|>"

# Common English words, most frequent first (their order is their Zipf rank).
COMMON = """
the and to a was he she it of in they you her his said that with is for on had but one day there
what so not be at all were very big little happy saw went we have up out can like time then i my
do get go me him no would could them their when this an are will from your if about mom dad friend
tree ball cat dog park house toy sun sky bird water play look see help find make want love good
nice new old red blue green small tall fast slow jump run walk sit eat drink sleep laugh smile cry
share give take come back home school garden flower cake box door window car boat fish bear bunny
duck frog girl boy baby sister brother teacher man woman king queen dragon magic star moon night
morning rain snow wind hill river sea sand rock stick leaf apple cookie milk bread because after
before again always never sometimes every together first last next many much some other each too
also just only even still now soon here where how why who which than more most thing place way
people world year part work hand eye life week case point group number fact
""".split()

NAMES = "Lily Tom Sue Ben Max Mia Sam Anna Tim Lucy Jack Emma Leo Zoe Kate Bob Amy Ron Ella Finn".split()

FOREIGN = """
Москва Россия привет данные система Ελλάδα Αθήνα δεδομένα 東京 日本語 中国 北京 数据 데이터 서울
José Müller Zoë Renée Chloé François Beyoncé Gödel Dvořák Łódź Søren São Zürich Québec résumé café
naïve façade déjà piñata jalapeño über
""".split()

ONSETS = "b c d f g h j k l m n p r s t v w y z ch sh th st tr br pl".split()
VOWELS = "a e i o u ea oo ai".split()
CODAS = ["", "n", "r", "s", "t", "l", "nd", "ck"]
SYLLABLES = sorted(
    {o + v + c for o, v, c in itertools.product(ONSETS, VOWELS, CODAS)} - {"fuck", "shit", "cunt"}
)
LETTERS = list("ABCDEFGHIJKLMNOPRSTUVW")

# (separator, probability) after a word. Separators whose first character is . ! or ? end a sentence.
STORY_SEPARATORS = [
    (" ", 0.80), (", ", 0.04), (". ", 0.07), (".\n\n", 0.02), ("! ", 0.012), ("? ", 0.01), (', "', 0.01),
    ('," ', 0.008), ('." ', 0.01), ('!" ', 0.005), (" and ", 0.015),
]  # fmt: skip
WEB_SEPARATORS = [
    (" ", 0.745), (", ", 0.05), (". ", 0.05), (".\n\n", 0.015), ("\n", 0.01), ("? ", 0.005), ("! ", 0.004),
    (": ", 0.008), ("; ", 0.003), (" (", 0.01), (") ", 0.01), (" - ", 0.01), (" \u2014 ", 0.008),
    ("\u2019s ", 0.006), ("'s ", 0.01), (' "', 0.006), ('" ', 0.006), (" \u201c", 0.006), ("\u201d ", 0.006),
    ("... ", 0.003), ("/", 0.01), ("-", 0.01), (".\n\n- ", 0.005),
]  # fmt: skip


def made_up_words(rng: np.random.Generator, count: int, max_syllables: int) -> list[str]:
    """`count` words of 1 to `max_syllables` random syllables."""
    syllables = np.array(SYLLABLES, dtype=object)
    words = syllables[rng.integers(0, len(syllables), count)]
    lengths = rng.integers(1, max_syllables + 1, count)
    for k in range(1, max_syllables):
        longer = lengths > k
        words[longer] += syllables[rng.integers(0, len(syllables), int(longer.sum()))]
    return words.tolist()


class PieceTable:
    """Strings stored once as UTF-8 in one buffer; `add` returns the ids of a list of strings."""

    def __init__(self):
        self._pieces: list[bytes] = []

    def add(self, strings: list[str]) -> np.ndarray:
        first = len(self._pieces)
        self._pieces += [s.encode("utf-8") for s in strings]
        return np.arange(first, len(self._pieces), dtype=np.int32)

    def freeze(self) -> None:
        self.lengths = np.array([len(p) for p in self._pieces], dtype=np.int32)
        self.starts = (np.cumsum(self.lengths, dtype=np.int64) - self.lengths).astype(np.int32)
        self.buffer = np.frombuffer(b"".join(self._pieces), dtype=np.uint8)

    def gather(self, ids: np.ndarray) -> bytes:
        """The bytes of the pieces `ids`, concatenated."""
        lengths = self.lengths[ids]
        ends = np.cumsum(lengths, dtype=np.int32)  # (batches are far below 2 GB)
        # Byte k of the output is byte (k - output start of its piece + table start of its piece).
        index = np.repeat(self.starts[ids] - (ends - lengths), lengths)
        index += np.arange(int(ends[-1]), dtype=np.int32)
        return np.take(self.buffer, index).tobytes()


class Profile:
    """The pieces and probabilities of one profile; `batch` draws whole documents."""

    def __init__(self, name: str, seed: int):
        self.seed = [seed, 1 if name == "stories" else 2]
        self.rng = np.random.default_rng(self.seed)
        lexicon_rng = np.random.default_rng([0, 7])  # the lexicon is the same for every seed
        table = self.table = PieceTable()
        stories = name == "stories"
        lexicon = COMMON + made_up_words(lexicon_rng, 3_000 if stories else 1_000_000, 2 if stories else 3)
        self.zipf_exponent = 1.1 if stories else 1.05
        self.words = table.add(lexicon)
        self.capitalized = table.add([w.capitalize() for w in lexicon])
        # The most common slot, a lexicon word and a space, as one piece: fewer pieces to gather.
        self.words_spaced = table.add([w + " " for w in lexicon])
        self.capitalized_spaced = table.add([w.capitalize() + " " for w in lexicon])
        separators = STORY_SEPARATORS if stories else WEB_SEPARATORS
        self.separators = table.add([s for s, _ in separators])
        self.separator_p = np.array([p for _, p in separators]) / sum(p for _, p in separators)
        self.sentence_end = np.array(
            [s.split()[0][0] in ".!?" if s.split() else False for s, _ in separators]
        )
        ending = [s.split()[0] if self.sentence_end[i] else "." for i, (s, _) in enumerate(separators)]
        self.document_end = table.add(ending)  # the last document of a batch
        self.document_end_then_next = table.add([e + END_OF_TEXT for e in ending])
        words_per_sentence = 1.0 / self.separator_p[self.sentence_end].sum()
        self.end_document_p = min(1.0, words_per_sentence / (180 if stories else 900))
        # Other kinds of words: (probability per word slot, function n -> piece ids [n, 6], -1 = none).
        if stories:
            self.names = table.add(NAMES)
            self.kinds = [(0.03, self._names)]
        else:
            self.names = table.add([w.capitalize() for w in made_up_words(lexicon_rng, 50_000, 2)])
            self.capitals = table.add([w.upper() for w in lexicon[:20_000]])
            self.foreign = table.add(FOREIGN)
            self.syllables = table.add(SYLLABLES)
            self.letters = table.add(LETTERS)
            self.integers = table.add([str(i) for i in range(100_000)])
            self.digits2 = table.add([f"{i:02d}" for i in range(100)])
            self.digits3 = table.add([f"{i:03d}" for i in range(1000)])
            self.symbols = dict(zip("$.,%@/", table.add(list("$.,%@/")), strict=True))
            self.link_parts = table.add(["https://www.", ".com/"])
            self.kinds = [(0.04, self._names), (0.02, self._numbers), (0.01, self._one_off),
                          (0.004, self._acronyms), (0.002, self._capitals), (0.004, self._foreign),
                          (0.001, self._links)]  # fmt: skip
        table.freeze()

    def _zipf(self, n: int, size: int) -> np.ndarray:
        """n ranks in [0, size), P(rank) roughly proportional to (rank + 2.7) ** -exponent."""
        s, offset = self.zipf_exponent, 2.7
        lo, hi = offset ** (1 - s), (size + offset) ** (1 - s)
        ranks = (lo - self.rng.random(n) * (lo - hi)) ** (1 / (1 - s)) - offset
        return np.clip(ranks.astype(np.int64), 0, size - 1)

    def _pick(self, ids: np.ndarray, n: int) -> np.ndarray:
        return ids[self.rng.integers(0, len(ids), n)]

    def _columns(self, n: int, *columns: np.ndarray) -> np.ndarray:
        out = np.full((n, 6), -1, dtype=np.int32)
        for i, column in enumerate(columns):
            out[:, i] = column
        return out

    def _names(self, n: int) -> np.ndarray:
        if len(self.names) < 100:
            return self._columns(n, self._pick(self.names, n))
        return self._columns(n, self.names[self._zipf(n, len(self.names))])

    def _numbers(self, n: int) -> np.ndarray:
        """Years (1987), prices ($906.53), thousands (12,345) and percentages (17%)."""
        kind = self.rng.integers(0, 4, n)
        out = self._columns(n, self.integers[self.rng.integers(0, 10 ** self.rng.integers(1, 6, n))])
        out[kind == 0, 0] = self.integers[self.rng.integers(1900, 2030, int((kind == 0).sum()))]
        price = kind == 1
        out[price, 1] = out[price, 0]
        out[price, 0] = self.symbols["$"]
        out[price, 2] = self.symbols["."]
        out[price, 3] = self._pick(self.digits2, int(price.sum()))
        thousands = kind == 2
        out[thousands, 1] = self.symbols[","]
        out[thousands, 2] = self._pick(self.digits3, int(thousands.sum()))
        out[kind == 3, 1] = self.symbols["%"]
        return out

    def _one_off(self, n: int) -> np.ndarray:
        """Words that occur about once: 2-4 random syllables, some with a number or a leading @."""
        out = self._columns(n, *(self._pick(self.syllables, n) for _ in range(4)))
        out[self.rng.random(n) < 0.3, 3] = -1
        out[self.rng.random(n) < 0.3, 2] = -1
        style = self.rng.integers(0, 3, n)
        out[style == 0, 4] = self._pick(self.integers[:1000], int((style == 0).sum()))
        handles = np.flatnonzero(style == 1)
        out[handles, 1:5] = out[handles, 0:4]
        out[handles, 0] = self.symbols["@"]
        return out

    def _acronyms(self, n: int) -> np.ndarray:
        out = self._columns(n, *(self._pick(self.letters, n) for _ in range(4)))
        out[self.rng.random(n) < 0.5, 3] = -1
        out[self.rng.random(n) < 0.3, 2] = -1
        return out

    def _capitals(self, n: int) -> np.ndarray:
        return self._columns(n, self.capitals[self._zipf(n, len(self.capitals))])

    def _foreign(self, n: int) -> np.ndarray:
        return self._columns(n, self._pick(self.foreign, n))

    def _links(self, n: int) -> np.ndarray:
        https, com = self.link_parts
        words = self.words[self._zipf(n, 5000)]
        paths = self.words[self._zipf(n, len(self.words))]
        return self._columns(
            n,
            np.full(n, https),
            words,
            np.full(n, com),
            paths,
            np.full(n, self.symbols["/"]),
            self._pick(self.integers, n),
        )

    def batch(self, index: int, n: int) -> bytes:
        """Batch `index`: about n words of text, whole documents joined by END_OF_TEXT, none after the last.

        Each batch draws from its own generator, seeded by (seed, profile, index), so batches can be
        made in any order and in parallel.
        """
        self.rng = np.random.default_rng([*self.seed, index])
        separators = self.rng.choice(len(self.separators), size=n, p=self.separator_p)
        separators[-1] = int(np.flatnonzero(self.sentence_end)[0])  # the batch ends a sentence
        # A word after a sentence end starts with a capital letter.
        starts = np.concatenate([[True], self.sentence_end[separators[:-1]]])
        ranks = self._zipf(n, len(self.words))
        pieces = np.full((n, 7), -1, dtype=np.int32)
        pieces[:, 0] = np.where(starts, self.capitalized[ranks], self.words[ranks])
        pieces[:, 6] = self.separators[separators]
        spaced = separators == 0  # " " (the first separator of both profiles)
        pieces[spaced, 0] += self.words_spaced[0] - self.words[0]  # the same word, with its space
        pieces[spaced, 6] = -1
        # A few slots are other kinds of words, each kind with its probability.
        draws = self.rng.random(n)
        bounds = np.cumsum([probability for probability, _ in self.kinds])
        special = np.flatnonzero(draws < bounds[-1])
        kind_of = np.searchsorted(bounds, draws[special], side="right")
        for k, (_, make) in enumerate(self.kinds):
            chosen = special[kind_of == k]
            pieces[chosen, :6] = make(len(chosen))
            pieces[chosen, 6] = self.separators[separators[chosen]]
        # Documents end at sentence ends; the last one of the batch ends the last document.
        ends = np.flatnonzero(self.sentence_end[separators])
        document_ends = ends[self.rng.random(len(ends)) < self.end_document_p]
        pieces[document_ends, 6] = self.document_end_then_next[separators[document_ends]]
        pieces[-1, 6] = self.document_end[separators[-1]]
        ids = pieces.ravel()
        return self.table.gather(ids[ids >= 0])


def parse_size(text: str) -> int:
    """'100MB', '1GB', '512KB' or a plain number of bytes (decimal units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 100MB, 1GB)")
    number, unit = match.groups()
    return int(float(number) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[unit])


_worker_profile: Profile | None = None


def _make_batch(args: tuple[int, int]) -> bytes:
    return _worker_profile.batch(*args)


def generate(
    profile: str, size: int, out, seed: int = 0, num_workers: int | None = None, batch_words: int = 500_000
) -> int:
    """Write at most `size` bytes of `profile` text to the binary file `out`; return the bytes written.

    Stops at the last document end that fits in `size`; a first document longer than `size` is
    written whole. Batches are made by `num_workers` processes (default: all cores); the output
    does not depend on their number.
    """
    global _worker_profile
    _worker_profile = Profile(profile, seed)  # built once, shared with the forked workers
    num_workers = num_workers or len(os.sched_getaffinity(0))
    separator = END_OF_TEXT.encode("utf-8")
    written = 0
    pool = multiprocessing.get_context("fork").Pool(num_workers) if num_workers > 1 else None
    with pool or contextlib.nullcontext():
        for first in itertools.count(0, num_workers):
            tasks = [(i, batch_words) for i in range(first, first + num_workers)]
            for data in pool.map(_make_batch, tasks) if pool else map(_make_batch, tasks):
                room = size - written - (len(separator) if written else 0)
                last = len(data) > room
                if last:  # the documents that fit
                    cut = data.rfind(separator, 0, max(0, room) + len(separator))
                    if cut == -1 and written == 0:  # the first document, whole
                        cut = data.find(separator) if separator in data else len(data)
                    data = data[: max(0, cut)]
                if data:
                    if written:
                        out.write(separator)
                        written += len(separator)
                    out.write(data)
                    written += len(data)
                if last:
                    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=["stories", "web"], required=True)
    parser.add_argument("--size", type=parse_size, required=True, help="e.g. 100MB, 1GB (decimal units)")
    parser.add_argument("--out", type=Path, required=True, help="output file (bench/out/ or /tmp, not git)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    start = time.perf_counter()
    with open(tmp, "wb") as f:
        written = generate(args.profile, args.size, f, args.seed)
    tmp.replace(args.out)
    seconds = time.perf_counter() - start
    print(
        f"{args.out}: {written / 1e6:.1f} MB of {args.profile} text (seed {args.seed}) in {seconds:.1f} s, "
        f"{written / 1e6 / seconds:.0f} MB/s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
