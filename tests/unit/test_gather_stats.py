"""gather_stats (``/metrics``, ``/readyz``) right after an encoder (re)starts listening.

A front-end's :class:`~shardserver.control.ControlClient` retries its connection every
0.05 -> 0.5 s; between the encoder starting to listen and that retry, a scrape used to report
a live encoder as down (``shardserver_encoder_up 0``, no ``shardserver_futures`` for it): the
failure seen in CI in ``test_counts_survive_an_encoder_restart``. Real Unix sockets.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from shardserver.control import ControlClient, serve_control
from shardserver.messages import StatsReply, StatsRequest
from shardserver.metrics import RECONNECT_GRACE_S, gather_stats


def _reply() -> StatsReply:
    return StatsReply(shard=0, pid=os.getpid(), futures={"retrieved": 2}, delivered_held=0, arena_bytes=1 << 20,
                      arena_used_bytes=4096, arena_reserved_bytes=0, decode_encode_s=0.0, counters={},
                      stages={"retrieved": 2}, engine=None)


async def _handler(msg, blob):
    assert isinstance(msg, StatsRequest)
    return _reply()


def test_a_scrape_waits_for_the_reconnect_to_a_restarted_encoder():
    async def main() -> tuple[dict, dict, float]:
        with tempfile.TemporaryDirectory(prefix="ss-gs-") as d:
            path = os.path.join(d, "enc0.sock")
            client = ControlClient(path, 0)
            client.start()
            await asyncio.sleep(0.8)  # nothing listens: the client's retry delay has grown to 0.5 s
            assert not client.connected
            server = await serve_control(path, _handler)
            try:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                [first] = await gather_stats([client], timeout=2.0)
                waited = loop.time() - t0
                [second] = await gather_stats([client], timeout=2.0)
            finally:
                await client.close()
                server.close()
                await server.wait_closed()
            return first, second, waited

    first, second, waited = asyncio.run(main())
    assert first == second
    assert (first["shard"], first["stages"], first["arena_used_bytes"]) == (0, {"retrieved": 2}, 4096)
    assert waited <= RECONNECT_GRACE_S + 0.2


def test_an_encoder_that_stays_down_is_reported_after_the_grace():
    async def main() -> tuple[dict, float]:
        with tempfile.TemporaryDirectory(prefix="ss-gs-") as d:
            client = ControlClient(os.path.join(d, "enc0.sock"), 3)
            client.start()
            try:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                [r] = await gather_stats([client], timeout=2.0)
                return r, loop.time() - t0
            finally:
                await client.close()

    r, waited = asyncio.run(main())
    assert r == {"shard": 3, "error": "encoder 3 is not connected"}
    assert RECONNECT_GRACE_S - 0.05 <= waited <= RECONNECT_GRACE_S + 0.3
