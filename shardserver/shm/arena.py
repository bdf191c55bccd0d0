"""Shared-memory arenas: one writer (an encoder), many readers (the front-ends).

An arena is a POSIX shared-memory file under ``/dev/shm`` (Linux), mapped
with :mod:`mmap`. We open it with ``os.open`` rather than
``multiprocessing.shared_memory`` so that no resource tracker ever unlinks a
segment behind our back: the supervisor creates and unlinks every segment
(:func:`create_segment`, :func:`unlink_segment`), and also removes segments
of dead runs at start (:func:`remove_stale_segments`).

Layout (all integers little-endian)::

    offset 0    8          16                  24            64
    +-----------+----------+-------------------+-------------+------+------+------+-----+
    | "SSARENA1"| u64 size | u64 owner start   | zeros       | slot | slot | free | ... |
    +-----------+----------+-------------------+-------------+------+------+------+-----+
    '-------------------- superblock ----------------------'

    ``owner start`` (offset 16) is the start time, in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``), of the process whose pid the segment's name carries, written by
    :func:`create_segment`; 0 when unknown (segments of versions before it, which left bytes
    16..63 zero). Readers ignore it; :func:`remove_stale_segments` uses it to tell a live owner
    from a later process that reuses its pid.

    one slot (64-byte aligned, ``capacity`` = 16 + payload rounded up to 64):
    +----------------+----------------+-----------------------------+---------+
    | u64 generation | u64 length     | payload (length bytes)      | padding |
    +----------------+----------------+-----------------------------+---------+

* Only the writer allocates and frees; the free list lives in the writer's
  memory (:class:`ArenaWriter`), the shared file holds headers and payloads.
* ``generation`` is a per-arena counter that never repeats. The writer sets it
  when a slot is committed and sets it to 0 when the slot is freed.
* A reader is told (offset, length, generation) by the writer over the control
  channel. :meth:`ArenaReader.read` checks the header, copies the payload,
  and checks the header again (an optimistic, seqlock-style read): if the slot
  was freed or reused meanwhile it raises :class:`SlotInvalidError` and the
  copy is discarded. Front-ends send results without that copy where they can:
  :meth:`ArenaReader.view` checks the header and hands out a view of the
  payload, and the sender checks :meth:`ArenaReader.valid` right before each write of a piece
  of it and lets the kernel copy straight from the view in the same call, copying itself only
  what the socket did not take (:meth:`shardserver.workers.http_conn.GatewayHttpProtocol.write_arena`).
  The writer never waits for readers; instead, a slot a reader may be copying (handed out,
  delivery not reported: ``ArenaWriter.free(slot, hold=True)``) keeps its bytes for ``hold_s``
  after its generation is zeroed, so a check and the copy right after it always read the same
  result (README.md, decision "reading a slot").
* When the writer frees a committed slot: its future's TTL passed (completed or
  retrieved), it was cancelled or acknowledged, or a full arena evicted it
  (only delivered results are evicted, but a delivered result may be polled
  again and be sent while it is evicted).
* Ordering: the writer stores the generation last on commit and zeroes it first on free;
  the reader loads it before and after the copy. That is enough on x86-64, whose stores are
  not reordered with stores nor loads with loads (the machines this runs on); a weakly
  ordered CPU (aarch64) would need fences around those two header accesses.
  ``tests/unit/test_units.py::test_reader_never_returns_bytes_of_a_reused_slot`` reuses slots
  from another process as fast as it can while reading them and checks every read's CRC.
"""

from __future__ import annotations

import bisect
import collections
import errno
import mmap
import os
import re
import struct
import time

from ..errors import SlotInvalidError

