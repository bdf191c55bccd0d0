"""A shard's journal of the futures it still owes a report for, kept across restarts.

The SDK's session-wide poller (``retrieve_futures``) learns that a future finished only from the
server. A future held by an encoder that dies (SIGKILL, crash) or by a gateway that restarts
would be forgotten and its sample would wait forever; the journal lets the next encoder of the
shard report it as failed (``{"state": "failed"}``), after which the SDK's ``retrieve_future``
gets 410 and it resubmits the sample.

One file per shard and gateway address, ``<state_dir>/futures/<tag>.<shard>.journal`` (``tag``
is the listening ``host_port``, so gateways sharing a state directory never share a file).
Records are ASCII lines, appended with one unbuffered ``os.write`` on an ``O_APPEND`` descriptor
(what a SIGKILLed process wrote stays in the page cache)::

    +<fid> <sampling_session_id> <cloned_sampler_id> <since> <crc>\\n    the shard accepted a SUBMIT
    -<fid> <crc>\\n                                          it owes no report any more

``since``: when it was accepted (unix seconds, whole), so that a future restored again and again
keeps its first age (``futures.completed_ttl_s`` counts from it); a ``+`` line without it (an
older gateway's) is still read, its age unknown. ``crc``: CRC-32 (``zlib.crc32``) of the text
before the last space, 8 lowercase hex digits. A
line whose CRC does not match or that has no final newline (a write cut short) is ignored.

The file is rewritten (the live records to a temporary file, then ``rename``) when a new
encoder takes it over, when it holds more than ``2 × live + COMPACT_SLACK`` records, and when
:meth:`FutureJournal.check` (the encoder's sweep, at most every ``CHECK_INTERVAL_S``) finds that
the path no longer names the file being appended to (``server.state_dir`` removed by a tmp
cleaner or an operator: appends to the unlinked file would still succeed, and the next encoder
would find nothing to take over); the directory is then made again. The
writing encoder holds ``flock(LOCK_EX)`` on it; a new encoder waits (up to ``lock_wait_s``) for
the encoder of a killed gateway that is still shutting down to let go.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["FutureJournal", "JournalRecord", "JournalTakeover", "JournalUnwritable", "journal_tag", "read_journal",
           "add_line", "end_line", "CHECK_INTERVAL_S", "COMPACT_SLACK", "JOURNAL_DIR"]

log = logging.getLogger("shardserver.journal")

# Records (adds and ends) written beyond twice the live set before the file is rewritten.
COMPACT_SLACK = 8192
JOURNAL_DIR = "futures"
# Seconds between two looks (a stat and an fstat) at whether the journal's path still names the
# file being appended to (FutureJournal.check); calls in between cost one comparison.
CHECK_INTERVAL_S = 0.5
_SUFFIX = ".journal"


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """A future the journal still owes a report for.

    Attributes:
        fid: the future ID (``request_id``).
        sid: its ``sampling_session_id``.
        clone: its ``cloned_sampler_id`` (``seq_id // 10**9``, the SDK's poller target).
        since: when the shard accepted it (unix seconds, whole); 0 for a record written before
            the field existed (its age is then unknown).
    """

    fid: str
    sid: str
    clone: int
    since: int = 0


@dataclass(slots=True)
class JournalTakeover:
    """What :meth:`FutureJournal.open` found in the journals it took over.

    Attributes:
        records: the futures still owed a report, in the order they were added.
        files: how many journal files were taken over.
        bad_lines: lines ignored (CRC mismatch, malformed, or a cut last line).
        waited_s: seconds spent waiting for another process's lock (s).
        lock_timeouts: files read without their lock (its holder kept it past ``lock_wait_s``).
        unreadable: files that could not be opened or read (an I/O error, another user's file, a
            directory in its place); left where they are, their futures unknown.
    """

    records: list[JournalRecord]
    files: int = 0
    bad_lines: int = 0
    waited_s: float = 0.0
    lock_timeouts: int = 0
    unreadable: int = 0


class JournalUnwritable(OSError):
    """:meth:`FutureJournal.open` read the journals it took over but could not write the new one
    (ENOSPC, EFBIG, EIO, ...). ``takeover`` is what it read (the futures still owed a report);
    the files it read are left in place, so the next encoder of the shard reads them again."""

    def __init__(self, exc: OSError, takeover: JournalTakeover) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), exc.filename)
        self.takeover = takeover


def journal_tag(host: str, port: int) -> str:
    """The file-name tag of a gateway listening on ``host:port``: ``host_port`` with every
    character outside ``[A-Za-z0-9.-]`` replaced by ``_`` (IPv6 colons included)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", f"{host}_{port}")


def _line(body: str) -> bytes:
    b = body.encode()
    return b"%s %08x\n" % (b, zlib.crc32(b))


def _unix_now() -> int:
    """Whole unix seconds now: a record's ``since``."""
    return int(time.time())


def add_line(fid: str, sid: str, clone: int, since: int = 0) -> bytes:
    """The ``+`` record of a future (bytes, ending in a newline); ``since`` 0 is left out."""
    return _line(f"+{fid} {sid} {clone} {since}" if since else f"+{fid} {sid} {clone}")


def end_line(fid: str) -> bytes:
    """The ``-`` record of a future (bytes, ending in a newline)."""
    return _line(f"-{fid}")


def read_journal(data: bytes) -> tuple[dict[str, JournalRecord], int]:
    """Replay journal bytes: the futures added and not ended (fid -> record, in add order) and
    how many lines were ignored (bad CRC, malformed, or a last line without its newline)."""
    live: dict[str, JournalRecord] = {}
    lines = data.split(b"\n")
    bad = 1 if lines[-1] else 0  # the last piece has no newline: a write cut short
    for raw in lines[:-1]:
        body, _, crc = raw.rpartition(b" ")
        try:
            ok = bool(body) and len(crc) == 8 and int(crc, 16) == zlib.crc32(body)
            text = body.decode("ascii") if ok else ""
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            bad += 1
            continue
        if text[0] == "+":
            parts = text[1:].split(" ")
            if len(parts) not in (3, 4) or not parts[2].lstrip("-").isdigit() or (
                    len(parts) == 4 and not parts[3].isdigit()):
                bad += 1
                continue
            live[parts[0]] = JournalRecord(parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) == 4 else 0)
        elif text[0] == "-" and " " not in text:
            live.pop(text[1:], None)
        else:
            bad += 1
    return live, bad


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: ``write`` may take only part of it (a file size limit, a
    disk filling up), and the next call then raises the reason (``OSError``: EFBIG, ENOSPC)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def _lock(fd: int, deadline: float) -> bool:
    """``flock(LOCK_EX)`` on ``fd``, retried every 20 ms until ``deadline`` (monotonic s)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _open_locked(path: str, deadline: float) -> int | None:
    """Open ``path`` and ``flock`` it, waiting until ``deadline`` (monotonic s) for its holder.

    A holder that compacts its journal renames a new file over ``path`` and lets the old one go,
    so a lock won on the old inode proves nothing: after locking, the descriptor must still be
    the file at ``path``, else it is opened again. Returns the locked descriptor; ``-fd - 1`` for
    one still locked at the deadline (read without the lock); None when ``path`` is gone.
    """
    for _ in range(1000):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # A state_dir mounted (or made) read-only since the last run: the file can still be
            # read, and its futures reported (flock works on a read-only descriptor).
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        locked = _lock(fd, deadline)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same or not locked:
            return fd if locked else -fd - 1
        os.close(fd)  # replaced while we waited: lock the file that is there now
    return None


def _held_by_another(path: str) -> bool:
    """Whether another open file description holds ``flock`` on the file at ``path`` (a new
    encoder of the shard that took the journal over); False when ``path`` is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not _lock(fd, 0.0)
    finally:
        os.close(fd)


