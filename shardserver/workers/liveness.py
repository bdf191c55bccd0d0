"""Liveness of the supervisor's children: a heartbeat in shared memory.

A child that is stopped (SIGSTOP, a debugger) or whose event loop is blocked still holds its
share of the work: a front-end keeps accepting connections from the shared listening socket
and never answers them, an encoder keeps its futures pending. Its process is alive, so its
sentinel never fires. Each encoder and front-end therefore runs a heartbeat task on its event
loop (:func:`start_heartbeat`) that writes ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for
every process of the machine) into its own float64 slot of a shared array every
:func:`beat_period_s` seconds; the supervisor (:class:`Heartbeats`) reads the slots and SIGKILLs
and restarts a child whose last beat is older than ``server.liveness_timeout_s``. A beat costs
one store into shared memory; the supervisor looks every 0.2 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Heartbeats", "HeartbeatSlot", "beat_period_s", "start_heartbeat"]

_CTX = mp.get_context("spawn")


def beat_period_s(timeout_s: float) -> float:
    """Seconds between two beats of a child for a liveness bound of ``timeout_s`` seconds:
    a quarter of it, at most 1 s (so a slow beat alone never reaches the bound)."""
    return min(1.0, timeout_s / 4)


@dataclass
class HeartbeatSlot:
    """One child's slot: ``array[index]`` is the CLOCK_MONOTONIC time (float64 seconds) of its last beat.

    Picklable into a spawned child as a ``Process`` argument (the array is shared memory).
    """

    array: Any
    index: int

    def beat(self) -> None:
        self.array[self.index] = time.monotonic()

    async def run(self, period_s: float) -> None:
        """Beat every ``period_s`` seconds until cancelled."""
        while True:
            self.beat()
            await asyncio.sleep(period_s)


def start_heartbeat(slot: HeartbeatSlot | None, timeout_s: float, name: str) -> asyncio.Task[None] | None:
    """Start beating ``slot`` on the running event loop; None when there is no slot or
    ``timeout_s`` is 0 (liveness checks off). The caller cancels the task at shutdown."""
    if slot is None or timeout_s <= 0:
        return None
    slot.beat()
    return asyncio.get_running_loop().create_task(slot.run(beat_period_s(timeout_s)), name=name)


class Heartbeats:
    """The supervisor's side: ``count`` slots of float64 seconds in shared memory.

    Args:
        count: number of children with a slot (encoders and front-ends).
    """

    def __init__(self, count: int) -> None:
        self.array = _CTX.RawArray("d", count)

    def slot(self, index: int) -> HeartbeatSlot:
        """The slot to hand to child ``index``; marked as beaten now (a fresh start is not stale)."""
        self.array[index] = time.monotonic()
        return HeartbeatSlot(self.array, index)

    def touch(self, index: int) -> None:
        """Count now as a beat of child ``index`` (it just reported READY)."""
        self.array[index] = time.monotonic()

    def age_s(self, index: int, now: float | None = None) -> float:
        """Seconds since child ``index`` last beat."""
        return (time.monotonic() if now is None else now) - self.array[index]
