"""A small HTTP/1.1 client for the engine's ``POST /v1/completions``: the answer is read
straight into one buffer of the answer's own size.

Why not aiohttp on this path: an engine answer is 0.5-10 MB, and aiohttp copies it four times on
the way in (the event loop's ``bytes`` per read, the parser's ``bytes`` per body fragment, the
stream reader's join of the fragments it holds, the caller's join of the pieces). Under a burst
of 32k-token answers those copies, into freshly faulted memory, cost more than a millisecond per
answer. Here the connection is an :class:`asyncio.BufferedProtocol`: once the header section
has arrived and gives a ``Content-Length`` (what vLLM's uvicorn sends for every non-streaming
answer), the event loop reads the rest of the body directly into a ``bytearray`` of exactly
that size, which the decoder parses as is. One copy, from the kernel.

Everything else HTTP allows still works, on a slower path: ``Transfer-Encoding: chunked``,
bodies delimited by the connection closing, ``Content-Encoding: gzip``/``deflate`` (decoded when an
engine or proxy sends it anyway; every member of a concatenated body; the gateway asks for
``Accept-Encoding: identity``), interim ``1xx`` responses. A body without a ``Content-Length``
of its own is held to ``engine.answer_budget_bytes`` as if it were :data:`STREAM_BODY_ESTIMATE`
bytes long, and counted as it arrives past that. The header section is parsed by ``httptools``
(llhttp, the parser uvicorn and aiohttp use), with the leniencies aiohttp's client parser allows
(bare LF line ends, lax header lines, spaces after a chunk size).

Used by :class:`shardserver.engine_client.EngineClient` for ``http://`` engines; an
``https://`` engine keeps aiohttp. Failures are reported as :class:`ConnectFailed`,
:class:`Broken` (with whether the header section had arrived and whether the connection had
carried an earlier request, which is what the caller's retry table needs), :class:`BadResponse`
and :class:`BodyTooLarge`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ipaddress
import mmap
import os
import socket
import time
import weakref
import zlib
from typing import Callable, Mapping, MutableMapping
from urllib.parse import quote, unquote, urlsplit

import httptools
import numpy as np

__all__ = ["EnginePool", "BodyBuffers", "request_target", "dead_peer_options", "set_options", "ConnectFailed", "Broken", "BadResponse", "BodyTooLarge",
           "MAX_HEAD_BYTES"]

#: The most bytes an answer's status line and header fields may take (bytes).
MAX_HEAD_BYTES = 64 * 1024
# Read size while the header section or a body without Content-Length arrives (bytes).
_HEAD_READ = 16 * 1024
_SLOW_READ = 256 * 1024
# What aiohttp's client (the engine client before this module, and still for https:// engines)
# tolerates in an answer: bare LF line ends, obsolete line folding and other header-value slack,
# spaces after a chunk size. An engine or proxy that sends these got its answers through.
_LENIENCIES = dict(lenient_headers=True, lenient_optional_cr_before_lf=True, lenient_spaces_after_chunk_size=True)
# Characters kept as they are in the request target's path (RFC 3986 pchar and "/", plus "%" for
# the escapes the URL already has).
_PATH_SAFE = "/%:@!$&'()*+,;=~"


class ConnectFailed(Exception):
    """No connection to the engine could be opened (refused, unreachable, DNS, connect timeout)."""


#: SO_RCVBUF (bytes) of a connection whose body is admitted, when EnginePool's
#: receive_buffer_bytes bounds the others: a 64 KiB window made every 0.66 MB answer come in ten
#: round trips (soak-131k: encoder CPU per result 1.40 -> 1.85 ms).
WIDE_RECEIVE_BYTES = 1 << 20
#: The most connections per pool widened to WIDE_RECEIVE_BYTES (the kernel never shrinks an
#: advertised window, so they stay wide): 64 x 2 MiB as the kernel counts them.
MAX_WIDE_CONNECTIONS = 64
#: What a body with no identity Content-Length (chunked, delimited by the connection closing, or
#: compressed) is taken to need of ``engine.answer_budget_bytes`` when it is let in (bytes): its
#: size is known only once it has arrived. An 8k-token answer with logprobs is ~0.66 MB, a
#: 32k-token one ~2.7 MB; what arrives past the estimate is counted as it arrives.
STREAM_BODY_ESTIMATE = 1 << 20


#: Answers waiting unread are let in past the budget while the host's TCP memory is above this
#: share of net.ipv4.tcp_mem's pressure mark (see TcpMemory)...
TCP_MEMORY_RELIEF = 0.9
#: ... up to this many budgets of answers held (16 MiB x 6 = 96 MiB per encoder by default). At
#: 0.75 and no bound the full soak never stalled but peaked at 1688 MiB PSS: the valve opened in
#: ordinary waves (~1.1 GB of TCP memory) and read every waiting answer. At 0.9, 16 budgets let in
#: 8341 answers in one full soak (peak PSS 885 MiB), 6 budgets 4977 (577 MiB); neither stalled.
TCP_MEMORY_RELIEF_BUDGETS = 6


class TcpMemory:
    """Whether the host's TCP memory nears ``net.ipv4.tcp_mem``'s pressure mark.

    Past the mark Linux prunes receive queues and drops arriving segments, loopback included,
    and the senders' retransmission timeouts back off towards two minutes: answers left waiting
    in sockets (:meth:`EnginePool._admit`) would then stop arriving at all (soak-131k, 2 x 2023
    answers of 0.66 MB waiting: 1.7 GB against a 1.5 GB mark). :meth:`pressed` is True while
    ``/proc/net/sockstat``'s TCP ``mem`` (pages) is at least :data:`TCP_MEMORY_RELIEF` of the
    mark (``/proc/sys/net/ipv4/tcp_mem``'s middle value); read at most every ``every_s``
    seconds. Always False where those files cannot be read.
    """

    __slots__ = ("every_s", "_until", "_pressed", "_mark", "_sockstat")

    def __init__(self, every_s: float = 0.25, sockstat: str = "/proc/net/sockstat",
                 tcp_mem: str = "/proc/sys/net/ipv4/tcp_mem") -> None:
        self.every_s = every_s
        self._until = 0.0
        self._pressed = False
        self._mark: int | None = None
        try:
            with open(tcp_mem) as f:
                self._mark = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
        self._sockstat = sockstat

    def pages(self) -> int | None:
        """TCP memory in use (pages), or None where unknown."""
        if not self._mark:
            return None
        try:
            with open(self._sockstat) as f:
                for line in f:
                    if line.startswith("TCP:"):
                        parts = line.split()
                        return int(parts[parts.index("mem") + 1])
        except (OSError, ValueError, IndexError):
            return None
        return None

    def pressed(self) -> bool:
        """True while TCP memory is at least TCP_MEMORY_RELIEF of the pressure mark."""
        now = time.monotonic()
        if now < self._until:
            return self._pressed
        self._until = now + self.every_s
        used = self.pages()
        self._pressed = used is not None and self._mark is not None and used >= TCP_MEMORY_RELIEF * self._mark
        return self._pressed


class Broken(Exception):
    """The connection ended or failed before the answer was complete.

    Attributes:
        answered: the answer's header section had arrived (the body was cut).
        reused: the connection had carried an earlier request (an idle keep-alive connection
            the engine may have closed as the request went out).
    """

    def __init__(self, message: str, *, answered: bool, reused: bool) -> None:
        super().__init__(message)
        self.answered = answered
        self.reused = reused


class BadResponse(Exception):
    """The engine's bytes are not an HTTP/1.x response (bad status line, malformed chunking,
    a header section over :data:`MAX_HEAD_BYTES`, an unsupported ``Content-Encoding``, a body
    that does not decompress)."""


class BodyTooLarge(Exception):
    """The answer's body passes the caller's bound.

    Attributes:
        status: the answer's HTTP status.
        declared: the ``Content-Length`` that passes it (bytes), or None when the bound was
            passed while reading (chunked, compressed, or close-delimited bodies).
        got: bytes of (decoded) body read when it stopped.
    """

    def __init__(self, status: int, declared: int | None, got: int) -> None:
        super().__init__(f"body over the bound ({declared if declared is not None else got} bytes)")
        self.status = status
        self.declared = declared
        self.got = got


class BodyBuffers:
    """Receive buffers for ``Content-Length`` answers, kept for reuse.

    A new buffer for every answer costs more than the copy into it: a 2.4 MB answer is 600 fresh
    pages, each faulted in and zeroed by the kernel (and ``bytearray(n)`` zeroes it again). A
    buffer taken from here is already resident. Buffers come in size classes 1/16 to 1/8 of
    their size apart (at least 64 KiB), so an answer wastes at most 12.5 %, and answers of
    one shape share a class; an answer takes a free buffer of its class or of the next
    classes up to twice its size.

    Args:
        keep_bytes: the most bytes of buffers, in use and kept free together (bytes): a buffer
            given back is kept only while that stays within it, else freed. 0 keeps none.
        counters: where ``engine_buffers_reused`` / ``engine_buffers_new`` (answers that got a
            kept buffer / a new one) are counted, e.g. the encoder's ``ShardCounters``.

    Buffers are uint8 ``numpy`` arrays over private anonymous memory mappings of their own (no zeroing
    pass of ours; freed, a buffer's pages go straight back to the kernel instead of staying in
    malloc's heap); callers see a ``memoryview`` of the answer's length.
    """

    GRANULE_MIN = 64 * 1024

    def __init__(self, keep_bytes: int, counters: MutableMapping[str, int] | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.counters: MutableMapping[str, int] = counters if counters is not None else collections.Counter()
        self.kept = 0  # bytes of free buffers held
        self.out = 0  # bytes of buffers handed out by take() and not given back
        self._free: dict[int, list[tuple[float, np.ndarray]]] = {}
        self._out: dict[int, np.ndarray] = {}  # id(view's array) -> its buffer, for give()
        self.reused = 0  # answers that got a kept buffer
        self.allocated = 0  # answers that needed a new one

    @classmethod
    def size_class(cls, n: int) -> int:
        """The buffer size (bytes) that holds an ``n``-byte answer."""
        g = max(cls.GRANULE_MIN, 1 << max(n.bit_length() - 4, 0))
        return -(-n // g) * g

    def take(self, n: int) -> memoryview:
        """A writable ``memoryview`` of ``n`` bytes (format ``B``) over a kept or new buffer."""
        c = self.size_class(max(n, 1))  # (a mapping of 0 bytes does not exist)
        buf = None
        cand = c
        while cand <= 2 * c:
            lst = self._free.get(cand)
            if lst:
                buf = lst.pop()[1]
                self.kept -= buf.size
                self.reused += 1
                self.counters["engine_buffers_reused"] += 1
                break
            cand = self.size_class(cand + 1)
        if buf is None:
            # A mapping of its own, not malloc: freed, it goes straight back to the kernel. From
            # malloc's heap, thousands of freed answer buffers stayed resident (glibc raises its
            # mmap threshold to the largest block freed, so they came from the heap, which then
            # only shrinks from its top).
            # Private, not shared (mmap's default for -1): a fresh private page costs the kernel
            # about half what a shmem page does (no page-cache insert; 2.75 MB filled fresh,
            # 1.6 vs 2.4-2.9 ms on 2 CPUs), and nothing else ever maps these buffers.
            buf = np.frombuffer(mmap.mmap(-1, c, flags=mmap.MAP_PRIVATE), dtype=np.uint8)
            self.allocated += 1
            self.counters["engine_buffers_new"] += 1
        view = buf[:n]
        self._out[id(view)] = buf
        self.out += buf.size
        return memoryview(view)

    def give(self, data: object) -> None:
        """Take back a view :meth:`take` returned (anything else is ignored). The view must not
        be used afterwards: its bytes will be overwritten by a later answer. A buffer still read
        elsewhere (an export of the view, a slice of it, its array) is dropped instead of kept."""
        owner = getattr(data, "obj", None)
        buf = self._out.pop(id(owner), None) if owner is not None else None
        if buf is None:
            return
        self.out -= buf.size
        # A slice of the view (``data[a:b]``) is no export of it: release() succeeds, but the
        # slice shares the view's managed buffer, which then keeps the array alive.
        array = weakref.ref(owner)
        del owner
        if isinstance(data, memoryview):
            try:
                data.release()  # a later use fails loudly instead of reading another answer
            except BufferError:  # something still reads it: never hand this buffer out again
                return
        if array() is not None:  # a slice, or the array itself, is still read somewhere
            return
        if self.kept + self.out + buf.size <= self.keep_bytes:
            self._free.setdefault(buf.size, []).append((time.monotonic(), buf))
            self.kept += buf.size

    def trim(self, idle_s: float) -> int:
        """Free the kept buffers unused for ``idle_s`` seconds or more; returns the bytes freed."""
        cutoff = time.monotonic() - idle_s
        freed = 0
        for size, lst in list(self._free.items()):
            keep = [(t, b) for t, b in lst if t > cutoff]
            freed += size * (len(lst) - len(keep))
            if keep:
                self._free[size] = keep
            else:
                del self._free[size]
        self.kept -= freed
        return freed


class _Exchange:
    """One request's answer as it arrives (state shared by the protocol and the parser callbacks)."""

    __slots__ = ("waiter", "limit", "status", "headers_done", "interim", "length", "body", "got",
                 "direct", "inflater", "complete", "keep_alive", "error", "received", "chunked",
                 "encoding", "retry_after", "location", "watch", "counted", "paused", "reserve")

    def __init__(self, waiter: asyncio.Future, limit: int) -> None:
        self.waiter = waiter
        self.limit = limit
        self.status = 0
        self.headers_done = False
        self.interim = False  # the header section that arrived was a 1xx
        self.length: int | None = None  # Content-Length
        self.chunked = False
        self.encoding = b""  # Content-Encoding, lower case
        self.body: bytearray | memoryview = bytearray()
        self.got = 0  # body bytes in self.body
        self.direct = False  # the event loop reads into self.body (Content-Length, identity)
        self.inflater = None
        self.complete = False
        self.keep_alive = True
        self.error: BaseException | None = None
        self.received = 0  # bytes of this answer received (header section included)
        # Bytes reported to EnginePool.on_bytes for this answer: what the slower path received,
        # plus the whole Content-Length of a body admitted to the fast path (reserved up front).
        self.counted = 0
        self.paused = False  # the body waits, unread, for room in the answer budget (EnginePool._admit)
        # Of a body without Content-Length let in under the budget: what is counted for it ahead
        # of its arrival and not yet used up by its bytes (EnginePool._let_in).
        self.reserve = 0
        self.retry_after: bytes | None = None  # the answer's Retry-After field, as sent
        self.location: bytes | None = None  # the answer's Location field (a redirect), as sent
        self.watch: asyncio.TimerHandle | None = None  # the read-idle check (EnginePool._watch)


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection to the engine; carries one exchange at a time.

    Up to ``engine.pool_size`` of them wait on the engine at once (2048 per encoder in the
    soak), so a connection holds little while it waits: no ``__dict__``, no parser until the
    first byte of its answer (``parser``), no read-idle timer until its header section arrived
    (``_Exchange.watch``).
    """

    __slots__ = ("pool", "transport", "closed", "requests", "idle_since", "x", "parser", "head_view",
                 "body_view", "head_bytes", "dirty", "wide")

    def __init__(self, pool: "EnginePool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.requests = 0  # requests sent on this connection
        self.idle_since = 0.0
        self.x: _Exchange | None = None
        self.parser: httptools.HttpResponseParser | None = None
        # The buffer of the read in progress: one of the pool's two read buffers, shared by
        # every connection (the event loop fills a buffer and calls buffer_updated, which
        # consumes it, before it asks any connection for a buffer again).
        self.head_view: memoryview = pool._head_read
        self.body_view: memoryview | None = None
        self.head_bytes = 0  # header-section bytes seen for the current answer
        self.dirty = False  # bytes beyond the answer arrived: never reuse
        self.wide = False  # its SO_RCVBUF was raised for an admitted body (EnginePool.wide_bytes)

    # -- asyncio.BufferedProtocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        x = self.x
        if x is not None and x.direct and not x.paused and not x.waiter.done():
            return self.body_view[x.got:]  # type: ignore[index]
        if x is not None and x.headers_done and not x.interim and not x.complete and not x.direct:
            self.head_view = self.pool._slow_read  # a body without Content-Length: larger reads
        else:
            self.head_view = self.pool._head_read
        return self.head_view

    def buffer_updated(self, nbytes: int) -> None:
        x = self.x
        if x is None or x.waiter.done():  # bytes that answer nothing of ours: never reuse
            self.dirty = True
            self._drop()
            return
        x.received += nbytes
        if x.direct:  # counted as a whole when admitted (EnginePool._admit)
            if x.paused:  # a read the event loop made before it saw the pause: keep it aside
                x.body += self.head_view[:nbytes]  # type: ignore[operator]
                x.counted += nbytes
                self.pool.waiting_bytes += nbytes
                self.pool.on_bytes(nbytes)
            x.got += nbytes
            if x.got >= x.length:  # type: ignore[operator]
                if x.got > x.length:  # type: ignore[operator]
                    self.dirty = True  # bytes beyond the answer: never reuse the connection
                    del x.body[x.length:]  # type: ignore[union-attr,arg-type]
                    x.got = x.length  # type: ignore[assignment]
                self._end_body()
            return
        n = nbytes
        if x.reserve:  # a body let in under the budget arrives into what was counted for it
            used = min(x.reserve, n)
            x.reserve -= used
            n -= used
        if n:
            x.counted += n
            self.pool.on_bytes(n)
            if x.paused:  # a read the event loop made before it saw the pause
                self.pool.waiting_bytes += n
        try:
            if not x.headers_done:
                if self.head_bytes >= MAX_HEAD_BYTES:
                    raise BadResponse(f"answer header section over {MAX_HEAD_BYTES} bytes")
                self.head_bytes += nbytes
            direct = x.direct
            p = self.parser
            if p is None:  # the answer's first byte
                p = self.parser = httptools.HttpResponseParser(self)
                p.set_dangerous_leniencies(**_LENIENCIES)
            p.feed_data(self.head_view[:nbytes])
            if x.direct and not direct and x.got and not x.paused:
                # Admitted within this read: the body bytes that came with the header section
                # were counted with the read and again in the body's reservation.
                x.counted -= x.got
                self.pool.on_bytes(-x.got)
        except httptools.HttpParserUpgrade:  # not a parse error in httptools' hierarchy
            if x.complete:  # a second answer after ours
                self.dirty = True
            else:
                self._fail(BadResponse(f"HTTP {self.parser.get_status_code()} (an upgrade) to a request that "  # type: ignore[union-attr]
                                       f"asked for none"))
        except httptools.HttpParserError as exc:
            inner = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else None
            if isinstance(inner, _Stop):
                return
            if isinstance(inner, (BodyTooLarge, BadResponse)):
                self._fail(inner)
            elif x.complete:  # bytes after a complete answer: the answer stands
                self.dirty = True
            elif self.requests > 1 and not x.headers_done and not x.interim:
                # Garbage where a reused connection's next answer should start: bytes left over
                # from the previous answer (a proxy that under-stated its Content-Length), not
                # this request's answer. Sent again on a fresh connection; the same garbage
                # there is final.
                self._fail(Broken(f"bytes that start no HTTP/1.1 answer on a reused connection ({exc})",
                                  answered=False, reused=True))
            else:
                self._fail(BadResponse(f"not an HTTP/1.1 answer: {exc}"))
        except (BodyTooLarge, BadResponse) as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        x = self.x
        if x is not None and x.headers_done and not x.interim and not x.complete and \
                x.length is None and not x.chunked:
            self._end_body()  # a body delimited by the connection closing
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        x = self.x
        if x is not None and not x.waiter.done():
            answered = x.headers_done and not x.interim
            what = str(exc) if exc is not None else "the engine closed the connection"
            if answered and x.length is not None:
                what += f" after {x.got} of {x.length} body bytes"
            elif answered:
                what += f" after {x.got} body bytes"
            self._fail(Broken(what, answered=answered, reused=self.requests > 1))
        self.pool._forget(self)

    # -- the answer ----------------------------------------------------------------------------

    # httptools callbacks
    def on_message_begin(self) -> None:
        x = self.x
        if x is not None and x.complete:
            self.dirty = True  # a second answer to one request
            raise _Stop()
        pool = self.pool
        if x is not None and x.watch is None and pool.read_idle_s > 0:
            # Judged from the answer's first byte (EnginePool._watch): a peer that stops inside
            # the header section is as silent as one that stops inside the body.
            x.watch = asyncio.get_running_loop().call_later(pool.read_idle_s, pool._watch, self, x, x.received)

    def on_header(self, name: bytes, value: bytes) -> None:
        x = self.x
        n = name.lower()
        if n == b"content-length":
            try:
                v = int(value)
            except ValueError:
                raise BadResponse(f"bad Content-Length {value[:40]!r}") from None
            if v < 0 or (x.length is not None and x.length != v):
                raise BadResponse(f"bad Content-Length {value[:40]!r}")
            x.length = v
        elif n == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            if any(c not in (b"chunked", b"identity", b"") for c in codings):
                # (gzip as a transfer-coding: nothing sends it, and its bytes read as JSON would
                # make a confusing error; Content-Encoding: gzip is what servers use)
                raise BadResponse(f"unsupported Transfer-Encoding {value[:60]!r} (only chunked)")
            x.chunked = b"chunked" in codings
        elif n == b"content-encoding":
            x.encoding = value.strip().lower()
        elif n == b"retry-after":
            x.retry_after = value.strip()
        elif n == b"location":
            x.location = value.strip()

    def on_headers_complete(self) -> None:
        x = self.x
        p = self.parser
        status = p.get_status_code()
        if 100 <= status < 200:  # interim answer (100 Continue, 103 Early Hints): the real one follows
            x.interim = True
            x.length, x.chunked, x.encoding, x.retry_after, x.location = None, False, b"", None, None
            return
        x.interim = False
        x.status = status
        x.headers_done = True
        x.keep_alive = p.should_keep_alive()
        if x.chunked:
            x.length = None  # Transfer-Encoding wins over Content-Length (RFC 9112 6.3)
        enc = x.encoding
        if enc in (b"gzip", b"x-gzip"):
            x.inflater = _Inflater(gzip=True)
        elif enc == b"deflate":
            x.inflater = _Inflater(gzip=False)
        elif enc not in (b"", b"identity"):
            raise BadResponse(f"Content-Encoding {enc[:40].decode('latin-1')!r}, which the gateway did not offer")
        if x.length is not None and x.length > x.limit:
            raise BodyTooLarge(status, x.length, 0)
        if x.length and x.inflater is None and status not in (204, 304):  # (an empty body: nothing to read)
            x.direct = True  # the rest of this read is copied in by on_body, later reads land in place
            if self.pool._admit(self, x):
                self.take_buffer()
            # else: the body waits unread for room (its buffer is taken when admitted; what
            # arrived with the header section collects in x.body meanwhile)
        elif status not in (204, 304) and x.length != 0 and self.pool.budget_bytes:
            self.pool._admit(self, x)  # a body of unknown size: let in as STREAM_BODY_ESTIMATE bytes, or wait
        if status in (204, 304):
            x.length = 0
        pool = self.pool
        if pool.read_idle_s > 0 and x.watch is None:
            # Judged from here on (EnginePool._watch): no byte for read_idle_s fails the exchange.
            x.watch = asyncio.get_running_loop().call_later(
                pool.read_idle_s, pool._watch, self, x, -1 if x.paused else x.received)

    def on_body(self, data: bytes) -> None:
        x = self.x
        if x.interim:
            return
        if x.direct:
            n = len(data)
            if x.paused:
                x.body += data  # type: ignore[operator]
            else:
                self.body_view[x.got:x.got + n] = data  # type: ignore[index]
            x.got += n
            return
        if x.inflater is not None:
            try:
                data = x.inflater.decompress(data, x.limit - x.got + 1)
            except zlib.error as exc:
                raise _undecodable(x, exc) from None
            if x.inflater.unconsumed_tail:
                raise BodyTooLarge(x.status, None, x.got + len(data))
        _append(x, data)

    def on_message_complete(self) -> None:
        x = self.x
        if x.interim:
            # A 1xx (103 Early Hints, 100 Continue) is complete: the real answer may come as late
            # as the request runs. Not judged until its first byte (on_message_begin).
            x.interim = False
            if x.watch is not None:
                x.watch.cancel()
                x.watch = None
            return
        self._end_body()

    def take_buffer(self) -> None:
        """Give the admitted ``Content-Length`` body its receive buffer (the bytes that came
        before, with the header section, are copied in); later reads land in it."""
        x = self.x
        pool = self.pool
        view = pool.buffers.take(x.length)  # type: ignore[arg-type]
        if x.got:
            view[:x.got] = x.body  # type: ignore[index]
        x.body = self.body_view = view
        if pool.receive_buffer_bytes and not self.wide and pool.wide < pool.max_wide:
            # An admitted body is read at once: through a window of its size, not the small one
            # that bounds what a waiting answer leaves in the kernel. The kernel never shrinks an
            # advertised window, so a widened connection stays wide; at most max_wide are.
            try:
                self.transport.get_extra_info("socket").setsockopt(  # type: ignore[union-attr]
                    socket.SOL_SOCKET, socket.SO_RCVBUF, pool.wide_bytes)
            except (OSError, AttributeError):
                return
            self.wide = True
            pool.wide += 1

    def _end_body(self) -> None:
        x = self.x
        # An empty body is empty whatever its Content-Encoding says (an empty 503/413/204 from a
        # proxy that labels every answer gzip): no compressed stream began, so none ended early.
        if x.inflater is not None and x.inflater.started:
            try:
                rest = x.inflater.flush()
                if not x.inflater.eof:
                    raise Broken(f"compressed body ends early ({x.got} bytes decoded)", answered=True,
                                 reused=self.requests > 1)
                _append(x, rest)
            except zlib.error as exc:
                self._fail(_undecodable(x, exc))
                return
            except (Broken, BodyTooLarge) as exc:
                self._fail(exc)
                return
        x.complete = True
        self._finish()

    def _finish(self) -> None:
        x = self.x
        if x is None or x.waiter.done():
            return
        if x.paused:  # the whole body came with its header section: nothing left to wait for
            self.pool._unwait(x)
            if not self.closed:
                self.transport.resume_reading()  # type: ignore[union-attr]
        self.body_view = None
        x.waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        x = self.x
        if x is not None and not x.waiter.done():
            # Kept without the traceback of the callback that found it: its frames hold ``x``
            # (and the body read so far), and ``x`` holds the error, a reference cycle that only
            # the cyclic GC frees, which an encoder runs rarely (``settle_gc``). Our errors'
            # messages say what happened.
            exc.__traceback__ = None
            exc.__context__ = None
            x.error = exc
            x.waiter.set_result(None)
        self.body_view = None
        self._drop()

    def _drop(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()


def _take_error(x: _Exchange) -> BaseException:
    """The error that ended ``x``, no longer held by it: raised by :meth:`EnginePool.post`, whose
    frame (in the traceback) holds ``x``; an ``x`` still holding the error would make a reference
    cycle that keeps the body read so far alive until the cyclic GC runs."""
    err, x.error = x.error, None
    assert err is not None
    return err


def _append(x: _Exchange, data: bytes) -> None:
    """Add decoded body bytes to a body read on the slower path; BodyTooLarge past the limit."""
    x.body += data  # type: ignore[operator]
    x.got += len(data)
    if x.got > x.limit:
        raise BodyTooLarge(x.status, None, x.got)


def _undecodable(x: _Exchange, exc: zlib.error) -> BadResponse:
    return BadResponse(f"body does not decompress ({x.encoding.decode('latin-1')}): {exc}")


class _Stop(Exception):
    """Stops httptools' feed at a second answer to one request (raised from a callback)."""


class _Inflater:
    """``Content-Encoding: gzip`` or ``deflate`` (zlib-wrapped as RFC 9110 says, or raw DEFLATE as
    some servers send it; decided by the first byte). A body may hold several members back to
    back (RFC 1952 2.2: a server that compresses each write on its own): each is decoded by a
    fresh decompressor, as aiohttp's client does."""

    # Input fed per call after a member boundary (bytes), doubling up to the maximum: the
    # decompressor copies what follows its member into ``unused_data``, so handing it the whole
    # rest at every boundary would be quadratic in the number of members.
    WINDOW_MIN = 64
    WINDOW_MAX = 64 * 1024

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._z = None

    def _start(self, first_byte: int) -> None:
        if self._gzip:
            wbits = 16 + zlib.MAX_WBITS
        else:
            wbits = -zlib.MAX_WBITS if (first_byte & 0x0F) != 8 else zlib.MAX_WBITS
        self._z = zlib.decompressobj(wbits)

    def decompress(self, data: bytes, max_length: int) -> bytes:
        """The decoded bytes of ``data`` (at most ``max_length`` >= 1; when the output stops
        there, the rest of the input is dropped and :attr:`unconsumed_tail` is set or the
        output is ``max_length`` long). Raises ``zlib.error`` for bytes that do not decode."""
        view = memoryview(data)
        pos, n, parts = 0, 0, []
        window = len(view)  # the whole input until a member ends within it
        while pos < len(view) and n < max_length:
            if self._z is None or self._z.eof:
                if self._z is not None:
                    window = self.WINDOW_MIN
                self._start(view[pos])
            end = min(pos + window, len(view))
            piece = self._z.decompress(view[pos:end], max_length - n)
            parts.append(piece)
            n += len(piece)
            if self._z.eof:
                pos = end - len(self._z.unused_data)
            elif self._z.unconsumed_tail:
                break
            else:
                pos = end
                window = min(window * 2, max(self.WINDOW_MAX, window))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def unconsumed_tail(self) -> bytes:
        return self._z.unconsumed_tail if self._z is not None else b""

    @property
    def started(self) -> bool:
        """Whether any body byte has been fed (a compressed stream began)."""
        return self._z is not None

    @property
    def eof(self) -> bool:
        return self._z is not None and self._z.eof

    def flush(self) -> bytes:
        return self._z.flush() if self._z is not None else b""


def dead_peer_options(seconds: float) -> list[tuple[int, int, int]]:
    """The ``setsockopt`` triples ``(level, option, value)`` that make the kernel declare a TCP
    connection dead when its peer acknowledges nothing for about ``seconds`` (``engine.
    dead_connection_s``) while the connection waits for the answer: keepalive probes after
    ``seconds / 3`` idle, then up to 6 more. The connection then fails with ``ETIMEDOUT``
    (``connection_lost``), as a reset one does. Empty for 0 (off) or where Linux's options are
    missing.

    A busy or slow engine is never taken for dead: its kernel acknowledges the probes however
    long the generation takes. Only a peer that is gone (host down, partition) stops answering.
    ``TCP_USER_TIMEOUT`` is not used: Linux applies it to a peer that holds a zero window too
    (an engine that reads nothing of a large request for a while), although that peer
    acknowledges every probe. A request still unacknowledged when the peer vanished is left to
    the kernel's retransmission limit (``net.ipv4.tcp_retries2``, ~15 min).
    """
    if seconds <= 0 or not hasattr(socket, "TCP_KEEPIDLE"):
        return []
    idle = max(1, int(seconds // 3))
    interval = max(1, int((seconds - idle) // 6))
    count = max(1, min(6, int((seconds - idle) // interval)))
    return [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval), (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)]


def set_options(sock: Any, options: list[tuple[int, int, int]]) -> None:
    """``sock.setsockopt`` for each ``(level, option, value)``; an option the socket refuses is
    skipped (a transport without a real TCP socket)."""
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except (OSError, AttributeError):
            return


def request_target(url: str) -> str:
    """The request target (origin form: path and query) that :class:`EnginePool` sends for
    ``url``, as aiohttp (yarl) sends it: a space or non-ASCII letter percent-encoded (UTF-8),
    existing %-escapes and the characters a path may hold as they are; ``/`` for an empty path."""
    parts = urlsplit(url)
    return quote(parts.path or "/", safe=_PATH_SAFE) + (f"?{parts.query}" if parts.query else "")


class EnginePool:
    """Keep-alive connections to one ``http://`` engine, and the POST that uses them.

    Args:
        url: the full request URL (``http://[user:password@]host[:port]/path``); credentials
            become an ``Authorization: Basic`` header, as aiohttp's client does.
        connect_timeout_s: bound on opening a connection (seconds).
        idle_s: an idle connection older than this is closed instead of reused (seconds).
        read_idle_s: once an answer's first byte has arrived, a connection that then delivers
            no byte for this long (inside the header section or the body) is taken as broken
            (:class:`Broken`, answered); 0: no such bound. Before the first byte nothing is
            bounded here: the engine may generate for minutes before it answers.
        on_bytes: called with the byte count of answer bytes as they arrive (header sections
            included; a body read into its own buffer is reported as a whole, its
            ``Content-Length``, when it is admitted), and with minus an answer's total once
            :meth:`post` is done with it, so a caller can keep the engine bytes this process holds.
        budget_bytes: the answer bytes this process may hold (bytes; 0: no bound). A
            ``Content-Length`` body that would take ``held()`` past it is not read yet: its
            connection stops reading after the header section (the rest stays in the kernel's
            socket buffer and the engine's) until :meth:`wake` finds room, first come first
            served. A body is always admitted when nothing else is held, so one larger than the
            budget still arrives. A body of unknown size (chunked, close-delimited, compressed)
            waits the same way, taken as :data:`STREAM_BODY_ESTIMATE` bytes; once let in it is
            read to its end, counted as it arrives past the estimate.
        held: the answer bytes held now (bytes), e.g. ``EngineClient.answer_bytes``; required
            with ``budget_bytes``.
        keep_buffer_bytes: the most bytes of receive buffers kept for reuse (:class:`BodyBuffers`).
        counters: passed to :class:`BodyBuffers`.
        dns_ttl_s: a host name (not an IP literal) is resolved at most once per this many
            seconds (``loop.getaddrinfo``), not for every new connection (seconds).
        receive_buffer_bytes: ``SO_RCVBUF`` of each connection, set once it is open (bytes; the
            kernel accounts twice that); 0: the kernel's autotuning (up to ``net.ipv4.tcp_rmem``'s
            maximum, 32 MiB on some hosts). Bounds the kernel memory an answer waiting unread
            for room in ``budget_bytes`` holds on this side: see ``engine.receive_buffer_bytes``.
            A connection whose body is admitted is widened to :data:`WIDE_RECEIVE_BYTES` (at most
            :data:`MAX_WIDE_CONNECTIONS` of them), so the body comes at full speed.
        dead_connection_s: a connection whose peer acknowledges nothing for about this long
            fails (:func:`dead_peer_options`; ``engine.dead_connection_s``), seconds; 0: off.

    Not thread-safe; one per event loop.
    """

    def __init__(self, url: str, *, connect_timeout_s: float, idle_s: float,
                 on_bytes: Callable[[int], None] | None = None, keep_buffer_bytes: int = 64 << 20,
                 counters: MutableMapping[str, int] | None = None, read_idle_s: float = 0.0,
                 budget_bytes: int = 0, held: Callable[[], int] | None = None,
                 dns_ttl_s: float = 10.0, receive_buffer_bytes: int = 0, dead_connection_s: float = 0.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"EnginePool needs an http:// URL with a host, got scheme {parts.scheme!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == 80 else f"{host}:{self.port}"
        self.target = request_target(url)
        self.auth = None
        if parts.username is not None:
            cred = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode("latin-1")
            self.auth = "Basic " + base64.b64encode(cred).decode("ascii")
        self.connect_timeout_s = connect_timeout_s
        self.receive_buffer_bytes = receive_buffer_bytes
        self.socket_options = dead_peer_options(dead_connection_s)
        # Connections widened for an admitted body (_Connection.take_buffer): at most max_wide of
        # wide_bytes each, so what answers waiting on them can leave in the kernel stays bounded.
        self.wide_bytes = max(WIDE_RECEIVE_BYTES, receive_buffer_bytes)
        self.tcp_memory = TcpMemory()
        self.max_wide = MAX_WIDE_CONNECTIONS
        self.wide = 0
        self.idle_s = idle_s
        self.read_idle_s = read_idle_s
        self.on_bytes: Callable[[int], None] = on_bytes or (lambda n: None)
        self.buffers = BodyBuffers(keep_buffer_bytes, counters)
        # Read buffers shared by all connections (see _Connection.head_view): 16 KiB while a
        # header section arrives, 256 KiB for a body without Content-Length. One per connection
        # was 16 KiB of each of up to engine.pool_size engine calls in flight.
        self._head_read = memoryview(bytearray(_HEAD_READ))
        self._slow_read = memoryview(bytearray(_SLOW_READ))
        if budget_bytes and held is None:
            raise ValueError("budget_bytes needs held")
        self.budget_bytes = budget_bytes
        self.held: Callable[[], int] = held or (lambda: 0)
        # Answers whose bodies wait unread for room in the budget, oldest first (entries whose
        # exchange ended meanwhile are skipped by wake()).
        self._waiting: collections.deque[tuple[_Connection, _Exchange]] = collections.deque()
        # Bytes the waiting answers hold (what came with their header sections, at most one
        # 16 KiB read each); counted in held() too, but never what keeps a body out.
        self.waiting_bytes = 0
        self._idle: collections.deque[_Connection] = collections.deque()
        self._all: set[_Connection] = set()
        self._closed = False
        self.dns_ttl_s = dns_ttl_s
        try:
            ipaddress.ip_address(self.host)
            self._literal = True  # asyncio and uvloop take it as it is, with no lookup
        except ValueError:
            self._literal = False
        self._addrs: list[tuple] = []  # getaddrinfo's answer, while fresh
        self._addrs_until = 0.0  # time.monotonic() when it goes stale
        self._lookup: asyncio.Future[list[tuple]] | None = None  # the lookup in flight

    @property
    def waiting(self) -> int:
        """Answers whose bodies wait unread for room in ``budget_bytes`` (an upper bound: entries
        of exchanges that ended meanwhile leave at the next :meth:`wake`)."""
        return len(self._waiting)

    def _admit(self, conn: _Connection, x: _Exchange) -> bool:
        """A ``Content-Length`` body is about to be read into its buffer: count it whole and
        return True, or, when that would pass ``budget_bytes`` while other answers are held (or
        others already wait), stop reading its connection until :meth:`wake` admits it and
        return False. A waiting body takes no receive buffer: a kept one is resident memory."""
        need = self._need(x)
        if self.budget_bytes and not self._waiting:
            other = self.held() - self.waiting_bytes - x.counted  # held by the answers let in
            if other <= 0 or other + need <= self.budget_bytes:
                self._let_in(x, need)
                return True
        elif not self.budget_bytes:
            self._let_in(x, need)
            return True
        if self._relieves(x.counted, need):
            self.buffers.counters["engine_answers_let_in_for_tcp_memory"] += 1
            self._let_in(x, need)
            return True
        x.paused = True
        self.waiting_bytes += x.counted
        conn.transport.pause_reading()  # type: ignore[union-attr]
        self._waiting.append((conn, x))
        self.buffers.counters["engine_answers_waited"] += 1
        return False

    def _relieves(self, counted: int, need: int) -> bool:
        """Whether a body of ``need`` bytes that would wait is let in anyway to relieve the host's
        TCP memory: while :class:`TcpMemory` says it nears the pressure mark, up to
        :data:`TCP_MEMORY_RELIEF_BUDGETS` x ``budget_bytes`` of answers are read (``counted``:
        what of this one is already counted)."""
        other = self.held() - self.waiting_bytes - counted
        return other + need <= TCP_MEMORY_RELIEF_BUDGETS * self.budget_bytes and self.tcp_memory.pressed()

    @staticmethod
    def _need(x: _Exchange) -> int:
        """What ``x``'s body needs of the budget (bytes): its ``Content-Length`` on the fast path,
        else at least :data:`STREAM_BODY_ESTIMATE` (a compressed body's length is a lower bound)."""
        if x.direct:
            return x.length or 0
        return max(x.length or 0, STREAM_BODY_ESTIMATE)

    def _let_in(self, x: _Exchange, need: int, arrived: int = 0) -> None:
        """Count ``x``'s body as let in: a ``Content-Length`` body whole, less the ``arrived``
        bytes of it counted already; a body of unknown size as ``need`` bytes reserved ahead,
        which its bytes use up as they arrive (``_Exchange.reserve``)."""
        if x.direct:
            self._count(x, need - arrived)
        else:
            x.reserve = need
            self._count(x, need)

    def _unwait(self, x: _Exchange) -> None:
        """``x`` stops waiting (admitted, complete, or ended): its bytes leave ``waiting_bytes``."""
        if x.paused:
            x.paused = False
            self.waiting_bytes -= x.counted

    def _count(self, x: _Exchange, n: int) -> None:
        x.counted += n
        self.on_bytes(n)

    def wake(self) -> int:
        """Admit waiting answers, oldest first, while they fit in ``budget_bytes`` (the first
        always when nothing else is held), and let their connections read again. Call whenever
        held answer bytes drop; returns how many were admitted."""
        q = self._waiting
        n = 0
        while q:
            conn, x = q[0]
            if conn.x is not x or not x.paused or conn.closed or x.waiter.done():
                q.popleft()
                continue
            other = self.held() - self.waiting_bytes  # held by the answers let in
            need = self._need(x)
            if other > 0 and other + need > self.budget_bytes:
                if not self._relieves(0, need):
                    break
                self.buffers.counters["engine_answers_let_in_for_tcp_memory"] += 1
            q.popleft()
            self._unwait(x)
            self._let_in(x, need, x.got)  # (what came with the header section is counted already)
            if x.direct:
                conn.take_buffer()
            conn.transport.resume_reading()  # type: ignore[union-attr]
            n += 1
        return n

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn.wide:
            conn.wide = False
            self.wide -= 1
        # Closed idle connections are skipped when taken; no scan of the deque here.

    async def _resolve(self, loop: asyncio.AbstractEventLoop) -> list[tuple]:
        """The addresses of ``self.host`` (``loop.getaddrinfo`` tuples, in its order): cached for
        ``dns_ttl_s`` seconds, and one lookup shared by the connects that need it meanwhile (a
        waiter cancelled by its timeout leaves the lookup running for the others). A failed
        lookup is not cached.

        Raises:
            OSError: the lookup failed (``socket.gaierror``) or found no address.
        """
        if self._addrs and time.monotonic() < self._addrs_until:
            return self._addrs
        if self._lookup is None:
            async def lookup() -> list[tuple]:
                try:
                    try:
                        addrs = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                    except OSError as exc:
                        raise OSError(f"cannot resolve {self.host!r}: {exc}") from None
                    if not addrs:
                        raise OSError(f"cannot resolve {self.host!r}: no address")
                    self._addrs, self._addrs_until = addrs, time.monotonic() + self.dns_ttl_s
                    return addrs
                finally:
                    self._lookup = None

            self._lookup = loop.create_task(lookup())
            # Retrieved here, so that a failure nobody waits for any more is not logged.
            self._lookup.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._lookup)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        """Connect to ``self.host``: an IP literal directly, a name to the addresses it resolves
        to (:meth:`_resolve`), in order, the first that accepts.

        Raises:
            OSError: the lookup failed, or every address refused (the last one's error, which
                names that address).
        """
        if self._literal:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
            return conn
        last: OSError | None = None
        for family, type_, proto, _, sockaddr in await self._resolve(loop):
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, sockaddr)
            except OSError as exc:
                sock.close()
                # One argument: a plain OSError, never TimeoutError (that is the connect timeout).
                last = OSError(f"{self.host} ({sockaddr[0]} port {sockaddr[1]}): "
                               f"{os.strerror(exc.errno) if exc.errno else exc}")
                continue
            except BaseException:
                sock.close()
                raise
            _, conn = await loop.create_connection(lambda: _Connection(self), sock=sock)
            return conn
        assert last is not None  # _resolve returns at least one address
        raise last

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                conn = await self._open(loop)
        except TimeoutError:
            raise ConnectFailed(f"connect timeout after {self.connect_timeout_s:g} s "
                                f"(engine.connect_timeout_s)") from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        sock = conn.transport.get_extra_info("socket")
        if self.receive_buffer_bytes:
            set_options(sock, [(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer_bytes)])
        set_options(sock, self.socket_options)
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        q = self._idle
        while q:
            conn = q.pop()  # the most recently used: the least likely to have been closed
            if conn.closed:
                continue
            if now - conn.idle_since > self.idle_s:
                conn._drop()
                continue
            return conn
        return None

    async def post(self, body: bytes, headers: Mapping[str, str], *, limit: int,
                   fresh: bool = False, meta: dict[str, object] | None = None,
                   method: str = "POST", target: str | None = None) -> tuple[int, memoryview, bool]:
        """POST ``body`` to the pool's URL and read the whole answer.

        Args:
            body: the request body (bytes).
            headers: extra request header fields (``Content-Type``, ``X-Request-Id`` ...).
            limit: the most (decoded) body bytes to accept.
            fresh: use a new connection and close it afterwards (after a reused connection
                failed before any answer).
            meta: if given, receives ``"retry_after"`` and ``"location"``: the answer's
                ``Retry-After`` and ``Location`` fields (``bytes`` as sent, or None).
            method: the request method; ``GET`` with an empty ``body`` sends no
                ``Content-Length`` (the engine probe's ``GET /health``, see
                :class:`shardserver.health.EngineProbe`). The answer to a ``HEAD`` is not handled.
            target: the request target to use instead of the pool's (:func:`request_target` of
                another URL on the same host and port).

        Returns:
            ``(status, body, reused)``: the final status, the decoded body, and whether the
            connection had carried an earlier request. The body is a ``memoryview`` (format
            ``B``) of exactly its length: over a :class:`BodyBuffers` buffer for a
            ``Content-Length`` identity body (hand it back with :meth:`recycle` when done), else
            over a ``bytearray``. With ``budget_bytes``, ``held()`` must count the body from
            here until the caller is done with it, and the caller then calls :meth:`wake`.

        Raises:
            ConnectFailed: no connection could be opened.
            Broken: the connection ended before the answer was complete.
            BadResponse: the answer is not valid HTTP/1.x (or cannot be decoded).
            BodyTooLarge: the body passes ``limit``.
            ValueError: a header name or value holds a line break (nothing is sent).
            asyncio.CancelledError: when cancelled (e.g. by the caller's timeout), the connection
                is closed, which makes vLLM abort the request.
        """
        if self._closed:
            raise ConnectFailed("the engine client is closed")
        length = "" if method == "GET" and not body else f"Content-Length: {len(body)}\r\n"
        lines = [f"{method} {target or self.target} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                 f"Accept: */*\r\nAccept-Encoding: identity\r\n{length}"]
        if fresh:
            lines.append("Connection: close\r\n")
        if self.auth is not None and not any(k.lower() == "authorization" for k in headers):
            lines.append(f"Authorization: {self.auth}\r\n")
        for k, v in headers.items():
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
                raise ValueError(f"header field {k!r} holds a line break")
            lines.append(f"{k}: {v}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        conn = None if fresh else self._take_idle()
        if conn is None:
            conn = await self._connect()
        conn.requests += 1
        reused = conn.requests > 1
        loop = asyncio.get_running_loop()
        x = _Exchange(loop.create_future(), limit)
        conn.x = x
        conn.parser = None  # made when the answer's first byte arrives (buffer_updated)
        conn.head_bytes = 0
        try:
            try:
                conn.transport.write(head)
                if body:
                    conn.transport.write(body)
            except (RuntimeError, OSError) as exc:  # a transport closed under us
                raise Broken(str(exc) or type(exc).__name__, answered=False, reused=reused) from None
            del head, lines, length  # (not held while the answer is awaited)
            if conn.closed and not x.waiter.done():
                raise Broken("the engine closed the connection", answered=False, reused=reused)
            try:
                await x.waiter
            finally:
                if x.watch is not None:
                    x.watch.cancel()
            if x.error is not None:
                raise _take_error(x)  # (no local name: this frame must not hold the error)
        except BaseException:
            conn.x = None
            conn.parser = None  # (the parser holds the connection's callbacks: a cycle)
            conn._drop()
            self._unwait(x)
            self.on_bytes(-x.counted)
            self.buffers.give(x.body)
            if self._waiting:
                self.wake()
            raise
        conn.x = None
        conn.parser = None
        # The body now counts as the caller's (held() must still include it): the caller calls
        # wake() once it is done with it.
        self.on_bytes(-x.counted)
        if fresh or conn.closed or conn.dirty or not x.keep_alive or self._closed:
            conn._drop()
        else:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        if meta is not None:
            meta["retry_after"] = x.retry_after
            meta["location"] = x.location
        body_out = x.body if isinstance(x.body, memoryview) else memoryview(x.body)
        return x.status, body_out, reused

    def _watch(self, conn: _Connection, x: _Exchange, seen: int) -> None:
        """Every ``read_idle_s`` while an answer is awaited: once its first byte has arrived, fail
        the exchange if no byte came since the last look (a silent peer: a partition, a hung
        proxy), in its header section or its body."""
        if x.waiter.done() or conn.x is not x:
            return
        # (a paused body, waiting for room in budget_bytes, is not read on purpose: not judged)
        if not x.paused and not x.interim and x.received == seen:
            where = f"after {x.got} body bytes" if x.headers_done else \
                f"inside the answer's header section ({conn.head_bytes} bytes)"
            conn._fail(Broken(f"no answer byte for {self.read_idle_s:g} s {where} (engine.read_idle_timeout_s)",
                              answered=True, reused=conn.requests > 1))
            return
        x.watch = asyncio.get_running_loop().call_later(
            self.read_idle_s, self._watch, conn, x, -1 if x.paused else x.received)

    def close_idle(self) -> int:
        """Close the idle connections unused for ``idle_s`` seconds or more (also done lazily when
        a request looks for one); returns how many were closed. Called periodically, so that an
        engine or proxy that never closes idle connections does not keep up to ``pool_size`` of
        them open."""
        cutoff = time.monotonic() - self.idle_s
        q = self._idle
        n = 0
        while q and (q[0].closed or q[0].idle_since < cutoff):  # oldest first
            conn = q.popleft()
            if not conn.closed:
                conn._drop()
                n += 1
        return n

    def recycle(self, body: object) -> None:
        """The caller is done with a body :meth:`post` returned: its buffer may be reused."""
        self.buffers.give(body)

    async def close(self) -> None:
        """Close every connection (idempotent)."""
        self._closed = True
        for conn in list(self._all):
            conn._drop()
        self._idle.clear()
