"""SIGTERM under load (issue 11, item 3, the front-end side): 128 raw HTTP/1.1 keep-alive clients
keep sampling (asample, then retrieve_future until done) when the supervisor gets SIGTERM.

Every request a client sent must get a complete answer: no connection reset, no connection
closed before the response. Held long-polls are answered 408 try_again at once; answers
during the drain carry ``Connection: close``; new connections are refused once the
front-ends stopped listening (clean for a client: nothing was sent).
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time

import pytest

from conftest import Api
from frontend_raw_http import ConnectionBroken, RawConnection
from shardserver.testing import RunningServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CLIENTS = 128


async def _load(port: int, ssid: str, proc, load_s: float) -> tuple[collections.Counter, list[str]]:
    """Run CLIENTS sampling loops for ``load_s`` s, SIGTERM ``proc``, run until every client is
    refused. Returns (counts of outcomes, descriptions of the broken exchanges)."""
    counts: collections.Counter = collections.Counter()
    broken: list[str] = []
    term = asyncio.Event()

    async def client(i: int) -> None:
        conn: RawConnection | None = None
        rid = None
        seq = 0
        deadline = time.monotonic() + load_s + 30
        while time.monotonic() < deadline:
            if conn is None or not conn.usable or await conn.closed_by_peer():
                if conn is not None:
                    conn.close()
                conn = RawConnection("127.0.0.1", port)
                try:
                    await conn.connect()
                except ConnectionRefusedError:
                    counts["refused after TERM" if term.is_set() else "refused before TERM"] += 1
                    return
            sent_after_term = term.is_set()
            try:
                if rid is None:
                    seq += 1
                    body = json.dumps({"sampling_session_id": ssid, "seq_id": i * 10_000 + seq, "num_samples": 1,
                                       "prompt": {"chunks": [{"tokens": [7, i, seq]}]},
                                       "sampling_params": {"max_tokens": 3, "seed": 1}}).encode()
                    r = await conn.request("POST", "/api/v1/asample", body)
                    phase = "drain" if term.is_set() else "load"
                    if r.status == 200:
                        rid = r.json()["request_id"]
                    counts[f"{phase} asample {r.status}"] += 1
                else:
                    r = await conn.request("POST", "/api/v1/retrieve_future", json.dumps({"request_id": rid}).encode())
                    phase = "drain" if term.is_set() else "load"
                    if r.status != 408:
                        rid = None
                    elif term.is_set():
                        assert r.json()["type"] == "try_again"
                    counts[f"{phase} retrieve {r.status}"] += 1
                if phase == "drain" and r.closes:
                    counts["drain answers with Connection: close"] += 1
            except ConnectionBroken as exc:
                broken.append(f"client {i} (sent {'after' if sent_after_term else 'before'} SIGTERM): {exc}")
                conn = None
        counts["client ran out of time"] += 1

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    await asyncio.sleep(load_s)
    term.set()
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*tasks), 40)
    return counts, broken


def test_sigterm_with_128_clients_in_flight_resets_none():
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 << 20),
           # Results take 0.3 s, so at any time most clients hold a retrieve_future long-poll.
           "SHARDSERVER_SIMULATOR__LATENCY_S": "0.3"}
    with RunningServer(env=env) as s:
        ssid = Api(s.url).sampling_session()
        counts, broken = asyncio.run(_load(s.port, ssid, s.proc, load_s=2.0))
        assert s.proc.wait(20) == 0
    assert broken == [], f"{len(broken)} exchanges cut: {broken[:5]} ... {dict(counts)}"
    assert counts["refused after TERM"] == CLIENTS, dict(counts)  # every client ended on a refused connect
    assert counts["client ran out of time"] == 0 and counts["refused before TERM"] == 0, dict(counts)
    # Under load every client sampled; the held polls were answered at once with try_again.
    assert counts["load retrieve 200"] >= CLIENTS, dict(counts)
    assert counts["drain retrieve 408"] >= CLIENTS // 2, dict(counts)
    assert counts["drain answers with Connection: close"] >= CLIENTS // 2, dict(counts)
    assert not [k for k in counts if k.split()[-1].startswith("5")], dict(counts)
    assert not any("Exception in ASGI application" in line for line in s.log_lines)
