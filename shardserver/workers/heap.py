"""Giving an encoder's free heap memory back to the operating system (glibc ``malloc_trim``).

An encoder receives engine answers of up to megabytes each, often thousands at once (a batch
of samples that finish together). CPython allocates them with ``malloc``; once decoded they are
freed, but glibc keeps the freed memory in its heap: the heap only shrinks from its top, and
the chunks of thousands of answers received side by side leave it fragmented (measured with
``benchmarks/run_load.py --scenario soak-131k --quick``: 640 MiB of one encoder's 690 MiB heap
free and still resident after a burst). ``malloc_trim(0)`` returns every free page of the
heap to the kernel (``MADV_DONTNEED``), wherever it lies.

:class:`HeapTrimmer` does that from the encoder's sweep (``futures.sweep_interval_s``) when the
heap holds at least ``min_free_bytes`` free. Off where the C library has no ``malloc_trim`` and
``mallinfo2`` (glibc < 2.33, musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["HeapTrimmer", "TRIM_MIN_FREE_BYTES"]

log = logging.getLogger("shardserver.heap")

#: Free heap (bytes) above which the sweep trims: about 100 engine answers of 8k tokens.
TRIM_MIN_FREE_BYTES = 64 * 1024 * 1024


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33), every field a size_t in bytes.
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, info = lib.malloc_trim, lib.mallinfo2
    except (OSError, AttributeError):
        return None, None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    return trim, info


class HeapTrimmer:
    """Trims the process's glibc heap when it holds much free memory.

    Args:
        min_free_bytes: trim when the heap's free bytes (``mallinfo2().fordblks``) reach this.

    Attributes:
        enabled: False where the C library lacks ``malloc_trim``/``mallinfo2`` (then
            :meth:`maybe_trim` does nothing).
        trims: how many trims ran; trimmed_free_bytes: the free heap bytes they found (bytes;
            what they could give back, an upper bound of what they did).
    """

    def __init__(self, min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> None:
        self.min_free_bytes = min_free_bytes
        self._trim, self._info = _libc()
        self.enabled = self._trim is not None
        self.trims = 0
        self.trimmed_free_bytes = 0

    def free_bytes(self) -> int:
        """Free bytes in the heap (``mallinfo2().fordblks``), 0 when not enabled."""
        return int(self._info().fordblks) if self._info is not None else 0

    def maybe_trim(self) -> int:
        """Trim if the heap holds at least ``min_free_bytes`` free; return the free bytes found
        then (0 when it did not trim)."""
        if not self.enabled:
            return 0
        free = self.free_bytes()
        if free < self.min_free_bytes:
            return 0
        self._trim(0)
        self.trims += 1
        self.trimmed_free_bytes += free
        return free