__all__ = [
    "ArenaSpaceError",
    "SHM_DIR",
    "SEGMENT_PREFIX",
    "SLOT_HEADER",
    "SUPERBLOCK",
    "ALIGN",
    "ARENA_READ_HOLD_S",
    "Slot",
    "create_segment",
    "unlink_segment",
    "segment_name",
    "remove_stale_segments",
    "pid_alive",
    "pid_start_ticks",
    "segment_stale",
    "shm_free_bytes",
    "check_shm_space",
    "ArenaWriter",
    "ArenaReader",
]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shardserver-"
MAGIC = b"SSARENA1"
SUPERBLOCK = 64
SLOT_HEADER = 16
ALIGN = 64
_HDR = struct.Struct("<QQ")
_SB = struct.Struct("<8sQ")
_OWNER = struct.Struct("<Q")  # owner start time, at offset _SB.size
_GEN = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE
#: Seconds an encoder's arena holds the space of a freed slot that a front-end may be copying
#: (handed out by a POLL, its delivery not reported: :meth:`ArenaWriter.free` with ``hold``). A front-end checks a slot's generation and copies from it in the
#: same synchronous call (microseconds); if that ever took longer than half of this, it cuts the
#: response (:class:`shardserver.api.sampling.ResultResponse`). Only results freed while being
#: sent are held (cancelled, expired or evicted mid-send), so a long hold costs little room.
ARENA_READ_HOLD_S = 2.0
_NAME_RE = re.compile(r"^shardserver-(\d+)-([0-9a-f]{8})-a(\d+)\.(\d+)$")


def segment_name(pid: int, run_id: str, shard: int, incarnation: int) -> str:
    """File name (under /dev/shm) of shard ``shard``'s arena; ``pid`` is the supervisor's."""
    return f"{SEGMENT_PREFIX}{pid}-{run_id}-a{shard}.{incarnation}"


