"""Sampling endpoints: ``asample`` submits to the owning shard, ``retrieve_future`` long-polls it.

``asample`` validates the request, flattens the prompt to token ids, computes the largest
``SampleResponse`` the request can produce (the arena reservation,
:func:`shardserver.codec.encode.max_sample_response_size`), builds the vLLM
``/v1/completions`` body (:func:`shardserver.engine_request.completion_request_body`) and
sends both to the shard that ``(sampling_session_id, seq_id)`` hashes to (:func:`shardserver.ids.shard_of`), which dedupes resubmissions and mints the
future ID. An unset ``max_tokens`` becomes the engine's context window minus the prompt, and a
request that cannot fit it is refused here with 400: the window is the one the engine reports in
``GET /v1/models`` (learned by the encoders' probes, :attr:`FrontendContext.engine_windows`),
else ``engine.max_model_len``. ``retrieve_future`` asks the shard the future ID hashes to and sends a finished
result straight from that shard's arena, without a copy (:class:`ResultResponse`):
protobuf when ``Accept`` names :data:`PROTO_MEDIA_TYPE`, else JSON. The answers are listed
in README's ``retrieve_future`` table.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from typing import Annotated

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..codec.sizes import max_sample_response_size
from ..config import EngineConfig
from ..engine_request import completion_request_body, context_window
from ..errors import EncoderDeadError, SlotInvalidError
from ..ids import shard_of
from ..metrics import count_asample_refused
from ..messages import (
    PollDone,
    PollFailed,
    PollPending,
    PollRequest,
    RefusalReason,
    ResultForm,
    SubmitRefused,
    SubmitRequest,
)
from ..shm.arena import ArenaReader, ArenaWriter
from .auth import owner_of
from .common import CONNECTION_SCOPE_KEY, WAIT_WRITTEN_SCOPE_KEY, error, read_json, refuse_future_id
from .models import UNSUPPORTED_SAMPLE_FIELDS, EncodedTextChunk, RetrieveFutureRequest, SampleRequest
from .state import FrontendContext, context

__all__ = ["router", "PROTO_MEDIA_TYPE", "REFUSAL_STATUS", "ARENA_FIRST_PIECE_BYTES", "ARENA_PIECE_BYTES",
           "ResultResponse", "asample", "retrieve_future", "request_digest"]

log = logging.getLogger("shardserver.frontend")

PROTO_MEDIA_TYPE = "application/x-protobuf"

# The HTTP status of each SUBMIT refusal (429: the SDK retries after Retry-After).
REFUSAL_STATUS = {
    RefusalReason.NO_ROOM: 429,
    RefusalReason.PENDING_LIMIT: 429,
    RefusalReason.PENDING_BYTES: 429,
    RefusalReason.KEY_QUOTA: 429,
    RefusalReason.TOO_LARGE: 400,
    RefusalReason.INVALID: 400,
    RefusalReason.CONFLICT: 409,
    RefusalReason.INTERNAL: 500,
    RefusalReason.STOPPING: 503,
}

router = APIRouter()


#: Bytes of a result sent from the arena in its first write: a result up to this size goes out
#: in one write, from the arena straight into the socket when the socket takes it all. What the
#: socket does not take is copied (GatewayHttpProtocol.write_arena), so a client that reads
#: slowly holds at most this much of a copy, then ARENA_PIECE_BYTES at a time.
ARENA_FIRST_PIECE_BYTES = 1 << 20
#: Bytes of each later write of a result from the arena (once the previous one left the process).
ARENA_PIECE_BYTES = 256 << 10


class ResultResponse(Response):
    """A finished result's bytes; reports delivery (``on_delivered()``) only when its last byte was
    written to a connection that stayed open.

    Under shardserver's own connection handling the scope carries
    :data:`~shardserver.api.common.WAIT_WRITTEN_SCOPE_KEY`: after the body is handed to the
    transport, delivery waits until the transport's write buffer is empty with the connection
    still open (up to ``server.keep_alive_s``). A client that reads part of the body and closes
    breaks the connection while bytes are still buffered: not delivered, so the result stays
    in the completed stage and a re-poll gets it (the retrieved TTL never starts). Elsewhere
    (e.g. a test client) only a disconnect seen before the write counts.

    **Sent from the arena** (``slot`` given; the scope carries the connection,
    :data:`~shardserver.api.common.CONNECTION_SCOPE_KEY`): ``content`` is a
    :meth:`~shardserver.shm.arena.ArenaReader.view` of the slot, not a copy. The encoder may
    free and reuse the slot at any time (TTL, eviction of a delivered result polled again,
    cancel, ack), so it goes out in pieces (:data:`ARENA_FIRST_PIECE_BYTES`, then
    :data:`ARENA_PIECE_BYTES` each once the previous one left the process), each written by
    :meth:`~shardserver.workers.http_conn.GatewayHttpProtocol.write_arena`: the slot's generation
    is checked, then the socket takes what fits straight from the arena and the rest is copied,
    all in one call, so no reference to the slot outlives it and every byte sent is the
    result's. A piece that finds the slot freed is not written and the connection is reset
    (:meth:`~shardserver.workers.http_conn.GatewayHttpProtocol.abort_response`): the client gets
    fewer bytes than ``Content-Length``, all of them the result's, ``on_cut()`` is called
    (counted as ``retrieve_cut_slot_reused``) and the result is not reported delivered (a
    re-poll answers 410 if it is gone, and the SDK resubmits).

    Args:
        content: the result (proto or JSON bytes, or a view of its arena slot with ``slot``).
        media_type: its Content-Type.
        on_delivered: called once the result counts as delivered.
        headers: extra response headers (ignored when ``raw_headers`` is given).
        written_timeout_s: how long to wait for the write buffer to empty.
        raw_headers: the complete raw header list, prebuilt (what ``headers`` would give).
        slot: ``(reader, offset, generation)`` of the arena slot ``content`` views.
        on_cut: called when a response from the arena was cut because the slot was reused.
    """

    def __init__(self, content: bytes | memoryview, media_type: str, on_delivered,
                 headers: dict[str, str] | None = None, written_timeout_s: float = 75.0, *,
                 raw_headers: list[tuple[bytes, bytes]] | None = None,
                 slot: tuple[ArenaReader, int, int] | None = None, on_cut=None) -> None:
        if raw_headers is None:
            super().__init__(content=bytes(content) if slot is None and isinstance(content, memoryview) else content,
                             media_type=media_type, headers=headers)
        else:  # what Response.__init__ sets, with the headers built by the caller
            self.status_code = 200
            self.media_type = media_type
            self.background = None
            self.body = content  # type: ignore[assignment]
            self.raw_headers = raw_headers
        self._on_delivered = on_delivered
        self._written_timeout_s = written_timeout_s
        self._slot = slot
        self._on_cut = on_cut

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        conn = scope.get(CONNECTION_SCOPE_KEY) if self._slot is not None else None
        if conn is not None:
            await self._send_from_arena(conn, send)
            return
        body = self.body if self._slot is None else self._copy()
        if body is None:
            return
        # The request body was read already, so a pending receive() completes only on disconnect
        # (or, in uvicorn, once the response is complete): look before writing.
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.sleep(0)
            lost = watch.done()
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            watch.cancel()
        if lost:
            return
        wait_written = scope.get(WAIT_WRITTEN_SCOPE_KEY)
        if wait_written is not None and not await wait_written(self._written_timeout_s):
            return
        self._on_delivered()

    def _copy(self) -> bytes | None:
        """The slot's bytes copied out (no connection to send the view on); None if it was reused."""
        reader, offset, generation = self._slot  # type: ignore[misc]
        data = bytes(self.body)
        return data if reader.valid(offset, generation) else None

    async def _send_from_arena(self, conn, send) -> None:
        reader, offset, generation = self._slot  # type: ignore[misc]
        view: memoryview = self.body  # type: ignore[assignment]
        await asyncio.sleep(0)  # a disconnect already received is seen before the first write
        if conn.closed():
            return
        n = len(view)
        conn.arena_guard, conn.arena_cut = self._slot, False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pos, piece = 0, ARENA_FIRST_PIECE_BYTES
            while True:
                end = min(n, pos + piece)
                await send({"type": "http.response.body", "body": view[pos:end], "more_body": end < n})
                if conn.arena_cut:
                    self._cut(conn)
                    return
                if end >= n:
                    break
                pos, piece = end, ARENA_PIECE_BYTES
                # The next piece once this one left the process (at most one copy held).
                left = conn.bytes_not_taken()
                while True:
                    flushed = await conn.wait_flushed(self._written_timeout_s)
                    if flushed is False:
                        return  # the connection broke: nothing delivered
                    if flushed:
                        break
                    now_left = conn.bytes_not_taken()
                    if now_left < left:
                        left = now_left  # a slow reader, still taking bytes: wait on
                        continue
                    # Nothing taken for server.keep_alive_s: the client stopped reading. Let go
                    # of the connection and the view (it pins the arena's mapping, which a
                    # restarted encoder's old arena would otherwise keep in /dev/shm).
                    conn.abort_response()
                    return
        finally:
            conn.arena_guard = None
        if not await conn.wait_written(self._written_timeout_s):
            return
        self._on_delivered()

    def _cut(self, conn) -> None:
        conn.abort_response()
        if self._on_cut is not None:
            self._on_cut()


