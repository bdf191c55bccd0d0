#!/usr/bin/env python3
"""Load harness for shardserver: results/s, server CPU per result, memory, up to 131072 futures in flight.

Usage (from the repo root)::

    .venv/bin/python benchmarks/run_load.py --scenario burst-32k [--quick]
    .venv/bin/python benchmarks/run_load.py --scenario scaling --shards 1,2 --quick
    .venv/bin/python benchmarks/run_load.py --scenario benchmarks/scenarios/queue-8k.toml --set requests=2048

One invocation runs a scenario (``benchmarks/scenarios/<name>.toml``) against real gateways
started with :class:`shardserver.testing.RunningServer` on 127.0.0.1 (embedded engine
simulator, its own process ``shardserver: engine-sim``), driven by the protocol-faithful driver
in ``benchmarks/load_driver.py`` (one or more driver processes). For each run it reports:

* results/s (verified results / seconds from go to the last result),
* server CPU seconds per result: utime+stime deltas (``/proc/<pid>/stat``) summed over every
  process of the server's process group except the engine simulator (supervisor, encoders,
  front-ends, multiprocessing helpers),
* peak memory of those processes, sampled every ``mem_interval_s``: PSS summed (shared memory,
  e.g. the /dev/shm arenas, counted once) from ``/proc/<pid>/smaps_rollup``, and RSS summed,
* peak proto bytes retained in the arenas (sum of ``arena_used_bytes`` from ``/stats``),
* p50/p99 time to result (s, from the first ``asample`` to a verified result, retries included),
* failures and retries by kind, bytes delivered.

Processes are pinned with ``os.sched_setaffinity`` when more than one core is available: the
driver processes and the engine simulator share the first ``--driver-cores`` cores (default: 1
on 2-3 cores, cores/4 on more), the server gets the rest. A JSON record of every run goes to
``benchmarks/results/`` (or ``--out``), with PNG plots (results/s vs shard count, time-to-result
CDF) when matplotlib is installed. Goals are reported (PASS/MISS), never asserted; the exit
status is non-zero only when the harness itself failed (server did not start, leftovers).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import load_driver  # noqa: E402
from shardserver.testing import RunningServer, our_shm_segments  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SIM_TITLE = "shardserver: engine-sim"

DEFAULTS: dict[str, Any] = {
    "name": "custom",
    "description": "",
    "requests": 512,               # samples in the run
    "tokens": 8192,                # max_tokens per sample (the simulator runs to max_tokens)
    "num_samples": 1,              # sequences per sample
    "prompt_tokens": 32,           # prompt length (tokens)
    "distinct": 16,                # distinct (prompt, seed) pairs; request i uses pair i % distinct
    "concurrency": 512,            # samples in flight
    "connections": 512,            # driver HTTP connections (all driver processes together)
    "engine_delay_s": 0.0,         # simulator delay per engine request (s)
    "engine_delay_kind": "latency_s",  # SimConfig knob that carries the delay: latency_s or queue_delay_s
    "engine_pool_size": 512,       # engine.pool_size (connections per encoder)
    "arena_bytes": 268435456,      # shards.arena_bytes (bytes per shard)
    "shards": "auto",              # int, or "auto" = cores given to the server (>= 2 on a 2-core box)
    "front_ends": 2,               # int, "half" = ceil(S/2), or "same" = S
    "shard_counts": None,          # list or "1..cores": one run per S (the scaling scenario)
    "requests_per_shard": None,    # when set: requests = requests_per_shard * S
    "concurrency_per_shard": None,  # when set: concurrency = connections = concurrency_per_shard * S
    "reference": True,             # also run S=1, F=1
    "poll_timeout_s": 45.0,        # client timeout per retrieve_future (s), as the SDK with plain httpx
    "max_polls": 100000,           # bound on retrieve_future calls per future
    "max_resubmits": 10,           # bound on 410-triggered resubmits per sample
    "time_limit_s": 900.0,         # a run stops counting after this (s); unfinished samples fail
    "mem_interval_s": 1.0,         # memory / arena sampling period (s)
    "warmup": 16,                  # samples each driver process runs (and discards) before the measured run
    "extra_env": {},               # more SHARDSERVER_* overrides for the server
    "goals": {},
}


# ------------------------------------------------------------------------------------------------
# scenario and machine
# ------------------------------------------------------------------------------------------------
def load_scenario(name: str, quick: bool, sets: list[str]) -> dict[str, Any]:
    """Scenario dict: defaults < TOML < [quick] (with --quick) < --set key=value (TOML literal values)."""
    path = Path(name)
    if not path.exists():
        path = HERE / "scenarios" / f"{name}.toml"
    with open(path, "rb") as f:
        data = tomllib.load(f)
    quick_tbl = data.pop("quick", {})
    spec = {**DEFAULTS, **data}
    spec["goals"] = {**DEFAULTS["goals"], **data.get("goals", {})}
    if quick:
        spec.update(quick_tbl)
    for s in sets:
        k, _, v = s.partition("=")
        if k not in DEFAULTS:
            raise SystemExit(f"--set: unknown key {k!r} (known: {', '.join(sorted(DEFAULTS))})")
        spec[k] = tomllib.loads(f"v = {v}")["v"] if v else ""
    spec["quick"] = quick
    spec["scenario_file"] = str(path)
    return spec


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def plan_cores(driver_cores: int | None, pin: bool) -> dict[str, list[int]]:
    """Split the CPUs this process may use into driver(+engine sim) cores and server cores."""
    avail = sorted(os.sched_getaffinity(0))
    n = len(avail)
    if not pin or n == 1:
        return {"driver": avail, "server": avail, "pinned": False}  # type: ignore[dict-item]
    d = driver_cores if driver_cores else (1 if n < 4 else max(1, n // 4))
    d = max(1, min(d, n - 1))
    return {"driver": avail[:d], "server": avail[d:], "pinned": True}  # type: ignore[dict-item]


# ------------------------------------------------------------------------------------------------
# /proc measurements
# ------------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, str, float] | None:
    """(pgid, state, cpu seconds utime+stime) of pid, or None when it is gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = s.rsplit(")", 1)[1].split()
    return int(f[2]), f[0], (int(f[11]) + int(f[12])) / CLK_TCK


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def group_pids(pgid: int) -> dict[int, str]:
    """Live members of process group ``pgid``: pid -> title."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[0] == pgid and st[1] != "Z":
                out[int(d)] = _title(int(d))
    return out


def server_pids(pgid: int) -> dict[int, str]:
    """The server's processes: its process group minus the engine simulator."""
    return {p: t for p, t in group_pids(pgid).items() if not t.startswith(SIM_TITLE)}


