"""Which vision-encoder outputs the runner holds, decided by the scheduler.

The runner keeps each image's encoder output (its placeholder rows) keyed by content hash; this
manager is the bookkeeping side: an LRU over those keys bounded in rows, and a per-step
budget of encoder rows to compute. A repeated image (in a later chunk of the same prompt, or
in another request) skips the encoder while its entry lives. The scheduler plans a chunk
only if every image it touches is cached or fits this step's budget, and tells the runner
which entries to compute and which to drop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mmserve.inputs import MMInput


class EncoderCacheManager:
    def __init__(self, capacity_rows: int, rows_per_step: int) -> None:
        self.capacity = capacity_rows  # rows the runner may hold at once
        self.rows_per_step = rows_per_step  # encoder rows computed per step, at most
        self._cached: OrderedDict[str, int] = OrderedDict()  # key -> rows, least recent first
        self._used = 0
        self._step_rows = 0  # rows planned for computation this step
        self._pinned: set[str] = set()  # needed by this step: never evicted during it
        self._evicted: list[str] = []
        self.hits = 0  # images of planned chunks found cached (cumulative, for metrics)
        self.misses = 0  # ... to compute

    def begin_step(self) -> None:
        self._step_rows = 0
        self._pinned.clear()

    def end_step(self) -> list[str]:
        """Keys the runner should drop before this step runs."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def __contains__(self, key: object) -> bool:
        return key in self._cached

    def plan(self, inputs: Sequence[MMInput]) -> list[MMInput] | None:
        """Reserves room for the inputs a chunk touches; returns those to compute this step,
        or None (nothing reserved) when they do not fit the step budget or the cache."""
        new = {mm.key: mm for mm in inputs if mm.key not in self._cached}
        rows = sum(mm.placeholder.length for mm in new.values())
        alone = self._step_rows == 0 and len(new) == 1  # an image over the budget runs alone
        if new and not alone and self._step_rows + rows > self.rows_per_step:
            return None
        if not self._make_room(rows, {mm.key for mm in inputs}):
            return None
        for mm in inputs:
            if mm.key in self._cached:
                self._cached.move_to_end(mm.key)
            self._pinned.add(mm.key)
        for key, mm in new.items():
            self._cached[key] = mm.placeholder.length
        self.misses += len(new)
        self.hits += len(inputs) - len(new)
        self._used += rows
        self._step_rows += rows
        return list(new.values())

    def _make_room(self, rows: int, keep: set[str]) -> bool:
        free = self.capacity - self._used
        victims = []
        for key, size in self._cached.items():  # least recently used first
            if free >= rows:
                break
            if key not in self._pinned and key not in keep:
                victims.append(key)
                free += size
        if free < rows and any(k in self._pinned or k in keep for k in self._cached):
            return False  # too big beside what this step needs: it runs in a later step
        for key in victims:
            self._used -= self._cached.pop(key)
            self._evicted.append(key)
        return True
