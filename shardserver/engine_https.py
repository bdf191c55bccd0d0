"""The engine client's transport for ``https://`` engines: aiohttp, through two pools.

:class:`shardserver.engine_client.EngineClient` uses :mod:`shardserver.engine_http` for
``http://`` engines and this module for ``https://`` ones; it is imported only then, so an
encoder of an ``http://`` deployment never loads aiohttp (~16 MiB of private memory per
process, measured with ``/proc/self/smaps_rollup`` after the import).

The first pool keeps connections alive for ``engine.pool_idle_s``; the second never reuses one
(an attempt after a reused connection broke before any answer). Every connection counts the
bytes it receives that no reader has claimed yet (:class:`_CountingHandler`), so that the
owner's ``answer_bytes`` covers answers in aiohttp's buffers too.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from .config import mask_urls_in
from .engine_http import dead_peer_options, set_options
from .errors import EngineError

if TYPE_CHECKING:
    from .engine_client import EngineClient

__all__ = ["HttpsTransport"]


class _TraceCtx:
    """Per-attempt aiohttp trace context: did the attempt get a reused pooled connection?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(session: Any, ctx: Any, params: Any) -> None:
    ctx.trace_request_ctx.reused = True


class _CountingHandler(ResponseHandler):
    """aiohttp's client protocol, also counting the bytes it received that no reader has
    claimed yet (:meth:`HttpsTransport._receive` claims a response's bytes when it ends): engine
    answers in this process's memory, whether a reader has started on them or not."""

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: "EngineClient") -> None:
        super().__init__(loop)
        self._owner = owner
        self.unclaimed = 0

    def data_received(self, data: bytes) -> None:
        n = len(data)
        self.unclaimed += n
        self._owner._add_unclaimed(n)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._owner._add_unclaimed(-self.unclaimed)
        self.unclaimed = 0
        super().connection_lost(exc)