def sim_pids(pgid: int) -> list[int]:
    return [p for p, t in group_pids(pgid).items() if t.startswith(SIM_TITLE)]


def cpu_of(pids: list[int]) -> dict[int, float]:
    out = {}
    for p in pids:
        st = _stat(p)
        if st is not None:
            out[p] = st[2]
    return out


def mem_of(pids: list[int]) -> tuple[int, int]:
    """(PSS, RSS) in bytes summed over pids (smaps_rollup; kB in the file)."""
    pss = rss = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return pss, rss


class Monitor(threading.Thread):
    """Samples server PSS/RSS and arena bytes every ``interval`` s until stopped (bounded by ``max_s``)."""

    def __init__(self, pgid: int, url: str, interval: float, max_s: float) -> None:
        super().__init__(name="load-monitor", daemon=True)
        self.pgid, self.url, self.interval, self.max_s = pgid, url, interval, max_s
        self.stop_ev = threading.Event()
        self.peak_pss = self.peak_rss = self.peak_arena_used = 0
        self.samples: list[tuple[float, int, int, int]] = []  # (t s, pss, rss, arena used) bytes

    def arena_used(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
                js = json.loads(r.read())
            return sum(int(s.get("arena_used_bytes", 0)) for s in js.get("shards", []))
        except (OSError, ValueError):
            return -1

    def _arena_loop(self) -> None:
        """/stats can take seconds when the server is saturated: polled on its own thread."""
        t0 = time.monotonic()
        while not self.stop_ev.is_set() and time.monotonic() - t0 < self.max_s:
            used = self.arena_used()
            self.last_used = used
            self.peak_arena_used = max(self.peak_arena_used, used)
            self.stop_ev.wait(self.interval)

    def run(self) -> None:
        t0 = time.monotonic()
        self.last_used = -1
        arena = threading.Thread(target=self._arena_loop, name="load-monitor-arena", daemon=True)
        arena.start()
        while not self.stop_ev.is_set() and time.monotonic() - t0 < self.max_s:
            pss, rss = mem_of(list(server_pids(self.pgid)))
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.samples.append((round(time.monotonic() - t0, 2), pss, rss, self.last_used))
            self.stop_ev.wait(self.interval)
        arena.join(10)
        used = self.arena_used()       # one last look at the arenas, at the end of the run
        self.peak_arena_used = max(self.peak_arena_used, used)


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(xs), q))


