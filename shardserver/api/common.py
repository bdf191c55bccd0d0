"""What every handler shares: the JSON body under a size limit, and error answers.

Two ways a request is refused, kept apart because they answer differently:

* :class:`BodyError` (body too large: 413; not JSON: 400) and pydantic's ``ValidationError``
  (a body that does not fit the request model: 400) are raised and turned into answers by
  the exception handlers of :mod:`shardserver.api.app`, which count them (``http_<status>``
  in ``/stats``) and add the ``X-Shardserver-Front-End`` header.
* :func:`error` builds the ``{"error": message}`` answer a handler returns itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..ids import FutureIdStatus
from .state import FrontendContext, context

__all__ = ["BodyError", "error", "read_json", "json_nesting", "MAX_JSON_NESTING", "validation_message", "TIMED_OUT_SCOPE_KEY", "WAIT_WRITTEN_SCOPE_KEY",
           "CONNECTION_SCOPE_KEY",
           "CLIENT_CLOSED"]

# Set in the ASGI scope by the connection (shardserver.workers.http_conn) when the request's body
# did not arrive within server.body_timeout_s; the client was answered 408 there.
TIMED_OUT_SCOPE_KEY = "shardserver.timed_out"
# Set in the ASGI scope by the connection: ``await scope[WAIT_WRITTEN_SCOPE_KEY](timeout_s)`` is
# True once every byte of the response left the process on a connection that stayed open
# (shardserver.workers.http_conn.GatewayHttpProtocol.wait_written).
WAIT_WRITTEN_SCOPE_KEY = "shardserver.wait_written"
# Set in the ASGI scope by the connection: the connection itself
# (shardserver.workers.http_conn.GatewayHttpProtocol), whose ``closed()``, ``wait_flushed()``,
# ``wait_written()`` and ``abort_response()`` let a result be sent straight from the arena
# (shardserver.api.sampling.ResultResponse).
CONNECTION_SCOPE_KEY = "shardserver.connection"
# Status recorded (never sent: nobody is listening) for a request whose client closed the
# connection before its body was complete; nginx's "client closed request".
CLIENT_CLOSED = 499


class BodyError(Exception):
    """The request body cannot be read: ``status`` 413 (too large), 415 (compressed) or 400 (not JSON)."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """``{"error": message, **extra}`` with HTTP ``status``."""
    return JSONResponse({"error": message, **extra}, status_code=status)


def validation_message(exc: ValidationError) -> str:
    """The first 5 problems of ``exc`` as ``loc: msg`` (``+N more`` for the rest)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request body: " + "; ".join(parts) + more


#: Arrays/objects nested deeper than this many levels are refused (400 "nested too deeply"),
#: whichever path served the request. The stdlib parser recurses once per level, so by itself it
#: fails at ``sys.getrecursionlimit()`` minus however deep the ASGI stack above the handler is.
MAX_JSON_NESTING = 900

_fast_json = msgspec.json.Decoder().decode
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPENS = None  # uint8 -> +1 ("[", "{"), -1 ("]", "}"), 0; built on first use (numpy loads then)


