"""The state of one front-end process, shared by every HTTP handler as ``app.state.frontend``.

Handlers get it with :func:`context` (``request.app.state.frontend``), the way starlette
and vLLM's API server share state, never through closures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..config import Config
from ..control import ControlClient
from ..ids import IdSigner
from ..messages import PollPending
from ..metrics import FrontendCounters
from ..shm.arena import ArenaReader
from .auth import KeyTable

__all__ = ["FrontendContext", "context"]


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
        auth: the accepted API keys (digests only).
        fe_header: ``{"X-Shardserver-Front-End": str(index), "X-Shardserver-Host": server.host_id}``,
            the headers of most answers (HAProxy's health check compares the host with its server
            name, so a host configured with the wrong ``server.host_id`` gets no traffic).
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
    auth: KeyTable = field(default_factory=KeyTable.open)  # the accepted API keys (digests only)
    fe_header: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.fe_header = {"X-Shardserver-Front-End": str(self.index), "X-Shardserver-Host": self.cfg.server.host_id}

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

    async def start(self) -> None:
        self.clients = [ControlClient(p, i) for i, p in enumerate(self.socket_paths)]
        for c in self.clients:
            c.start()
        for c in self.clients:
            await c.wait_connected(self.cfg.shards.ready_timeout_s)

    def drain(self) -> None:
        """Shutdown has begun: release held polls (they answer 408 try_again) and refuse new holds."""
        self.draining = True
        for c in self.clients:
            c.release_polls(PollPending(draining=True))

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def context(request: Request) -> FrontendContext:
    """The :class:`FrontendContext` of the app serving ``request`` (``request.app.state.frontend``)."""
    return request.app.state.frontend
