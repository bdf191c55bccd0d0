"""The SDK's session-wide poller (``retrieve_futures``) and ``cancel_future``.

``POST /api/v1/retrieve_futures`` (tinker >= 0.26.2, when ``/client/config`` says
``sample_use_retrieve_futures``) replaces one held ``retrieve_future`` per sample with one held
request per sampling session: the SDK waits on it until a sample's future completes, then
fetches that one result with ``retrieve_future`` and acknowledges it in the next poll
(``retrieved_request_ids``). 131,072 samples in flight then hold one connection, not 131,072.

Futures live in the shards (the shard a future ID hashes to), so a session's completions are
spread over every shard. Each shard stamps a completion with ``time.monotonic_ns()`` (one clock
for every process of the host, strictly increasing within a shard; moved up, by less than 1 µs, to
the next value congruent to the run's :func:`~shardserver.ids.cursor_tag`, so a cursor of another
run or clock is told apart and taken as 0) and keeps a log per session
(:meth:`shardserver.workers.encoder.EncoderCore.session_poll`). The cursor the SDK carries is
one such stamp: every completion of the session stamped at or before it has been reported. A
poll runs in up to three steps, each a SESSION_POLL to every shard:

1. Collect: ``T`` = now; each shard frees the acknowledged futures, forgets what the cursor has
   passed and returns its completions stamped in ``(cursor, T]`` (at most
   ``futures.retrieve_futures_max_ids / S`` each). A completion stamped at or before ``T`` was
   logged before ``T``, so before the shard read the request: none is missed. When a shard's
   list was cut, the answer stops at the earliest last stamp among the cut lists. The new cursor
   is the last stamp returned (unchanged when nothing is: an idle SDK stops polling).
2. Hold (only when step 1 found nothing and the client allows a hold): every shard holds until a
   completion of the session arrives there, for at most ``futures.long_poll_s`` (25 s; the SDK's
   client timeout is 45 s). Shutdown releases the hold at once.
3. When a shard woke: collect again (step 1, no acks) and answer that.

A shard that is down (restarting) or does not answer makes the poll answer 503, which the SDK
retries after 1 s with the same cursor and acks, so no completion is skipped. A future in flight
when the gateway restarted or its encoder died is not forgotten: each encoder journals the
futures it owes a report for in ``server.state_dir``
(:mod:`shardserver.workers.journal`), and the next encoder of the shard reports them as failed
(stamped at its start, so after any cursor of the earlier run); ``retrieve_future`` answers 410
and the SDK resubmits. Without a ``state_dir`` no journal is kept and such a future is never
reported, so the supervisor does not announce the poller in a run that cannot keep journals. An encoder
that is shutting down refuses new SUBMITs (503, the SDK retries): a future it accepted then
would be neither answered nor journaled.

``POST /api/v1/cancel_future`` (tinker >= 0.26, when ``/client/dynamic_config`` says
``sample_cancel_enabled``; the SDK sends it when the caller stops waiting for a sample): the
shard cancels the engine request (aiohttp closes the connection; vLLM aborts a request whose
client went away), frees its arena reservation or result, and forgets the future.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import ControlError, EncoderDeadError
from ..ids import CURSOR_TAG_SPAN, FutureIdStatus, cursor_tag, shard_of
from ..messages import CompletionEvent, SessionPollReply, SessionPollRequest
from .auth import owner_of
from .common import error, read_json, refuse_future_id
from .models import CancelFutureRequest, RetrieveFuturesRequest
from .state import FrontendContext, context

__all__ = ["router", "retrieve_futures", "cancel_future", "collect", "completions_json"]

log = logging.getLogger("shardserver.frontend")

router = APIRouter()

# Seconds a front-end waits for a shard's answer to a SESSION_POLL that is not held.
_CONTROL_TIMEOUT_S = 30.0


async def collect(ctx: FrontendContext, sid: str, clone: int, after: int, upto: int,
                  acks: list[list[str]] | None = None) -> tuple[list[CompletionEvent], int]:
    """Step 1 of a poll (module docstring): the session's completions stamped in ``(after, upto]``
    from every shard, oldest first, and the new cursor.

    ``acks[s]``: acknowledged future IDs of shard ``s``. Returns ``(events, cursor)``: ``cursor``
    is the last stamp returned, or ``after`` when none is; every completion stamped at or before
    it is in ``events`` (or was in an earlier answer).

    Raises:
        EncoderDeadError, ControlError, asyncio.TimeoutError: a shard did not answer.
    """
    shards = len(ctx.clients)
    limit = max(1, ctx.cfg.futures.retrieve_futures_max_ids // shards)
    replies = await asyncio.gather(*(
        c.session_poll(SessionPollRequest(sid=sid, clone=clone, after=after, upto=upto, limit=limit,
                                          acks=acks[i] if acks else []), timeout=_CONTROL_TIMEOUT_S)
        for i, c in enumerate(ctx.clients)), return_exceptions=True)
    bound = upto
    for r in replies:
        if isinstance(r, BaseException):
            raise r
        if r.more and r.events:
            bound = min(bound, r.events[-1].stamp)
    events = sorted((e for r in replies for e in r.events if e.stamp <= bound),  # type: ignore[union-attr]
                    key=lambda e: e.stamp)
    return events, (events[-1].stamp if events else after)


async def _hold(ctx: FrontendContext, sid: str, clone: int, after: int, upto: int, hold_s: float) -> bool:
    """Step 2: hold on every shard until one has a completion of the session stamped after
    ``after`` (True), or every hold ended without one, or shutdown began (False). A shard that
    fails ends the hold (False): the SDK polls again at once and step 1 reports the failure."""
    req = SessionPollRequest(sid=sid, clone=clone, after=after, upto=upto, limit=1, timeout=hold_s)
    tasks = [asyncio.ensure_future(c.session_poll(req, timeout=hold_s + 15)) for c in ctx.clients]
    drain = asyncio.ensure_future(ctx.drain_started.wait())
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {drain}, timeout=hold_s + 15,
                                               return_when=asyncio.FIRST_COMPLETED)
            pending.discard(drain)
            if drain.done() or not done:
                return False
            for t in done:
                if t.cancelled() or t.exception() is not None:
                    return False
                r: SessionPollReply = t.result()
                if r.woke or r.events:
                    return True
        return False
    finally:
        for t in (*tasks, drain):
            t.cancel()  # the shards' held requests are superseded by the next poll of the session


def completions_json(events: list[CompletionEvent]) -> list[dict[str, Any]]:
    """The SDK's ``FutureCompletion`` list (``tinker/types/future_completion.py``): ``finished``
    with ``response_payload_uncompressed_size`` (the protobuf's bytes), or ``failed`` (failed
    or gone: the SDK learns which from ``retrieve_future``)."""
    return [{"state": "finished", "request_id": e.fid, "response_payload_uncompressed_size": e.size}
            if e.ok else {"state": "failed", "request_id": e.fid} for e in events]


@router.post("/api/v1/retrieve_futures")
async def retrieve_futures(request: Request) -> JSONResponse:
    """The session-wide poller: ``{"completions": [...], "cursor": int}`` (module docstring).

    Served whether or not ``futures.retrieve_futures`` announces it: an SDK reads
    ``/client/config`` once, so one that learned the poller from an earlier run of the gateway
    keeps polling after a restart with the flag off (a 404 failed SDK 0.38's every later sample
    and made SDK 0.26.2 retry forever). 404 when the sampling session is not this server's (for
    this API key); 503 when a shard did not answer (the SDK retries after 1 s).
    """
    ctx = context(request)
    cfg = ctx.cfg
    req = RetrieveFuturesRequest.model_validate(await read_json(request))
    owner = owner_of(request)
    sid, clone = req.target.sampling_session_id, req.target.cloned_sampler_id
    if ctx.signer.open_sampling_session_id(sid, owner) is None:
        ctx.count("retrieve_futures_404")
        return error(404, "unknown sampling_session_id (sessions of an earlier server run are not kept unless "
                          "server.id_secret is set)")
    shards = cfg.shards.count
    acks: list[list[str]] = [[] for _ in range(shards)]
    for rid in req.retrieved_request_ids:
        if ctx.signer.check_future_id(rid, owner) == FutureIdStatus.OK:
            acks[shard_of(rid, shards)].append(rid)
    long_poll = cfg.futures.long_poll_s
    hold = 0.0 if ctx.draining else long_poll if req.timeout is None else min(req.timeout, long_poll)
    now = time.monotonic_ns()
    # A cursor from the future, or without this run's tag, was not issued by this run: it comes
    # from an earlier run or another clock (the host rebooted; the state directory moved to
    # another host), where it may lie between this run's start and now and would pass the
    # futures lost at the restart unreported. Start over (completions may come twice; the SDK
    # ignores those it does not wait for).
    prev = req.prev_cursor
    after = prev if prev <= now and prev % CURSOR_TAG_SPAN == cursor_tag(ctx.signer.run_id) else 0
    ctx.count("retrieve_futures")
    try:
        events, cursor = await collect(ctx, sid, clone, after, now, acks)
        if not events and hold > 0:
            ctx.count("retrieve_futures_held")
            if await _hold(ctx, sid, clone, after, now, hold):
                events, cursor = await collect(ctx, sid, clone, after, time.monotonic_ns())
    except (EncoderDeadError, ControlError, asyncio.TimeoutError) as exc:
        ctx.count("retrieve_futures_503")
        return JSONResponse({"error": f"a shard did not answer ({exc or type(exc).__name__}); retry"},
                            status_code=503, headers=ctx.fe_header)
    if events:
        ctx.count("retrieve_futures_completions", len(events))
    return JSONResponse({"completions": completions_json(events), "cursor": cursor}, headers=ctx.fe_header)


@router.post("/api/v1/cancel_future")
async def cancel_future(request: Request) -> JSONResponse:
    """Stop and forget a future: 200 ``{"request_id", "cancelled": true, "state"}`` with the state it
    was in (``pending``: its engine request was stopped and its reservation freed; ``done`` /
    ``failed`` / ``gone``: what it held was freed).

    Like ``retrieve_future``: 404 for an ID this run never issued (or another key's), 410 for one
    of an earlier run or one the shard no longer holds; 503 when the shard did not answer. 404
    when ``futures.cancel_enabled`` is off.
    """
    ctx = context(request)
    if not ctx.cfg.futures.cancel_enabled:
        return error(404, "cancel_future is disabled on this server (futures.cancel_enabled = false)")
    req = CancelFutureRequest.model_validate(await read_json(request))
    fid = req.request_id
    refused = refuse_future_id(ctx, fid, owner_of(request), "cancel")
    if refused is not None:
        return refused
    shard = shard_of(fid, ctx.cfg.shards.count)
    try:
        reply = await ctx.clients[shard].cancel(fid, timeout=_CONTROL_TIMEOUT_S)
    except EncoderDeadError as exc:
        ctx.count("cancel_410")
        return JSONResponse({"error": f"shard {shard} lost its state ({exc})"}, status_code=410,
                            headers=ctx.fe_header)
    except (ControlError, asyncio.TimeoutError) as exc:
        ctx.count("cancel_503")
        return JSONResponse({"error": f"shard {shard} did not answer ({exc or type(exc).__name__}); retry"},
                            status_code=503, headers=ctx.fe_header)
    if reply.was == "unknown":
        ctx.count("cancel_410")
        return JSONResponse({"error": "unknown or expired future (nothing to cancel)"}, status_code=410,
                            headers=ctx.fe_header)
    ctx.count(f"cancel_{reply.was}")
    return JSONResponse({"request_id": fid, "cancelled": True, "state": reply.was}, headers=ctx.fe_header)
