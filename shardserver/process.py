"""What every shardserver process does the same way: its title, its logging, and leaving
when its parent (the supervisor) is gone.

Used by the supervisor (``shardserver serve``), the encoders and front-ends
(:mod:`shardserver.workers`) and the engine simulator's process
(:func:`shardserver.engine_sim.run_process`). Depends on nothing else in the package.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from typing import Callable

__all__ = ["set_process_title", "configure_logging", "watch_parent", "die_with_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

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


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process as soon as its parent (the supervisor) exits,
    even by SIGKILL: ``prctl(PR_SET_PDEATHSIG, sig)`` on Linux, through ctypes.

    Call it first thing in a spawned child. The parent may have died before the call (then no
    signal would ever come), so this checks ``getppid()`` afterwards and sends ``sig`` to itself
    at once if the parent is already gone. The signal fires when the *thread* that started the
    child exits: the supervisor starts every child from its main thread. :func:`watch_parent`
    stays as the fallback where ``prctl`` is missing.

    Args:
        parent_pid: the supervisor's pid, as the supervisor saw it (``os.getpid()``).
        sig: the signal to receive: SIGTERM runs the child's own shutdown; SIGKILL for children
            that have nothing to clean up.

    Returns:
        True if the kernel will send the signal; False where ``prctl`` is unavailable (not Linux).
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            armed = False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return armed


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
