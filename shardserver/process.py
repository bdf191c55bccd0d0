"""What every shardserver process does the same way: its title, its logging, and leaving
when its parent (the supervisor) is gone.

Used by the supervisor (``shardserver serve``), the encoders and front-ends
(:mod:`shardserver.workers`) and the engine simulator's process
(:func:`shardserver.engine_sim.run_process`). Depends on nothing else in the package.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Callable

__all__ = ["set_process_title", "configure_logging", "watch_parent"]

log = logging.getLogger("shardserver")


def set_process_title(role: str) -> None:
    """Name this process ``shardserver: <role>`` for ``ps``/``top`` (e.g. ``encoder 3``).

    Silently does nothing when ``setproctitle`` (a core dependency) is missing.
    """
    try:
        import setproctitle

        setproctitle.setproctitle(f"shardserver: {role}")
    except ImportError:  # pragma: no cover - setproctitle is a core dependency
        pass


def configure_logging(level: str) -> None:
    """Plain ``time level name[pid]: message`` lines on stderr, one handler, no Rich.

    ``level``: a :mod:`logging` level name, any case (``server.log_level``: debug, info,
    warning, error).
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root.addHandler(h)
    root.setLevel(level.upper())
    logging.getLogger("shardserver").setLevel(level.upper())


async def watch_parent(parent_pid: int, on_gone: Callable[[], object], *, who: str, interval_s: float = 0.5,
                       logger: logging.Logger | None = None) -> None:
    """Return once the parent is gone, after calling ``on_gone()`` exactly once.

    Every ``interval_s`` seconds compares ``os.getppid()`` with ``parent_pid``: a child whose
    supervisor was SIGKILLed is re-parented (to init or a subreaper), so a different ppid
    means nobody will send it SIGTERM. Then logs ``"<who>: supervisor <pid> is gone,
    exiting"`` as a warning on ``logger`` and calls ``on_gone`` (typically the setter of the
    process's stop event). Run it as a task and cancel it on a normal stop.
    """
    while True:
        await asyncio.sleep(interval_s)
        if os.getppid() != parent_pid:
            (logger or log).warning("%s: supervisor %d is gone, exiting", who, parent_pid)
            on_gone()
            return
