"""The embedded engine simulator's process (started by the supervisor when ``engine.url`` is empty)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Any

__all__ = ["run_sim_process", "serve_sim_on_socket"]

log = logging.getLogger("shardserver.engine_sim")


async def serve_sim_on_socket(sock: socket.socket, sim_cfg: dict[str, Any], parent_pid: int | None = None) -> None:
    """Serve the simulator on an already-bound socket until SIGTERM (or the parent dies)."""
    from aiohttp import web

    from ..engine_sim import SimConfig, make_app

    app = make_app(SimConfig.from_mapping(sim_cfg))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's; it sends SIGTERM
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                if parent_pid is not None and os.getppid() != parent_pid:
                    break
    finally:
        await runner.cleanup()


def run_sim_process(sock: socket.socket, sim_cfg: dict[str, Any], log_level: str, parent_pid: int) -> None:
    """Spawn target: name the process ``shardserver: engine-sim`` and serve on ``sock``."""
    try:
        import setproctitle

        setproctitle.setproctitle("shardserver: engine-sim")
    except ImportError:  # pragma: no cover
        pass
    from ._subprocess import configure_logging

    configure_logging(log_level)
    import uvloop

    try:
        uvloop.run(serve_sim_on_socket(sock, sim_cfg, parent_pid))
    except KeyboardInterrupt:
        pass
