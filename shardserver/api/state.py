"""The state of one front-end process, shared by every HTTP handler as ``app.state.frontend``.

Handlers get it with :func:`context` (``request.app.state.frontend``), the way starlette
and vLLM's API server share state, never through closures.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..config import Config
from ..control import ControlClient
from ..ids import IdSigner
from ..messages import PollPending
from ..metrics import FrontendCounters
from ..shm.arena import SHM_DIR, ArenaReader
from .auth import KeyTable

__all__ = ["FrontendContext", "context"]


log = logging.getLogger("shardserver.frontend")

#: Seconds between a front-end's upkeep rounds (FrontendContext.upkeep).
UPKEEP_S = 5.0


@dataclass
class FrontendContext:
    """What one front-end process holds: no futures, no sessions, only connections and mappings.

    Attributes:
        cfg: the validated config.
        index: this front-end's index (0..F-1), sent as ``X-Shardserver-Front-End``.
        signer: mints and checks session, sampling-session and future IDs.
        socket_paths: the encoders' control sockets, index = shard.
        clients: one :class:`~shardserver.control.ControlClient` per shard (after :meth:`start`).
        readers: open arena segments by name.
        counters: this process's counters, shown by ``/stats``.
        ready_conn: pipe end on which the READY message goes to the supervisor (None after).
        draining: set once shutdown began (polls are not held any more).
        drain_started: an event set with ``draining`` (held ``retrieve_futures`` polls wait on it).
        auth: the accepted API keys (digests only).
        fe_header: ``{"X-Shardserver-Front-End": str(index), "X-Shardserver-Host": server.host_id}``,
            the headers of most answers (HAProxy's health check compares the host with its server
            name, so a host configured with the wrong ``server.host_id`` gets no traffic).
        engine_windows: ``{model id: context window in tokens}`` as the encoders learned it from the
            engine's ``GET /v1/models`` (empty until then, or with probing off); refreshed by
            :meth:`learn_engine_windows` and by every ``/readyz``.
    """

    cfg: Config
    index: int
    signer: IdSigner
    socket_paths: list[str]
    clients: list[ControlClient] = field(default_factory=list)
    readers: dict[str, ArenaReader] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=FrontendCounters)  # bytes_delivered also feeds Prometheus
    ready_conn: Any = None
    draining: bool = False
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)
    auth: KeyTable = field(default_factory=KeyTable.open)  # the accepted API keys (digests only)
    fe_header: dict[str, str] = field(init=False)
    engine_windows: dict[str, int] = field(default_factory=dict)
    _windows_task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _upkeep_task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _result_headers: dict[tuple[int, str], list[tuple[bytes, bytes]]] = field(default_factory=dict, init=False,
                                                                              repr=False)

    def __post_init__(self) -> None:
        self.fe_header = {"X-Shardserver-Front-End": str(self.index), "X-Shardserver-Host": self.cfg.server.host_id}

    def note_engine_windows(self, windows: dict[str, int]) -> None:
        """Keep the engine's context windows from STATS replies (an empty report changes nothing)."""
        if windows:
            self.engine_windows = dict(windows)

    async def learn_engine_windows(self) -> None:
        """Forever: every ``engine.health_interval_s`` (at most 1 s; 0.2 s in the first 30 s
        while nothing was learned) ask one encoder (in turn) for its STATS and keep the context
        windows its engine probe learned, so ``asample`` follows an engine restarted with
        another model."""
        from ..health import engine_models_of
        from ..metrics import gather_stats

        interval = min(self.cfg.engine.health_interval_s, 1.0)
        fast_until = asyncio.get_running_loop().time() + 30.0
        turn = 0
        while True:
            if self.clients:
                c = self.clients[turn % len(self.clients)]
                turn += 1
                self.note_engine_windows(engine_models_of(await gather_stats([c], timeout=2.0)))
            fast = not self.engine_windows and asyncio.get_running_loop().time() < fast_until
            await asyncio.sleep(min(interval, 0.2) if fast else interval)

    def result_headers(self, shard: int, media_type: str, length: int) -> list[tuple[bytes, bytes]]:
        """The raw headers of a 200 result of ``length`` bytes from ``shard``: exactly what
        starlette's ``Response(headers={**fe_header, "X-Shardserver-Shard": str(shard)},
        media_type=media_type)`` builds (lower-cased given headers in order, then content-length,
        then content-type), with everything but the length built once per (shard, media type)."""
        key = (shard, media_type)
        head = self._result_headers.get(key)
        if head is None:
            hdrs = {**self.fe_header, "X-Shardserver-Shard": str(shard)}
            head = self._result_headers[key] = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                                for k, v in hdrs.items()]
        return [*head, (b"content-length", b"%d" % length), (b"content-type", media_type.encode("latin-1"))]

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def reader(self, name: str) -> ArenaReader:
        r = self.readers.get(name)
        if r is None:
            shard_prefix = name.rsplit(".", 1)[0]
            for old in [k for k in self.readers if k.rsplit(".", 1)[0] == shard_prefix]:
                self.readers.pop(old).close()  # that shard's encoder was restarted with a fresh arena
            r = self.readers[name] = ArenaReader(name)
        return r

    def drop_unlinked_readers(self) -> None:
        """Close the arena readers whose segment is gone from ``/dev/shm`` (an encoder was
        restarted: the supervisor unlinked its arena before starting the new one). Called when a
        control client reconnects; until then a shard's old reader was closed only by the first
        result read from its new arena, so with no such read it kept the old arena mapped, and
        tmpfs kept its pages (a break test counted 6 MiB per restart). A reader with views still
        alive (a response being sent) is unmapped when the last of them goes."""
        for name in [n for n in self.readers if not os.path.exists(os.path.join(SHM_DIR, n))]:
            self.readers.pop(name).close()

    async def upkeep(self) -> None:
        """Forever, every :data:`UPKEEP_S`: write this process's metrics files again if a
        ``/tmp`` cleaner removed them with the run directory
        (:func:`~shardserver.prometheus_dir.restore_removed_files`)."""
        from ..prometheus_dir import restore_removed_files

        while True:
            await asyncio.sleep(UPKEEP_S)
            try:
                restore_removed_files()
            except Exception:  # the metrics must never stop the front-end
                log.exception("front-end %d: cannot write its metrics files again", self.index)

    async def start(self) -> None:
        self.clients = [ControlClient(p, i) for i, p in enumerate(self.socket_paths)]
        for c in self.clients:
            c.on_reconnect = self.drop_unlinked_readers
            c.start()
        for c in self.clients:
            await c.wait_connected(self.cfg.shards.ready_timeout_s)
        self._upkeep_task = asyncio.get_running_loop().create_task(self.upkeep(), name="front-end-upkeep")
        if self.cfg.engine.health_interval_s > 0:  # the encoders' probes learn the engine's windows
            self._windows_task = asyncio.get_running_loop().create_task(self.learn_engine_windows(),
                                                                        name="learn-engine-windows")

    def drain(self) -> None:
        """Shutdown has begun: release held polls (they answer 408 try_again) and refuse new holds."""
        self.draining = True
        self.drain_started.set()
        for c in self.clients:
            c.release_polls(PollPending(draining=True))

    async def stop(self) -> None:
        from ..aio import cancel_and_wait

        await cancel_and_wait(self._windows_task)
        self._windows_task = None
        await cancel_and_wait(self._upkeep_task)
        self._upkeep_task = None
        for c in self.clients:
            await c.close()
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def context(request: Request) -> FrontendContext:
    """The :class:`FrontendContext` of the app serving ``request`` (``request.app.state.frontend``)."""
    return request.app.state.frontend
