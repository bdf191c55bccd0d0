"""Connections of one front-end: accepting them under a cap, timing out slow clients, draining.

uvicorn accepts connections inside uvloop and gives each an ``HttpToolsProtocol``; it has no
limit on how long a client may take to send its request headers, no cap on open connections
(``limit_concurrency`` answers 503 *after* accepting, which does not save a file descriptor),
and at shutdown it closes idle keep-alive connections at once, so a request crossing that
close is reset. This module replaces the two pieces involved, keeping uvicorn for everything
else (HTTP parsing, the ASGI cycle, graceful waiting):

* :class:`Listener` accepts from the supervisor's listening socket itself (``accept()`` on
  readiness, then ``loop.connect_accepted_socket``), so it can *stop accepting* while the
  front-end holds ``server.max_connections`` connections (lowered to what ``RLIMIT_NOFILE``
  allows): new clients then wait in the kernel's backlog, where another front-end with room
  takes them, instead of being accepted and closed. At the cap, the connection that has waited
  longest on its client (idle between requests, or not sending a complete request), if for at
  least :data:`EVICT_MIN_IDLE_S`, is closed first to make room. ``accept()`` failing
  for lack of file descriptors pauses accepting for :data:`ACCEPT_ERROR_PAUSE_S` and is
  logged. At shutdown it stops accepting, takes every connection already waiting in the
  backlog (they are answered, not reset), and closes its copy of the listening socket.
* :class:`GatewayHttpProtocol` (a subclass of uvicorn's ``HttpToolsProtocol``) enforces
  ``server.header_timeout_s`` (from the connection's start or the first byte of a request
  until its headers are complete) and ``server.body_timeout_s`` (from the end of the headers
  until the whole body arrived): a request that started is answered ``408`` with
  ``Connection: close``, a connection that sent nothing is closed. It also bounds a request's
  headers to ``server.max_header_bytes`` (httptools has no bound of its own and concatenates a
  header value piece by piece): beyond it, ``431`` and close. During a drain every
  response carries ``Connection: close`` and idle connections are closed after
  :data:`DRAIN_IDLE_S` without a new request. No idle close (drain, keep-alive timeout,
  eviction at the cap) happens while the client's next request waits unread in the socket
  (``FIONREAD``): a busy event loop runs due timers before its reads, and a close with unread
  bytes resets them.

Metrics (``docs/OPERATIONS.md``): ``shardserver_connections_open`` (gauge),
``shardserver_connection_timeouts_total{phase}``, ``shardserver_connection_cap_reached_total``,
``shardserver_connections_evicted_total``, ``shardserver_accept_errors_total{reason}``.
Log lines about these are rate-limited (:class:`RateLimitedLog`).

Relies on these attributes of uvicorn's ``HttpToolsProtocol`` (uvicorn 0.30 - 0.54): ``cycle``
(``response_complete``, ``response_started``, ``keep_alive``, ``disconnected``,
``message_event``), ``pipeline``, ``transport``, ``connections`` and ``server_state``.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import logging
import mmap
import os
import resource
import socket
import struct
import termios
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..aio import RateLimitedLog
from ..api.common import CONNECTION_SCOPE_KEY, TIMED_OUT_SCOPE_KEY, WAIT_WRITTEN_SCOPE_KEY
from ..metrics import ACCEPT_ERRORS, CONNECTION_CAP_REACHED, CONNECTION_TIMEOUTS, CONNECTIONS_EVICTED, CONNECTIONS_OPEN
from ..shm.arena import ARENA_READ_HOLD_S

__all__ = ["ConnectionLimits", "GatewayHttpProtocol", "Listener", "RateLimitedLog", "effective_max_connections",
           "DRAIN_IDLE_S", "EVICT_MIN_IDLE_S", "ACCEPT_ERROR_PAUSE_S", "FD_RESERVE"]

log = logging.getLogger("shardserver.frontend")

# During a drain, an idle connection is closed after this many seconds without a new request
# (a client that was about to send gets its answer, with Connection: close, instead of a reset).
DRAIN_IDLE_S = 0.5
# At the cap, only connections waiting on their client at least this long are closed to make room
# (one idle for less is likely to carry a request right now; a request takes milliseconds to send).
EVICT_MIN_IDLE_S = 1.0
# A request body still arriving moves its connection's waiting clock (EVICT_MIN_IDLE_S) on by
# each this many bytes received: a slow upload that keeps sending is not closed at the cap, a
# slowloris (a few bytes now and then, or a head trickled in) is.
EVICT_PROGRESS_BYTES = 4096
_EVICTED_BODY = b"request not complete within 1 s while the front-end is at server.max_connections; retry\n"
# accept() failed for lack of file descriptors or memory: stop accepting this long.
ACCEPT_ERROR_PAUSE_S = 0.5
# File descriptors kept free for everything but client connections (control sockets, arenas,
# metrics files, the logging pipe, imports).
FD_RESERVE = 64
# The fewest connections a key's share of a front-end's connections allows (auth.key_share).
MIN_CONNECTIONS_PER_KEY = 8
# Connections taken from the backlog per readiness event (the others wait for the next one).
ACCEPT_BATCH = 64
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TIMEOUT_BODY = {
    "headers": b"request headers not received within server.header_timeout_s\n",
    "body": b"request body not received within server.body_timeout_s\n",
}


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits of one front-end, in seconds, from ``[server]``.

    Attributes:
        header_timeout_s: a request's headers must be complete this long after the connection
            was made or the request's first byte arrived.
        body_timeout_s: a request's body must be complete this long after its headers.
        front_end: this front-end's index (for log lines).
        max_header_bytes: bytes a request's line and headers may take (``server.max_header_bytes``).
        linger_bytes: after an answer given before its request's body was complete (a 413),
            the most body bytes read and discarded before the connection is closed (the
            front-ends use twice ``server.max_request_bytes``: a request a little over the
            bound still ends, and its connection serves the next one); 0: no bound.
        private_arena_copy: copy each piece of a result out of the arena *before* checking its
            slot, and send the copy (a seqlock read, :meth:`GatewayHttpProtocol.write_arena`);
            the front-ends set it under ``auth.mode = "keys"``, where a byte of another result
            would be another tenant's. Costs one copy of the result (8 µs per 256 KB from a warm cache).
    """

    header_timeout_s: float
    body_timeout_s: float
    front_end: int = 0
    max_header_bytes: int = 64 * 1024
    linger_bytes: int = 0
    private_arena_copy: bool = False


