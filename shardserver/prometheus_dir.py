"""The run's Prometheus multiprocess directory (no ``prometheus_client`` import at module level).

``prometheus_client`` decides how it stores values when it is first imported:
in mmap files under ``$PROMETHEUS_MULTIPROC_DIR`` if that variable is set, in
process memory otherwise. So the supervisor calls
:func:`prepare_prometheus_dir` before it imports :mod:`shardserver.metrics` and
before it spawns any child; the children inherit the variable.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from typing import Iterator

__all__ = ["MULTIPROC_ENV", "prepare_prometheus_dir", "prometheus_dir", "mark_process_dead", "use_cached_pid",
           "restore_removed_files", "fold_dead_process", "files_lock"]

log = logging.getLogger("shardserver.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The lock file in the multiprocess directory (not ``*.db``: the collector reads only those).
#: A scrape holds it shared while it reads the files, :func:`fold_dead_process` exclusively.
LOCK_NAME = ".fold.lock"
#: What stands for the pid in the file names of the folded counts of dead processes
#: (``counter_dead.db``, ``histogram_dead.db``, ``summary_dead.db``).
FOLDED_PID = "dead"
#: The file types whose values are summed over processes, so a dead process's file can be
#: folded into one (live gauges are dropped instead, :func:`mark_process_dead`).
_SUMMED_TYPES = ("counter", "histogram", "summary")


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
    """Bookkeeping for a child that exited: drop its live-mode gauge files, and fold its
    counter, histogram and summary files into the run's files of dead processes
    (:func:`fold_dead_process`), so totals stay monotonic across worker restarts while the
    directory holds a bounded number of files however often workers restart. Errors are logged,
    never raised (a fold that finds the lock busy is left to the next one).
    """
    d = prometheus_dir()
    if d is None or pid is None:
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, d)
    except OSError as exc:  # pragma: no cover - a file vanished meanwhile
        log.debug("mark_process_dead(%s): %s", pid, exc)
    try:
        fold_dead_process(pid, d)
    except LockBusy as exc:  # folded at the next restart
        log.info("metrics of dead process %s not folded yet: %s", pid, exc)
    except (OSError, ValueError) as exc:  # its files stay: counted as before, one more file each
        log.warning("metrics of dead process %s not folded (%s): its files stay", pid, exc)


#: How long :func:`fold_dead_process` tries to take the lock (seconds) before it leaves the files
#: for a later fold: a scrape holds it for milliseconds, but a front-end stopped mid-scrape
#: (SIGSTOP, a hang the supervisor is about to find) must not stop the supervisor.
FOLD_LOCK_WAIT_S = 0.5


class LockBusy(OSError):
    """The directory's lock was not free within :data:`FOLD_LOCK_WAIT_S`."""


