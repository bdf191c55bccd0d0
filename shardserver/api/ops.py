"""Operations endpoints: liveness, readiness, metrics, stats, and what this gateway does not serve.

``/healthz``, ``/readyz`` and ``/metrics`` need no API key
(:data:`shardserver.api.auth.PUBLIC_PATHS`). Their bodies are described in
``docs/OPERATIONS.md``. :data:`fallback_router` holds the catch-all under ``/api/v1/``
and must be the last router included (see :func:`shardserver.api.app.create_app`).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import ControlError, EncoderDeadError
from ..health import readiness
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import metrics_body
from .common import error
from .state import context

__all__ = ["router", "fallback_router", "TRAINING_ENDPOINTS", "healthz", "readyz", "metrics", "stats",
           "not_served"]

# Endpoints of the Tinker API that train; this gateway only samples.
TRAINING_ENDPOINTS = (
    "create_model", "forward", "forward_backward", "optim_step", "load_weights", "save_weights",
    "save_weights_for_sampler", "get_info", "unload_model", "load_state", "save_state",
)

router = APIRouter()
fallback_router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    """200 ``{"status": "ok", "front_end": i, "pid": p}`` while this process runs."""
    ctx = context(request)
    return JSONResponse({"status": "ok", "front_end": ctx.index, "pid": os.getpid()}, headers=ctx.fe_header)


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """200 when every encoder is connected and the engine reachable, else 503 with the reason
    (:func:`shardserver.health.readiness`)."""
    ctx = context(request)
    # encoders connected, the engine reachable and serving the pinned engine.model (if any)
    status, body = await readiness(ctx.clients, model=ctx.cfg.engine.model)
    ctx.note_engine_windows(body.get("max_model_len") or {})  # the freshest windows, for asample
    return JSONResponse(body, status_code=status, headers=ctx.fe_header)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format, aggregated over every process of the run (:func:`shardserver.metrics.metrics_body`)."""
    ctx = context(request)
    return Response(await metrics_body(ctx.clients), media_type=METRICS_CONTENT_TYPE, headers=ctx.fe_header)


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    """JSON: this front-end's counters and every shard's STATS reply (or ``{"shard", "error"}``
    for a shard that did not answer within 5 s)."""
    ctx = context(request)
    shards_out: list[Any] = []
    for c in ctx.clients:
        try:
            shards_out.append(msgspec.to_builtins(await c.stats(timeout=5)))
        except (EncoderDeadError, ControlError, asyncio.TimeoutError) as exc:
            shards_out.append({"shard": c.shard, "error": str(exc)})
    return JSONResponse({"front_end": ctx.index, "pid": os.getpid(), "counters": ctx.counters,
                         "shards": shards_out}, headers=ctx.fe_header)


@fallback_router.api_route("/api/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
async def not_served(path: str, request: Request) -> JSONResponse:
    """Any other ``/api/v1/`` path: 501 for a Tinker training endpoint (:data:`TRAINING_ENDPOINTS`),
    404 otherwise."""
    ctx = context(request)
    if path.split("/")[0] in TRAINING_ENDPOINTS:
        ctx.count("http_501")
        return error(501, f"/api/v1/{path} is a training endpoint: not supported by this gateway "
                          "(it only samples)")
    allowed = _methods_served(request)
    if allowed:
        ctx.count("http_405")
        return JSONResponse({"error": f"/api/v1/{path} does not take {request.method[:16]}: use {', '.join(allowed)}"},
                            status_code=405, headers={"Allow": ", ".join(allowed)})
    ctx.count("http_404")
    return error(404, f"no such endpoint: /api/v1/{path}")


def _methods_served(request: Request) -> list[str]:
    """The methods (sorted) that the app's routes serve at the request's path, from
    ``app.state.route_methods`` (``[(path regex, methods)]``, set by ``create_app``): the
    ``Allow`` of a 405 for a path that exists under another method (``GET /api/v1/asample``)."""
    path = request.scope["path"]
    allowed: set[str] = set()
    for regex, methods in getattr(request.app.state, "route_methods", ()):
        if regex.match(path):
            allowed |= methods
    allowed.discard("HEAD")
    return sorted(allowed)
