"""Waits between ranks that are not collectives: as long as it takes, but never on a hung rank.

A collective gives up after the process group's timeout (`train.timeout_s`), which is right for
training steps and wrong for file I/O: writing or reading a large checkpoint on slow storage can
take longer than any sensible collective timeout, and the other ranks must wait for it without
being told that a rank hung. So the ranks of a checkpoint meet through the rendezvous store
instead, under a different rule:

- every rank `beat()`s while it works (after each piece of a file it writes or reads) and while it
  waits: a counter per rank in the store, bumped at most a few times a second;
- `wait(keys)` polls the store until every key has been posted, and gives up only when a rank that
  has yet to post its key has not beaten for `timeout_s`: that rank hung (or died, which the
  launcher reports first). A slow rank beats; a hung one does not.

So a checkpoint of any size never trips the hung-rank detection, while a rank that stops making
progress is still reported within `timeout_s` (plus one poll). Keys are namespaced by the phase
(e.g. "commit/500"), so every phase uses fresh keys.

Without a store (a world of one) posting and waiting happen in this process only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch.distributed as dist


class RankHungError(RuntimeError):
    """A rank made no progress for `timeout_s` while the others waited for it."""


class Heartbeat:
    """Post values, wait for other ranks' values, and prove this rank alive; see module docs."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, timeout_s: float, phase: str):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.phase = timeout_s, phase
        self._interval = min(0.5, timeout_s / 10)  # beats and polls, well inside the timeout
        self._last_beat = 0.0
        self._local: dict[str, str] = {}

    def beat(self) -> None:
        """Tell the other ranks this one is making progress (rate-limited: cheap to call often)."""
        now = time.monotonic()
        if self.store is not None and now - self._last_beat >= self._interval:
            self.store.add(f"beat/{self.rank}", 1)
            self._last_beat = now

    def post(self, key: str, value: str) -> None:
        """Make `value` available to every rank under `key` (in this phase)."""
        if self.store is None:
            self._local[key] = value
        else:
            self.store.set(f"{self.phase}/{key}", value)

    def wait(self, keys: dict[str, int], what: str) -> dict[str, str]:
        """Wait until each key has been posted; {key: the rank that posts it} -> {key: value}.

        Raises RankHungError naming the rank when one that has not posted its key yet makes no
        progress for `timeout_s`.
        """
        if self.store is None:
            return {key: self._local[key] for key in keys}
        names = {key: f"{self.phase}/{key}" for key in keys}
        last_seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last changed)
        while True:
            self.beat()
            pending = [key for key in keys if not self.store.check([names[key]])]
            if not pending:
                return {key: self.store.get(names[key]).decode() for key in keys}
            now = time.monotonic()
            for rank in sorted({keys[key] for key in pending}):
                count = self.store.add(f"beat/{rank}", 0)
                if rank not in last_seen or last_seen[rank][0] != count:
                    last_seen[rank] = (count, now)
                elif now - last_seen[rank][1] >= self.timeout_s:
                    raise RankHungError(
                        f"rank {rank} made no progress for {self.timeout_s:g} s (train.timeout_s) while "
                        f"rank {self.rank} waited for it to finish {what}: it hung"
                    )
            time.sleep(self._interval / 2)

    def barrier(self, what: str, ranks: Sequence[int] | None = None) -> None:
        """Every rank (of `ranks`, default all) posts "done" and waits for the others' (see `wait`)."""
        ranks = range(self.world_size) if ranks is None else ranks
        self.post(f"{what}/{self.rank}", "done")
        if self.store is not None:
            self.wait({f"{what}/{r}": r for r in ranks}, what)
