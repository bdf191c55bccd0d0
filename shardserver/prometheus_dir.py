"""The run's Prometheus multiprocess directory (no ``prometheus_client`` import at module level).

``prometheus_client`` decides how it stores values when it is first imported:
in mmap files under ``$PROMETHEUS_MULTIPROC_DIR`` if that variable is set, in
process memory otherwise. So the supervisor calls
:func:`prepare_prometheus_dir` before it imports :mod:`shardserver.metrics` and
before it spawns any child; the children inherit the variable.
"""

from __future__ import annotations

import logging
import os

__all__ = ["MULTIPROC_ENV", "prepare_prometheus_dir", "prometheus_dir", "mark_process_dead", "use_cached_pid"]

log = logging.getLogger("shardserver.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_prometheus_dir(run_dir: str) -> str:
    """Create ``<run_dir>/metrics`` (removing ``*.db`` files already there) and set
    ``PROMETHEUS_MULTIPROC_DIR`` to it in this process's environment.

    Returns:
        the directory path.

    Raises:
        OSError: the directory cannot be created.
    """
    path = os.path.join(run_dir, "metrics")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.unlink(os.path.join(path, name))
    os.environ[MULTIPROC_ENV] = path
    return path


_pid = [0]


def _cached_pid() -> int:
    return _pid[0]


def _refresh_pid() -> None:
    _pid[0] = os.getpid()


def use_cached_pid() -> None:
    """Make ``prometheus_client``'s multiprocess values read this process's pid from a cache.

    In multiprocess mode every ``inc()``/``set()``/``observe()`` calls its process identifier
    (``os.getpid``, a system call) to notice a ``fork()``; an encoder makes dozens of metric
    updates per result, and the calls were 3-5 % of its CPU in ``benchmarks/run_load.py
    --scenario queue-8k``. The cache is refreshed in the child after every ``os.fork()``
    (``os.register_at_fork``), so a forked child still gets files of its own. Call before any
    metric is created (the values class is chosen per metric at creation); a no-op when
    ``PROMETHEUS_MULTIPROC_DIR`` is unset (process-local values never call it).
    """
    if not os.environ.get(MULTIPROC_ENV):
        return
    from prometheus_client import values

    if _pid[0] == 0:
        _refresh_pid()
        os.register_at_fork(after_in_child=_refresh_pid)
    values.ValueClass = values.MultiProcessValue(process_identifier=_cached_pid)


def prometheus_dir() -> str | None:
    """The multiprocess directory of this process, or None when metrics are process-local."""
    d = os.environ.get(MULTIPROC_ENV)
    return d if d and os.path.isdir(d) else None


def mark_process_dead(pid: int | None) -> None:
    """Bookkeeping for a child that exited: drop its live-mode gauge files.

    Counter and histogram files of dead processes are kept on purpose, so that totals stay
    monotonic across worker restarts. Errors are logged at debug level, never raised.
    """
    d = prometheus_dir()
    if d is None or pid is None:
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, d)
    except OSError as exc:  # pragma: no cover - a file vanished meanwhile
        log.debug("mark_process_dead(%s): %s", pid, exc)