def effective_max_connections(configured: int) -> tuple[int, int]:
    """``(cap, soft RLIMIT_NOFILE)``: ``configured`` lowered to the soft file-descriptor limit
    minus :data:`FD_RESERVE` (at least 16)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured, -1
    return max(16, min(configured, soft - FD_RESERVE)), soft


class _ArenaSafeTransport:
    """The transport as a request's response cycle sees it (uvicorn's ``RequestResponseCycle``
    writes its response through ``cycle.transport``): writes of arena views (memoryviews over an
    ``mmap``: a result's slot, :class:`shardserver.api.sampling.ResultResponse`) go through
    :meth:`GatewayHttpProtocol.write_arena`; everything else is the real transport's."""

    __slots__ = ("_t", "_proto")

    def __init__(self, transport: asyncio.Transport, proto: "GatewayHttpProtocol") -> None:
        self._t = transport
        # weak: the protocol holds this object, and a reference cycle would keep every closed
        # connection for the cyclic GC (tests/e2e/test_frontend_slow_clients.py, 2000 resets)
        self._proto = weakref.ref(proto)

    def write(self, data: Any) -> None:
        proto = self._proto() if type(data) is memoryview and type(data.obj) is mmap.mmap else None
        if proto is not None:
            proto.write_arena(data)
        else:
            self._t.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header/body timeouts, idle tracking and a clean drain.

    Args:
        config, server_state, app_state, _loop: as for ``HttpToolsProtocol``.
        limits: the timeouts.
        listener: told when the connection closes and when it becomes idle or busy (the cap).
    """

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
                 listener: "Listener | None" = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._listener = listener
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0      # loop time at which _timer fires
        self._deadline = 0.0        # loop time at which the current phase times out
        self._phase = ""            # "headers" or "body" while a timer runs
        self._started = False       # a byte of the current request arrived
        self._draining = False
        self.idle_since = 0.0       # monotonic time it began waiting on its client (0: a request is served)
        self._lost: Exception | None | bool = False  # False while connected; else connection_lost's exc
        self._write_event: asyncio.Event | None = None  # set on resume_writing and connection_lost
        self._in_head = True        # the next bytes belong to a request line or headers
        self._head_bytes = 0        # bytes of them received so far
        self._tail = b""            # the last 3 bytes of the head so far (a blank line may straddle reads)
        self._linger_left: int | None = None  # body bytes still read after an early answer (None: not lingering)
        self._peer_eof = False      # the client half-closed after whole requests: close once they are answered
        self._fd = -1               # the socket's descriptor for arena writes (-1: TLS or unknown: copy)
        self._arena_transport: _ArenaSafeTransport | None = None
        #: (reader, offset, generation) of the arena slot the response in progress is sent from;
        #: each arena write checks it first (see write_arena)
        self.arena_guard: tuple[Any, int, int] | None = None
        self.arena_cut = False      # an arena write found the slot freed: the response must be cut
        self.owner: str | None = None  # the API key's owner tag its first authenticated request had
        self.answered = 0           # responses completed on this connection
        self.doomed = False         # refused for its key's share; its answer is delayed (evictable at once)
        self._progress = 0          # bytes of the request in progress since its waiting clock last moved

    # -- timers ---------------------------------------------------------------------------------
    def _arm(self, phase: str, seconds: float) -> None:
        """Time ``phase`` out in ``seconds``. One timer per connection is reused: a timer that
        fires before the new deadline stays and re-arms itself for the rest (no timer created
        and cancelled per request on a busy keep-alive connection)."""
        self._phase = phase
        when = self.loop.time() + seconds
        self._deadline = when
        if self._timer is not None:
            if self._timer_when <= when:
                return
            self._timer.cancel()
        self._timer_when = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _disarm(self, cancel: bool = False) -> None:
        """No phase is timed any more; the timer itself is only cancelled with ``cancel``
        (otherwise it fires with nothing to do, or is re-used by the next :meth:`_arm`)."""
        self._phase = ""
        if cancel and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if not self._phase:
            return
        if self.loop.time() < self._deadline:  # armed again since this timer was set
            self._timer_when = self._deadline
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
            return
        self._on_timeout()

    def _on_timeout(self) -> None:
        phase, self._timer, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        if phase == "drain" and self.unread_bytes():
            # A request arrived while the event loop was busy past DRAIN_IDLE_S: the loop runs due
            # timers before it reads, so it is still in the socket. Closing now would reset it
            # (a close with unread data sends RST); read and answer it (Connection: close) instead.
            self._arm("drain", DRAIN_IDLE_S)
            return
        if phase in ("drain", "linger"):
            self.transport.close()  # idle through the drain's grace, or the linger is over
            return
        CONNECTION_TIMEOUTS.labels(phase=phase).inc()
        if self._listener is not None:
            self._listener.timeout_log.hit(
                "front-end %d: closed a connection whose request %s did not arrive within server.%s_timeout_s=%g "
                "(slow or stalled client)", self._limits.front_end, phase, "header" if phase == "headers" else "body",
                self._limits.header_timeout_s if phase == "headers" else self._limits.body_timeout_s)
        cycle = self.cycle
        answer = self._started and (cycle is None or cycle.response_complete or not cycle.response_started)
        if cycle is not None and not cycle.response_complete:
            cycle.scope[TIMED_OUT_SCOPE_KEY] = phase  # type: ignore[literal-required]  # read_json answers 408
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its send() is a no-op
            cycle.message_event.set()
        if answer:
            body = _TIMEOUT_BODY[phase]
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout (``server.keep_alive_s`` idle after a response): close,
        unless the client's next request is already in the socket, unread because the event
        loop ran this timer before its reads (closing then would reset that request)."""
        if self.transport.is_closing():
            return
        if self.unread_bytes():
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return
        self.transport.close()

    def unread_bytes(self) -> int:
        """Bytes the client sent that are still in the kernel's receive queue, not yet read by the
        event loop (``FIONREAD``); 0 when none, or when the socket cannot be asked."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return 0
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
        except (OSError, ValueError):
            return 0
        return buf[0]

    # -- connection -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            try:
                self._fd = sock.fileno()
            except (OSError, ValueError):
                self._fd = -1
        self._arena_transport = _ArenaSafeTransport(transport, self)
        CONNECTIONS_OPEN.inc()
        self._arm("headers", self._limits.header_timeout_s)  # a new connection must send a request
        self._wait_on_client()  # evictable at the cap until its first request is complete
        if self._listener is not None and self._listener.draining:
            self.begin_drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc if exc is not None else True
        if self._write_event is not None:
            self._write_event.set()
        self._disarm(cancel=True)
        if self.idle_since and self._listener is not None:
            self._listener.not_idle(self)
        self.idle_since = 0.0
        super().connection_lost(exc)
        # uvicorn cancels its keep-alive timer only for a connection closed cleanly (exc None):
        # one reset by its client (SO_LINGER 0, as HAProxy's health checks close) stayed
        # referenced by the timer, ~11.5 KB each, for server.keep_alive_s.
        self._unset_keepalive_if_required()
        # The protocol and its last request's scope reference each other (the scope carries
        # CONNECTION_SCOPE_KEY and the bound WAIT_WRITTEN_SCOPE_KEY): with these links kept, a
        # closed connection's objects (~9 KB) waited for the cyclic GC, which a front-end runs
        # rarely (GC_THRESHOLD), and churning clients piled them up (tests/e2e/
        # test_frontend_slow_clients.py). A request still running keeps its own cycle and scope.
        self.cycle = None  # type: ignore[assignment]
        self.scope = None  # type: ignore[assignment]
        CONNECTIONS_OPEN.dec()
        if self._listener is not None:
            self._listener.released(self)
            if self.owner is not None:
                self._listener.unclaim(self.owner)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client shut down its sending side (``shutdown(SHUT_WR)``, a half-close). Requests
        it sent whole are still answered (pipelined ones too), then the connection is closed;
        uvicorn closed it at once, so such a client got no answer. With nothing to answer, or a
        request cut off before its end (it can never complete), the connection closes now.

        Returns True to keep the transport open for writing (asyncio's ``Protocol`` contract).
        """
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete and not cycle.more_body
        if (answering or self.pipeline) and self._in_head and not self._head_bytes:
            self._peer_eof = True
            self._disarm()  # (no timer judges a request that is complete)
            return True
        return None

    def data_received(self, data: bytes) -> None:
        if self.idle_since and self._started and not self._in_head:
            # A body that keeps arriving is not a stalled request. (A head does not count: it is
            # at most server.max_header_bytes, and one trickled 4 KiB at a time would otherwise
            # hold its slot for server.header_timeout_s.)
            self._progress += len(data)
            if self._progress >= EVICT_PROGRESS_BYTES:
                self._wait_on_client()
        if self._phase == "drain":
            self._disarm()
        if self._linger_left is not None:
            # The answer went out before the request's body was complete (413): what follows is
            # read and thrown away, so that the client still reads the answer, but only so much
            # (a 100 GiB upload was drained whole, ~44 s of CPU on 2 cores).
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self._linger_left = None
                self._disarm()
                self.transport.close()
                return
        if self._in_head:
            # Count a request's head before the parser sees it: up to the blank line that ends it
            # (which may straddle two reads), else the whole read. A request pipelined behind
            # another in the same read is counted from its next read on (at most one read more).
            tail = self._tail
            end = (tail + data[:3]).find(b"\r\n\r\n") if tail else -1  # the blank line straddles
            if end >= 0:
                end += 4 - len(tail)
            else:
                end = data.find(b"\r\n\r\n")  # no copy of the read (it may carry a large body)
                if end >= 0:
                    end += 4
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self._limits.max_header_bytes:
                if not self.transport.is_closing():
                    self._reject_headers()
                return
            self._tail = (tail + data[-3:])[-3:] if end < 0 else b""
        super().data_received(data)

    def _reject_headers(self) -> None:
        """431 with ``Connection: close``, then close: the headers passed ``server.max_header_bytes``."""
        self._disarm(cancel=True)
        if self._listener is not None:
            self._listener.timeout_log.hit(
                "front-end %d: closed a connection whose request headers exceeded server.max_header_bytes=%d",
                self._limits.front_end, self._limits.max_header_bytes)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        body = b"request headers exceed server.max_header_bytes=%d bytes\n" % self._limits.max_header_bytes
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                             b"charset=utf-8\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._started = True
        if self.idle_since:
            self._wait_on_client()  # a request starts: its client gets EVICT_MIN_IDLE_S to complete it
        if self._phase != "headers" or self.cycle is not None:
            # A new request on a kept-alive connection; a fresh connection's timer runs since its start.
            self._arm("headers", self._limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = False, 0, b""
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None:
            scope = self.cycle.scope
            scope[WAIT_WRITTEN_SCOPE_KEY] = self.wait_written  # type: ignore[literal-required]
            scope[CONNECTION_SCOPE_KEY] = self  # type: ignore[literal-required]
            # The cycle writes through a transport that writes arena views safely (write_arena).
            self.cycle.transport = self._arena_transport  # type: ignore[assignment]
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # answered with Connection: close, then closed
        if self.parser is not None and self.cycle is not None and self.cycle.more_body:
            self._arm("body", self._limits.body_timeout_s)

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        if self._phase in ("body", "linger"):
            self._disarm()
        self._linger_left = None
        self._started = False
        cycle = self.cycle
        if self.idle_since and (cycle is None or not cycle.response_complete):
            # (an answer given before the body was complete: the connection waits for the next request)
            self.idle_since = 0.0
            if self._listener is not None:
                self._listener.not_idle(self)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self.answered += 1
        cycle = self.cycle
        early = cycle is not None and cycle.more_body  # answered before the request's body was complete
        queued = bool(self.pipeline)  # (super() starts the next pipelined request, if any)
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._peer_eof and not queued:
            self._unset_keepalive_if_required()
            self.transport.close()  # every request the half-closed client sent is answered
            return
        if early and self._limits.linger_bytes:
            # Read the rest for at most body_timeout_s and linger_bytes, then close (unless it
            # ends: then the connection serves the next request, as any other).
            self._linger_left = self._limits.linger_bytes
            self._arm("linger", self._limits.body_timeout_s)
            self._wait_on_client()
            return
        if self.pipeline:
            return
        if self._draining:
            self._arm("drain", DRAIN_IDLE_S)
        self._wait_on_client()

    def _wait_on_client(self) -> None:
        """The connection now waits on its client (fresh, between requests, receiving a request
        that is not complete yet, or reading the rest of a body already answered): from now on,
        once :data:`EVICT_MIN_IDLE_S` has passed, the listener may close it to make room at the
        cap (:meth:`Listener._evictable`). A request that is complete is served, not evictable."""
        self.idle_since = time.monotonic()
        self._progress = 0
        listener = self._listener
        if listener is not None:
            listener.idle(self)
            if self.doomed or (listener.keys_mode and self.owner is None and self.answered):
                listener.recheck_soon()  # evictable at once: a client waiting in the backlog may take its place

    # -- delivery -------------------------------------------------------------------------------
    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_event is not None:
            self._write_event.set()

    async def wait_written(self, timeout: float) -> bool:
        """Wait until every byte written so far has left this process for the kernel.

        Returns True when the transport's write buffer is empty while the connection is open
        (or was closed by us, cleanly, after the buffer was sent: a ``Connection: close``
        answer); False when the connection broke first (the client reset or closed it: the
        bytes still buffered never left) or ``timeout`` seconds passed.
        The ASGI app finds it as ``scope[WAIT_WRITTEN_SCOPE_KEY]``.
        """
        deadline = self.loop.time() + timeout
        while True:
            if self._lost is not False:
                return self._lost is True  # closed cleanly: uvloop/asyncio flush before closing
            if self.transport.get_write_buffer_size() == 0:
                return True
            left = deadline - self.loop.time()
            if left <= 0:
                return False
            if self._write_event is None:
                self._write_event = asyncio.Event()
            self._write_event.clear()
            try:  # woken by resume_writing / connection_lost; re-checked at least every 50 ms
                await asyncio.wait_for(self._write_event.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass

    def claim(self, owner: str) -> bool:
        """The connection's first authenticated request names its owner (``auth.mode = keys``):
        count it against that key's share of this front-end's connections
        (:meth:`Listener.claim`). False when the key holds its share already: the caller answers
        429 and closes. A connection keeps its first owner."""
        if self.owner is not None:
            return True
        if self._listener is not None and not self._listener.claim(owner, self):
            return False
        self.owner = owner
        return True

    def doom(self) -> None:
        """Its request was refused for its key's connection share and is answered after a delay
        (:data:`~shardserver.api.auth.TOO_MANY_POLL_WAIT_S`): meanwhile the listener may close it
        at once to make room at the cap (:meth:`Listener._evictable`), so a key cannot hold slots
        with refused requests; the client then sees a closed connection and retries."""
        self.doomed = True
        self._wait_on_client()

    def bytes_not_taken(self) -> int:
        """Bytes written to this connection that the client has not taken yet: the transport's
        buffer plus the kernel's send queue (``TIOCOUTQ``: not yet acknowledged). It goes down as
        the client reads, however slowly (the transport's buffer alone moves only when the
        kernel's queue has drained by a third)."""
        n = self.transport.get_write_buffer_size()
        if self._fd >= 0:
            buf = array.array("i", [0])
            try:
                fcntl.ioctl(self._fd, termios.TIOCOUTQ, buf, True)
                n += buf[0]
            except (OSError, ValueError):
                pass
        return n

    def write_arena(self, data: memoryview) -> None:
        """Write bytes viewed in an arena (a result's slot) so that nothing refers to them once
        this returns: the encoder may free and reuse the slot at any moment after.

        First the slot is checked (:attr:`arena_guard`): freed already, nothing is written and
        :attr:`arena_cut` is set (the caller cuts the response). Otherwise, when nothing waits in
        the transport's buffer, the kernel takes what fits in the socket straight from the arena
        (``os.write``, no copy), and only the rest is copied into the transport's buffer. The
        check and the copies happen in this one call, microseconds apart, and the encoder holds a
        freed slot's bytes unchanged for :data:`~shardserver.shm.arena.ARENA_READ_HOLD_S`
        (``ArenaWriter.free``), so every byte that leaves is the result's. (uvloop, given the
        view itself, keeps a reference to what the socket did not take and reads it whenever the
        client reads on: another result's bytes, once the slot was reused, and another tenant's
        under ``auth.mode = keys``.) Should the call ever take half that hold and find the slot
        freed at the end, :attr:`arena_cut` is set too: the response is cut, never complete.

        With :attr:`ConnectionLimits.private_arena_copy` (keys mode) the bytes are copied out
        first and the slot checked after the copy, and only the copy is sent: a slot the encoder
        has not freed by the end of the copy was not rewritten during it (it writes a slot again
        only after freeing it), so no byte of another tenant's result can leave, even from a
        front-end stopped for longer than the hold between its check and its send.
        """
        guard = self.arena_guard
        private = guard is not None and self._limits.private_arena_copy
        if guard is not None:
            reader, offset, generation = guard
            t0 = time.monotonic()
            if private:
                data = memoryview(bytes(data))  # the copy, then the check (seqlock order)
            if not reader.valid(offset, generation):
                self.arena_cut = True
                return
        t = self.transport
        sent = 0
        if self._fd >= 0 and t.get_write_buffer_size() == 0 and not t.is_closing():
            try:
                sent = os.write(self._fd, data)
            except OSError:  # EAGAIN: the socket is full; a broken one: the transport's write finds out
                sent = 0
        if sent < len(data):
            t.write(data[sent:] if private else bytes(data[sent:]))
        if guard is not None and not private and time.monotonic() - t0 > ARENA_READ_HOLD_S / 2 \
                and not reader.valid(offset, generation):
            self.arena_cut = True

    def closed(self) -> bool:
        """Whether the connection is lost or closing (the client left, or we closed it)."""
        return self._lost is not False or self.transport.is_closing()

    async def wait_flushed(self, timeout: float) -> bool | None:
        """Wait until the transport's write buffer is empty: every byte written so far was
        taken by the kernel (copied into the socket), so the objects they came from are no
        longer read. Returns True then (connection open), False when the connection is lost or
        closing, None when ``timeout`` seconds passed first.

        While waiting, the buffer's low- and high-water marks are 0, so ``resume_writing`` comes
        exactly when the buffer empties (no polling); they are restored afterwards.
        """
        t = self.transport
        if self.closed():
            return False
        if t.get_write_buffer_size() == 0:
            return True
        if self._write_event is None:
            self._write_event = asyncio.Event()
        ev = self._write_event
        low, high = t.get_write_buffer_limits()
        ev.clear()
        t.set_write_buffer_limits(high=0, low=0)  # paused while anything is buffered; resumed at empty
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if not t.is_closing():
                t.set_write_buffer_limits(high=high, low=low)
        if self.closed():
            return False
        return True if t.get_write_buffer_size() == 0 else None

    def abort_response(self) -> None:
        """Cut the response in progress: reset the connection (``SO_LINGER`` 0, so bytes still in
        the kernel's send queue are discarded too) without finishing it. The client sees fewer
        bytes than ``Content-Length`` announced (or a reset), never a complete response."""
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True  # uvicorn: no "returned without completing response" error
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()

    # -- shutdown -------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Shutdown began: a request in progress is answered with ``Connection: close``; an idle
        connection is closed after :data:`DRAIN_IDLE_S` unless a request arrives (answered, then
        closed)."""
        if self._draining or self.transport is None or self.transport.is_closing():
            return
        self._draining = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        elif not self._started and self._phase != "body":
            self._arm("drain", DRAIN_IDLE_S)

    def shutdown(self) -> None:
        """uvicorn's graceful-shutdown hook: see :meth:`begin_drain` (uvicorn itself closes idle
        connections at once, resetting requests that cross the close)."""
        self.begin_drain()

    def evict(self) -> None:
        """Close this connection, which waits on its client, to make room under the cap. A request
        that started and is not answered yet is answered ``503`` (``Retry-After: 1``,
        ``Connection: close``; the SDK retries it) first; a connection between requests is just
        closed."""
        self._disarm(cancel=True)
        CONNECTIONS_EVICTED.inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its send() is a no-op
            cycle.message_event.set()
        if self._started and (cycle is None or not cycle.response_started) and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(_EVICTED_BODY), _EVICTED_BODY))
        self.transport.close()


ProtocolFactory = Callable[[], GatewayHttpProtocol]


class Listener:
    """Accepts connections from a listening socket shared with other processes, up to a cap.

    Stands in for the ``asyncio.Server`` uvicorn would create (``close()`` and
    ``wait_closed()`` are what uvicorn's shutdown calls).

    Args:
        sock: the listening socket (this process's copy).
        max_connections: open connections at which accepting stops (see
            :func:`effective_max_connections`).
        front_end: this front-end's index, for log lines.
        key_share: ``auth.key_share`` in keys mode (the share of the connections one key may
            hold); 0: no per-key bound.
        keys_mode: ``auth.mode = "keys"``.
    """

    def __init__(self, sock: socket.socket, max_connections: int, front_end: int = 0,
                 key_share: float = 0.0, keys_mode: bool = False) -> None:
        self.sock = sock
        # auth.mode = "keys": at the cap, connections that never authenticated make room first
        # (_evictable)
        self.keys_mode = keys_mode
        self.max_connections = max_connections
        self.front_end = front_end
        # auth.key_share (keys mode; 0: no per-key bound): the connections one key may hold here.
        self.per_owner = max(MIN_CONNECTIONS_PER_KEY, int(key_share * max_connections)) if 0 < key_share < 1 else 0
        self.owned: dict[str, int] = {}  # owner -> open connections it claimed
        self.loop = asyncio.get_running_loop()
        self.factory: ProtocolFactory | None = None
        self.open = 0               # accepted and not yet lost
        self.draining = False
        self._reading = False
        self._resume: asyncio.TimerHandle | None = None
        self._error_pause = False   # accept() ran out of file descriptors: wait for _resume
        self._capped = False        # paused at the cap since the last time a connection closed below it
        self._idle: OrderedDict[GatewayHttpProtocol, None] = OrderedDict()  # oldest idle first
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = asyncio.Event()
        self.cap_log = RateLimitedLog(log, logging.WARNING)
        self.error_log = RateLimitedLog(log, logging.ERROR)
        self.timeout_log = RateLimitedLog(log, logging.WARNING)

    def start(self, factory: ProtocolFactory) -> None:
        self.factory = factory
        self.sock.setblocking(False)
        self._start_reading()

    # -- accepting ------------------------------------------------------------------------------
    def _start_reading(self) -> None:
        if not self._reading and not self.draining and self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False

    def _on_readable(self) -> None:
        for _ in range(ACCEPT_BATCH):
            victim = None
            if self.open >= self.max_connections:
                victim = self._evictable()
                if victim is None:
                    return
            conn = self._accept_one()
            if conn is None:
                return
            if victim is not None:  # only now: a client is really waiting for the room
                self._evict(victim)
            self._attach(conn)

    def _accept_one(self) -> socket.socket | None:
        """One connection from the backlog; None when it is empty or accepting must pause."""
        while True:
            try:
                conn, _addr = self.sock.accept()
                return conn
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                reason = errno.errorcode.get(exc.errno or 0, "other")
                ACCEPT_ERRORS.labels(reason=reason).inc()
                if exc.errno not in _FD_ERRNOS:
                    continue  # ECONNABORTED and the like: that client is gone, take the next
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                self.error_log.hit("front-end %d: cannot accept connections: %s (%d open, RLIMIT_NOFILE soft limit "
                                   "%d): pausing accepts for %.1f s", self.front_end, exc.strerror or exc, self.open,
                                   soft, ACCEPT_ERROR_PAUSE_S)
                self._stop_reading()
                self._error_pause = True
                self._schedule_resume(ACCEPT_ERROR_PAUSE_S)
                return None

    def _attach(self, conn: socket.socket) -> None:
        assert self.factory is not None
        self.open += 1
        conn.setblocking(False)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        t = self.loop.create_task(self._connect(conn))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        assert self.factory is not None
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)  # type: ignore[arg-type]
        except (OSError, RuntimeError) as exc:  # the client left at once; no protocol was made
            log.debug("front-end %d: dropping a connection that failed at start: %s", self.front_end, exc)
            conn.close()
            self.open -= 1

    def _evictable(self) -> GatewayHttpProtocol | None:
        """At the cap: the connection that has waited longest on its client, if that is at least
        :data:`EVICT_MIN_IDLE_S`; else None, and accepting stops until a connection closes (or the
        longest-waiting one has waited long enough).

        Waiting on its client (:meth:`GatewayHttpProtocol._wait_on_client`): a keep-alive
        connection between requests, a new one that has not sent a complete request, one whose
        request started (first byte) but is not complete, one reading the rest of a body that
        was answered already (a 401 or 413). So connections that never complete a request (silent
        ones, slowloris, unauthenticated requests with a large ``Content-Length``), which hold no
        key and count against no key's share, cannot hold every slot for
        ``server.header_timeout_s`` or ``server.body_timeout_s`` each: at the cap they make room
        for new clients. A request that is complete is being served and is never closed here; one
        whose next request already waits unread in its socket is passed over (closing it would
        reset that request)."""
        now = time.monotonic()
        recheck = EVICT_MIN_IDLE_S
        for proto in self._idle:  # oldest wait first
            idle_s = now - proto.idle_since
            if idle_s >= EVICT_MIN_IDLE_S:
                if proto.unread_bytes():
                    continue  # its next request is already here, unread (the loop was busy): not idle
                return proto
            # Every connection from here on has waited less. In keys mode, one that never
            # authenticated and sits between requests (it was answered, e.g. GET /healthz: a
            # public path) goes at once: otherwise such connections, each re-sending a cheap
            # request more often than every EVICT_MIN_IDLE_S, would hold every slot against
            # every key (they count against no key's share).
            recheck = min(recheck, EVICT_MIN_IDLE_S - idle_s)
            if proto.doomed or (self.keys_mode and proto.owner is None and proto.answered and not proto._started
                                and not proto.unread_bytes()):
                return proto
        # None has waited long enough, or each that has has its next request unread, or they
        # were accepted and not made yet (connect_accepted_socket runs in a task): look again,
        # or a peer that never completes a request would hold these slots until its timeouts.
        self._pause_at_cap(recheck)
        return None

    def _evict(self, proto: GatewayHttpProtocol) -> None:
        self._idle.pop(proto, None)
        proto._listener = None  # its connection_lost no longer reports here: the slot is free now
        proto.idle_since = 0.0
        self.open -= 1
        if proto.owner is not None:
            # (connection_lost no longer reports here: without this a key's count only grew with
            # every eviction of its connections, until the key was refused for good)
            self.unclaim(proto.owner)
        proto.evict()

    def _pause_at_cap(self, recheck_s: float) -> None:
        """Stop accepting at the cap; look for room again in ``recheck_s`` seconds (or as soon as
        a connection closes). Counted and logged once per stretch at the cap."""
        if not self._capped:
            self._capped = True
            CONNECTION_CAP_REACHED.inc()
            self.cap_log.hit("front-end %d: %d open connections = server.max_connections: not accepting new ones "
                             "until one closes or waits on its client for %g s (they wait in the listen backlog)",
                             self.front_end, self.open, EVICT_MIN_IDLE_S)
        self._stop_reading()
        self._schedule_resume(recheck_s)

    def recheck_soon(self) -> None:
        """A connection became evictable at once: when paused at the cap, look for room at the
        next turn of the event loop instead of at the scheduled re-check (else nothing)."""
        if self._capped and not self._reading and not self._error_pause and not self.draining:
            if self._resume is not None:
                self._resume.cancel()
            self._resume = self.loop.call_soon(self._resume_now)  # type: ignore[assignment]

    def _schedule_resume(self, delay: float) -> None:
        if self._resume is None:
            self._resume = self.loop.call_later(delay, self._resume_now)

    def _resume_now(self) -> None:
        self._resume = None
        self._error_pause = False
        self._start_reading()
        if self._reading:
            self._on_readable()  # level-triggered anyway; take what waits now

    # -- bookkeeping from the protocols ---------------------------------------------------------
    def idle(self, proto: GatewayHttpProtocol) -> None:
        self._idle[proto] = None
        self._idle.move_to_end(proto)

    def not_idle(self, proto: GatewayHttpProtocol) -> None:
        self._idle.pop(proto, None)

    def claim(self, owner: str, proto: GatewayHttpProtocol | None = None) -> bool:
        """Count one more connection of ``owner`` (``proto``'s first authenticated request);
        False (nothing counted) when it may not have one more. In keys mode no key can then hold
        every connection slot and lock the other keys out (each key's share of
        ``server.max_connections``, :attr:`per_owner`).

        A key at its share still gets the connection when one of its own connections sits idle
        between requests: that one is closed instead (an SDK keeps up to 20 idle pooled
        connections, which alone would use up its share and refuse its poller's new connection).
        """
        n = self.owned.get(owner, 0)
        if self.per_owner and n >= self.per_owner:
            idle = next((p for p in self._idle if p.owner == owner and p is not proto and not p._started
                         and p.answered and not p.unread_bytes()), None)
            if idle is None:
                self.cap_log.hit("front-end %d: an API key holds its share of the connections (%d of "
                                 "server.max_connections = %d, auth.key_share), each busy: answering 429 and "
                                 "closing", self.front_end, self.per_owner, self.max_connections)
                return False
            self._evict(idle)  # (its count goes with it)
            n = self.owned.get(owner, 0)
        self.owned[owner] = n + 1
        return True

    def unclaim(self, owner: str) -> None:
        n = self.owned.get(owner, 0) - 1
        if n > 0:
            self.owned[owner] = n
        else:
            self.owned.pop(owner, None)

    def released(self, proto: GatewayHttpProtocol) -> None:
        self._idle.pop(proto, None)
        self.open -= 1
        if self.open < self.max_connections:
            self._capped = False
        if self.open < self.max_connections and not self._error_pause and not self._reading:
            if self._resume is not None:  # a re-check at the cap is due: a slot is free now
                self._resume.cancel()
                self._resume = None
            self._start_reading()

    # -- shutdown -------------------------------------------------------------------------------
    def drain(self) -> int:
        """Stop accepting, take every connection already waiting in the backlog (bounded; they are
        answered, not reset) and close this process's copy of the listening socket. Idempotent.
        Returns how many connections were taken from the backlog."""
        self.draining = True
        self._stop_reading()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        taken = 0
        if self.sock.fileno() >= 0:
            for _ in range(4 * ACCEPT_BATCH):
                try:
                    conn, _addr = self.sock.accept()
                except OSError:
                    break
                self._attach(conn)  # its protocol starts draining in connection_made
                taken += 1
            self.sock.close()
        self._closed.set()
        return taken

    def close(self) -> None:
        """uvicorn's ``server.close()``: :meth:`drain` (a no-op when it already ran)."""
        self.drain()

    async def wait_closed(self) -> None:
        await self._closed.wait()
