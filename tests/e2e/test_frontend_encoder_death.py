"""Encoder death races (issue 11, item 8): 64 clients keep sampling while encoder 0 is SIGKILLed
again and again. Requests that reach a dying encoder's connection answer 503 (``asample``: the
SDK retries) or 410 (``retrieve_future``: the SDK resubmits), never 500."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import Api
from frontend_raw_http import ConnectionBroken, RawConnection
from shardserver.testing import RunningServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CLIENTS = 64
KILLS = 4
GAP_S = 2.5


def _encoder_pid(pgid: int, shard: int) -> int | None:
    """The live ``shardserver: encoder <shard>`` process of the server whose process group is ``pgid``."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z" and cmd == f"shardserver: encoder {shard}":
            return int(d)
    return None


async def _sample_while_killing(port: int, ssid: str, pgid: int) -> tuple[collections.Counter, list[str], list[int]]:
    counts: collections.Counter = collections.Counter()
    bad: list[str] = []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        conn = RawConnection("127.0.0.1", port)
        await conn.connect()
        seq, rid = 0, None
        while not stop.is_set():
            if not conn.usable or await conn.closed_by_peer():
                conn = RawConnection("127.0.0.1", port)
                await conn.connect()
            try:
                if rid is None:
                    seq += 1
                    body = json.dumps({"sampling_session_id": ssid, "seq_id": i * 100_000 + seq, "num_samples": 1,
                                       "prompt": {"chunks": [{"tokens": [3, i, seq]}]},
                                       "sampling_params": {"max_tokens": 2, "seed": 1}}).encode()
                    r = await conn.request("POST", "/api/v1/asample", body, timeout=30)
                    counts[f"asample {r.status}"] += 1
                    if r.status == 200:
                        rid = r.json()["request_id"]
                    elif r.status != 503:
                        bad.append(f"asample {r.status} {r.body[:200]!r}")
                else:
                    r = await conn.request("POST", "/api/v1/retrieve_future",
                                           json.dumps({"request_id": rid}).encode(), timeout=30)
                    counts[f"retrieve {r.status}"] += 1
                    if r.status not in (200, 408, 410):
                        bad.append(f"retrieve_future {r.status} {r.body[:200]!r}")
                    if r.status != 408:
                        rid = None
            except ConnectionBroken as exc:
                bad.append(f"connection cut: {exc}")
        conn.close()

    async def killer() -> list[int]:
        killed = []
        for _ in range(KILLS):
            await asyncio.sleep(GAP_S)
            deadline = time.monotonic() + 10
            pid = None
            while pid is None and time.monotonic() < deadline:  # the restarted encoder may still be starting
                pid = _encoder_pid(pgid, 0)
                if pid is None:
                    await asyncio.sleep(0.05)
            assert pid is not None, "encoder 0 did not come back"
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        await asyncio.sleep(1.0)
        stop.set()
        return killed

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    killed = await killer()
    await asyncio.wait_for(asyncio.gather(*tasks), 40)
    return counts, bad, killed


def test_encoder_sigkilled_under_load_never_answers_500():
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 << 20), "SHARDSERVER_SIMULATOR__LATENCY_S": "0.02"}
    with RunningServer(env=env) as s:
        ssid = Api(s.url).sampling_session()
        counts, bad, killed = asyncio.run(_sample_while_killing(s.port, ssid, s.proc.pid))
        log = list(s.log_lines)
    assert len(set(killed)) == KILLS
    assert bad == [], f"{len(bad)} wrong answers: {bad[:5]} {dict(counts)}"
    assert counts["asample 200"] > CLIENTS and counts["retrieve 200"] > CLIENTS, dict(counts)
    assert counts["retrieve 410"] > 0, dict(counts)  # futures of the killed encoder
    assert not [ln for ln in log if "Exception in ASGI application" in ln or "RuntimeError" in ln]
