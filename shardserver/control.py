"""The control channel between front-ends and encoders: small typed frames over Unix sockets.

Each front-end keeps one connection to each encoder
(``<run_dir>/enc-<shard>.sock``). A frame is::

    u32 length (of everything after it) | u8 kind | u32 tag | payload

* ``kind`` is a :class:`~shardserver.messages.Kind`; ``tag`` pairs a reply with
  its request (0 for one-way messages).
* The payload is ``u32 meta_length | meta | blob``. ``meta`` is one message of
  :mod:`shardserver.messages`, MessagePack-encoded; each request kind and each
  reply union has its own decoder. Only SUBMIT carries a blob: the engine
  request body, built once by the front-end and posted by the encoder as-is.
* Replies never carry result bytes: a completed result is answered with where
  it lies in the shard's arena (name, offset, length, generation) and the
  front-end copies it out of shared memory itself.
* Errors cross as typed replies (a refusal with its reason, a failed future
  with its message and category); exceptions are never pickled. A request
  the encoder cannot handle (unknown kind, undecodable meta, a bug in its
  handler) is answered with an ``ERROR`` frame holding an
  :class:`~shardserver.messages.ErrorReply`. When a connection breaks, every
  request waiting on it fails at once with :class:`EncoderDeadError` and the
  client reconnects in the background.

Messages (structs of :mod:`shardserver.messages`):

========== ============================================ =====================================================
kind       request (meta; blob)                          reply
========== ============================================ =====================================================
SUBMIT     ``SubmitRequest``; blob: engine request body  ``SubmitAccepted`` or ``SubmitRefused`` (with a
                                                         ``RefusalReason``)
POLL       ``PollRequest`` (fid, timeout s, want)        ``PollDone`` (arena, offset, length, generation,
                                                         form), ``PollPending``, ``PollFailed``, ``PollGone``
DELIVERED  ``Delivered`` (fid)                           (none)
SESSION_FINISHED ``SessionFinished`` (session, owner)     (none)
STATS      ``StatsRequest``                              ``StatsReply``
SESSION_   ``SessionPollRequest`` (sid, clone, after,    ``SessionPollReply`` (events: ``CompletionEvent``
POLL       upto, limit, acks, timeout s)                 fid/stamp/ok/size, more, woke)
CANCEL     ``CancelRequest`` (fid)                       ``CancelReply`` (was: the state it was in)
(any)                                                    ``ErrorReply`` in an ERROR frame
========== ============================================ =====================================================
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Awaitable, Callable, NamedTuple

import msgspec

from .aio import cancel_and_wait
from .errors import ControlError, EncoderDeadError
from .messages import (
    CancelReply,
    CancelRequest,
    ControlProtocolError,
    Delivered,
    SessionFinished,
    ErrorReply,
    Kind,
    PollFailed,
    PollReply,
    PollRequest,
    RefusalReason,
    SessionPollReply,
    SessionPollRequest,
    StatsReply,
    StatsRequest,
    SubmitRefused,
    SubmitReply,
    SubmitRequest,
    decode_error,
    decode_reply,
    decode_request,
    encode_meta,
)

__all__ = ["Kind", "Frame", "encode_frame", "read_frame", "ControlClient", "serve_control"]

log = logging.getLogger("shardserver.control")

_HEAD = struct.Struct("<IBI")
_META = struct.Struct("<I")
MAX_FRAME = 1 << 30


class Frame(NamedTuple):
    """One frame as read; ``meta`` is still encoded (MessagePack bytes)."""

    kind: int
    tag: int
    meta: bytes
    blob: bytes


def encode_frame(kind: int, tag: int, msg: msgspec.Struct, blob: bytes = b"") -> bytes:
    """One frame as bytes (see the module docstring); ``msg`` is a :mod:`shardserver.messages` struct."""
    m = encode_meta(msg)
    body_len = 1 + 4 + 4 + len(m) + len(blob)
    return b"".join((_HEAD.pack(body_len, kind, tag), _META.pack(len(m)), m, blob))


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """Read one frame; decode its meta with :func:`shardserver.messages.decode_request` or
    :func:`~shardserver.messages.decode_reply`.

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection.
        ControlProtocolError (a ValueError): the frame's length fields are out of range.
    """
    head = await reader.readexactly(_HEAD.size)
    length, kind, tag = _HEAD.unpack(head)
    if length < 9 or length > MAX_FRAME:
        raise ControlProtocolError(f"control frame length {length} out of range [9, {MAX_FRAME}]")
    rest = await reader.readexactly(length - 5)
    (mlen,) = _META.unpack_from(rest, 0)
    if mlen > len(rest) - 4:
        raise ControlProtocolError(f"control frame meta length {mlen} exceeds the frame ({len(rest) - 4} bytes left)")
    return Frame(kind, tag, rest[4:4 + mlen], rest[4 + mlen:])


def _time_out(fut: asyncio.Future[object]) -> None:
    """A request's timer: its reply did not come in time (``asyncio.TimeoutError``)."""
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class ControlClient:
    """A front-end's connection to one encoder, with request/reply matching and reconnects.

    The typed calls (:meth:`submit`, :meth:`poll`, :meth:`delivered`, :meth:`stats`) are what
    the HTTP handlers use; an :class:`~shardserver.messages.ErrorReply` from the encoder is
    folded into each call's own reply type.

    Args:
        path: the encoder's Unix socket.
        shard: shard index, for messages.
    """

    def __init__(self, path: str, shard: int) -> None:
        self.path = path
        self.shard = shard
        self._writer: asyncio.StreamWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Frames queued in this loop iteration, written together by _flush (None: nothing queued).
        self._out: list[bytes] | None = None
        # tag -> (reply future, the kind of the request it answers)
        self._pending: dict[int, tuple[asyncio.Future[object], Kind]] = {}
        self._polls: set[int] = set()
        self._next_tag = 1
        self._connected = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.connects = 0
        #: called after each connection to the encoder past the first (a restarted encoder)
        self.on_reconnect: Callable[[], None] | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(
            self._run(), name=f"control-client-{self.shard}")

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _run(self) -> None:
        delay = 0.05
        while not self._closing:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path)
            except OSError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            delay = 0.05
            self._writer = writer
            self.connects += 1
            self._connected.set()
            if self.connects > 1 and self.on_reconnect is not None:
                try:
                    self.on_reconnect()
                except Exception:  # a hook must not stop the connection
                    log.exception("control client %d: on_reconnect failed", self.shard)
            try:
                while True:
                    frame = await read_frame(reader)
                    waiting = self._pending.pop(frame.tag, None)
                    if waiting is None or waiting[0].done():
                        continue  # its caller gave up (timeout) or was answered already (drain)
                    self._answer(waiting[0], waiting[1], frame)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                pass
            finally:
                self._connected.clear()
                self._writer = None
                self._out = None  # frames for the lost connection: their requests fail below
                writer.close()
                self._fail_all(f"encoder {self.shard} connection lost")

    def _answer(self, fut: asyncio.Future[object], kind: Kind, frame: Frame) -> None:
        """Resolve one request's future with its decoded reply (a malformed reply fails only that
        request, with a :class:`~shardserver.messages.ControlProtocolError`)."""
        try:
            if frame.kind == Kind.REPLY:
                fut.set_result(decode_reply(kind, frame.meta))
            elif frame.kind == Kind.ERROR:
                fut.set_result(decode_error(frame.meta))
            else:
                raise ControlProtocolError(f"encoder {self.shard} answered {kind.name} with a frame of kind "
                                           f"{frame.kind}")
        except ControlProtocolError as exc:
            log.error("encoder %d: %s", self.shard, exc)
            fut.set_exception(exc)

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(EncoderDeadError(why))

    async def request(self, kind: Kind, msg: msgspec.Struct, blob: bytes = b"",
                      timeout: float | None = None) -> object:
        """Send a request and wait for its reply: one of ``REPLY_TYPES[kind]``
        (:mod:`shardserver.messages`), or an :class:`~shardserver.messages.ErrorReply`.

        Raises:
            EncoderDeadError: not connected, or the connection broke before the reply.
            asyncio.TimeoutError: no reply within ``timeout`` seconds.
            ControlProtocolError: the reply frame could not be decoded.
        """
        tag = self._next_tag
        self._next_tag = (tag % 0xFFFFFFF0) + 1
        if not self._write(encode_frame(kind, tag, msg, blob)):
            raise EncoderDeadError(f"encoder {self.shard} is not connected")
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        self._pending[tag] = (fut, kind)
        if kind == Kind.POLL:
            self._polls.add(tag)
        # A timer on the reply future itself (asyncio.wait_for would add a task-side wrapper).
        timer = None if timeout is None else loop.call_later(timeout, _time_out, fut)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(tag, None)
            self._polls.discard(tag)

    async def _checked(self, kind: Kind, msg: msgspec.Struct, timeout: float | None) -> object:
        """:meth:`request` for kinds whose encoder-side error is the caller's exception.

        Raises:
            ControlError: the encoder answered with an :class:`~shardserver.messages.ErrorReply`.
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        reply = await self.request(kind, msg, timeout=timeout)
        if isinstance(reply, ErrorReply):
            raise ControlError(f"encoder {self.shard} could not answer {kind.name}: {reply.message}")
        return reply

    async def submit(self, req: SubmitRequest, body: bytes, timeout: float | None = None) -> SubmitReply:
        """SUBMIT: register a sample request whose engine request body (JSON bytes) is ``body``.

        Returns :class:`~shardserver.messages.SubmitAccepted` or
        :class:`~shardserver.messages.SubmitRefused` (an encoder-side error becomes a refusal
        with reason ``INTERNAL``).

        Raises:
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        reply = await self.request(Kind.SUBMIT, req, body, timeout)
        if isinstance(reply, ErrorReply):
            return SubmitRefused(reason=RefusalReason.INTERNAL, message=reply.message)
        return reply  # type: ignore[return-value]

    async def poll(self, req: PollRequest, timeout: float | None = None) -> PollReply:
        """POLL: where a future's result is, held by the encoder up to ``req.timeout`` seconds.

        Returns :class:`~shardserver.messages.PollDone`, ``PollPending``, ``PollFailed`` or
        ``PollGone`` (an encoder-side error becomes a failure of category ``server``).

        Raises:
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        reply = await self.request(Kind.POLL, req, timeout=timeout)
        if isinstance(reply, ErrorReply):
            return PollFailed(error=reply.message, category="server")
        return reply  # type: ignore[return-value]

    def delivered(self, fid: str) -> bool:
        """DELIVERED (one-way): the result of ``fid`` reached a connected client. False if not connected."""
        return self.send(Kind.DELIVERED, Delivered(fid=fid))

    def session_finished(self, session: str, owner: str) -> bool:
        """SESSION_FINISHED (one-way): the client closed the session whose ID ends in ``session``
        (16 characters); its undelivered results count as abandoned. False if not connected."""
        return self.send(Kind.SESSION_FINISHED, SessionFinished(session=session, owner=owner))

    async def stats(self, timeout: float | None = None) -> StatsReply:
        """STATS: the shard's counters and gauges.

        Raises:
            ControlError: the encoder answered with an error.
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        return await self._checked(Kind.STATS, StatsRequest(), timeout)  # type: ignore[return-value]

    async def session_poll(self, req: SessionPollRequest, timeout: float | None = None) -> SessionPollReply:
        """SESSION_POLL: one session's completions in this shard (held up to ``req.timeout`` s).

        Raises:
            ControlError: the encoder answered with an error.
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        return await self._checked(Kind.SESSION_POLL, req, timeout)  # type: ignore[return-value]

    async def cancel(self, fid: str, timeout: float | None = None) -> CancelReply:
        """CANCEL: stop and forget future ``fid``; the reply says which state it was in.

        Raises:
            ControlError: the encoder answered with an error.
            EncoderDeadError, asyncio.TimeoutError, ControlProtocolError: as :meth:`request`.
        """
        return await self._checked(Kind.CANCEL, CancelRequest(fid=fid), timeout)  # type: ignore[return-value]

    def release_polls(self, reply: PollReply) -> int:
        """Answer every POLL still waiting on this connection with ``reply`` (used when draining).

        The encoder's own answer, if it comes later, is ignored. Returns how many were released.
        """
        n = 0
        for tag in list(self._polls):
            waiting = self._pending.get(tag)
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(reply)
                n += 1
        return n

    def send(self, kind: Kind, msg: msgspec.Struct) -> bool:
        """Fire-and-forget message (tag 0); False if not connected (or the connection just broke)."""
        return self._write(encode_frame(kind, 0, msg))

    def _write(self, frame: bytes) -> bool:
        """Queue ``frame`` on the connection; False when there is none or it is closing.

        Frames queued in one event-loop iteration (the POLLs, SUBMITs and DELIVEREDs of every
        request handled in it) go out in one write at the end of it (:meth:`_flush`), in order.
        The encoder may have died a moment ago: its socket is closed before :meth:`_run` sees
        the end of the stream and clears ``_writer``, and writing to a closed transport raises
        (``RuntimeError`` in uvloop). Both mean the same as "not connected"; frames queued for
        a connection that is lost before the flush are dropped (their requests fail with it).
        """
        w = self._writer
        if w is None or w.is_closing():
            return False
        out = self._out
        if out is None:
            self._out = [frame]
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush, w)
        else:
            out.append(frame)
        return True

    def _flush(self, w: asyncio.StreamWriter) -> None:
        if w is not self._writer:
            return  # scheduled for a connection that was lost since (its queue was dropped)
        out, self._out = self._out, None
        if not out or w.is_closing():
            return
        try:
            if len(out) == 1:
                w.write(out[0])
            else:
                w.writelines(out)
        except (RuntimeError, OSError):
            pass

    async def close(self) -> None:
        self._closing = True
        self._out = None
        if self._writer is not None:
            self._writer.close()
        await cancel_and_wait(self._task)
        self._fail_all("control client closed")


Handler = Callable[[msgspec.Struct, bytes], Awaitable["msgspec.Struct | None"]]


async def serve_control(path: str, handler: Handler) -> asyncio.AbstractServer:
    """Serve the control protocol on a Unix socket (encoder side).

    ``handler(msg, blob)`` gets each request decoded into its :mod:`shardserver.messages` struct
    and returns the reply struct (None for one-way kinds). Each request runs in its own task so a
    held POLL does not block the connection. The replies made in one event-loop iteration go out
    in one write at the start of the next (a write system call per reply was ~4 % of a busy
    encoder's time). A request that cannot be decoded, or whose handler
    raises, is answered with an :class:`~shardserver.messages.ErrorReply` in an ERROR frame
    (when it has a tag); the connection stays up. Only a broken frame length ends the connection.
    """

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        # Replies made in one event-loop iteration, written together (one writev) by flush()
        # at the start of the next one, in the order they were made; None: none waiting.
        out: list[bytes] | None = None

        def flush() -> None:
            nonlocal out
            frames, out = out, None
            if not frames or writer.is_closing():
                return
            if len(frames) == 1:
                writer.write(frames[0])
            else:
                writer.writelines(frames)

        def answer(tag: int, kind: Kind, reply: msgspec.Struct) -> None:
            nonlocal out
            if tag and not writer.is_closing():
                frame = encode_frame(kind, tag, reply)
                if out is None:
                    out = [frame]
                    loop.call_soon(flush)
                else:
                    out.append(frame)

        async def run_one(msg: msgspec.Struct, tag: int, blob: bytes) -> None:
            try:
                reply = await handler(msg, blob)
            except Exception as exc:  # a bug in a handler must not kill the connection
                log.exception("control handler failed for %s", type(msg).__name__)
                answer(tag, Kind.ERROR, ErrorReply(message=f"internal error: {exc}"))
                return
            if reply is not None:
                answer(tag, Kind.REPLY, reply)

        try:
            while True:
                frame = await read_frame(reader)
                try:
                    msg = decode_request(frame.kind, frame.meta)
                except ControlProtocolError as exc:
                    log.error("control: %s", exc)
                    answer(frame.tag, Kind.ERROR, ErrorReply(message=str(exc)))
                    continue
                t = loop.create_task(run_one(msg, frame.tag, frame.blob))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            pass  # the encoder is stopping: end this connection quietly
        finally:
            try:
                flush()  # the replies already made still go out, as when each was written at once
            except (RuntimeError, OSError):
                pass
            for t in list(tasks):
                t.cancel()
            writer.close()

    return await asyncio.start_unix_server(on_conn, path=path)