def create_segment(name: str, size: int) -> None:
    """Create a zero-filled segment of ``size`` payload bytes (plus the 64-byte superblock).

    When ``name`` is a :func:`segment_name`, the superblock records the start time of the
    process it names (:func:`pid_start_ticks`; 0 if that pid is not running), which
    :func:`remove_stale_segments` compares to tell that process from a later one with its pid.

    Raises:
        FileExistsError: a segment of that name exists.
        OSError: /dev/shm is full or not writable.
    """
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, SUPERBLOCK + size)
        m = _NAME_RE.match(name)
        owner_start = (pid_start_ticks(int(m.group(1))) or 0) if m else 0
        os.pwrite(fd, _SB.pack(MAGIC, size) + _OWNER.pack(owner_start), 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def shm_free_bytes(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """(bytes free for an unprivileged writer, total bytes) of the filesystem holding ``shm_dir``
    (``os.statvfs``: ``f_bavail`` and ``f_blocks`` times ``f_frsize``).

    Raises:
        OSError: ``shm_dir`` does not exist or cannot be examined.
    """
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_shm_space(count: int, arena_bytes: int, shm_dir: str = SHM_DIR) -> tuple[int, int, int]:
    """Check that ``count`` arenas of ``arena_bytes`` fit in the free space of ``shm_dir``.

    Segments are created sparse (``ftruncate``): a tmpfs that is too small is only noticed when
    an encoder writes a result into a page that cannot be allocated, and the kernel kills it with
    SIGBUS. So the supervisor checks before it creates anything.

    Returns:
        (bytes needed, bytes free, filesystem size): needed = count * (arena_bytes + 64-byte superblock).

    Raises:
        ConfigError: (key ``shards.arena_bytes``) needed > free; the message gives the numbers
            and the fix.
        OSError: ``shm_dir`` cannot be examined.
    """
    from ..errors import ConfigError

    needed = count * (SUPERBLOCK + arena_bytes)
    free, size = shm_free_bytes(shm_dir)
    if needed > free:
        mib = 1024 * 1024
        raise ConfigError("shards.arena_bytes", (
            f"the arenas need shards.count x shards.arena_bytes = {count} x {arena_bytes} = {needed} bytes "
            f"({needed / mib:.0f} MiB) of shared memory, but {shm_dir} has only {free} bytes ({free / mib:.0f} MiB) "
            f"free of {size} ({size / mib:.0f} MiB); results written beyond that would kill the encoders "
            f"(SIGBUS). Lower shards.arena_bytes or shards.count, or enlarge {shm_dir} (docker run "
            f"--shm-size=..., Kubernetes: an emptyDir with medium: Memory mounted there, or "
            f"mount -o remount,size=... {shm_dir})"))
    return needed, free, size


def unlink_segment(name: str) -> bool:
    """Remove a segment; True if it existed. Mappings stay valid until closed."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) shardserver process.

    A zombie, a missing pid, or a pid reused by an unrelated program all count as dead.
    """
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    state = stat.rsplit(b")", 1)[1].split()[0]
    return state != b"Z" and b"shardserver" in cmdline


def pid_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22,
    ``starttime``; ``os.sysconf("SC_CLK_TCK")`` ticks a second); None when no such process is
    running or it is a zombie. A pid and its start time together name one process: a later
    process that reuses the pid has a larger start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat.rsplit(b")", 1)[1].split()  # fields 3, 4, ...: the name may hold ") "
        if fields[0] == b"Z":
            return None
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_time() -> float:
    """Wall-clock time of boot, seconds since the epoch (``btime`` of ``/proc/stat``, whole
    seconds). Raises OSError or ValueError where /proc/stat has none."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise ValueError("/proc/stat has no btime line")


# Fallback rule only (segments without an owner start time): wall-clock slack between a
# process's start computed from btime (truncated to whole seconds, and moved by clock steps
# since boot) and a file's mtime.
_CLOCK_SLACK_S = 2.0


def segment_stale(name: str) -> bool:
    """Whether segment ``name`` (a :func:`segment_name` under /dev/shm) belongs to no running
    process: the pid in its name is not running (missing or a zombie), or is now another
    process, one that started after the segment was created (the pid was reused).

    Reuse is told exactly by the owner's start time that :func:`create_segment` wrote into
    the superblock (clock ticks since boot, compared for equality: no wall clock involved). A
    segment without one (made by an older version, or not readable by this user) falls back
    on its modification time: tmpfs updates ``st_mtime`` on every write, including writes
    through a mapping and page punching (checked on Linux 6.x), so the mtime is at or after
    the creation and at or before the last write of the owner; a process that started more
    than 2 s (:data:`_CLOCK_SLACK_S`) after it cannot be the owner. A reuse within that slack
    goes unnoticed (the segment stays until a later start), never the other way round.

    The process's command line is not looked at: it used to be (stale unless it contained
    "shardserver"), which deleted the live segments of a gateway or test run whose command
    line lacks that word (``python -m pytest``) whenever another gateway started meanwhile.
    Names that do not match :func:`segment_name` are never stale.
    """
    m = _NAME_RE.match(name)
    if not m:
        return False
    pid = int(m.group(1))
    start = pid_start_ticks(pid)
    if start is None:
        return True
    path = os.path.join(SHM_DIR, name)
    recorded = 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # already gone
    except OSError:
        pass  # another user's segment (mode 0600): judge by its mtime
    else:
        try:
            head = os.pread(fd, _SB.size + _OWNER.size, 0)
        finally:
            os.close(fd)
        # A segment being created right now may still be empty or all zeros: no record.
        if len(head) == _SB.size + _OWNER.size and head[:8] == MAGIC:
            recorded = _OWNER.unpack_from(head, _SB.size)[0]
    if recorded:
        return recorded != start
    try:
        mtime = os.stat(path).st_mtime
        started = _boot_time() + start / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return False  # cannot tell: keep it
    return started > mtime + _CLOCK_SLACK_S


def remove_stale_segments() -> list[str]:
    """Unlink the segments of processes no longer running (:func:`segment_stale`). Returns
    their names. Segments of live processes stay, whatever their command line."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if segment_stale(name) and unlink_segment(name):
            removed.append(name)
    return removed


