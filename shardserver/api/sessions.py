"""Session endpoints: the SDK's setup calls and the sampling session.

Sessions hold no server state: a session ID and a sampling-session ID are signed by
:class:`shardserver.ids.IdSigner` (the sampling-session ID carries ``base_model`` and
``model_path``) and bound to the request's API-key owner (:func:`shardserver.api.auth.owner_of`),
so any front-end checks them. The request bodies are the SDK's
(:mod:`shardserver.api.models`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..ids import SamplingSession
from .auth import owner_of
from .common import error, read_json
from .models import CreateSamplingSessionRequest, CreateSessionRequest
from .state import context

__all__ = ["router", "MAX_MODEL_NAME", "client_config", "dynamic_config", "create_session", "session_heartbeat",
           "finish_session", "telemetry", "create_sampling_session", "get_sampler"]

# Longest base_model / model_path accepted (they travel inside the signed sampling-session ID).
MAX_MODEL_NAME = 512

router = APIRouter()


@router.post("/api/v1/client/config")
async def client_config(request: Request) -> JSONResponse:
    """``{"pjwt_auth_enabled": false}``: the SDK keeps sending its API key (no JWT exchange); plus
    ``"sample_use_retrieve_futures": true`` when ``futures.retrieve_futures`` is on (SDK 0.26.2+
    then waits on the session-wide poller, :mod:`shardserver.api.futures`; older SDKs ignore it)."""
    await read_json(request)
    ctx = context(request)
    body: dict[str, bool] = {"pjwt_auth_enabled": False}
    if ctx.cfg.futures.retrieve_futures:
        body["sample_use_retrieve_futures"] = True
    return JSONResponse(body, headers=ctx.fe_header)


@router.post("/api/v1/client/dynamic_config")
async def dynamic_config(request: Request) -> JSONResponse:
    """``{"sample_cancel_enabled": true}`` when ``futures.cancel_enabled`` is on (SDK 0.26+ then sends
    ``cancel_future`` for a sample its caller stopped waiting for), else ``{}``."""
    await read_json(request)
    ctx = context(request)
    return JSONResponse({"sample_cancel_enabled": True} if ctx.cfg.futures.cancel_enabled else {},
                        headers=ctx.fe_header)


@router.post("/api/v1/create_session")
async def create_session(request: Request) -> JSONResponse:
    """A new signed session ID, bound to the request's owner."""
    ctx = context(request)
    CreateSessionRequest.model_validate(await read_json(request))
    return JSONResponse({"session_id": ctx.signer.mint_session_id(owner_of(request)), "type": "create_session"},
                        headers=ctx.fe_header)


@router.post("/api/v1/session_heartbeat")
async def session_heartbeat(request: Request) -> JSONResponse:
    """200 for a session ID this server signed for this owner, else 404."""
    ctx = context(request)
    body = await read_json(request)
    if not isinstance(body, dict) or not ctx.signer.check_session_id(body.get("session_id"), owner_of(request)):
        return error(404, "unknown session_id")
    return JSONResponse({"type": "session_heartbeat"}, headers=ctx.fe_header)


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> JSONResponse:
    """``{}``. The SDK (tinker >= 0.27, ``ServiceClient.close()``) is done with the session: every
    shard is told (SESSION_FINISHED), so the results of its sampling sessions that were never
    retrieved may be evicted at once when a new sample finds no room (``futures.abandoned_after_s``
    otherwise). An ID this server did not sign for this owner changes nothing (still ``{}``: the
    SDK ignores the answer)."""
    await read_json(request)
    ctx = context(request)
    owner = owner_of(request)
    if ctx.signer.check_session_id(session_id, owner):
        for c in ctx.clients:
            c.session_finished(session_id[-16:], owner)
    return JSONResponse({}, headers=ctx.fe_header)


@router.post("/api/v1/telemetry")
async def telemetry(request: Request) -> JSONResponse:
    """Accepted and dropped."""
    await read_json(request)
    return JSONResponse({"status": "accepted"}, headers=context(request).fe_header)


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: Request) -> JSONResponse:
    """A signed sampling-session ID carrying ``base_model`` / ``model_path``.

    404 for an unknown session ID; 400 without either model name, or with one longer than
    :data:`MAX_MODEL_NAME` characters.
    """
    ctx = context(request)
    req = CreateSamplingSessionRequest.model_validate(await read_json(request))
    if not ctx.signer.check_session_id(req.session_id, owner_of(request)):
        return error(404, f"unknown session_id {req.session_id[:64]!r} (create_session first)")
    if not req.base_model and not req.model_path:
        return error(400, "create_sampling_session needs base_model or model_path")
    for name in ("base_model", "model_path"):
        v = getattr(req, name)
        if v is not None and len(v) > MAX_MODEL_NAME:
            return error(400, f"{name} is {len(v)} characters long; at most {MAX_MODEL_NAME} are accepted")
    sid = ctx.signer.mint_sampling_session_id(
        SamplingSession(req.session_id, req.base_model, req.model_path, req.sampling_session_seq_id),
        owner_of(request))
    return JSONResponse({"sampling_session_id": sid, "type": "create_sampling_session"}, headers=ctx.fe_header)


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> JSONResponse:
    """``{"sampler_id", "base_model", "model_path"}`` of a sampling-session ID, or 404."""
    ctx = context(request)
    sess = ctx.signer.open_sampling_session_id(sampler_id, owner_of(request))
    if sess is None:
        return error(404, "unknown sampler id")
    # base_model picks the client's tokenizer: a model_path-only session reports the engine's model.
    base = sess.base_model or ctx.cfg.engine.model or sess.model_path or ""
    return JSONResponse({"sampler_id": sampler_id, "base_model": base, "model_path": sess.model_path},
                        headers=ctx.fe_header)
