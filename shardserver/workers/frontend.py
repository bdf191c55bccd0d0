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
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from ..api.app import create_app
from ..api.state import FrontendContext
from ..api.auth import KeyTable
from ..config import Config
from ..ids import IdSigner
from ._subprocess import settle_gc
from .http_conn import ConnectionLimits, GatewayHttpProtocol, Listener, effective_max_connections

__all__ = ["DrainingServer", "FrontendProc"]

log = logging.getLogger("shardserver.frontend")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with this front-end's connection handling (:mod:`.http_conn`).

    * Connections are accepted by a :class:`~.http_conn.Listener` (the cap
      ``server.max_connections``) and served by :class:`~.http_conn.GatewayHttpProtocol`
      (``server.header_timeout_s`` / ``server.body_timeout_s``).
    * On SIGTERM, at once (not at uvicorn's next 0.1 s tick): stop accepting, take the
      connections already waiting in the backlog, close this process's listening socket,
      answer held retrieve_future polls (408 try_again, which the SDK re-polls) instead of
      cutting them off at the end of the graceful period, and mark every connection draining:
      each response carries ``Connection: close``, idle connections close after
      :data:`~.http_conn.DRAIN_IDLE_S`. Requests already received are answered; uvicorn then
      waits up to ``server.graceful_shutdown_s`` for the connections to close.
    """

    def __init__(self, config: uvicorn.Config, ctx: FrontendContext) -> None:
        super().__init__(config)
        self._ctx = ctx
        self.listener: Listener | None = None

    async def startup(self, sockets=None) -> None:  # type: ignore[override]
        """uvicorn's startup (lifespan first), with our Listener on ``sockets[0]`` instead of
        ``loop.create_server``; then :func:`~._subprocess.settle_gc`."""
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        assert sockets and len(sockets) == 1, "a front-end serves the supervisor's one listening socket"
        cfg = self._ctx.cfg.server
        loop = asyncio.get_running_loop()
        cap, soft = effective_max_connections(cfg.max_connections)
        if cap < cfg.max_connections:
            log.warning("front-end %d: server.max_connections=%d lowered to %d: the soft RLIMIT_NOFILE is %d "
                        "(raise it, e.g. ulimit -n, or lower server.max_connections)",
                        self._ctx.index, cfg.max_connections, cap, soft)
        auth = self._ctx.cfg.auth
        listener = self.listener = Listener(sockets[0], cap, self._ctx.index,
                                            key_share=auth.key_share if auth.mode == "keys" else 0.0,
                                            keys_mode=auth.mode == "keys")
        limits = ConnectionLimits(cfg.header_timeout_s, cfg.body_timeout_s, self._ctx.index, cfg.max_header_bytes,
                                  linger_bytes=2 * cfg.max_request_bytes, private_arena_copy=auth.mode == "keys")
        state, config = self.server_state, self.config

        def protocol() -> GatewayHttpProtocol:
            return GatewayHttpProtocol(config=config, server_state=state, app_state=self.lifespan.state,
                                       _loop=loop, limits=limits, listener=listener)

        listener.start(protocol)
        self.servers = [listener]  # type: ignore[list-item]  # uvicorn's shutdown calls close() and wait_closed()
        self.started = True
        settle_gc()  # the app, routes and encoder connections exist now: freeze them out of the GC

    def begin_drain(self) -> None:
        """Stop accepting and drain (see the class docstring); idempotent."""
        if self.listener is not None:
            taken = self.listener.drain()
            if taken:
                log.info("front-end %d: draining %d connections taken from the backlog", self._ctx.index, taken)
        for proto in list(self.server_state.connections):
            if isinstance(proto, GatewayHttpProtocol):
                proto.begin_drain()
        self._ctx.drain()

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        self.begin_drain()  # uvicorn's tick may notice should_exit before the signal's callback runs
        await super().shutdown(sockets)

    def handle_exit(self, sig, frame) -> None:  # runs in the signal handler: only schedule work
        if sig == signal.SIGINT:
            return  # Ctrl-C reaches the whole process group: the supervisor decides (it sends SIGTERM)
        super().handle_exit(sig, frame)
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self.begin_drain)
        except RuntimeError:
            pass


class FrontendProc:
    """Process wrapper: ``FrontendProc.run`` is the only spawn target of a front-end."""

    @staticmethod
    def run(cfg: Config, index: int, sock, socket_paths: list[str], secret: bytes, run_id: str,
            parent_pid: int, ready_conn=None, auth: KeyTable | None = None, heartbeat=None) -> None:
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
            server.begin_drain()

        async def main() -> None:
            from .liveness import start_heartbeat

            t = asyncio.get_running_loop().create_task(
                watch_parent(parent_pid, leave, who=f"front-end {index}", logger=log),
                name=f"front-end-{index}-parent-watch")
            # The supervisor's liveness check (server.liveness_timeout_s) reads these beats.
            hb = start_heartbeat(heartbeat, cfg.server.liveness_timeout_s, f"front-end-{index}-heartbeat")
            try:
                await server.serve(sockets=[sock])
            finally:
                t.cancel()
                if hb is not None:
                    hb.cancel()

        import uvloop

        uvloop.run(main())
