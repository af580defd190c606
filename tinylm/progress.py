"""Progress of long work as plain lines on stderr, the same on a terminal and in a log file.

    progress = Progress("[encode] train.txt", total=size, unit="B")
    for chunk in chunks:
        progress.update(len(chunk))

The first line comes FIRST_S seconds in, then one every EVERY_S seconds, each with the share done,
the rate and the time left; work that ends sooner says nothing. The training loop times its lines
between those of `train.log_interval` with the same `ProgressClock` (tinylm/pretrain/log.py).
"""

from __future__ import annotations

import sys
import time

FIRST_S = 5.0  # the first line this many seconds in, so a slow machine is known within seconds
EVERY_S = 60.0  # then a line at least this often


def amount(value: float, unit: str) -> str:
    """'12,345 merges', or bytes in kB, MB, GB ('3.2 MB')."""
    if unit != "B":
        return f"{value:,.0f} {unit}".rstrip()
    for prefix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {prefix}B"
    return f"{value:.0f} B"


class ProgressClock:
    """When the next progress line is due: FIRST_S seconds after the start, then EVERY_S seconds
    after the last line."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        """Count FIRST_S from now (the start of the work, or after a pause such as a compilation)."""
        self._last, self._after = time.perf_counter(), FIRST_S

    def due(self) -> bool:
        return time.perf_counter() - self._last >= self._after

    def printed(self) -> None:
        """A line was printed: the next is due EVERY_S from now."""
        self._last, self._after = time.perf_counter(), EVERY_S


class Progress:
    """Lines on stderr for work of `total` units (None: unknown), labelled `label`; `enabled=False`
    prints nothing."""

    def __init__(self, label: str, total: float | None, unit: str = "", enabled: bool = True):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.done = 0.0
        self.started = time.perf_counter()
        self.clock = ProgressClock()

    def update(self, n: float = 1) -> None:
        """Count `n` more units done; print a line when one is due."""
        self.done += n
        if self.enabled and self.clock.due():
            print(f"{self.label}: {self.line(time.perf_counter())}", file=sys.stderr, flush=True)
            self.clock.printed()

    def line(self, now: float) -> str:
        """'1.2 MB of 5.0 MB (24 %) in 6 s, 0.2 MB/s, 19 s left' (no share or time left without a total)."""
        elapsed = now - self.started
        rate = self.done / max(elapsed, 1e-9)
        out = amount(self.done, self.unit)
        if self.total:
            out += f" of {amount(self.total, self.unit)} ({100 * self.done / self.total:.0f} %)"
        out += f" in {elapsed:.0f} s, {amount(rate, self.unit)}/s"
        if self.total and rate > 0:
            out += f", {max(self.total - self.done, 0) / rate:.0f} s left"
        return out