def run_one(spec: dict[str, Any], shards: int, front_ends: int, label: str, cores: dict[str, Any],
            driver_procs: int, progress_bar: bool) -> dict[str, Any]:
    """Start a gateway (S=shards, F=front_ends), drive the scenario, measure, stop. Returns the record."""
    spec = dict(spec)
    if spec.get("requests_per_shard"):
        spec["requests"] = int(spec["requests_per_shard"]) * shards
    if spec.get("concurrency_per_shard"):
        spec["concurrency"] = spec["connections"] = int(spec["concurrency_per_shard"]) * shards
    env = {
        "SHARDSERVER_SHARDS__COUNT": str(shards),
        "SHARDSERVER_SERVER__FRONT_ENDS": str(front_ends),
        "SHARDSERVER_SHARDS__ARENA_BYTES": str(int(spec["arena_bytes"])),
        "SHARDSERVER_ENGINE__POOL_SIZE": str(int(spec["engine_pool_size"])),
        "SHARDSERVER_SERVER__LOG_LEVEL": "warning",
        f"SHARDSERVER_SIMULATOR__{spec['engine_delay_kind'].upper()}": str(float(spec["engine_delay_s"])),
        **{k: str(v) for k, v in dict(spec.get("extra_env") or {}).items()},
    }
    me = os.getpid()
    print(f"\n== {label}: {spec['requests']} x {spec['tokens']} tokens, "
          f"{spec['concurrency']} in flight, {spec['connections']} connections, engine delay "
          f"{spec['engine_delay_s']} s ({spec['engine_delay_kind']})", file=sys.stderr, flush=True)
    # The server inherits the server cores; we (and the driver processes we spawn) keep the driver cores.
    os.sched_setaffinity(me, cores["server"])
    try:
        server = RunningServer(env=env, start_timeout=120).__enter__()
    finally:
        os.sched_setaffinity(me, cores["driver"])
    record: dict[str, Any] = {"label": label, "shards": shards, "front_ends": front_ends,
                              "requests": spec["requests"], "tokens": spec["tokens"],
                              "concurrency": spec["concurrency"], "connections": spec["connections"],
                              "engine_delay_s": spec["engine_delay_s"], "driver_procs": driver_procs}
    procs: list[Any] = []
    try:
        assert server.proc is not None
        pgid = server.proc.pid
        for p in sim_pids(pgid):
            os.sched_setaffinity(p, cores["driver"])
        placement = {f"{p} {t}": sorted(os.sched_getaffinity(p)) for p, t in group_pids(pgid).items()}
        ctx = mp.get_context("spawn")
        progress = ctx.Array("q", driver_procs * load_driver.N_SLOTS, lock=False)
        go, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
        for row in range(driver_procs):
            p = ctx.Process(target=load_driver.driver_process, name=f"load-driver-{row}",
                            args=(row, driver_procs, server.url, spec, progress, go, ready, results), daemon=True)
            p.start()
            procs.append(p)
        for p in procs:
            placement[f"{p.pid} load-driver"] = sorted(os.sched_getaffinity(p.pid))
        placement[f"{me} orchestrator"] = sorted(os.sched_getaffinity(me))
        n_ready = 0
        t_wait = time.monotonic()
        while n_ready < driver_procs:
            r = ready.get(timeout=max(1.0, 180 - (time.monotonic() - t_wait)))
            if r < 0:
                raise RuntimeError(results.get(timeout=5)[1])
            n_ready += 1
        spids = server_pids(pgid)
        cpu0 = cpu_of(list(spids))
        sim0 = cpu_of(sim_pids(pgid))
        mon = Monitor(pgid, server.url, float(spec["mem_interval_s"]), float(spec["time_limit_s"]) + 900)
        mon.start()
        t_go = time.monotonic()
        go.set()
        outs: list[Any] = []
        bar = None
        if progress_bar:
            try:
                from tqdm import tqdm

                bar = tqdm(total=int(spec["requests"]), unit="res", file=sys.stderr, smoothing=0.1,
                           mininterval=0.5, dynamic_ncols=True)
            except ImportError:
                bar = None
        last = 0
        hard_end = t_go + float(spec["time_limit_s"]) + 800
        while len(outs) < driver_procs and time.monotonic() < hard_end:
            try:
                outs.append(results.get(timeout=0.5))
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            N = load_driver.N_SLOTS
            done = sum(progress[i * N + load_driver.P_DONE] for i in range(driver_procs))
            failed = sum(progress[i * N + load_driver.P_FAILED] for i in range(driver_procs))
            retries = sum(progress[i * N + load_driver.P_RETRIES] for i in range(driver_procs))
            el = time.monotonic() - t_go
            if bar is not None:
                bar.update(done + failed - last)
                bar.set_postfix_str(f"fail {failed} retries {retries} {done / max(el, 1e-9):.0f}/s", refresh=False)
            elif int(el * 2) % 10 == 0:
                print(f"\r  {done + failed}/{spec['requests']} done, {failed} failed, {retries} retries, "
                      f"{el:.0f} s", end="", file=sys.stderr, flush=True)
            last = done + failed
            if any(o[0] == "error" for o in outs):
                break
        if bar is not None:
            bar.close()
        wall_cpu_end = time.monotonic()
        end_pids = server_pids(pgid)
        cpu1 = cpu_of(list(end_pids))
        sim1 = cpu_of(sim_pids(pgid))
        mon.stop_ev.set()
        mon.join(10)
        errors = [o[1] for o in outs if o[0] == "error"]
        if errors or len(outs) < driver_procs:
            raise RuntimeError(f"driver failed: {errors or 'no result before the hard time limit'}")
        res = [o[1] for o in outs]
        # Server CPU: pids alive at both ends (delta) + pids born during the run (all their CPU).
        server_cpu = sum(cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0) + sum(cpu1[p] for p in cpu1 if p not in cpu0)
        lost = [p for p in cpu0 if p not in cpu1]
        lat = [x for r in res for x in r.latencies_s]
        done = sum(r.done for r in res)
        failures = sum(r.failures for r in res)
        t_first = min(r.t_go for r in res)
        t_last = max(r.t_end for r in res)
        wall = max(t_last - t_first, 1e-9)
        counters: dict[str, int] = {}
        for r in res:
            for k, v in r.counters.items():
                counters[k] = counters.get(k, 0) + v
        bytes_delivered = sum(r.bytes_delivered for r in res)
        record.update({
            "results": done,
            "failures": failures,
            "wall_s": round(wall, 3),
            "results_per_s": round(done / wall, 1),
            "server_cpu_s": round(server_cpu, 3),
            "server_cpu_ms_per_result": round(1000 * server_cpu / max(done, 1), 3),
            "server_cpu_cores_busy": round(server_cpu / max(wall_cpu_end - t_go, 1e-9), 2),
            "sim_cpu_s": round(sum(sim1.get(p, 0) - sim0.get(p, 0) for p in sim1), 3),
            "driver_cpu_s": round(sum(r.cpu_s for r in res), 3),
            "peak_pss_bytes": mon.peak_pss,
            "peak_rss_bytes": mon.peak_rss,
            "peak_arena_used_bytes": mon.peak_arena_used,
            "ttr_p50_s": _pct(lat, 50),
            "ttr_p99_s": _pct(lat, 99),
            "ttr_max_s": max(lat) if lat else None,
            "bytes_delivered": bytes_delivered,
            "bytes_per_result": round(bytes_delivered / max(done, 1)),
            "retries": {k: v for k, v in sorted(counters.items()) if not k.startswith("fail_")},
            "failures_by_kind": {k[5:]: v for k, v in sorted(counters.items()) if k.startswith("fail_")},
            "first_errors": [e for r in res for e in r.first_errors][:10],
            "server_processes": {str(p): t for p, t in spids.items()},
            "server_processes_lost": lost,
            "server_processes_new": [p for p in end_pids if p not in spids],
            "placement": placement,
            "memory_samples": mon.samples,
            "latencies_s": sorted(lat),
            "done_at_s": sorted(x for r in res for x in r.done_at_s),
        })
        try:
            record["server_stats"] = server.stats()
        except Exception as exc:  # noqa: BLE001
            record["server_stats"] = {"error": repr(exc)}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        sup_pid = server.proc.pid if server.proc is not None else 0
        rc = server.stop()
        record["server_exit_code"] = rc
        record["leftover_processes"] = bool(server.leftover_processes)
        record["leftover_segments"] = [s for s in our_shm_segments() if s.startswith(f"shardserver-{sup_pid}-")]
    print(f"   {record.get('results')} results, {record.get('failures')} failures, "
          f"{record.get('results_per_s')} results/s, {record.get('server_cpu_ms_per_result')} ms server CPU/result, "
          f"peak PSS {record.get('peak_pss_bytes', 0) / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return record


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _mib(b: int | None) -> str:
    return "-" if b is None or b < 0 else f"{b / 2**20:.0f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table of the runs."""
    head = ("| run | S | F | results | fail | results/s | server CPU ms/result | cores busy | peak PSS MiB "
            "| peak RSS MiB | arena used MiB | p50 ms | p99 ms | MB delivered | driver+sim CPU s | retries |")
    lines = [head, "|" + "---|" * 16]
    for r in runs:
        retr = ", ".join(f"{k} {v}" for k, v in r["retries"].items()) or "0"
        lines.append(f"| {r['label']} | {r['shards']} | {r['front_ends']} | {r['results']} | {r['failures']} "
                     f"| {r['results_per_s']} | {r['server_cpu_ms_per_result']} | {r['server_cpu_cores_busy']} "
                     f"| {_mib(r['peak_pss_bytes'])} | {_mib(r['peak_rss_bytes'])} | {_mib(r['peak_arena_used_bytes'])} "
                     f"| {_ms(r['ttr_p50_s'])} | {_ms(r['ttr_p99_s'])} | {r['bytes_delivered'] / 1e6:.0f} "
                     f"| {r['driver_cpu_s']:.1f}+{r['sim_cpu_s']:.1f} | {retr} |")
    return "\n".join(lines)


def goals(spec: dict[str, Any], runs: list[dict[str, Any]], cores: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(goal, measured, passed) for the scenario's goals, on the main (non-reference) runs."""
    g = spec.get("goals", {})
    main = [r for r in runs if not r["label"].startswith("reference")]
    out = []
    if "server_cpu_ms_per_result_max" in g:
        lim = float(g["server_cpu_ms_per_result_max"])
        for r in main:
            out.append((f"{r['label']}: server CPU per result <= {lim} ms",
                        f"{r['server_cpu_ms_per_result']} ms", r["server_cpu_ms_per_result"] <= lim))
    if "failures_max" in g:
        for r in main:
            out.append((f"{r['label']}: failures <= {g['failures_max']}", str(r["failures"]),
                        r["failures"] <= int(g["failures_max"])))
    if "pss_over_retained_factor" in g:
        f, slack = float(g["pss_over_retained_factor"]), float(g.get("pss_over_retained_slack_bytes", 0))
        for r in main:
            bound = f * max(r["peak_arena_used_bytes"], 0) + slack
            out.append((f"{r['label']}: peak PSS <= {f} x proto retained ({_mib(r['peak_arena_used_bytes'])} MiB) "
                        f"+ {slack / 1e6:.0f} MB = {bound / 2**20:.0f} MiB",
                        f"{_mib(r['peak_pss_bytes'])} MiB", r["peak_pss_bytes"] <= bound))
    if "scaling_efficiency_min" in g:
        eff = float(g["scaling_efficiency_min"])
        one = [r for r in main if r["shards"] == 1]
        ncores = len(cores["server"])
        if one:
            base = one[0]["results_per_s"]
            for r in main:
                if r["shards"] == 1:
                    continue
                need = eff * r["shards"] * base
                within = r["shards"] <= ncores
                out.append((f"S={r['shards']}: results/s >= {eff} x {r['shards']} x {base} (S=1)"
                            + ("" if within else f" [S > {ncores} server cores: not expected]"),
                            f"{r['results_per_s']} ({r['results_per_s'] / max(base, 1e-9):.2f}x)",
                            r["results_per_s"] >= need))
    return out


def plots(out_dir: Path, stem: str, runs: list[dict[str, Any]]) -> list[str]:
    """results/s vs shard count and the time-to-result CDF as PNGs; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    by_f: dict[str, list[tuple[int, float]]] = {}
    for r in runs:
        by_f.setdefault("reference (F=1)" if r["label"].startswith("reference") else "runs", []).append(
            (r["shards"], r["results_per_s"]))
    for name, pts in by_f.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ones = [r["results_per_s"] for r in runs if r["shards"] == 1 and not r["label"].startswith("reference")]
    if ones:
        xs = sorted({r["shards"] for r in runs})
        ax.plot(xs, [ones[0] * x for x in xs], ls="--", color="gray", label="linear from S=1")
    ax.set_xlabel("shards (encoder processes)")
    ax.set_ylabel("results/s")
    ax.set_title(stem)
    ax.grid(alpha=0.3)
    ax.legend()
    p = out_dir / f"{stem}-throughput.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        lat = r["latencies_s"]
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=r["label"])
    ax.set_xlabel("time to result (s)")
    ax.set_ylabel("fraction of results")
    ax.set_title(f"{stem}: time-to-result CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    p = out_dir / f"{stem}-ttr-cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))
    return files


def parse_shards(v: str | None) -> list[int] | None:
    if not v:
        return None
    return [int(x) for x in v.split(",") if x.strip()]


def resolve_counts(spec: dict[str, Any], cores: dict[str, Any], cli: list[int] | None) -> list[int]:
    if cli:
        return cli
    n = len(cores["server"])
    sc = spec.get("shard_counts")
    if sc == "1..cores":
        return list(range(1, n + 1))
    if isinstance(sc, list):
        return [int(x) for x in sc]
    s = spec.get("shards", "auto")
    return [max(2, n) if s == "auto" else int(s)]


def resolve_front_ends(spec: dict[str, Any], s: int, cli: int | None) -> int:
    if cli:
        return cli
    f = spec.get("front_ends", 2)
    if f == "half":
        return max(1, math.ceil(s / 2))
    if f == "same":
        return s
    return int(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True, help="name in benchmarks/scenarios/ or a TOML path")
    ap.add_argument("--quick", action="store_true", help="apply the scenario's [quick] scale-down")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    ap.add_argument("--shards", help="comma list of shard counts (overrides the scenario)")
    ap.add_argument("--front-ends", type=int, help="front-end processes (overrides the scenario)")
    ap.add_argument("--no-reference", action="store_true", help="skip the S=1, F=1 reference run")
    ap.add_argument("--driver-procs", type=int, help="driver processes (default: one per driver core)")
    ap.add_argument("--driver-cores", type=int, help="cores for the driver + engine sim (rest: server)")
    ap.add_argument("--no-pin", action="store_true", help="do not set CPU affinity")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"), help="output folder")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C so every started server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    spec = load_scenario(args.scenario, args.quick, args.set)
    cores = plan_cores(args.driver_cores, not args.no_pin)
    driver_procs = args.driver_procs or len(cores["driver"])
    counts = resolve_counts(spec, cores, parse_shards(args.shards))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = f"{spec['name']}{'-quick' if args.quick else ''}-{stamp}"
    meta = {"scenario": spec["name"], "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "nproc": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
            "kernel": platform.release(), "cores": cores, "driver_procs": driver_procs,
            "spec": {k: v for k, v in spec.items()}, "started": stamp}
    print(f"{spec['name']}{' (--quick)' if args.quick else ''}: {spec['description']}\n"
          f"machine: {os.cpu_count()} CPUs ({cpu_model()}); driver + engine sim on cores {cores['driver']}, "
          f"server on cores {cores['server']}{'' if cores['pinned'] else ' (not pinned)'}; "
          f"{driver_procs} driver process(es)", file=sys.stderr, flush=True)
    runs: list[dict[str, Any]] = []
    failed_harness = False
    plan = [(s, f, f"S={s} F={f}") for s in counts for f in [resolve_front_ends(spec, s, args.front_ends)]]
    if spec.get("reference") and not args.no_reference:
        plan.append((1, 1, "reference S=1 F=1"))
    for s, f, label in plan:
        try:
            runs.append(run_one(spec, s, f, label, cores, driver_procs, not args.no_progress))
        except Exception as exc:  # noqa: BLE001 - report and go on with the next run
            failed_harness = True
            print(f"run {label} failed: {exc}", file=sys.stderr, flush=True)
    os.sched_setaffinity(0, sorted(set(cores["driver"]) | set(cores["server"])))
    if not runs:
        return 2
    tbl = table(runs)
    ref = [r for r in runs if r["label"].startswith("reference")]
    lines = [f"## {spec['name']}{' (--quick)' if args.quick else ''}", "",
             f"`{meta['command']}` on {os.cpu_count()} CPUs ({meta['cpu_model']}); driver+sim cores "
             f"{cores['driver']}, server cores {cores['server']}", "", tbl, ""]
    if ref:
        for r in runs:
            if r is not ref[0]:
                lines.append(f"vs reference S=1 F=1: results/s x{r['results_per_s'] / max(ref[0]['results_per_s'], 1e-9):.2f}, "
                             f"server CPU/result x{r['server_cpu_ms_per_result'] / max(ref[0]['server_cpu_ms_per_result'], 1e-9):.2f} ({r['label']})")
        lines.append("")
    gl = goals(spec, runs, cores)
    for name, val, ok in gl:
        lines.append(f"GOAL {'PASS' if ok else 'MISS'}: {name}: measured {val}")
    for r in runs:
        if r["failures"]:
            lines.append(f"{r['label']}: failures by kind {r['failures_by_kind']}; first: {r['first_errors'][:3]}")
        if r["leftover_processes"] or r["leftover_segments"] or r["server_exit_code"] != 0:
            failed_harness = True
            lines.append(f"{r['label']}: CLEANUP PROBLEM: exit code {r['server_exit_code']}, leftover processes "
                         f"{r['leftover_processes']}, leftover segments {r['leftover_segments']}")
    pngs = plots(out_dir, stem, runs)
    record = {"meta": meta, "runs": runs, "goals": [{"goal": n, "measured": v, "pass": ok} for n, v, ok in gl],
              "plots": pngs}
    jpath = out_dir / f"{stem}.json"
    jpath.write_text(json.dumps(record, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    lines += ["", f"record: {jpath}", *[f"plot: {p}" for p in pngs]]
    print("\n".join(lines), flush=True)
    return 1 if failed_harness else 0


if __name__ == "__main__":
    sys.exit(main())
