"""Deadlines of a shard's futures, bucketed by time (the TTL sweep's index).

A shard holds up to ``shards.max_pending`` futures (65,536 in the full soak), each with a TTL
deadline that moves as the future changes state (pending, completed, retrieved). A heap of
``(deadline, seq, fid)`` tuples cost ~120 bytes per item (the tuple, a float and an int); a
bucket keeps only a reference to the future ID the table already holds (~9 bytes per item).

Items are not removed when a deadline moves: the caller says what a key's deadline is now
(``deadline_of``), and an item whose key is gone, or whose deadline now falls in another
bucket, is skipped when its bucket comes due. The caller rebuilds the index from its table when
stale items dominate (:meth:`DeadlineBuckets.rebuild`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

__all__ = ["DeadlineBuckets", "GRANULARITY_S"]

# Width of a bucket (seconds of monotonic time). Only the bucket that holds ``now`` is checked
# item by item (and kept in part); every earlier one is due whole. Finer than the encoder's
# futures.sweep_interval_s (1 s by default), so a sweep checks at most one partial bucket.
GRANULARITY_S = 0.25


class DeadlineBuckets:
    """Keys (future IDs) by the time bucket of their deadline.

    Args:
        granularity_s: bucket width (seconds, > 0).

    ``len()`` counts items, stale ones included.
    """

    __slots__ = ("_g", "_buckets", "_heap", "_items")

    def __init__(self, granularity_s: float = GRANULARITY_S) -> None:
        if not granularity_s > 0:
            raise ValueError(f"granularity_s must be > 0, got {granularity_s!r}")
        self._g = granularity_s
        self._buckets: dict[int, list[str]] = {}
        self._heap: list[int] = []  # bucket numbers, one item per bucket
        self._items = 0

    def __len__(self) -> int:
        return self._items

    def add(self, key: str, deadline: float) -> None:
        """File ``key`` under ``deadline`` (seconds, the caller's clock). An earlier item of the
        same key is left in place (it is skipped once its bucket comes due)."""
        b = int(deadline // self._g)
        lst = self._buckets.get(b)
        if lst is None:
            self._buckets[b] = [key]
            heapq.heappush(self._heap, b)
        else:
            lst.append(key)
        self._items += 1

    def pop_due(self, now: float, deadline_of: Callable[[str], float | None]) -> list[str]:
        """Take out the keys whose deadline is ``<= now``.

        ``deadline_of(key)`` gives a key's current deadline, or None when it is gone; items whose
        key is gone or whose deadline moved to another bucket are dropped. A key filed twice
        under one bucket can come back twice: the caller re-checks each key's deadline as it
        acts on it. Items of the bucket holding ``now`` that are not due yet stay.
        """
        g, heap, buckets = self._g, self._heap, self._buckets
        out: list[str] = []
        while heap and heap[0] * g <= now:
            b = heapq.heappop(heap)
            keys = buckets.pop(b)
            self._items -= len(keys)
            keep: list[str] = []
            for k in keys:
                d = deadline_of(k)
                if d is None or int(d // g) != b:
                    continue
                (out if d <= now else keep).append(k)
            if keep:
                lst = buckets.get(b)
                if lst is None:
                    buckets[b] = keep
                    heapq.heappush(heap, b)
                else:
                    lst.extend(keep)
                self._items += len(keep)
                break  # b holds now: every later bucket starts after it
        return out

    def rebuild(self, items: Iterable[tuple[str, float]]) -> None:
        """Replace every item with ``items`` (``(key, deadline)`` pairs: each live key once)."""
        self._buckets, self._heap, self._items = {}, [], 0
        for key, deadline in items:
            self.add(key, deadline)
