"""Small asyncio helpers shared by the worker processes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["cancel_and_wait", "RateLimitedLog"]


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished; its exception, if any, is dropped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


class RateLimitedLog:
    """Logs an event at once, then at most once per ``interval_s`` with the count since the last line.

    ``hit(msg, *args)`` formats ``msg % args``; each ``msg`` (the format string: one kind of
    event) is limited on its own. A line that stands for more than one event ends with
    ``" (N times in the last T s)"``: N events since that kind's previous line, T seconds ago.
    Events folded into no line yet are logged ``interval_s`` after that previous line even if no
    further event comes (from the running event loop; without one, at the next event), with the
    arguments of the last of them.
    """

    def __init__(self, logger: logging.Logger, level: int, interval_s: float = 10.0) -> None:
        self.logger, self.level, self.interval_s = logger, level, interval_s
        # per format string: [monotonic time of its last line, events folded since, last args,
        # flush timer handle or None]
        self._kinds: dict[str, list[Any]] = {}

    def hit(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        k = self._kinds.get(msg)
        if k is None:
            k = self._kinds[msg] = [-1e18, 0, (), None]
        k[1] += 1
        k[2] = args
        if now - k[0] >= self.interval_s:
            self._emit(msg, k, now)
        elif k[3] is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            k[3] = loop.call_later(k[0] + self.interval_s - now, self._flush, msg)

    def _flush(self, msg: str) -> None:
        k = self._kinds.get(msg)
        if k is not None:
            k[3] = None
            if k[1]:
                self._emit(msg, k, time.monotonic())

    def _emit(self, msg: str, k: list[Any], now: float) -> None:
        n, since, args = k[1], now - k[0], k[2]
        if k[3] is not None:
            k[3].cancel()
        k[:] = [now, 0, (), None]
        if n > 1:
            msg += f" ({n} times in the last {since:.0f} s)"
        self.logger.log(self.level, msg, *args)
