"""Assembly of a front-end's FastAPI app: lifespan, middleware, exception handlers, routers.

The handlers themselves live in :mod:`.ops`, :mod:`.sessions` and :mod:`.sampling`; they
reach the process's :class:`~shardserver.api.state.FrontendContext` as
``request.app.state.frontend``. Routes are listed in README's API section.
"""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..metrics import HttpMetricsMiddleware, count_auth_rejected
from . import ops, sampling, sessions
from .access_log import make_access_log
from .auth import AuthMiddleware
from .common import BodyError, validation_message
from .state import FrontendContext, context

__all__ = ["create_app", "lifespan", "body_error", "validation_error"]

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
    """A body that is too large (413) or not JSON (400); counted as ``http_<status>``."""
    ctx = context(request)
    ctx.count(f"http_{exc.status}")
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=ctx.fe_header)


async def validation_error(request: Request, exc: ValidationError) -> JSONResponse:
    """A body that does not fit its request model: 400 naming the first problems; counted as ``http_400``."""
    ctx = context(request)
    ctx.count("http_400")
    return JSONResponse({"error": validation_message(exc)}, status_code=400, headers=ctx.fe_header)


def create_app(ctx: FrontendContext) -> FastAPI:
    """The FastAPI app of one front-end, with ``ctx`` as ``app.state.frontend``."""
    app = FastAPI(title="shardserver", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = ctx
    # The last added runs first: count and time every response (401s included), then check the key.
    app.add_middleware(AuthMiddleware, table=ctx.auth, on_reject=count_auth_rejected,
                       headers=[(b"x-shardserver-front-end", str(ctx.index).encode())])
    app.add_middleware(HttpMetricsMiddleware, access_log=make_access_log(ctx.cfg.server.access_log, ctx.index))
    app.add_exception_handler(BodyError, body_error)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, validation_error)  # type: ignore[arg-type]
    # Routes match in this order; the /api/v1/ catch-all must come last.
    app.include_router(ops.router)
    app.include_router(sessions.router)
    app.include_router(sampling.router)
    app.include_router(ops.fallback_router)
    return app