def _open_map(name: str, writable: bool, keep_fd: bool = False) -> tuple[mmap.mmap, int, int]:
    """``(mapping, payload size, fd)`` of arena ``name``; ``fd`` is -1 unless ``keep_fd``."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED,
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except BaseException:
        os.close(fd)
        raise
    if not keep_fd:
        os.close(fd)
        fd = -1
    magic, size = _SB.unpack_from(mm, 0)
    if magic != MAGIC or size + SUPERBLOCK != total:
        mm.close()
        if fd >= 0:
            os.close(fd)
        raise ValueError(f"{path} is not a shardserver arena")
    return mm, size, fd


class ArenaSpaceError(OSError):
    """The filesystem under the arena (``/dev/shm``, tmpfs) has no room for the pages a result
    needs (``ENOSPC`` from ``posix_fallocate``): the segment is sparse, so its pages are taken
    only as results are written, and something else filled ``/dev/shm`` since the start. Raised
    by :meth:`ArenaWriter.payload` and :meth:`ArenaWriter.write` *instead of* the ``SIGBUS``
    that writing to such a page through the mapping would raise (which killed the encoder)."""


class Slot:
    """A committed or reserved region: ``offset`` of its header in the file, ``capacity`` bytes
    (header included), ``length`` payload bytes, ``generation`` (0 until committed)."""

    __slots__ = ("offset", "capacity", "length", "generation")

    def __init__(self, offset: int, capacity: int) -> None:
        self.offset = offset
        self.capacity = capacity
        self.length = 0
        self.generation = 0

    def __repr__(self) -> str:
        return f"Slot(off={self.offset}, cap={self.capacity}, len={self.length}, gen={self.generation})"


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ArenaWriter:
    """The single writer of one arena: allocates, commits and frees slots.

    Not thread-safe; used from one encoder's event loop. Allocation is address-ordered first
    fit over a free list kept sorted by offset, with neighbours coalesced on free.
    """

    def __init__(self, name: str, hold_s: float = 0.0) -> None:
        self.name = name
        #: seconds a slot freed with ``hold=True`` (a reader may be copying it) stays unusable: its
        #: generation is zeroed at once (readers see it freed), its bytes stay as they are until
        #: then, so a reader that checked the generation just before copying never copies
        #: another result's bytes (see :meth:`free`)
        self.hold_s = hold_s
        self._held: collections.deque[tuple[float, int, int]] = collections.deque()  # (due, offset, capacity)
        self.held_bytes = 0
        self._mm, self.size, self._fd = _open_map(name, writable=True, keep_fd=True)
        self._view = memoryview(self._mm)
        self._fallocate = hasattr(os, "posix_fallocate")
        self._free_offs: list[int] = [SUPERBLOCK]
        self._free_size: dict[int, int] = {SUPERBLOCK: self.size}
        # The free blocks again, by size class (a block of s bytes is in class s.bit_length()):
        # per class the offsets in ascending order, and a bit mask of the classes holding any.
        # alloc() then finds the lowest block that fits without walking the small holes that
        # shrink() leaves behind every result (one per result: a scan over them cost ~50 µs per
        # SUBMIT with 2048 results held, benchmarks/README_load.md "queue-8k: encoder fixed costs").
        self._class_offs: list[list[int]] = [[] for _ in range(self.size.bit_length() + 1)]
        self._classes = 0
        self._cls_add(SUPERBLOCK, self.size)
        self._gen = 0
        self.used_bytes = 0
        self.live_slots = 0
        self.released_bytes = 0  # bytes of pages punched out by free() (MADV_REMOVE), in total
        self._punch = hasattr(mmap, "MADV_REMOVE")

    # -- accounting ---------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        if self._held:
            self.release_held()
        return self.size - self.used_bytes

    @staticmethod
    def slot_bytes(payload: int) -> int:
        """Arena bytes a payload of ``payload`` bytes occupies (header and alignment included)."""
        return _round(SLOT_HEADER + payload)

    def largest_free(self) -> int:
        """Size in bytes of the largest free block (0 when the arena is full)."""
        if self._held:
            self.release_held()
        if not self._classes:
            return 0
        sizes = self._free_size
        return max(sizes[off] for off in self._class_offs[self._classes.bit_length() - 1])

    # -- the free blocks by size class ----------------------------------------------------
    def _cls_add(self, off: int, size: int) -> None:
        c = size.bit_length()
        lst = self._class_offs[c]
        if not lst:
            self._classes |= 1 << c
            lst.append(off)
        elif off > lst[-1]:
            lst.append(off)
        else:
            bisect.insort(lst, off)

    def _cls_del(self, off: int, size: int) -> None:
        c = size.bit_length()
        lst = self._class_offs[c]
        if lst[-1] == off:
            lst.pop()
        else:
            del lst[bisect.bisect_left(lst, off)]
        if not lst:
            self._classes &= ~(1 << c)

    def _first_fit(self, need: int) -> int:
        """Offset of the lowest free block of at least ``need`` bytes; -1 when none.

        Every block of a class above ``need``'s (``need.bit_length()``) is large enough, so
        only the lowest of each such class and those of ``need``'s own class below it are looked at.
        """
        c = need.bit_length()
        best = -1
        higher = self._classes >> (c + 1)
        cc = c + 1
        offs = self._class_offs
        while higher:
            if higher & 1:
                first = offs[cc][0]
                if best < 0 or first < best:
                    best = first
            higher >>= 1
            cc += 1
        if self._classes >> c & 1:
            sizes = self._free_size
            for off in offs[c]:
                if best >= 0 and off > best:
                    break
                if sizes[off] >= need:
                    return off
        return best

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, payload: int) -> Slot | None:
        """Reserve space for ``payload`` bytes; None when no free block is large enough.

        Address-ordered first fit: the lowest free block that is large enough. Slots are thus
        packed at the start of the arena, and the pages ever written (which tmpfs keeps resident
        until the segment is unlinked) stay close to the peak of bytes in use instead of
        spreading over the whole arena, as next fit did (soak-131k: PSS grew to the arena's size).
        """
        need = self.slot_bytes(payload)
        if self._held:
            self.release_held()
        off = self._first_fit(need)
        if off < 0:
            return None
        sizes = self._free_size
        sz = sizes.pop(off)
        self._cls_del(off, sz)
        offs = self._free_offs
        i = bisect.bisect_left(offs, off)
        if sz == need:
            del offs[i]
        else:
            offs[i] = off + need
            sizes[off + need] = sz - need
            self._cls_add(off + need, sz - need)
        self.used_bytes += need
        self.live_slots += 1
        return Slot(off, need)

    def payload(self, slot: Slot, length: int) -> memoryview:
        """Writable view of ``length`` payload bytes of a reserved slot, its pages (and the slot
        header's) backed by the filesystem first (``posix_fallocate``: allocates the pages tmpfs
        does not hold yet, a no-op for those it does; ~1 µs plus the zeroing a page fault would
        do anyway).

        Raises:
            ValueError: ``length`` does not fit the slot.
            ArenaSpaceError: ``/dev/shm`` has no room for those pages (the slot stays reserved:
                the caller frees it).
        """
        if SLOT_HEADER + length > slot.capacity:
            raise ValueError(f"payload of {length} bytes does not fit slot of capacity {slot.capacity}")
        if self._fallocate:
            try:
                os.posix_fallocate(self._fd, slot.offset, SLOT_HEADER + length)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise ArenaSpaceError(errno.ENOSPC, f"{SHM_DIR} has no room for the {SLOT_HEADER + length} "
                                                        f"bytes of a result in arena {self.name}") from None
                self._fallocate = False  # not supported here (EOPNOTSUPP, EINVAL): pages come on write
        start = slot.offset + SLOT_HEADER
        return self._view[start:start + length]

    def commit(self, slot: Slot, length: int) -> int:
        """Publish ``length`` payload bytes; returns the slot's new generation."""
        if SLOT_HEADER + length > slot.capacity:
            raise ValueError(f"payload of {length} bytes does not fit slot of capacity {slot.capacity}")
        self._gen += 1
        slot.length = length
        slot.generation = self._gen
        # Length first, generation last: a reader that sees the generation sees the length.
        struct.pack_into("<Q", self._mm, slot.offset + 8, length)
        struct.pack_into("<Q", self._mm, slot.offset, self._gen)
        return self._gen

    def write(self, data: bytes | memoryview) -> Slot | None:
        """Allocate, copy ``data`` in and commit; None when the arena has no room.

        Raises:
            ArenaSpaceError: ``/dev/shm`` has no room for the pages (nothing stays allocated).
        """
        slot = self.alloc(len(data))
        if slot is None:
            return None
        try:
            view = self.payload(slot, len(data))
        except ArenaSpaceError:
            self.free(slot)
            raise
        view[:] = data
        self.commit(slot, len(data))
        return slot

    def free(self, slot: Slot, hold: bool = False) -> None:
        """Invalidate the slot for readers and return its space to the free list; the memory
        pages it leaves entirely free go back to the kernel (see :meth:`_release_pages`). After
        :meth:`close`, nothing: the segment goes with the encoder (a control request answered
        during its shutdown may still free results).

        ``hold``: a reader may be copying from the slot at this moment (it was handed out and
        its delivery not reported): the generation is zeroed now, but the bytes stay and the
        space is reused only after :attr:`hold_s` (:meth:`release_held`)."""
        if self._mm.closed:
            return
        committed = slot.generation != 0
        if committed:
            # (a slot never committed has no header to clear, and its page may not be backed: a
            # write there after posix_fallocate failed would be the SIGBUS it was to prevent)
            struct.pack_into("<Q", self._mm, slot.offset, 0)
        slot.generation = 0
        self.live_slots -= 1
        if committed and hold and self.hold_s > 0:
            # A front-end may be copying this result out right now, having checked its
            # generation a moment ago: the bytes stay until hold_s has passed (they still count
            # in used_bytes), so what it copies is this result's or, once punched, zeros.
            self._held.append((time.monotonic() + self.hold_s, slot.offset, slot.capacity))
            self.held_bytes += slot.capacity
            return
        start, end = self._give_back(slot.offset, slot.capacity)
        self._release_pages(slot.offset, slot.offset + slot.capacity, start, end)

    def release_held(self, now: float | None = None) -> int:
        """Give back the space of the held slots whose ``hold_s`` has passed (see :meth:`free`);
        called by :meth:`alloc`, :meth:`largest_free`, :attr:`free_bytes` and the owner's
        periodic sweep. Returns how many were released."""
        held = self._held
        if not held or self._mm.closed:
            return 0
        if now is None:
            now = time.monotonic()
        n = 0
        while held and held[0][0] <= now:
            _, off, cap = held.popleft()
            self.held_bytes -= cap
            start, end = self._give_back(off, cap)
            self._release_pages(off, off + cap, start, end)
            n += 1
        return n

    def _release_pages(self, lo: int, hi: int, start: int, end: int) -> None:
        """Punch out of the segment (``MADV_REMOVE``: tmpfs frees them, in every process that
        maps them) the whole pages of ``[lo, hi)`` (a freed slot) that lie inside the free block
        ``[start, end)``. tmpfs keeps every page ever written until the segment is unlinked: with
        results written all over the reservations of many pending requests, the pages resident
        grew with the arena bytes ever reserved rather than those in use (soak-131k poller: 6.4
        GiB of PSS for 271 MiB of results). A reader that meets such a page reads zeros: the
        slot's generation is 0, which it treats as freed. Counted in :attr:`released_bytes`."""
        if not self._punch:
            return
        p = _PAGE
        a = lo // p * p
        if a < start:
            a += p
        b = -(-hi // p) * p
        if b > end:
            b -= p
        if b > a:
            try:
                self._mm.madvise(mmap.MADV_REMOVE, a, b - a)
            except OSError:  # not tmpfs (a test's plain file) or not supported: keep the pages
                self._punch = False
                return
            self.released_bytes += b - a

    def shrink(self, slot: Slot, payload: int) -> None:
        """Keep only room for ``payload`` bytes in a reserved (not yet committed) slot; the tail
        goes back to the free list. Lets a request reserve its largest result up front and keep
        just what the result needed.
        """
        keep = self.slot_bytes(payload)
        if keep > slot.capacity:
            raise ValueError(f"cannot grow a slot of {slot.capacity} bytes to {keep}")
        if keep < slot.capacity:
            self._give_back(slot.offset + keep, slot.capacity - keep)
            slot.capacity = keep

    def _give_back(self, off: int, size: int) -> tuple[int, int]:
        """Return ``[off, off + size)`` to the free list; the free block it is now part of
        (``(start, end)`` offsets, after coalescing with its neighbours)."""
        self.used_bytes -= size
        offs = self._free_offs
        sizes = self._free_size
        i = bisect.bisect_left(offs, off)
        # Coalesce with the following block.
        if i < len(offs) and offs[i] == off + size:
            nxt = sizes.pop(offs[i])
            self._cls_del(offs[i], nxt)
            size += nxt
            del offs[i]
        # Coalesce with the preceding block.
        if i > 0:
            prev = offs[i - 1]
            psize = sizes[prev]
            if prev + psize == off:
                self._cls_del(prev, psize)
                psize += size
                sizes[prev] = psize
                self._cls_add(prev, psize)
                return prev, prev + psize
        offs.insert(i, off)
        sizes[off] = size
        self._cls_add(off, size)
        return off, off + size

    def read(self, slot: Slot) -> bytes:
        """Copy of a committed slot's payload (writer side, e.g. to derive JSON)."""
        start = slot.offset + SLOT_HEADER
        return bytes(self._view[start:start + slot.length])

    def close(self) -> None:
        self._view.release()
        self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ArenaReader:
    """Read-only mapping of an arena, for a front-end.

    Raises:
        FileNotFoundError: the segment does not exist (e.g. already unlinked).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._mm, self.size, _ = _open_map(name, writable=False)
        self._view = memoryview(self._mm).toreadonly()

    def read(self, offset: int, length: int, generation: int) -> bytes:
        """Copy of the payload of the slot at ``offset``, validated against ``generation``.

        Raises:
            SlotInvalidError: the slot was freed or reused before or during the copy.
        """
        mm = self._mm
        if offset < SUPERBLOCK or offset + SLOT_HEADER + length > SUPERBLOCK + self.size:
            raise SlotInvalidError(f"slot at {offset} (+{length}) is outside arena {self.name}")
        gen, ln = _HDR.unpack_from(mm, offset)
        if gen != generation or ln != length:
            raise SlotInvalidError(
                f"slot at {offset} of {self.name} modified or invalid (generation {gen}, expected {generation})")
        data = mm[offset + SLOT_HEADER: offset + SLOT_HEADER + length]
        gen2 = _HDR.unpack_from(mm, offset)[0]
        if gen2 != generation:
            raise SlotInvalidError(
                f"slot at {offset} of {self.name} was reused during the read (generation {gen2})")
        return data

    def view(self, offset: int, length: int, generation: int) -> memoryview:
        """A read-only view of the payload of the slot at ``offset`` (no copy), valid *now*.

        Unlike :meth:`read`, the bytes are not taken: the writer may free and reuse the slot
        while the view is being read. A caller that passes the view on (e.g. to a socket) must
        check :meth:`valid` right before each read of it and finish that read at once, keeping no
        reference for later (the writer holds a freed slot's bytes for its ``hold_s`` while a
        reader may be copying it; generations never repeat, and ``free`` zeroes the generation
        first). The view pins the mapping: :meth:`close` while one is alive leaves the unmapping
        to the last view's release.

        Returns:
            ``length`` bytes (``memoryview``, format ``B``, read-only).

        Raises:
            SlotInvalidError: the slot is outside the arena, or freed or reused already.
        """
        if offset < SUPERBLOCK or offset + SLOT_HEADER + length > SUPERBLOCK + self.size:
            raise SlotInvalidError(f"slot at {offset} (+{length}) is outside arena {self.name}")
        gen, ln = _HDR.unpack_from(self._mm, offset)
        if gen != generation or ln != length:
            raise SlotInvalidError(
                f"slot at {offset} of {self.name} modified or invalid (generation {gen}, expected {generation})")
        start = offset + SLOT_HEADER
        return self._view[start:start + length]

    def valid(self, offset: int, generation: int) -> bool:
        """Whether the slot at ``offset`` still holds ``generation`` (never freed since it was
        committed with it): every byte read from it before this call was the result's."""
        return _GEN.unpack_from(self._mm, offset)[0] == generation

    def close(self) -> None:
        """Unmap the arena; with views of it still alive (a response still being sent), the
        mapping goes when the last of them is released."""
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported; the mmap object unmaps when it is freed
            pass
