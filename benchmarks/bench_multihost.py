#!/usr/bin/env python3
"""What the HAProxy hop costs: the same burst to one gateway host directly, and through HAProxy.

Usage (from the repo root; HAProxy >= 2.6 installed, e.g. ``make haproxy``)::

    .venv/bin/python benchmarks/bench_multihost.py                 # 256 x 32768 tokens, 3 hosts
    .venv/bin/python benchmarks/bench_multihost.py --requests 512 --tokens 8192 --hosts 2

Three runs of one burst (``--requests`` samples of ``--tokens`` tokens, all in flight), each
driven by the protocol-faithful driver of ``benchmarks/load_driver.py`` (every result verified
byte for byte; 410 -> resubmit as the SDK does):

1. ``direct``: one gateway host, no balancer;
2. ``haproxy-1``: the same single host behind HAProxy (the config ``shardserver haproxy-config``
   writes), which isolates the cost of the hop;
3. ``haproxy-N``: ``--hosts`` hosts (each ``server.host_id`` h1..hN, one shared ``id_secret``)
   behind HAProxy: asample by least connections, retrieve_future to the future's owner.

Every host has ``--shards`` encoders and ``--front-ends`` front-ends and its own embedded
engine simulator. Reported per run: results/s, server CPU ms per result (utime+stime of every
gateway process of every host, engine simulators excluded, plus HAProxy's own CPU, reported
separately too), p50/p99 time to result, futures per host and retrieve_future 410s per host
(from each host's ``/metrics``). With more than one core, the driver and the simulators are
pinned to the first core and the gateways and HAProxy (one thread: it sizes itself to its CPU
affinity) to the rest, as in ``run_load.py``. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import load_driver  # noqa: E402
from run_load import DEFAULTS, _pct, cpu_model, cpu_of, plan_cores, server_pids, sim_pids  # noqa: E402
from shardserver.testing import RunningHaproxy, RunningServer, find_haproxy, http_counts  # noqa: E402

SECRET = "bench-multihost-secret"


def start_hosts(n: int, args: argparse.Namespace, cores: dict[str, Any]) -> list[RunningServer]:
    env = {"SHARDSERVER_SHARDS__COUNT": str(args.shards), "SHARDSERVER_SERVER__FRONT_ENDS": str(args.front_ends),
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(args.arena_bytes), "SHARDSERVER_SERVER__LOG_LEVEL": "warning",
           "SHARDSERVER_SERVER__ID_SECRET": SECRET}
    me = os.getpid()
    hosts: list[RunningServer] = []
    os.sched_setaffinity(me, cores["server"])
    try:
        for i in range(1, n + 1):
            hosts.append(RunningServer(env={**env, "SHARDSERVER_SERVER__HOST_ID": f"h{i}"}, start_timeout=120)
                         .__enter__())
    except BaseException:
        for h in hosts:
            h.stop()
        raise
    finally:
        os.sched_setaffinity(me, cores["driver"])
    for h in hosts:
        assert h.proc is not None
        for p in sim_pids(h.proc.pid):
            os.sched_setaffinity(p, cores["driver"])
    return hosts


def drive(url: str, spec: dict[str, Any], hosts: list[RunningServer], haproxy: RunningHaproxy | None
          ) -> dict[str, Any]:
    """One burst against ``url``; CPU of every host's gateway processes and of HAProxy."""
    ctx = mp.get_context("spawn")
    progress = ctx.Array("q", load_driver.N_SLOTS, lock=False)
    go, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=load_driver.driver_process, name="load-driver-0",
                       args=(0, 1, url, spec, progress, go, ready, results), daemon=True)
    proc.start()
    try:
        if ready.get(timeout=180) < 0:
            raise RuntimeError(results.get(timeout=5)[1])
        pids = [p for h in hosts for p in server_pids(h.proc.pid)]  # type: ignore[union-attr]
        before = [http_counts(h.url) for h in hosts]
        cpu0 = cpu_of(pids)
        hp0 = haproxy.cpu_seconds() if haproxy else 0.0
        go.set()
        kind, res = results.get(timeout=float(spec["time_limit_s"]) + 60)
        cpu1 = cpu_of(pids)
        hp1 = haproxy.cpu_seconds() if haproxy else 0.0
        after = [http_counts(h.url) for h in hosts]
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if kind != "ok":
        raise RuntimeError(res)
    gw_cpu = sum(cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0)
    hp_cpu = hp1 - hp0
    done = max(res.done, 1)
    wall = max(res.t_end - res.t_go, 1e-9)

    def d(i: int, key: tuple[str, str]) -> int:
        return int(after[i].get(key, 0) - before[i].get(key, 0))

    return {
        "results": res.done, "failures": res.failures, "wall_s": round(wall, 3),
        "results_per_s": round(res.done / wall, 1),
        "server_cpu_ms_per_result": round(1000 * (gw_cpu + hp_cpu) / done, 3),
        "gateway_cpu_ms_per_result": round(1000 * gw_cpu / done, 3),
        "haproxy_cpu_ms_per_result": round(1000 * hp_cpu / done, 3),
        "ttr_p50_s": _pct(res.latencies_s, 50), "ttr_p99_s": _pct(res.latencies_s, 99),
        "futures_per_host": [d(i, ("asample", "200")) for i in range(len(hosts))],
        "retrieve_410_per_host": [d(i, ("retrieve_future", "410")) for i in range(len(hosts))],
        "retries": dict(res.counters),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--shards", type=int, default=1, help="encoders per host")
    ap.add_argument("--front-ends", dest="front_ends", type=int, default=1, help="front-ends per host")
    ap.add_argument("--arena-bytes", dest="arena_bytes", type=int, default=256 * 1024 * 1024)
    ap.add_argument("--no-pin", action="store_true", help="do not pin driver and server to separate cores")
    ap.add_argument("--out", help="write the JSON record here too")
    args = ap.parse_args(argv)
    haproxy_bin, why = find_haproxy()
    if haproxy_bin is None:
        print(f"bench_multihost: {why}", file=sys.stderr)
        return 2
    spec = {**DEFAULTS, "requests": args.requests, "tokens": args.tokens, "concurrency": args.requests,
            "connections": args.requests, "time_limit_s": 600.0}
    cores = plan_cores(None, not args.no_pin)
    record: dict[str, Any] = {"cpu": cpu_model(), "nproc": os.cpu_count(), "python": platform.python_version(),
                              "cores": cores, "requests": args.requests, "tokens": args.tokens,
                              "shards_per_host": args.shards, "front_ends_per_host": args.front_ends, "runs": {}}
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        for label, n, via in (("direct", 1, False), ("haproxy-1", 1, True), (f"haproxy-{args.hosts}", args.hosts, True)):
            print(f"== {label}: {args.requests} x {args.tokens} tokens, {n} host(s)", file=sys.stderr, flush=True)
            hosts = start_hosts(n, args, cores)
            hp = None
            try:
                if via:
                    os.sched_setaffinity(me, cores["server"])
                    try:
                        hp = RunningHaproxy([(f"h{i + 1}", f"127.0.0.1:{h.port}") for i, h in enumerate(hosts)],
                                            Path(tempfile.mkdtemp(dir=tmp)), haproxy_bin).__enter__()
                    finally:
                        os.sched_setaffinity(me, cores["driver"])
                r = drive(hp.url if hp else hosts[0].url, spec, hosts, hp)
            finally:
                if hp is not None:
                    hp.stop()
                for h in hosts:
                    h.stop()
            record["runs"][label] = r
            print(f"   {json.dumps(r)}", file=sys.stderr, flush=True)
    print(f"\n{record['cpu']}, nproc={record['nproc']}, pinned={cores['pinned']} "
          f"(driver+simulators on {cores['driver']}, gateways+HAProxy on {cores['server']}); "
          f"{args.requests} x {args.tokens} tokens, S={args.shards} F={args.front_ends} per host\n")
    print("| run | results/s | server CPU ms/result (incl. HAProxy) | of which HAProxy | p50 s | p99 s "
          "| futures per host | 410s | failures |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in record["runs"].items():
        print(f"| {label} | {r['results_per_s']} | {r['server_cpu_ms_per_result']:.2f} "
              f"| {r['haproxy_cpu_ms_per_result']:.2f} | {r['ttr_p50_s']:.2f} | {r['ttr_p99_s']:.2f} "
              f"| {r['futures_per_host']} | {sum(r['retrieve_410_per_host'])} | {r['failures']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
