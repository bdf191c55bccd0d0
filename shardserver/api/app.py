"""Assembly of a front-end's FastAPI app: lifespan, middleware, exception handlers, routers.

The handlers themselves live in :mod:`.ops`, :mod:`.sessions`, :mod:`.sampling` and :mod:`.futures`; they
reach the process's :class:`~shardserver.api.state.FrontendContext` as
``request.app.state.frontend``. Routes are listed in README's API section.
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.middleware.errors import ServerErrorMiddleware

from ..metrics import HttpMetricsMiddleware, count_auth_rejected
from . import futures, ops, sampling, sessions
from .access_log import make_access_log
from .auth import AuthMiddleware
from .common import BodyError, validation_message
from .state import FrontendContext, context

__all__ = ["create_app", "lifespan", "body_error", "validation_error", "GatewayApp", "FAST_PATHS"]

log = logging.getLogger("shardserver.frontend")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect to every encoder, tell the supervisor READY (once), serve; then close everything."""
    ctx: FrontendContext = app.state.frontend
    await ctx.start()
    if ctx.ready_conn is not None:
        ctx.ready_conn.send(("ready", ctx.index, os.getpid()))
        ctx.ready_conn.close()
        ctx.ready_conn = None
    log.info("front-end %d ready (pid %d)", ctx.index, os.getpid())
    yield
    await ctx.stop()
    log.info("front-end %d stopped", ctx.index)


async def body_error(request: Request, exc: BodyError) -> JSONResponse:
    """A body that is too large (413), compressed (415) or not JSON (400); counted as ``http_<status>``."""
    ctx = context(request)
    ctx.count(f"http_{exc.status}")
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=ctx.fe_header)


async def validation_error(request: Request, exc: ValidationError) -> JSONResponse:
    """A body that does not fit its request model: 400 naming the first problems; counted as ``http_400``."""
    ctx = context(request)
    ctx.count("http_400")
    return JSONResponse({"error": validation_message(exc)}, status_code=400, headers=ctx.fe_header)


#: The hot endpoints (one ``asample`` and at least one ``retrieve_future`` per sample) that
#: :class:`GatewayApp` serves without FastAPI's routing; method ``POST`` only.
FAST_PATHS = {"/api/v1/asample": sampling.asample, "/api/v1/retrieve_future": sampling.retrieve_future}


def _fast_endpoint(handler):
    """ASGI app calling ``handler(Request) -> Response`` with the app's two exception handlers
    (:func:`body_error`, :func:`validation_error`), as FastAPI's route would."""

    async def endpoint(scope: dict, receive, send) -> None:
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except BodyError as exc:
            response = await body_error(request, exc)
        except ValidationError as exc:
            response = await validation_error(request, exc)
        await response(scope, receive, send)

    return endpoint


class GatewayApp(FastAPI):
    """FastAPI, except that ``POST`` to one of :data:`FAST_PATHS` takes a short way.

    The short way is ServerErrorMiddleware (500 on an unexpected exception), then the same
    :class:`~shardserver.metrics.HttpMetricsMiddleware` (counts, latency, access log) and
    :class:`~shardserver.api.auth.AuthMiddleware` as the full stack, then the handler with
    the app's exception handlers. It skips the router, dependency solving, FastAPI's telemetry
    and body-limit layers and the exit stack, which these two handlers do not use
    (``max_request_bytes`` is enforced by :func:`~shardserver.api.common.read_json`); their
    responses are byte-identical (tests/e2e/test_fast_path.py). ``server.fast_path = false``
    sends them through FastAPI too.
    """

    _fast: dict[str, object] = {}

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and scope["method"] == "POST":
            app = self._fast.get(scope["path"])
            if app is not None:
                scope["app"] = self
                await app(scope, receive, send)  # type: ignore[operator]
                return
        await super().__call__(scope, receive, send)


def create_app(ctx: FrontendContext) -> FastAPI:
    """The FastAPI app of one front-end, with ``ctx`` as ``app.state.frontend`` (a
    :class:`GatewayApp`: the two hot endpoints skip FastAPI's routing unless ``server.fast_path``
    is false)."""
    # FastAPI's native OpenTelemetry hook is off: this server exports its own metrics
    # (:mod:`shardserver.metrics`), and with it on every request looked up the global
    # tracer, meter and logger providers (~8% of a front-end's samples under burst-32k).
    app = GatewayApp(title="shardserver", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                     telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.frontend = ctx
    auth_kw = dict(table=ctx.auth, on_reject=count_auth_rejected,
                   headers=[(b"x-shardserver-front-end", str(ctx.index).encode())])
    access_log = make_access_log(ctx.cfg.server.access_log, ctx.index)
    # The last added runs first: count and time every response (401s included), then check the key.
    app.add_middleware(AuthMiddleware, **auth_kw)  # type: ignore[arg-type]
    app.add_middleware(HttpMetricsMiddleware, access_log=access_log)
    if ctx.cfg.server.fast_path:
        app._fast = {path: ServerErrorMiddleware(HttpMetricsMiddleware(
            AuthMiddleware(_fast_endpoint(handler), **auth_kw), access_log=access_log))  # type: ignore[arg-type]
            for path, handler in FAST_PATHS.items()}
    app.add_exception_handler(BodyError, body_error)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, validation_error)  # type: ignore[arg-type]
    # Routes match in this order; the /api/v1/ catch-all must come last.
    app.include_router(ops.router)
    app.include_router(sessions.router)
    app.include_router(sampling.router)
    app.include_router(futures.router)
    app.include_router(ops.fallback_router)
    # Which methods each path serves, for the catch-all's 405 (ops.not_served).
    app.state.route_methods = [(route.path_regex, set(route.methods)) for r in (
        ops.router, sessions.router, sampling.router, futures.router) for route in r.routes
        if isinstance(route, APIRoute)]
    return app
