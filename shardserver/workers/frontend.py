"""Front-end workers: FastAPI on uvicorn (uvloop + httptools), stateless.

Any front-end serves any request. Sessions are signed IDs (:mod:`shardserver.ids`),
futures live in the encoders, and result bytes are copied straight out of
the owning shard's arena into the response: no re-encoding, no pickling, one
memcpy. This module holds only the process: :class:`FrontendProc` runs the app
of :func:`shardserver.api.app.create_app` (the HTTP handlers are in
:mod:`shardserver.api`) on the supervisor's listening socket, in a
:class:`DrainingServer`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal

import uvicorn

from ..api.app import create_app
from ..api.state import FrontendContext
from ..api.auth import KeyTable
from ..config import Config
from ..ids import IdSigner

__all__ = ["DrainingServer", "FrontendProc"]

log = logging.getLogger("shardserver.frontend")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, plus: when shutdown starts, held retrieve_future polls are answered at
    once (408 try_again, which the SDK re-polls) instead of being cut off as 500s at the end of
    the graceful period."""

    def __init__(self, config: uvicorn.Config, ctx: FrontendContext) -> None:
        super().__init__(config)
        self._ctx = ctx

    def handle_exit(self, sig, frame) -> None:  # runs in the signal handler: only schedule work
        if sig == signal.SIGINT:
            return  # Ctrl-C reaches the whole process group: the supervisor decides (it sends SIGTERM)
        super().handle_exit(sig, frame)
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self._ctx.drain)
        except RuntimeError:
            pass


class FrontendProc:
    """Process wrapper: ``FrontendProc.run`` is the only spawn target of a front-end."""

    @staticmethod
    def run(cfg: Config, index: int, sock, socket_paths: list[str], secret: bytes, run_id: str,
            parent_pid: int, ready_conn=None, auth: KeyTable | None = None) -> None:
        from ..process import die_with_parent, watch_parent
        from ._subprocess import child_setup

        # SIGTERM: uvicorn's shutdown closes the listening socket first, then finishes its responses.
        die_with_parent(parent_pid, signal.SIGTERM)
        child_setup(f"front-end {index}", cfg)
        ctx = FrontendContext(cfg=cfg, index=index, signer=IdSigner(secret, run_id, cfg.server.host_id),
                              socket_paths=socket_paths, ready_conn=ready_conn, auth=auth or KeyTable.open())
        app = create_app(ctx)
        ucfg = uvicorn.Config(
            app, loop="uvloop", http="httptools", lifespan="on", access_log=False,  # see shardserver.api.access_log
            log_config=None, log_level=cfg.server.log_level, timeout_keep_alive=max(1, math.ceil(cfg.server.keep_alive_s)),
            timeout_graceful_shutdown=max(1, math.ceil(cfg.server.graceful_shutdown_s)), backlog=cfg.server.backlog,
            server_header=False)
        server = DrainingServer(ucfg, ctx)

        def leave() -> None:
            server.should_exit = True

        async def main() -> None:
            t = asyncio.get_running_loop().create_task(
                watch_parent(parent_pid, leave, who=f"front-end {index}", logger=log),
                name=f"front-end-{index}-parent-watch")
            try:
                await server.serve(sockets=[sock])
            finally:
                t.cancel()

        import uvloop

        uvloop.run(main())