class _Refused(Exception):
    """``asample`` refuses the request: answered ``status`` ``{"error": message}`` by :func:`error`."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


#: A chunk's token ids as msgspec checks them: ints (not bool, not float) in [0, 2^31).
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


def _prompt_tokens(req: SampleRequest) -> list[int]:
    """The prompt's token ids, every chunk concatenated.

    Raises:
        _Refused: 400 for a field of :data:`UNSUPPORTED_SAMPLE_FIELDS` that is set, a chunk
            that is not ``encoded_text``, a token id outside [0, 2^31), or no tokens at all.
        ValidationError: a chunk that is not an ``EncodedTextChunk`` (the app answers 400).
    """
    for name in UNSUPPORTED_SAMPLE_FIELDS:
        v = getattr(req, name)
        if v not in (None, 0):
            raise _Refused(400, f"{name} is not supported by this gateway")
    tokens: list[int] = []
    in_range = True  # every id so far came through the ranged conversion
    for i, chunk in enumerate(req.prompt.chunks):
        ctype = chunk.get("type", "encoded_text")
        if ctype != "encoded_text":
            raise _Refused(400, f"prompt.chunks[{i}]: chunk type {ctype!r} is not supported by this gateway "
                                "(token prompts only)")
        ids = chunk.get("tokens")
        if type(ids) is list:
            # Type and range in one C pass (~20 ns a token); anything it refuses takes the path
            # below, whose errors (pydantic's, or the range message) are the answer.
            try:
                tokens.extend(msgspec.convert(ids, _TOKEN_IDS))
                continue
            except msgspec.ValidationError:
                pass
        tokens.extend(EncodedTextChunk.model_validate(chunk).tokens)
        in_range = False
    if tokens and not in_range and not (0 <= min(tokens) and max(tokens) < 2**31):
        bad = next(t for t in tokens if not 0 <= t < 2**31)
        raise _Refused(400, f"prompt token id {bad} is outside [0, 2^31)")
    if not tokens:
        raise _Refused(400, "prompt has no tokens")
    return tokens


def request_digest(body: bytes, derived_max_tokens: int | None) -> bytes:
    """16-byte BLAKE2b of the canonical form of a sample request: its engine body
    (:func:`~shardserver.engine_request.completion_request_body`, which holds every field the result
    depends on: model, prompt, ``n``, sampling params, prompt logprobs), with ``max_tokens`` written
    as ``null`` when the SDK left it unset (``derived_max_tokens``: the value the gateway put there,
    the context window minus the prompt), so an SDK retry of the same request after the engine
    reported another window still matches. The SDK resends the same ``SampleRequest`` (same
    ``seq_id``, same fields) when it retries an ``asample`` whose answer it did not get."""
    if derived_max_tokens is not None:
        body = body.replace(b'"max_tokens":%d,' % derived_max_tokens, b'"max_tokens":null,', 1)
    return hashlib.blake2b(body, digest_size=16).digest()


def _never_fits(arena_bytes: int, reserve: int, n: int, max_tokens: int, unset: bool, plen: int,
                window: int) -> str | None:
    """The 400 message when a request's arena reservation (``reserve`` payload bytes: its largest
    possible ``SampleResponse``, plus the slot header) exceeds a whole shard's arena
    (``shards.arena_bytes``), so no amount of waiting makes room: the SDK would retry a 429
    forever. None when it can fit. ``unset``: the SDK left ``max_tokens`` unset (its default), so
    it is the context window of ``window`` tokens minus the ``plen``-token prompt."""
    need = ArenaWriter.slot_bytes(reserve)
    if need <= arena_bytes:
        return None
    mt = (f"max_tokens unset, i.e. up to {max_tokens} tokens (the context window of {window} tokens minus the "
          f"{plen}-token prompt)" if unset else f"max_tokens={max_tokens}")
    return (f"num_samples={n} with {mt} can produce a result of {need} bytes, more than a shard's whole arena "
            f"(shards.arena_bytes={arena_bytes}); set or lower max_tokens, lower num_samples, or raise "
            f"shards.arena_bytes")


def _check_limits(engine: EngineConfig, n: int, plen: int, max_tokens: int | None, model: str,
                  window: int, learned: bool) -> None:
    """Raises _Refused (400) when ``n`` > ``engine.max_num_samples``, or a prompt of ``plen``
    tokens (plus ``max_tokens``, when set) does not fit the context window of ``window`` tokens:
    the engine's own (``learned``, from ``GET /v1/models``; vLLM would refuse the request with a
    400) or, when the engine did not report one, ``engine.max_model_len`` (then only the prompt
    is checked, as a configured value may be below the engine's)."""
    if n > engine.max_num_samples:
        raise _Refused(400, f"num_samples={n} exceeds engine.max_num_samples={engine.max_num_samples}")
    where = f"the engine's context window of {window} tokens (max_model_len of {model} in GET /v1/models)"
    if plen >= window:
        if not learned:
            raise _Refused(400, f"prompt of {plen} tokens does not fit engine.max_model_len={window}")
        raise _Refused(400, f"prompt of {plen} tokens does not fit {where}")
    if learned and max_tokens is not None and plen + max_tokens > window:
        raise _Refused(400, f"prompt of {plen} tokens + max_tokens {max_tokens} = {plen + max_tokens} tokens "
                            f"exceeds {where}")


@router.post("/api/v1/asample")
async def asample(request: Request) -> JSONResponse:
    """Submit a sample request; ``{"request_id", "sample_sequence_ids"}`` on success.

    400 for what the gateway does not support, what does not fit the engine's limits, or a
    request whose largest possible result exceeds a whole shard's arena (:func:`_never_fits`), 404
    for an unknown sampling session, and the shard's refusals (see :func:`_submit`).
    """
    ctx = context(request)
    cfg = ctx.cfg
    req = SampleRequest.model_validate(await read_json(request))
    try:
        tokens = _prompt_tokens(req)
        sess = ctx.signer.open_sampling_session_id(req.sampling_session_id, owner_of(request))
        if sess is None:
            raise _Refused(404, "unknown sampling_session_id (create_sampling_session first; "
                                "a session of an earlier server run is valid only under the same ID secret: "
                                "server.id_secret or the id_secret file in server.state_dir)")
        model = cfg.engine.model or sess.base_model or sess.model_path or "default"
        # The engine's context window as its GET /v1/models reports it, else engine.max_model_len.
        window, learned = context_window(ctx.engine_windows, model, cfg.engine.max_model_len)
        _check_limits(cfg.engine, req.num_samples, len(tokens), req.sampling_params.max_tokens, model, window,
                      learned)
    except _Refused as exc:
        return error(exc.status, exc.message)
    n = req.num_samples
    sp = req.sampling_params
    plen = len(tokens)
    max_tokens = sp.max_tokens
    if max_tokens is None:
        # Unset means "until EOS or the context is full" for the SDK; vLLM would use 16.
        max_tokens = window - plen
    # topk_prompt_logprobs > 0 implies prompt logprobs (the top-k rows come with them).
    topk = req.topk_prompt_logprobs
    want_plp = bool(req.prompt_logprobs) or topk > 0
    reserve = max_sample_response_size(n, max_tokens, plen, want_plp, topk)  # the arena reservation
    too_large = _never_fits(cfg.shards.arena_bytes, reserve, n, max_tokens, sp.max_tokens is None, plen, window)
    if too_large is not None:
        count_asample_refused(RefusalReason.TOO_LARGE.value)
        return error(400, too_large)
    body = completion_request_body(
        model=model, prompt=tokens, n=n, max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=sp.top_k, seed=sp.seed, stop=sp.stop, prompt_logprobs=topk if want_plp else None)
    seq = req.seq_id if req.seq_id is not None else int.from_bytes(os.urandom(6), "little") + 10**15
    key = f"{req.sampling_session_id}#{seq}"
    shard = shard_of(key, cfg.shards.count)
    submit = SubmitRequest(sid=req.sampling_session_id, seq=seq, owner=owner_of(request), n=n,
                           prompt_logprobs=want_plp, topk=topk, reserve_bytes=reserve,
                           fill_context=sp.max_tokens is None,
                           prompt=tokens if want_plp else None,
                           digest=request_digest(body, max_tokens if sp.max_tokens is None else None))
    return await _submit(ctx, shard, submit, body, n)


async def _submit(ctx: FrontendContext, shard: int, submit: SubmitRequest, body: bytes, n: int) -> JSONResponse:
    """SUBMIT to ``shard`` and answer: 200 with the future ID, 503 when the shard is down or
    shutting down (retry),
    or the shard's refusal with the status of :data:`REFUSAL_STATUS` (429 with ``Retry-After: 1``
    when its arena has no room or its pending bounds are reached, 400 when the result could never
    fit, 409 with ``x-should-retry: false`` when ``(sampling_session_id, seq_id)`` already names a
    future of a different request); refusals are counted in ``shardserver_asample_refused_total{reason}``."""
    fe_header = ctx.fe_header
    try:
        reply = await ctx.clients[shard].submit(submit, body, timeout=30)
    except (EncoderDeadError, asyncio.TimeoutError) as exc:
        ctx.count("asample_503")
        return JSONResponse({"error": f"shard {shard} unavailable: {exc}; retry"}, status_code=503,
                            headers=fe_header)
    if isinstance(reply, SubmitRefused):
        status = REFUSAL_STATUS[reply.reason]
        ctx.count(f"asample_{status}")
        count_asample_refused(reply.reason.value)
        hdrs = dict(fe_header)
        if status in (429, 503):
            hdrs["Retry-After"] = "1"
        elif status == 409:
            hdrs["x-should-retry"] = "false"  # the SDK's HTTP layer retries a 409 (a lock timeout) otherwise
        return JSONResponse({"error": reply.message}, status_code=status, headers=hdrs)
    ctx.count("asample_ok")
    rid = reply.request_id
    return JSONResponse({"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]},
                        headers={**fe_header, "X-Shardserver-Shard": str(shard)})


def _cut(ctx: FrontendContext, fid: str) -> None:
    ctx.count("retrieve_cut_slot_reused")
    log.warning("future %s: its arena slot was freed or reused while the result was being sent; "
                "connection reset (the client re-polls)", fid)


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll a future (up to ``futures.long_poll_s``); the answers are README's ``retrieve_future`` table.

    404 for an ID this run never issued, 410 for one of an earlier run, of another gateway host
    (docs/MULTI_HOST.md) or a lost future, 408
    ``try_again`` while pending, 200 with the result bytes (:class:`ResultResponse`) or with
    ``{"error", "category"}`` when the engine failed it.
    """
    ctx = context(request)
    cfg = ctx.cfg
    shards = cfg.shards.count
    fe_header = ctx.fe_header
    req = RetrieveFutureRequest.model_validate(await read_json(request))
    fid = req.request_id
    refused = refuse_future_id(ctx, fid, owner_of(request), "retrieve", "; resubmit")
    if refused is not None:
        return refused
    shard = shard_of(fid, shards)
    want = ResultForm.PROTO if PROTO_MEDIA_TYPE in request.headers.get("accept", "") else ResultForm.JSON
    client = ctx.clients[shard]
    t0 = time.monotonic()
    for _attempt in range(3):
        try:
            reply = await client.poll(
                PollRequest(fid=fid, timeout=0 if ctx.draining else cfg.futures.long_poll_s, want=want),
                timeout=cfg.futures.long_poll_s + 15)
        except EncoderDeadError as exc:
            ctx.count("retrieve_410")
            return JSONResponse({"error": f"shard {shard} lost its state ({exc}); resubmit"},
                                status_code=410, headers=fe_header)
        except asyncio.TimeoutError:
            reply = PollPending()
        if isinstance(reply, PollDone):
            # Straight from the arena (no copy) when the connection can check the slot after
            # sending (ResultResponse); a copy when the JSON must be derived or elsewhere.
            from_arena = reply.form == want and reply.length > 0 and CONNECTION_SCOPE_KEY in request.scope
            try:
                reader = ctx.reader(reply.arena)
                if from_arena:
                    data = reader.view(reply.offset, reply.length, reply.generation)
                else:
                    data = reader.read(reply.offset, reply.length, reply.generation)
            except (SlotInvalidError, FileNotFoundError) as exc:
                log.debug("re-polling %s after a stale read: %s", fid, exc)
                continue
            if want == ResultForm.JSON and reply.form == ResultForm.PROTO:
                from ..codec.json_compat import sample_response_to_json  # pre-0.25 SDKs only

                data = sample_response_to_json(data)
            ctx.count("retrieve_done")
            ctx.count("bytes_delivered", len(data))
            media = PROTO_MEDIA_TYPE if want == ResultForm.PROTO else "application/json"
            return ResultResponse(
                data, media, lambda: client.delivered(fid),
                written_timeout_s=cfg.server.keep_alive_s,
                raw_headers=ctx.result_headers(shard, media, len(data)),
                slot=(reader, reply.offset, reply.generation) if from_arena else None,
                on_cut=lambda: _cut(ctx, fid))
        if isinstance(reply, PollPending):
            ctx.count("retrieve_408")
            return JSONResponse({"type": "try_again", "request_id": fid, "queue_state": "active"},
                                status_code=408, headers=fe_header)
        if isinstance(reply, PollFailed):
            ctx.count("retrieve_failed")
            client.delivered(fid)
            return JSONResponse({"error": reply.error, "category": reply.category}, headers=fe_header)
        ctx.count("retrieve_410")  # PollGone
        return JSONResponse({"error": f"future {reply.reason}; resubmit"},
                            status_code=410, headers=fe_header)
    ctx.count("retrieve_410")
    log.warning("future %s: arena slot kept changing during reads (%.3f s)", fid, time.monotonic() - t0)
    return JSONResponse({"error": "result was evicted while being read; resubmit"}, status_code=410,
                        headers=fe_header)
