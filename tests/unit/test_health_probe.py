"""The engine probe (:class:`shardserver.health.EngineProbe`) against a real server on 127.0.0.1,
over both transports: ``http://`` (the encoders' own client) and ``https://`` (aiohttp, TLS with
the test certificate of ``tests/e2e/tls``). Both must give the same verdicts: a redirect is an
answer (reachable; never followed), and an answer body over ``PROBE_BODY_LIMIT`` fails the probe
with a reason that says so, without reading it all (before: the https probe read any body whole,
1.9 GB peak for a 4 GiB ``/health``, and followed redirects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CERT = REPO / "tests" / "e2e" / "tls" / "cert.pem"

# Run in a child process: aiohttp builds its verifying TLS context when imported, from
# SSL_CERT_FILE among others, and this pytest process may have imported it already.
SCRIPT = r'''
import asyncio, json, ssl, sys
sys.path.insert(0, sys.argv[2])
from shardserver.health import EngineProbe, PROBE_BODY_LIMIT

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 1024}]}).encode()
BIG = 8 << 20
ANSWERS = [
    b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:1/health\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(MODELS) + MODELS,
    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % BIG + b" " * BIG,
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + (b"100000\r\n" + b" " * (1 << 20) + b"\r\n") * 8 + b"0\r\n\r\n",
]

async def main(scheme):
    seen = []
    async def handle(r, w):
        try:
            head = await r.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics "):  # the progress read after a reachable probe: none here
                w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await w.drain()
                return
            seen.append(head.split(b"\r\n")[0].decode())
            w.write(ANSWERS[len(seen) - 1])
            await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            w.close()
    ctx = None
    if scheme == "https":
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(sys.argv[3], sys.argv[4])
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    probe = EngineProbe(f"{scheme}://127.0.0.1:{port}", interval_s=60, timeout_s=5.0)
    probe.open()
    out = []
    for _ in range(3):
        ok = await probe.check_once()
        out.append([ok, probe.reason, probe.models])
    await probe.close()
    server.close()
    await server.wait_closed()
    print(json.dumps({"checks": out, "seen": seen}))

asyncio.run(main(sys.argv[1]))
'''


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_probe_verdicts_are_the_same_over_http_and_https(scheme: str) -> None:
    env = {**os.environ, "SSL_CERT_FILE": str(CERT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, scheme, str(REPO), str(CERT), str(CERT.with_name("key.pem"))],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    too_large = ("the answer's body is over 4194304 bytes, the most a probe reads (health.PROBE_BODY_LIMIT)")
    url = f"{scheme}://127.0.0.1:"
    checks = got["checks"]
    # 1: /health answers 302 (reachable, not followed), /v1/models tells the window.
    assert checks[0] == [True, "", {"m": 1024}]
    # 2: /health with an 8 MiB Content-Length body: not reachable, said why; the window stays.
    assert checks[1][0] is False and checks[1][2] == {"m": 1024}
    assert checks[1][1].startswith(f"cannot reach engine at {url}") and checks[1][1].endswith(
        f"/health: {too_large}"), checks[1][1]
    # 3: /health with an 8 MiB chunked body: the same.
    assert checks[2][0] is False and checks[2][1].endswith(f"/health: {too_large}"), checks[2][1]
    assert got["seen"] == ["GET /health HTTP/1.1", "GET /v1/models HTTP/1.1", "GET /health HTTP/1.1",
                           "GET /health HTTP/1.1"]


def test_a_slow_models_answer_does_not_hold_back_recovery() -> None:
    """Found by a break test: with ``/v1/models`` hanging, ``/readyz`` turned 200 only when the
    probe's models request timed out (5.5 s instead of 0.5 s after the engine came back). Once
    the context windows are known, the verdict is recorded first and the windows refreshed after;
    the first verdict still waits for them (so the first /readyz 200 carries them)."""
    import asyncio

    from shardserver.health import EngineProbe

    models = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 1024}]}).encode()
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models),
               b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
               None]  # /v1/models: never answered

    async def main() -> None:
        seen: list[str] = []

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head = await r.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics "):  # the progress read after a reachable probe: none here
                w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await w.drain()
                w.close()
                return
            seen.append(head.split(b"\r\n")[0].decode())
            answer = answers[len(seen) - 1]
            if answer is None:
                await asyncio.sleep(30)
            else:
                w.write(answer)
                await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        probe = EngineProbe(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", interval_s=60, timeout_s=5.0)
        probe.open()
        assert await probe.check_once() is True and probe.models == {"m": 1024}
        assert await probe.check_once() is False  # /health 503: down (no models request)
        t0 = time.monotonic()
        check = asyncio.get_running_loop().create_task(probe.check_once())
        while len(seen) < 5 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        # /v1/models is asked and hangs; the probe already says reachable, with the known window.
        assert seen[4] == "GET /v1/models HTTP/1.1" and not check.done()
        assert (probe.state().ok, probe.state().models) == (True, {"m": 1024})
        assert time.monotonic() - t0 < 2
        check.cancel()
        await probe.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_progress_is_read_from_vllm_token_counters_and_a_stall_is_logged_once(monkeypatch, caplog):
    """After each reachable probe, GET /metrics: the sum of vLLM's token counters. The first
    reading of an engine holding requests is no evidence (progress_at stays -inf); a reading that
    moved sets progress_at, which on_ok receives; counters frozen while requests run are logged
    once as a hung core, and again (INFO) when they move; frozen counters of an engine holding
    no request count like a moving one (an idle replica behind a balancer); an answer without the
    counters makes progress unknown (on_ok(None))."""
    import asyncio
    import logging
    import math

    from shardserver import health

    monkeypatch.setattr(health, "STALL_LOG_S", 0.0)
    state = {"tokens": 1000.0, "running": 2.0, "metrics": True}

    def metrics() -> bytes:
        if not state["metrics"]:
            return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
        text = ('# TYPE vllm:generation_tokens_total counter\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="m x {{1}}"}} {state["tokens"]}\n'
                'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09\n'
                'vllm:prompt_tokens_total{engine="0",model_name="m"} 50.0\n'
                'vllm:prompt_tokens_total{engine="1",model_name="m"} NaN\n'
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {state["running"]}\n').encode()
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)

    async def main() -> list:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head = await r.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics "):
                w.write(metrics())
            elif head.startswith(b"GET /health "):
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        probe = health.EngineProbe(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", interval_s=60,
                                   timeout_s=5.0)
        probe.open()
        got: list = []
        probe.on_ok = got.append
        try:
            assert await probe.check_once() is True
            assert probe.tokens == 1050.0 and probe.progress_at == -math.inf  # first reading: no evidence
            state["tokens"] = 1200.0
            t0 = time.monotonic()
            assert await probe.check_once() is True
            assert probe.tokens == 1250.0 and t0 <= probe.progress_at <= time.monotonic()
            moved = probe.progress_at
            assert await probe.check_once() is True  # frozen, 2 running: logged as stalled
            assert await probe.check_once() is True  # still frozen: not logged again
            state["tokens"] = 1300.0
            assert await probe.check_once() is True  # moving again: INFO
            assert probe.progress_at > moved
            again = probe.progress_at
            state["running"] = 0.0  # frozen but holding nothing (idle, or the idle replica behind a balancer)
            t1 = time.monotonic()
            assert await probe.check_once() is True and probe.progress_at >= t1  # counts, as /health did
            assert got[5] == probe.progress_at
            state["metrics"] = False
            assert await probe.check_once() is True and probe.tokens is None
            return got[:3] + [got[6]] + [moved, again, got[4]]
        finally:
            await probe.close()
            server.close()

    with caplog.at_level(logging.INFO, logger="shardserver.health"):
        first, second, third, last, moved, again, fifth = asyncio.run(asyncio.wait_for(main(), 30))
    assert first == -math.inf and second == moved and third == moved and last is None and fifth == again > moved
    hung = [r for r in caplog.records if "looks hung" in r.getMessage()]
    again = [r for r in caplog.records if "generates again" in r.getMessage()]
    assert len(hung) == 1 and hung[0].levelno == logging.WARNING, caplog.text
    assert "reports 2 requests running or waiting but its token counters (vllm:generation_tokens_total, " \
           "vllm:prompt_tokens_total in /metrics) have not moved" in hung[0].getMessage()
    assert len(again) == 1 and again[0].levelno == logging.INFO


def test_parse_engine_progress_sums_the_counters_and_knows_when_there_are_none():
    from shardserver.health import parse_engine_progress

    body = (b'# HELP vllm:generation_tokens_total Number of generation tokens processed.\n'
            b'vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 1234.0\n'
            b'vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 6.0\n'
            b'vllm:prompt_tokens_total 60\n'
            b'vllm:prompt_tokens_total{engine="2"} +Inf\n'
            b'vllm:num_requests_running{engine="0"} 3.0 1700000000000\n'
            b'vllm:num_requests_waiting{engine="0"} 7.0\n'
            b'vllm:generation_tokens_total{broken 5\n')
    assert parse_engine_progress(body) == (1300.0, 10.0)  # requests: running + waiting
    assert parse_engine_progress(b"vllm:num_requests_running 3.0\nhttp_requests_total 9\n") is None
    assert parse_engine_progress(b"") is None