def _make_dirs(directory: str) -> None:
    """Make ``directory`` and any missing parent with mode 0700 (less the umask), as a start
    does (``server.state_dir`` is made 0700 with the ID secret, ``futures/`` by
    :meth:`FutureJournal.open`); owned by this process's user. Raises ``OSError`` (EACCES,
    ENOSPC, ENOTDIR, ...) when one cannot be made."""
    parent = os.path.dirname(directory)
    if parent and parent != directory and not os.path.isdir(parent):
        _make_dirs(parent)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass


def _remove_stale(directory: str, tag: str, stale_s: float) -> None:
    """Remove the journals in ``directory`` of tags other than ``tag`` that nobody holds and
    that were last written more than ``stale_s`` seconds ago."""
    now = time.time()
    for name in os.listdir(directory):
        if not name.endswith(_SUFFIX) or name.startswith(tag + "."):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime > stale_s and _lock(fd, 0.0):
                os.unlink(path)
                log.info("removed the stale futures journal %s", path)
        except OSError:
            pass
        finally:
            os.close(fd)


class FutureJournal:
    """The open journal of one shard (see the module docstring). Made by :meth:`open`.

    ``live`` counts the futures added and not ended; the caller ends only what it added (or
    took over), once. ``recreations``: times :meth:`check` wrote the file again after it was
    removed or replaced; ``superseded``: :meth:`check` found a new encoder's file at the path.
    """

    def __init__(self, path: str, fd: int, live: int) -> None:
        self.path = path
        self.fd = fd
        self.live = live
        self.records = live  # records in the file
        self.compactions = 0
        self.recreations = 0
        self.superseded = False
        self._check_at = 0.0  # monotonic s before which check() does not look at the file

    @classmethod
    def open(cls, directory: str, tag: str, shard: int, shards: int,
             lock_wait_s: float = 5.0, stale_s: float = 0.0) -> tuple[FutureJournal, JournalTakeover]:
        """Take over the journals of shard ``shard`` and start its new one.

        Every ``<tag>.<k>.journal`` in ``directory`` with ``k % shards == shard`` is locked
        (waiting up to ``lock_wait_s`` s for a dying holder), replayed, and replaced by one file,
        ``<tag>.<shard>.journal``, holding the futures still owed a report, which are returned
        (their records stay in the new journal until :meth:`end`). ``stale_s`` > 0: journals of
        other gateways (other tags) not written for ``stale_s`` seconds and not locked are
        removed (a gateway that never came back on that address). A file that cannot be opened
        or read is skipped with a WARNING and left in place (``JournalTakeover.unreadable``).

        Raises:
            JournalUnwritable: the journals were read but the new one cannot be written (what was
                read is in its ``takeover``; the old files are left in place).
            OSError: the directory cannot be created or listed.
        """
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if stale_s > 0:
            _remove_stale(directory, tag, stale_s)
        pat = re.compile(re.escape(tag) + r"\.(\d+)" + re.escape(_SUFFIX) + r"(\.tmp\.\d+)?$")
        mine = os.path.join(directory, f"{tag}.{shard}{_SUFFIX}")
        taken: list[tuple[str, int]] = []
        out = JournalTakeover(records=[])
        live: dict[str, JournalRecord] = {}
        deadline = time.monotonic() + lock_wait_s
        t0 = time.monotonic()
        try:
            for name in sorted(os.listdir(directory)):
                m = pat.match(name)
                if m is None or int(m.group(1)) % shards != shard:
                    continue
                path = os.path.join(directory, name)
                if m.group(2):  # a rewrite cut short: the file it was to replace is still there
                    try:
                        os.unlink(path)
                    except OSError:  # gone already, or a read-only state_dir: left for a later run
                        pass
                    continue
                try:
                    fd = _open_locked(path, deadline)
                except OSError as exc:  # one bad file must not cost the shard its journal
                    out.unreadable += 1
                    log.warning("journal %s cannot be opened (%s); its futures will not be reported", path, exc)
                    continue
                if fd is None:
                    continue
                if fd < 0:  # still locked at the deadline: read it anyway
                    fd = -fd - 1
                    out.lock_timeouts += 1
                    log.warning("journal %s is still locked after %.1f s; taking it over anyway", path, lock_wait_s)
                try:
                    with os.fdopen(os.dup(fd), "rb") as f:
                        data = f.read()
                except OSError as exc:
                    os.close(fd)
                    out.unreadable += 1
                    log.warning("journal %s cannot be read (%s); its futures will not be reported", path, exc)
                    continue
                taken.append((path, fd))
                found, bad = read_journal(data)
                out.files += 1
                out.bad_lines += bad
                for fid, rec in found.items():
                    live.setdefault(fid, rec)
            out.waited_s = time.monotonic() - t0
            out.records = list(live.values())
            try:
                fd = cls._rewrite(mine, (add_line(r.fid, r.sid, r.clone, r.since) for r in out.records))
            except OSError as exc:
                raise JournalUnwritable(exc, out) from exc
            for path, _ in taken:
                if path != mine:
                    os.unlink(path)
        finally:
            for _, old in taken:
                os.close(old)
        return cls(mine, fd, len(out.records)), out

    @staticmethod
    def _rewrite(path: str, lines: Iterable[bytes]) -> int:
        """Write ``lines`` to a new file locked by this process, rename it to ``path``; its
        ``O_APPEND`` descriptor."""
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows the new file yet: never waits
            buf: list[bytes] = []
            size = 0
            for line in lines:
                buf.append(line)
                size += len(line)
                if size >= 1 << 20:
                    _write_all(fd, b"".join(buf))
                    buf, size = [], 0
            if buf:
                _write_all(fd, b"".join(buf))
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return fd

    def _append(self, line: bytes) -> None:
        """One record, in one ``write`` unless the kernel took only part of it (then the rest,
        or the ``OSError`` saying why not)."""
        n = os.write(self.fd, line)
        if n != len(line):
            _write_all(self.fd, line[n:])

    def add(self, fid: str, sid: str, clone: int) -> None:
        """Record that the shard accepted the future ``fid`` of session ``(sid, clone)`` now."""
        self._append(add_line(fid, sid, clone, _unix_now()))
        self.live += 1
        self.records += 1

    def end(self, fid: str) -> None:
        """Record that the shard owes no report for ``fid`` any more (it left the table, or the
        session's poller cursor passed it)."""
        self._append(end_line(fid))
        self.live -= 1
        self.records += 1

    @property
    def needs_compaction(self) -> bool:
        """The file holds more than ``2 × live + COMPACT_SLACK`` records."""
        return self.records > 2 * self.live + COMPACT_SLACK

    def compact(self, live: Iterable[JournalRecord]) -> None:
        """Rewrite the file with only ``live`` (the futures still owed a report: exactly those
        added and not ended) and continue appending to the new file.

        Raises:
            OSError: the new file cannot be written (the old one stays in use).
        """
        self._replace(live)
        self.compactions += 1

    def _replace(self, live: Iterable[JournalRecord]) -> None:
        """Write ``live`` to a new file at the path and append to it from now on (see
        :meth:`compact`; ``OSError`` when it cannot be written, the old file staying in use)."""
        n = 0

        def lines() -> Iterable[bytes]:
            nonlocal n
            for r in live:
                n += 1
                yield add_line(r.fid, r.sid, r.clone, r.since)

        fd = self._rewrite(self.path, lines())
        os.close(self.fd)
        self.fd = fd
        self.live = self.records = n

    def check(self, live: Callable[[], Iterable[JournalRecord]], now: float | None = None) -> str | None:
        """See that the path still names the file being appended to: at most once per
        :data:`CHECK_INTERVAL_S` s of ``now`` (monotonic s, default the clock), one ``stat`` and
        one ``fstat``; calls in between return None at once.

        The file (or its directory, ``server.state_dir`` included) was removed, or another file
        that nobody holds locked was put in its place: the directory is made again (mode 0700,
        as at start) and the file rewritten with ``live()`` (exactly the futures still owed a
        report, as for :meth:`compact`); appending goes on to the new file. Another file that a
        process holds locked is a new encoder's of the shard (it took the journal over): it is
        left alone, and ``superseded`` is set (this journal is not checked again).

        Returns:
            ``"removed"`` or ``"replaced"`` when the file was written again, ``"superseded"``
            when a new encoder's file was found, None otherwise.

        Raises:
            OSError: the file cannot be looked at or written again (EACCES, ENOSPC, ...):
                appending goes on to the old file (unlinked: lost at a restart), and a call
                :data:`CHECK_INTERVAL_S` s later tries again.
        """
        now = time.monotonic() if now is None else now
        if self.fd < 0 or self.superseded or now < self._check_at:
            return None
        self._check_at = now + CHECK_INTERVAL_S
        mine = os.fstat(self.fd)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            what = "removed"
        else:
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return None
            if _held_by_another(self.path):
                self.superseded = True
                return "superseded"
            what = "replaced"
        _make_dirs(os.path.dirname(self.path))
        self._replace(live())
        self.recreations += 1
        return what

    def close(self) -> None:
        """Close the file (it stays for the next encoder of the shard; an empty one is removed)."""
        if self.fd < 0:
            return
        if self.live == 0:
            try:
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:  # not a successor's file
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = -1
