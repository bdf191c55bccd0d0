"""Engine chaos, longer than the test: the real tinker SDK samples continuously while
``shardserver engine-sim`` (standalone) is SIGKILLed and restarted twice, with an idle gap past
the gateway's pooled-connection lifetime in between (the schedule of
``tests/e2e/test_engine_chaos.py``, with longer phases and more samples in flight).

Reports samples completed, failed (any exception, e.g. ``RequestFailedError``), wrong (any
token or logprob differing from the simulator's answer), in flight at each kill, and the
gateway's retry counters. Exit status 1 when anything failed or was wrong.

    .venv/bin/python benchmarks/engine_chaos.py --concurrency 256 --phase-s 20 --down-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=128, help="samples in flight (SDK coroutines)")
    ap.add_argument("--phase-s", type=float, default=10.0, help="sampling time between events")
    ap.add_argument("--down-s", type=float, default=10.0, help="time the engine stays dead after each SIGKILL")
    ap.add_argument("--idle-s", type=float, default=6.0, help="idle gap (no sampling) in the middle")
    ap.add_argument("--latency-s", type=float, default=0.25, help="engine-sim latency per request")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--pool-idle-s", type=float, default=4.0, help="engine.pool_idle_s of the gateway")
    a = ap.parse_args()

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    from conftest import BASE_MODEL, engine_body
    from fake_engine import SimEngineProcess
    from shardserver.testing import RunningServer
    from test_engine_chaos import chaos

    engine_body([1], 1, 1, 1)
    engine = SimEngineProcess(sim={"latency_s": a.latency_s})
    env = {"SHARDSERVER_SHARDS__COUNT": str(a.shards), "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(64 << 20), "SHARDSERVER_ENGINE__POOL_IDLE_S": str(a.pool_idle_s)}
    t0 = time.monotonic()
    with engine, RunningServer(env={**env, "SHARDSERVER_ENGINE__URL": engine.url}) as s:
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-chaos").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        out = asyncio.run(chaos(sampler, engine, phase_s=a.phase_s, down_s=a.down_s, idle_s=a.idle_s,
                                concurrency=a.concurrency))
        stats = s.stats()
    names = ("engine_keepalive_retries", "engine_reforwards", "engine_budget_exhausted", "failed_server", "gone")
    report = {"seconds": round(time.monotonic() - t0, 1), "concurrency": a.concurrency, "ok": out["ok"],
              "failed": len(out["failed"]), "wrong": len(out["wrong"]), "in_flight_at_kill": out["in_flight_at_kill"],
              "gateway": {n: sum(sh["counters"].get(n, 0) for sh in stats["shards"]) for n in names},
              "first_failures": out["failed"][:5], "first_wrong": out["wrong"][:5]}
    print(json.dumps(report, indent=1))
    return 1 if out["failed"] or out["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
