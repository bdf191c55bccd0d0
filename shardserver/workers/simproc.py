"""The embedded engine simulator's process (started by the supervisor when ``engine.url`` is empty)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any

from ..aio import cancel_and_wait
from ..process import configure_logging, set_process_title, watch_parent

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
    watcher = None
    if parent_pid is not None:
        watcher = loop.create_task(watch_parent(parent_pid, stop.set, who="engine-sim", logger=log),
                                   name="engine-sim-parent-watch")
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(watcher)
        await runner.cleanup()


def run_sim_process(sock: socket.socket, sim_cfg: dict[str, Any], log_level: str, parent_pid: int) -> None:
    """Spawn target: name the process ``shardserver: engine-sim`` and serve on ``sock``."""
    set_process_title("engine-sim")
    configure_logging(log_level)
    import uvloop

    try:
        uvloop.run(serve_sim_on_socket(sock, sim_cfg, parent_pid))
    except KeyboardInterrupt:
        pass
