"""Helpers every spawned child runs first: process title, logging, stdin."""

from __future__ import annotations

import gc
import os

from ..config import Config
from ..process import configure_logging, set_process_title

__all__ = ["child_setup", "configure_logging", "settle_gc", "GC_THRESHOLD", "run_encoder", "run_front_end"]


def child_setup(role: str, cfg: Config) -> None:
    """Name the process ``shardserver: <role>`` for ps, set up logging, detach stdin."""
    set_process_title(role)
    configure_logging(cfg.server.log_level)
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    except OSError:
        pass


#: Cyclic-GC thresholds of a serving child (CPython's default is (700, 10, 10)). A front-end
#: or encoder allocates thousands of short-lived containers per request (ASGI scopes, dicts,
#: coroutine frames); with the default, a generation-0 pass ran every few requests and the
#: older generations re-walked the whole imported FastAPI/pydantic object graph.
GC_THRESHOLD = (50_000, 20, 100)


def settle_gc() -> None:
    """Call once a child has finished starting: freeze what exists (modules, app, routes,
    config; :func:`gc.freeze` moves them to the permanent generation, which the collector never
    walks) and raise the thresholds to :data:`GC_THRESHOLD`. Reference counting still frees
    everything acyclic at once; cycles are collected, only less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


# The spawn targets of the workers. The supervisor hands these to multiprocessing rather than
# ``EncoderProc.run`` / ``FrontendProc.run``, whose modules it would have to import first: it then
# carried every worker's imports (numpy, simdjson, protobuf, aiohttp, FastAPI) without using them,
# 57 MiB of PSS at the demo config. A spawned child unpickles the target by name, so it imports
# this small module and then the worker's.
def run_encoder(*args: object, **kwargs: object) -> None:
    """Run :meth:`shardserver.workers.encoder.EncoderProc.run` (same arguments) in this process."""
    from .encoder import EncoderProc

    EncoderProc.run(*args, **kwargs)  # type: ignore[arg-type]


def run_front_end(*args: object, **kwargs: object) -> None:
    """Run :meth:`shardserver.workers.frontend.FrontendProc.run` (same arguments) in this process."""
    from .frontend import FrontendProc

    FrontendProc.run(*args, **kwargs)  # type: ignore[arg-type]
