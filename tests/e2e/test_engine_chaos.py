"""Chaos with the real SDK (issue 10, "done when"): 64 samples in flight at all times while the
engine (``shardserver engine-sim`` standalone) is SIGKILLed and restarted twice, with an idle gap
past the gateway's pooled-connection lifetime in between. No sample may fail and every result must
equal, token for token, what the simulator answers for it.

The bounded version runs here (about 15 s of sampling); ``benchmarks/engine_chaos.py`` runs the
same schedule for longer and with more samples in flight.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from conftest import BASE_MODEL, engine_body, expected_sequences
from fake_engine import SimEngineProcess
from shardserver.testing import RunningServer

pytestmark = [pytest.mark.sdk, pytest.mark.slow, pytest.mark.timeout(180)]

CONCURRENCY = 64
MAX_TOKENS = 8


async def chaos(sampler, engine: SimEngineProcess, *, phase_s: float, down_s: float, idle_s: float,
                concurrency: int) -> dict:
    """Sample with ``concurrency`` workers through: run, kill, down, restart, run, idle, run, kill,
    down, restart, run. Returns counts and the first failures (exceptions and wrong results)."""
    from tinker import types

    run = asyncio.Event()
    run.set()
    stop = False
    out = {"ok": 0, "failed": [], "wrong": [], "in_flight_at_kill": []}
    in_flight = 0

    async def worker(w: int) -> None:
        nonlocal in_flight
        k = 0
        while not stop:
            await run.wait()
            if stop:
                break
            k += 1
            prompt, seed = [w, k % 1000, 3], w * 100_000 + k
            in_flight += 1
            try:
                resp = await sampler.sample_async(
                    prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, seed=seed, temperature=1.0))
            except Exception as exc:  # every failure is counted, not raised: the test reports them all
                out["failed"].append(repr(exc)[:300])
                continue
            finally:
                in_flight -= 1
            want = expected_sequences(engine_body(prompt, 1, MAX_TOKENS, seed))[0]
            got = resp.sequences[0]
            if list(got.tokens) != want["tokens"] or not np.array_equal(
                    np.asarray(got.logprobs, dtype=np.float32), want["logprobs"]):
                out["wrong"].append((prompt, seed))
            else:
                out["ok"] += 1

    async def kill_and_restart() -> None:
        out["in_flight_at_kill"].append(in_flight)
        engine.kill()
        await asyncio.sleep(down_s)
        await asyncio.to_thread(engine.start)

    async def idle() -> None:
        run.clear()
        t = time.monotonic() + 30
        while in_flight and time.monotonic() < t:
            await asyncio.sleep(0.05)
        await asyncio.sleep(idle_s)
        run.set()

    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    try:
        await asyncio.sleep(phase_s)
        await kill_and_restart()
        await asyncio.sleep(phase_s)
        await idle()
        await asyncio.sleep(phase_s)
        await kill_and_restart()
        await asyncio.sleep(phase_s)
    finally:
        stop = True
        run.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return out


@pytest.mark.filterwarnings("ignore:.*sample_async.*:FutureWarning")  # deprecated in 0.38, still supported
def test_sdk_sampling_rides_out_engine_kills_and_idle_gaps():
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    engine_body([1], 1, 1, 1)  # build the simulator's token pool here before the clock matters
    engine = SimEngineProcess(sim={"latency_s": 0.25})
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 << 20), "SHARDSERVER_ENGINE__POOL_IDLE_S": "1",
           "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.5"}
    with engine, RunningServer(env={**env, "SHARDSERVER_ENGINE__URL": engine.url}) as s:
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-chaos").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        out = asyncio.run(chaos(sampler, engine, phase_s=3.0, down_s=1.5, idle_s=2.0, concurrency=CONCURRENCY))
        stats = s.stats()
    print("chaos:", {k: (v if not isinstance(v, list) or k == "in_flight_at_kill" else len(v)) for k, v in out.items()})
    assert out["failed"] == [] and out["wrong"] == []
    assert all(n >= CONCURRENCY // 2 for n in out["in_flight_at_kill"]), out["in_flight_at_kill"]
    assert out["ok"] >= 4 * CONCURRENCY
    reforwards = sum(sh["counters"].get("engine_reforwards", 0) for sh in stats["shards"])
    assert reforwards > 0
    assert sum(sh["counters"].get("failed_server", 0) for sh in stats["shards"]) == 0