@contextlib.contextmanager
def files_lock(d: str, shared: bool, wait_s: float | None = None) -> Iterator[None]:
    """Hold the multiprocess directory's lock (:data:`LOCK_NAME`, ``flock``): shared while a
    scrape reads the files, exclusive while :func:`fold_dead_process` moves values between them,
    so a scrape never sees a value twice or not at all (which Prometheus would read as a
    counter reset), nor a file that vanished between its listing and its read. With ``wait_s``
    (seconds), :class:`LockBusy` when the lock is not free by then; else it waits."""
    fd = os.open(os.path.join(d, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        if wait_s is None:
            fcntl.flock(fd, mode)
        else:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy(f"{LOCK_NAME} held for over {wait_s:g} s (a scrape in progress)") from None
                    time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _dead_pids(d: str) -> set[int]:
    """Pids of the summed-type files in ``d`` whose process no longer exists (files of dead
    processes a busy lock kept from being folded when they died)."""
    out = set()
    for name in os.listdir(d):
        typ, _, rest = name.partition("_")
        pid = rest[:-3] if rest.endswith(".db") else ""
        if typ in _SUMMED_TYPES and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                out.add(int(pid))
            except OSError:  # exists (another user's): not ours to judge
                pass
    return out


def fold_dead_process(pid: int, d: str | None = None) -> int:
    """Add the values of a dead process's ``counter_<pid>.db``, ``histogram_<pid>.db`` and
    ``summary_<pid>.db`` (``prometheus_client``'s multiprocess files in ``d``, default this
    process's directory) to ``<type>_dead.db`` and remove them, under the exclusive
    :func:`files_lock`; so too the files of any other process that no longer exists (left by
    an earlier fold that found the lock busy). The sums a scrape reports do not change; without
    this, every worker restart left two more files that every scrape reads (a crash loop, one
    restart per 30 s: ~5,800 a day). Returns how many files were folded.

    Raises:
        LockBusy: a scrape held the lock for over :data:`FOLD_LOCK_WAIT_S` (the files stay, and
            are folded by the next call).
        OSError: a file could not be read, written or removed (the scrape sums stay right: the
            dead file is removed only after its values were added).
    """
    d = d or prometheus_dir()
    if d is None:
        return 0
    n = 0
    with files_lock(d, shared=False, wait_s=FOLD_LOCK_WAIT_S):
        for dead in sorted({pid} | _dead_pids(d)):
            for typ in _SUMMED_TYPES:
                src = os.path.join(d, f"{typ}_{dead}.db")
                if os.path.exists(src):
                    _fold_file(src, os.path.join(d, f"{typ}_{FOLDED_PID}.db"))
                    n += 1
    return n


def _fold_file(src: str, dst: str) -> None:
    """Add every value of the multiprocess file ``src`` to ``dst`` (created when missing), then
    remove ``src``."""
    from prometheus_client.mmap_dict import MmapedDict

    values = MmapedDict.read_all_values_from_file(src)
    folded = MmapedDict(dst)
    try:
        for key, value, timestamp, _pos in values:
            total, _ = folded.read_value(key)
            folded.write_value(key, total + value, timestamp)
    finally:
        folded.close()
    os.unlink(src)


_own_files: list[str] = []


def restore_removed_files() -> int:
    """Write this process's multiprocess files again if they were removed (a ``/tmp`` cleaner
    took the run directory; the supervisor recreates it), and go on writing to the new ones.

    ``prometheus_client`` keeps each file mapped (``MmapedDict``) and would go on updating the
    unlinked copy, so ``/metrics`` lost this process's counts until it restarted, and they
    started again from 0. Here each removed file is written back from its mapping (same
    layout, so every value keeps its position) and the ``MmapedDict`` maps the new file in
    place: the metric objects keep their references. Cheap when nothing was removed (a
    ``stat`` per file of this process); the first call, and a call after a removal, walk the
    metrics of :data:`shardserver.metrics.REGISTRY` to find the mappings (not the garbage
    collector's objects: a worker froze them, ``settle_gc``). Returns how many files were
    restored.
    """
    if not os.environ.get(MULTIPROC_ENV):
        return 0
    if _own_files and all(os.path.exists(p) for p in _own_files):
        return 0
    from prometheus_client.mmap_dict import MmapedDict

    dicts = _mmaped_dicts()
    _own_files[:] = [d._fname for d in dicts]
    n = 0
    for d in dicts:
        if os.path.exists(d._fname):
            continue
        os.makedirs(os.path.dirname(d._fname), exist_ok=True)
        tmp = d._fname + ".restoring"
        with open(tmp, "wb") as f:
            f.write(d._m[:d._capacity])
        os.replace(tmp, d._fname)
        fresh = MmapedDict(d._fname)
        old_m, old_f = d._m, d._f
        d.__dict__.update(fresh.__dict__)  # the values refer to d: they now write to the new file
        old_m.close()
        old_f.close()
        n += 1
    if n:
        log.warning("process %d: %d metrics file(s) removed with the run directory were written again", os.getpid(), n)
    return n


def _mmaped_dicts() -> list:
    """The ``MmapedDict`` objects (writable) behind this process's metrics: found by walking the
    metric objects of :data:`shardserver.metrics.REGISTRY` (their children, buckets and values)."""
    from prometheus_client.mmap_dict import MmapedDict

    from .metrics import REGISTRY

    found: dict[int, MmapedDict] = {}
    seen: set[int] = set()
    stack: list = list(REGISTRY._collector_to_names)
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if type(o) is MmapedDict:
            if o._f.mode != "rb" and not o._f.closed:
                found[id(o)] = o
            continue
        if isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif type(o).__module__.startswith("prometheus_client") and hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return list(found.values())
