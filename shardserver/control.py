"""The control channel between front-ends and encoders: small typed frames over Unix sockets.

Each front-end keeps one connection to each encoder
(``<run_dir>/enc-<shard>.sock``). A frame is::

    u32 length (of everything after it) | u8 kind | u32 tag | payload

* ``kind`` is a :class:`Kind`; ``tag`` pairs a reply with its request (0 for
  one-way messages).
* The payload is ``u32 meta_length | meta (compact JSON object) | blob``. Only
  SUBMIT carries a blob: the engine request body, built once by the front-end
  and posted by the encoder as-is.
* Replies never carry result bytes: a completed result is answered with where
  it lies in the shard's arena (name, offset, length, generation) and the
  front-end copies it out of shared memory itself.
* Errors cross as strings and codes inside the reply (``{"state": "failed",
  "error": ..., "category": ...}``); exceptions are never pickled. When a
  connection breaks, every request waiting on it fails at once with
  :class:`EncoderDeadError` and the client reconnects in the background.

Message shapes (meta JSON):

========== ============================================================ =========================================
kind       request                                                      reply
========== ============================================================ =========================================
SUBMIT     sid, seq, owner, n, prompt_logprobs, topk, reserve_bytes,     ``{"request_id"}`` or ``{"status","message"}``
           prompt (int list, only with prompt logprobs); blob: body
POLL       fid, timeout (s), want ("proto" | "json")                    ``{"state": "done", "arena", "off", "len", "gen"}``,
                                                                        ``{"state": "pending"}``, ``{"state": "failed", ...}``,
                                                                        ``{"state": "gone", "reason"}``
DELIVERED  fid                                                          (none)
STATS      {}                                                           counters and gauges of the shard
========== ============================================================ =========================================
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import struct
from typing import Any, Awaitable, Callable

from .aio import cancel_and_wait
from .errors import EncoderDeadError

__all__ = ["Kind", "encode_frame", "read_frame", "ControlClient", "serve_control"]

log = logging.getLogger("shardserver.control")

_HEAD = struct.Struct("<IBI")
_META = struct.Struct("<I")
MAX_FRAME = 1 << 30


class Kind(enum.IntEnum):
    SUBMIT = 1
    POLL = 2
    DELIVERED = 3
    STATS = 4
    REPLY = 128


def encode_frame(kind: int, tag: int, meta: dict[str, Any], blob: bytes = b"") -> bytes:
    """One frame as bytes (see the module docstring)."""
    m = json.dumps(meta, separators=(",", ":")).encode()
    body_len = 1 + 4 + 4 + len(m) + len(blob)
    return b"".join((_HEAD.pack(body_len, kind, tag), _META.pack(len(m)), m, blob))


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, dict[str, Any], bytes]:
    """Read one frame: (kind, tag, meta, blob).

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection.
        ValueError: a malformed frame.
    """
    head = await reader.readexactly(_HEAD.size)
    length, kind, tag = _HEAD.unpack(head)
    if length < 9 or length > MAX_FRAME:
        raise ValueError(f"control frame length {length} out of range")
    rest = await reader.readexactly(length - 5)
    (mlen,) = _META.unpack_from(rest, 0)
    meta = json.loads(rest[4:4 + mlen])
    blob = rest[4 + mlen:]
    return kind, tag, meta, blob


class ControlClient:
    """A front-end's connection to one encoder, with request/reply matching and reconnects.

    Args:
        path: the encoder's Unix socket.
        shard: shard index, for messages.
    """

    def __init__(self, path: str, shard: int) -> None:
        self.path = path
        self.shard = shard
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._polls: set[int] = set()
        self._next_tag = 1
        self._connected = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.connects = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
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
            try:
                while True:
                    kind, tag, meta, _ = await read_frame(reader)
                    fut = self._pending.pop(tag, None)
                    if fut is not None and not fut.done():
                        fut.set_result(meta)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                pass
            finally:
                self._connected.clear()
                self._writer = None
                writer.close()
                self._fail_all(f"encoder {self.shard} connection lost")

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(EncoderDeadError(why))

    async def request(self, kind: Kind, meta: dict[str, Any], blob: bytes = b"",
                      timeout: float | None = None) -> dict[str, Any]:
        """Send a request and wait for its reply.

        Raises:
            EncoderDeadError: not connected, or the connection broke before the reply.
            asyncio.TimeoutError: no reply within ``timeout`` seconds.
        """
        w = self._writer
        if w is None:
            raise EncoderDeadError(f"encoder {self.shard} is not connected")
        tag = self._next_tag
        self._next_tag = (tag % 0xFFFFFFF0) + 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[tag] = fut
        if kind == Kind.POLL:
            self._polls.add(tag)
        w.write(encode_frame(kind, tag, meta, blob))
        try:
            if timeout is None:
                return await fut
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(tag, None)
            self._polls.discard(tag)

    def release_polls(self, reply: dict[str, Any]) -> int:
        """Answer every POLL still waiting on this connection with ``reply`` (used when draining).

        The encoder's own answer, if it comes later, is ignored. Returns how many were released.
        """
        n = 0
        for tag in list(self._polls):
            fut = self._pending.get(tag)
            if fut is not None and not fut.done():
                fut.set_result(dict(reply))
                n += 1
        return n

    def send(self, kind: Kind, meta: dict[str, Any]) -> bool:
        """Fire-and-forget message; False if not connected."""
        w = self._writer
        if w is None:
            return False
        w.write(encode_frame(kind, 0, meta))
        return True

    async def close(self) -> None:
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        await cancel_and_wait(self._task)
        self._fail_all("control client closed")


Handler = Callable[[int, dict[str, Any], bytes], Awaitable[dict[str, Any] | None]]


async def serve_control(path: str, handler: Handler) -> asyncio.AbstractServer:
    """Serve the control protocol on a Unix socket (encoder side).

    ``handler(kind, meta, blob)`` returns the reply meta (or None for one-way
    kinds). Each request runs in its own task so a held POLL does not block
    the connection.
    """

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task[None]] = set()

        async def run_one(kind: int, tag: int, meta: dict[str, Any], blob: bytes) -> None:
            try:
                reply = await handler(kind, meta, blob)
            except Exception as exc:  # a bug in a handler must not kill the connection
                log.exception("control handler failed for kind %s", kind)
                reply = {"state": "failed", "error": f"internal error: {exc}", "category": "server",
                         "status": 500, "message": f"internal error: {exc}"}
            if tag and reply is not None and not writer.is_closing():
                writer.write(encode_frame(Kind.REPLY, tag, reply))

        try:
            while True:
                kind, tag, meta, blob = await read_frame(reader)
                t = asyncio.get_running_loop().create_task(run_one(kind, tag, meta, blob))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            pass  # the encoder is stopping: end this connection quietly
        finally:
            for t in list(tasks):
                t.cancel()
            writer.close()

    return await asyncio.start_unix_server(on_conn, path=path)