def json_nesting(body: bytes) -> int:
    """How deep the arrays/objects of the valid JSON document ``body`` nest (0 for a scalar).

    Vectorised (numpy) after cutting out string literals; meant for the rare body with more than
    :data:`MAX_JSON_NESTING` brackets, so the hot path never pays for it.
    """
    global _OPENS
    import numpy as np  # here, not at the top: front-ends otherwise carry numpy for this alone

    if _OPENS is None:
        opens = np.zeros(256, np.int8)
        opens[[ord("["), ord("{")]] = 1
        opens[[ord("]"), ord("}")]] = -1
        _OPENS = opens
    if b'"' in body:
        body = _JSON_STRING.sub(b"", body)
    if not body:
        return 0
    steps = _OPENS[np.frombuffer(body, np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max())


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON (``{}`` when empty).

    Raises:
        BodyError: 415 when the request has a ``Content-Encoding`` other than ``identity`` (the
            tinker SDK never compresses the bodies of the endpoints this gateway serves: only
            the training ``forward_backward`` body is zstd-compressed, ``tinker/resources/training.py``,
            and that endpoint answers 501 here; parsing gzip bytes as JSON would answer a
            confusing 400); 413 when the body exceeds ``server.max_request_bytes`` (by Content-Length, or
            counted while receiving a chunked upload, which is cut off at the limit); 400 when it
            is not valid JSON (nested deeper than :data:`MAX_JSON_NESTING` levels included); 408 when it did not arrive within ``server.body_timeout_s`` (the
            connection already answered 408 and closed); :data:`CLIENT_CLOSED` when the client
            closed the connection first. The last two answers go nowhere (the connection is
            gone); they only count the request in the metrics.
    """
    max_body = context(request).cfg.server.max_request_bytes
    coding = request.headers.get("content-encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        raise BodyError(415, f"Content-Encoding: {coding[:40]} is not supported: send the request body "
                             "uncompressed (identity)")
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > max_body:
        raise BodyError(413, f"request body of {cl} bytes exceeds server.max_request_bytes={max_body}")
    # Count while receiving: a chunked upload without Content-Length is cut off at the limit.
    # The ASGI messages themselves (what starlette's Request.stream() yields, without its async
    # generator): http.request chunks until more_body is false, or http.disconnect.
    parts: list[bytes] = []
    size = 0
    receive = request.receive
    if hasattr(request, "_body"):  # read already (by whatever ran before), as Request.stream() does
        parts.append(request._body)
        size = len(request._body)
        if size > max_body:
            raise BodyError(413, f"request body exceeds server.max_request_bytes={max_body} bytes")
    elif request._stream_consumed:
        raise RuntimeError("Stream consumed")
    try:
        while not request._stream_consumed:
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_body:
                    raise BodyError(413, f"request body exceeds server.max_request_bytes={max_body} bytes")
                if chunk:
                    parts.append(chunk)
                if not message.get("more_body", False):
                    request._stream_consumed = True
            elif message["type"] == "http.disconnect":
                request._is_disconnected = True
                raise ClientDisconnect()
    except ClientDisconnect:
        if request.scope.get(TIMED_OUT_SCOPE_KEY):
            raise BodyError(408, "request body not received within server.body_timeout_s") from None
        raise BodyError(CLIENT_CLOSED, "the client closed the connection before its request body was complete") \
            from None
    body = b"".join(parts)
    brackets = body.count(b"[") + body.count(b"{")
    if brackets <= MAX_JSON_NESTING:
        # msgspec gives the same objects as json.loads for every document both accept; on
        # anything it refuses (NaN, 1e400, UTF-16, lone surrogates, bad JSON) json.loads decides,
        # so accepted documents and error messages stay the stdlib's.
        try:
            return _fast_json(body) if body else {}
        except msgspec.DecodeError:
            pass
    try:
        doc = json.loads(body) if body else {}
    except ValueError as exc:
        raise BodyError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses per nesting level: ~1000 levels exhaust the stack limit
        raise _too_deep() from None
    # A real request has a few brackets; counting them runs at memchr speed.
    if brackets > MAX_JSON_NESTING and json_nesting(body) > MAX_JSON_NESTING:
        raise _too_deep()
    return doc


def _too_deep() -> BodyError:
    """The 400 for a body nested past :data:`MAX_JSON_NESTING`. Made where it is raised: an error
    held in a local of :func:`read_json` would be held by its own traceback's frame, a reference
    cycle that kept the whole body (up to ``server.max_request_bytes``) until the cyclic GC ran,
    which a front-end does rarely (24.6 MB more RSS per 8 MiB body of ``[``)."""
    return BodyError(400, "request body is not valid JSON: arrays/objects nested too deeply")


def refuse_future_id(ctx: FrontendContext, fid: str, owner: str, endpoint: str, then: str = "") -> JSONResponse | None:
    """The answer to a future ID this front-end must not pass to a shard, or None when it may.

    404 for an ID this run never issued (bad MAC, or another API key's), 410 for one of an earlier
    run or of another gateway host (docs/MULTI_HOST.md). Counts ``<endpoint>_404`` /
    ``<endpoint>_410`` (and ``<endpoint>_410_other_host``). ``then`` is appended to the 410
    messages (e.g. ``"; resubmit"`` where the SDK resubmits the sample).
    """
    status = ctx.signer.check_future_id(fid, owner)
    if status == FutureIdStatus.OK:
        return None
    if status == FutureIdStatus.INVALID:
        ctx.count(f"{endpoint}_404")
        return error(404, f"unknown future {fid[:80]!r}: this server never issued it")
    ctx.count(f"{endpoint}_410")
    if status == FutureIdStatus.FOREIGN_HOST:  # its owner is down (or the balancer ignores owners)
        ctx.count(f"{endpoint}_410_other_host")
        why = "future is owned by another gateway host, which is unreachable"
    else:
        why = "future was issued by an earlier run of the server"
    return JSONResponse({"error": why + then}, status_code=410, headers=ctx.fe_header)