class HttpsTransport:
    """The two aiohttp sessions of one :class:`~shardserver.engine_client.EngineClient` and its
    attempts through them. Create it in the event loop that will use it.

    Args:
        owner: the engine client: its ``cfg`` (``connect_timeout_s``, ``pool_idle_s``,
            ``max_body_bytes``, ``dead_connection_s``), ``url``, ``display_url``, and its answer-byte counts
            (``_add_unclaimed``, ``_returned``), which this transport keeps up to date.
    """

    def __init__(self, owner: "EngineClient") -> None:
        self.owner = owner
        cfg = owner.cfg
        # aiohttp's own pool is unbounded: the encoder starts at most engine.pool_size calls, so
        # no attempt waits here for a connection (engine.timeout_s is the request's own time).
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=cfg.connect_timeout_s)
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        trace.freeze()
        options = dead_peer_options(cfg.dead_connection_s)

        def new_socket(addr_info: tuple[Any, ...]) -> socket.socket:
            # (aiohttp's socket_factory: engine.dead_connection_s, as the http:// pool sets it)
            family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
            sock = socket.socket(family=family, type=type_, proto=proto)
            set_options(sock, options)
            return sock

        factory = {"socket_factory": new_socket} if options else {}
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=cfg.pool_idle_s, **factory)
        # aiohttp's default read buffer (64 KiB): a larger one cost more memory when many engine
        # answers arrive at once (measured with benchmarks/run_load.py --scenario queue-8k) and
        # saved no measurable CPU.
        fresh = aiohttp.TCPConnector(limit=0, force_close=True, **factory)
        # Count what every engine connection receives (aiohttp keeps its protocol factory in
        # _factory; without it the bodies are counted as their reader takes them).
        self.counting = False
        if all(hasattr(c, "_factory") for c in (conn, fresh)):
            loop = asyncio.get_running_loop()
            for c in (conn, fresh):
                c._factory = functools.partial(_CountingHandler, loop, owner)
            self.counting = True
        self._session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=True,
                                              trace_configs=[trace])
        self._fresh = aiohttp.ClientSession(connector=fresh, timeout=timeout, auto_decompress=True)

    async def close(self) -> None:
        """Close both sessions and their connections."""
        await self._session.close()
        await self._fresh.close()

    async def attempt(self, fresh: bool, body: bytes, hdrs: dict[str, str],
                      meta: dict[str, Any]) -> tuple[int, bytes]:
        """One attempt on one connection (a new one when ``fresh``): (status, body bytes), or
        raises the owner's ``_Broken`` (no complete answer: may be sent again) or EngineError.
        ``meta`` receives ``"retry_after"`` and ``"location"`` (the answer's ``Retry-After`` and
        ``Location`` fields, or None)."""
        from .engine_client import _Broken

        owner = self.owner
        session = self._fresh if fresh else self._session
        trace = _TraceCtx()
        answered = False
        try:
            # (a redirect is an answer: aiohttp would follow it, re-POSTing elsewhere or as a GET)
            async with session.post(owner.url, data=body, headers=hdrs, trace_request_ctx=trace,
                                    allow_redirects=False) as resp:
                answered = True
                meta["retry_after"] = resp.headers.get("Retry-After")
                meta["location"] = resp.headers.get("Location")
                limit = owner.cfg.max_body_bytes
                if resp.content_length is not None and resp.content_length > limit:
                    raise EngineError(f"engine body of {resp.content_length} bytes exceeds "
                                      f"engine.max_body_bytes={limit}", status=resp.status, category="server")
                # 2xx bodies stay counted until the caller's release(); error bodies are read here only
                return resp.status, await self._receive(resp, limit, keep=resp.status < 300)
        except aiohttp.ClientConnectorCertificateError as exc:
            # Not transient: every attempt would fail the same way until the deployment changes
            # (like the gateway's credentials refused: 401/403), so the sample fails at once.
            raise EngineError(
                f"engine at {owner.display_url}: TLS certificate verification failed "
                f"({mask_urls_in(str(exc.certificate_error))}); the gateway must trust the engine's certificate: "
                f"add its CA to the system's store, or name it with SSL_CERT_FILE or SSL_CERT_DIR in the "
                f"gateway's environment", status=None, category="server") from None
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
            raise _Broken(f"cannot connect to engine at {owner.display_url}: {mask_urls_in(str(exc))}",
                          no_response=True, reused=False) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            what = str(exc) or type(exc).__name__
            if answered:
                raise _Broken(f"engine connection broke while reading the response: {mask_urls_in(what)}",
                              no_response=False, reused=trace.reused) from None
            raise _Broken(f"engine connection broke before the response: {mask_urls_in(what)}",
                          no_response=True, reused=trace.reused) from None
        except aiohttp.ClientResponseError as exc:
            # aiohttp's parser refusing the answer (its "400" is no status the engine sent):
            # worded as engine_http words it for http:// engines.
            raise EngineError(f"engine request failed: not an HTTP/1.1 answer: {mask_urls_in(str(exc.message))}",
                              status=None, category="server") from None
        except aiohttp.ClientError as exc:
            raise EngineError(f"engine request failed: {mask_urls_in(str(exc))}", status=None,
                              category="server") from None

    async def _receive(self, resp: aiohttp.ClientResponse, limit: int, keep: bool) -> bytes:
        """The whole (decoded) body, read as it arrives, given up as soon as it passes ``limit``
        bytes (so a chunked body, or a compressed one whose Content-Length is the compressed size,
        never makes the encoder hold more than ``limit`` plus one read), and joined once complete.
        When it ends (complete or not) the bytes its connection received for it leave the owner's
        unclaimed count; with ``keep`` (a 2xx body for the caller) its length counts as returned
        until the owner's ``release``.

        Raises:
            EngineError: the body passes ``limit`` bytes (``engine.max_body_bytes``).
            aiohttp.ClientPayloadError: the connection ended before the body did.
        """
        owner = self.owner
        content = resp.content
        proto = getattr(resp, "_protocol", None)
        counted = self.counting and isinstance(proto, _CountingHandler)
        chunks: list[bytes] = []
        got = 0
        complete = False
        chunk = b""
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                got += len(chunk)
                if not counted:
                    owner._add_unclaimed(len(chunk))
                if got > limit:
                    raise EngineError(f"engine body exceeds engine.max_body_bytes={limit} (stopped reading after "
                                      f"{got} bytes)", status=resp.status, category="server")
                chunks.append(chunk)
            complete = True
        finally:
            if counted:  # headers and body: no next response on this connection before our next request
                owner._add_unclaimed(-proto.unclaimed)
                proto.unclaimed = 0
            else:
                owner._add_unclaimed(-got)
            if not complete:
                # This frame outlives the failure: aiohttp's stream reader keeps the error, whose
                # traceback holds this frame, and the error's frames hold the reader (a cycle
                # only the cyclic GC frees, which an encoder runs rarely). Drop the partial body.
                chunks.clear()
                chunk = b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if keep:
            owner._returned += len(data)
        return data
