"""Gateway chaos, longer than the test: the real tinker SDK (0.38, session-wide poller) samples
continuously while the gateway is SIGKILLed and restarted 10 ms later, an encoder is SIGKILLed,
the gateway is stopped (SIGTERM) and restarted, and a front-end is SIGKILLed, round after round
(the schedule of ``tests/e2e/test_gateway_chaos.py``, with more rounds and more in flight).

Reports samples completed, failed (any exception that reached the caller), wrong (any token or
logprob differing from the simulator's answer), hung (still waiting ``--drain-s`` after the last
fault), and the gateway's counters of futures lost in restarts and resubmitted. Exit status 1
when anything failed, was wrong or hung.

    .venv/bin/python benchmarks/gateway_chaos.py --rounds 12 --in-flight 128 --per-round 200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12, help="faults injected (kill gateway, kill encoder, "
                                                            "SIGTERM gateway, kill front-end, in turn)")
    ap.add_argument("--in-flight", type=int, default=128, help="samples kept in flight")
    ap.add_argument("--per-round", type=int, default=200, help="samples completed between two faults")
    ap.add_argument("--latency-s", type=float, default=0.2, help="engine-sim latency per request (s)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--front-ends", type=int, default=2)
    ap.add_argument("--drain-s", type=float, default=90.0, help="after the last fault, how long samples may take")
    ap.add_argument("--config", default="demo", choices=["demo", "production"], help="configs/<name>.toml")
    ap.add_argument("--per-request", action="store_true", help="turn the poller off (SDKs poll each sample)")
    a = ap.parse_args()

    from test_gateway_chaos import API_KEY, gateway_chaos

    with tempfile.TemporaryDirectory(prefix="shardserver-chaos-state-") as state:
        env = {"SHARDSERVER_SERVER__STATE_DIR": state, "SHARDSERVER_SHARDS__COUNT": str(a.shards),
               "SHARDSERVER_SERVER__FRONT_ENDS": str(a.front_ends),
               "SHARDSERVER_SHARDS__ARENA_BYTES": str(64 << 20), "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "2",
               "SHARDSERVER_SIMULATOR__LATENCY_S": str(a.latency_s),
               "SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "false" if a.per_request else "true"}
        if a.config == "production":  # its embedded simulator, and the client's key from the environment
            env.update({"SHARDSERVER_ENGINE__URL": "", "SHARDSERVER_AUTH__KEYS_FILE": "", "SHARDSERVER_API_KEYS": API_KEY})
        out = gateway_chaos(rounds=a.rounds, in_flight=a.in_flight, per_round=a.per_round, env=env,
                            config=a.config, sample_timeout_s=a.drain_s,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    report = {**out, "errors": len(out["errors"]), "first_errors": out["errors"][:5],
              "wrong": len(out["wrong"]), "hung": len(out["hung"]), "first_hung": out["hung"][:5],
              "mode": "per_request" if a.per_request else "poller", "in_flight": a.in_flight}
    print(json.dumps(report, indent=1))
    return 1 if out["errors"] or out["wrong"] or out["hung"] or out["leftover_processes"] else 0


if __name__ == "__main__":
    sys.exit(main())
