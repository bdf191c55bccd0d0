"""Small asyncio helpers shared by the worker processes."""

from __future__ import annotations

import asyncio

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished; its exception, if any, is dropped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
