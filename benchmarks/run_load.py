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
import shutil
import signal
import subprocess
import sys
import threading
import time
import tempfile
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
    "mode": "per_request",         # how samples wait: "per_request" (a held retrieve_future each, SDK <= 0.26.1
                                   # or without the server's flag) or "poller" (one retrieve_futures per
                                   # driver process, then one retrieve_future per completed sample; SDK 0.26.2+)
    "modes": None,                 # list of modes: one run of each per shard count (overrides "mode")
    "poll_timeout_s": 45.0,        # client timeout per retrieve_future (s), as the SDK with plain httpx
    "max_polls": 100000,           # bound on retrieve_future calls per future
    "max_resubmits": 10,           # bound on 410-triggered resubmits per sample
    "sdk_dispatch_limit": 400,     # asample calls in flight per driver process, retries included, as SDK 0.38's
                                   # InternalClientHolder._sample_dispatch_semaphore (0: no limit)
    "time_limit_s": 900.0,         # a run stops counting after this (s); unfinished samples fail
    "mem_interval_s": 1.0,         # memory / arena sampling period (s)
    "warmup": 16,                  # samples each driver process runs (and discards) before the measured run
    "bare_parse_runs": 31,         # timed parses of the run's engine body (the median is the floor)
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


# Seconds a dead driver process's result has to arrive before the run stops waiting for it.
DRIVER_GONE_GRACE_S = 10.0


def collect_driver_results(procs: list[Any], results: Any, hard_end: float, tick: Any = None,
                           grace_s: float = DRIVER_GONE_GRACE_S) -> list[tuple[str, Any]]:
    """Wait for every driver process's ``("ok", DriverResult)`` or ``("error", message)`` on
    ``results`` (a multiprocessing queue), until ``hard_end`` (``time.monotonic()`` seconds).

    Stops early at the first error, and when a process has died without reporting (a crash
    reports nothing: seen once, 24576/24576 done and then nothing for 500 s): what a dead process
    put before it exited arrives within ``grace_s``; after that an ``("error", "... exit codes
    [...]")`` entry is added. ``tick()`` runs every 0.5 s (progress). Returns the entries in the
    order they came; fewer than ``len(procs)`` when ``hard_end`` passed.
    """
    outs: list[tuple[str, Any]] = []
    gone_since = None
    while len(outs) < len(procs) and time.monotonic() < hard_end:
        try:
            outs.append(results.get(timeout=0.5))
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        if tick is not None:
            tick()
        if any(o[0] == "error" for o in outs):
            break
        gone = sum(1 for p in procs if not p.is_alive())
        if gone > len(outs):
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace_s:
                codes = [p.exitcode for p in procs if not p.is_alive()]
                outs.append(("error", f"a driver process exited without a result (exit codes {codes})"))
                break
        else:
            gone_since = None
    return outs

ROLES = ("supervisor", "encoder", "front-end", "other")
ROLE_PLURAL = {"supervisor": "supervisor", "encoder": "encoders", "front-end": "front-ends", "other": "other"}


def role_of(title: str) -> str:
    """Role of a server process from its title (``shardserver: encoder 0`` -> ``encoder``).

    Titles are set with setproctitle by ``shardserver.cli`` (supervisor) and
    ``shardserver.workers._subprocess.child_setup`` (``encoder <shard>``, ``front-end <index>``);
    anything else of the group (the multiprocessing resource tracker) is ``other``.
    """
    for r in ("supervisor", "encoder", "front-end"):
        if title.startswith(f"shardserver: {r}"):
            return r
    return "other"


def mem_by_pid(pids: list[int]) -> dict[int, tuple[int, int]]:
    """pid -> (PSS, RSS) in bytes from ``/proc/<pid>/smaps_rollup`` (kB in the file); gone pids left out."""
    out = {}
    for p in pids:
        pss = rss = 0
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
        except OSError:
            continue
        out[p] = (pss, rss)
    return out


def mem_of(pids: list[int]) -> tuple[int, int]:
    """(PSS, RSS) in bytes summed over pids (shared pages: PSS splits them, RSS counts them in full)."""
    m = mem_by_pid(pids)
    return sum(v[0] for v in m.values()), sum(v[1] for v in m.values())


def fetch_stats(url: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /stats`` of the gateway as a dict (one front-end's counters, every shard's STATS), or None."""
    try:
        with urllib.request.urlopen(url + "/stats", timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


STAGES = ("pending", "completed", "retrieved", "gone")


def stats_summary(js: dict[str, Any]) -> dict[str, float]:
    """Sums over the shards of one /stats answer: arena bytes used/reserved, futures per stage, decode_encode_s."""
    shards = [s for s in js.get("shards", []) if "error" not in s]
    out: dict[str, float] = {
        "arena_used": sum(int(s.get("arena_used_bytes", 0)) for s in shards),
        "arena_reserved": sum(int(s.get("arena_reserved_bytes", 0)) for s in shards),
        "decode_encode_s": sum(float(s.get("decode_encode_s", 0.0)) for s in shards),
    }
    for st in STAGES:
        out[st] = sum(int(s.get("stages", {}).get(st, 0)) for s in shards)
    return out


class Monitor(threading.Thread):
    """The run's time series, sampled every ``interval`` s from ``t0`` (``time.monotonic()`` at go).

    :attr:`series` (columns of equal length, one row per sample): ``t_s`` (s since go); server
    PSS per role ``pss_<role>`` and RSS summed ``rss`` (bytes, ``/proc/<pid>/smaps_rollup`` of
    the live server processes); the drivers' cumulative counters from the shared progress array
    (``done``, ``failed``, ``submitted``, ``in_flight`` = submitted - done - failed, ``retries``,
    and ``retry_<kind>`` per kind of ``load_driver.RETRY_KINDS``).

    :attr:`stats_series` (own rows, because ``/stats`` can take seconds to answer when the server
    is saturated, so it is polled on its own thread): ``t_s`` (midpoint of request and answer,
    s since go), ``latency_s`` (how long the answer took), and sums over shards of
    ``arena_used`` / ``arena_reserved`` (bytes) and futures per stage (``pending``,
    ``completed``, ``retrieved``, ``gone``); :attr:`stats_failed`: when (s since go) a poll
    failed or took over 5 s. Stops when ``stop_ev`` is set or after ``max_s``.
    """

    def __init__(self, pgid: int, url: str, interval: float, max_s: float, t0: float,
                 progress: Any = None, driver_procs: int = 0) -> None:
        super().__init__(name="load-monitor", daemon=True)
        self.pgid, self.url, self.interval, self.max_s, self.t0 = pgid, url, interval, max_s, t0
        self.progress, self.driver_procs = progress, driver_procs
        self.stop_ev = threading.Event()
        self.peak_pss = self.peak_rss = self.peak_arena_used = 0
        self.peak_pss_by_role = {r: 0 for r in ROLES}
        self.pss_by_role_at_peak = {r: 0 for r in ROLES}
        self.samples: list[tuple[float, int, int, int]] = []  # (t s, pss, rss, arena used) bytes
        cols = ["t_s", *(f"pss_{r}" for r in ROLES), "rss", "done", "failed", "submitted", "in_flight", "retries",
                *(f"retry_{k}" for k in load_driver.RETRY_KINDS)]
        self.series: dict[str, list[float]] = {c: [] for c in cols}
        self.stats_series: dict[str, list[float]] = {c: [] for c in ("t_s", "latency_s", "arena_used",
                                                                     "arena_reserved", *STAGES)}
        self.last_arena_used = -1
        self.stats_failed: list[float] = []   # s since go of each /stats poll that failed or timed out (5 s)

    def arena_used(self) -> int:
        js = fetch_stats(self.url)
        return -1 if js is None else int(stats_summary(js)["arena_used"])

    def _stats_loop(self) -> None:
        k = 0
        while not self.stop_ev.is_set() and time.monotonic() - self.t0 < self.max_s:
            t_req = time.monotonic()
            js = fetch_stats(self.url)
            t_ans = time.monotonic()
            if js is None:
                self.stats_failed.append(round(t_req - self.t0, 2))
            else:
                st = stats_summary(js)
                row = {"t_s": round((t_req + t_ans) / 2 - self.t0, 2), "latency_s": round(t_ans - t_req, 3),
                       **{c: int(st[c]) for c in ("arena_used", "arena_reserved", *STAGES)}}
                for c, col in self.stats_series.items():
                    col.append(row[c])
                self.last_arena_used = int(st["arena_used"])
                self.peak_arena_used = max(self.peak_arena_used, self.last_arena_used)
            k += 1
            self.stop_ev.wait(max(0.0, self.t0 + k * self.interval - time.monotonic()))

    def _progress(self) -> dict[str, int]:
        """Cumulative driver counters summed over the driver processes' rows."""
        N = load_driver.N_SLOTS
        out = {"done": 0, "failed": 0, "submitted": 0, "retries": 0}
        kinds = dict.fromkeys(load_driver.RETRY_KINDS, 0)
        if self.progress is None:
            return {**out, **{f"retry_{k}": 0 for k in kinds}}
        for i in range(self.driver_procs):
            b = i * N
            out["done"] += self.progress[b + load_driver.P_DONE]
            out["failed"] += self.progress[b + load_driver.P_FAILED]
            out["submitted"] += self.progress[b + load_driver.P_SUBMITTED]
            out["retries"] += self.progress[b + load_driver.P_RETRIES]
            for j, k in enumerate(load_driver.RETRY_KINDS):
                kinds[k] += self.progress[b + load_driver.P_KIND0 + j]
        return {**out, **{f"retry_{k}": v for k, v in kinds.items()}}

    def sample(self) -> None:
        """Take one row of the series now."""
        now = time.monotonic()
        pids = server_pids(self.pgid)
        mem = mem_by_pid(list(pids))
        by_role = {r: 0 for r in ROLES}
        for p, (pss, _) in mem.items():
            by_role[role_of(pids[p])] += pss
        pss = sum(v[0] for v in mem.values())
        rss = sum(v[1] for v in mem.values())
        if pss > self.peak_pss:
            self.pss_by_role_at_peak = dict(by_role)
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
        for r in ROLES:
            self.peak_pss_by_role[r] = max(self.peak_pss_by_role[r], by_role[r])
        prog = self._progress()
        row: dict[str, float] = {"t_s": round(now - self.t0, 2), "rss": rss,
                                 **{f"pss_{r}": v for r, v in by_role.items()},
                                 **prog, "in_flight": prog["submitted"] - prog["done"] - prog["failed"]}
        for c, col in self.series.items():
            col.append(row[c])
        self.samples.append((row["t_s"], pss, rss, self.last_arena_used))

    def run(self) -> None:
        stats = threading.Thread(target=self._stats_loop, name="load-monitor-stats", daemon=True)
        stats.start()
        k = 0
        while not self.stop_ev.is_set() and time.monotonic() - self.t0 < self.max_s:
            self.sample()
            k += 1
            # Sample on a fixed grid (t0 + k * interval), whatever each sample cost.
            self.stop_ev.wait(max(0.0, self.t0 + k * self.interval - time.monotonic()))
        stats.join(10)
        self.sample()                   # one last row, at the end of the run
        used = self.arena_used()        # one last look at the arenas
        self.peak_arena_used = max(self.peak_arena_used, used)
        self.last_arena_used = used


# ------------------------------------------------------------------------------------------------
# the floor: a bare parse of the run's own engine body
# ------------------------------------------------------------------------------------------------
def listen_port(pid: int) -> int | None:
    """TCP port that process ``pid`` listens on (``/proc/<pid>/fd`` socket inodes vs ``/proc/<pid>/net/tcp``)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return None
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:   # 0A = LISTEN
                return int(f[1].rsplit(":", 1)[1], 16)
    return None


def engine_body(spec: dict[str, Any], sim_pid: int | None) -> tuple[bytes, str]:
    """One engine body of the scenario's shape: (body bytes, where it came from).

    The ``/v1/completions`` request the gateway sends for the scenario's first (prompt, seed)
    pair (:func:`load_driver.engine_request`), POSTed to the run's own simulator process
    (``"simulator"``); when that fails, rendered locally with
    ``shardserver.engine_sim.render_completion`` (``"render_completion"``: the same bytes but
    the id and ``created``).
    """
    req = load_driver.engine_request(load_driver.prompt_for(0, int(spec["prompt_tokens"])), int(spec["tokens"]),
                                     load_driver.seed_for(0), int(spec["num_samples"]))
    port = listen_port(sim_pid) if sim_pid else None
    if port:
        try:
            r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(req).encode(),
                                       headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(r, timeout=60) as resp:
                return resp.read(), "simulator"
        except (OSError, ValueError):
            pass
    from shardserver.engine_sim import SimConfig, render_completion

    return render_completion(req, SimConfig.from_mapping({"model_name": load_driver.BASE_MODEL})), "render_completion"


def bare_parse(body: bytes, n: int = 31) -> dict[str, Any]:
    """Time ``simdjson.Parser().parse(body)`` (reused parser, no field access; the encoder's floor).

    Returns ``{"ms": median CPU ms, "ms_min", "ms_max", "wall_ms": median wall ms, "n",
    "body_bytes"}`` over ``n`` parses after 3 unmeasured ones. ``ms`` is the calling thread's CPU
    time (``time.thread_time``), the same kind of figure as the server's utime+stime, so a
    machine shared with other jobs (which stretches wall time, not CPU time) moves it less.
    """
    import simdjson

    parser = simdjson.Parser()
    cpu, wall = [], []
    for i in range(n + 3):
        w, c = time.perf_counter(), time.thread_time()
        doc = parser.parse(body)
        dc, dw = time.thread_time() - c, time.perf_counter() - w
        del doc                       # a live document keeps the parser from being reused
        if i >= 3:
            cpu.append(dc * 1000)
            wall.append(dw * 1000)
    cpu.sort()
    wall.sort()
    return {"ms": round(cpu[len(cpu) // 2], 4), "ms_min": round(cpu[0], 4), "ms_max": round(cpu[-1], 4),
            "wall_ms": round(wall[len(wall) // 2], 4), "n": n, "body_bytes": len(body)}


def cpu_breakdown(titles: dict[int, str], cpu0: dict[int, float], cpu1: dict[int, float], results: int,
                  parse_ms: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per-process and per-role server CPU of a run.

    Args:
        titles: pid -> process title (every server pid seen at either end).
        cpu0, cpu1: pid -> utime+stime seconds at go and at the end (``/proc/<pid>/stat``); a pid
            born during the run counts all its CPU, a pid gone by the end counts 0 (listed with
            ``"lost": True``).
        results: verified results of the run (the per-result denominator).
        parse_ms: bare-parse time of the run's engine body, ms (the floor the ratios use).
    Returns:
        (processes, roles): processes is a list of ``{"pid", "title", "role", "cpu_s",
        "ms_per_result", "x_bare_parse"}`` sorted by role then title; roles maps each role of
        :data:`ROLES` to ``{"processes", "cpu_s", "ms_per_result", "x_bare_parse"}``.
    """
    n = max(results, 1)
    procs = []
    for p in sorted(set(cpu0) | set(cpu1)):
        cpu = cpu1[p] - cpu0.get(p, 0.0) if p in cpu1 else 0.0
        ms = 1000 * cpu / n
        procs.append({"pid": p, "title": titles.get(p, ""), "role": role_of(titles.get(p, "")),
                      "cpu_s": round(cpu, 3), "ms_per_result": round(ms, 3),
                      "x_bare_parse": round(ms / parse_ms, 2) if parse_ms > 0 else None,
                      **({"lost": True} if p not in cpu1 else {})})
    procs.sort(key=lambda d: (ROLES.index(d["role"]), d["title"], d["pid"]))
    roles = {}
    for r in ROLES:
        mine = [d for d in procs if d["role"] == r]
        cpu = sum(d["cpu_s"] for d in mine)
        ms = 1000 * cpu / n
        roles[r] = {"processes": len(mine), "cpu_s": round(cpu, 3), "ms_per_result": round(ms, 3),
                    "x_bare_parse": round(ms / parse_ms, 2) if parse_ms > 0 else None}
    return procs, roles


# ------------------------------------------------------------------------------------------------
# profiles (py-spy)
# ------------------------------------------------------------------------------------------------
def pyspy_path() -> str | None:
    """The py-spy executable: next to this interpreter (a venv) or on PATH; None when absent."""
    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


def start_profiles(roles: list[str], pids: dict[int, str], out_dir: Path, stem: str, label: str,
                   rate: int, extra: list[str]) -> list[dict[str, Any]]:
    """Start ``py-spy record -f raw`` on the first process of each role (by title), flags ``extra``.

    py-spy inherits this process's CPU affinity (the driver cores), so its own sampling does not
    run on the server's cores; ``--nonblocking`` (added unless ``extra`` has ``--native``, which
    needs to stop the target) reads the target without stopping it. Returns
    one dict per profiler (``proc``, ``pid``, ``title``, ``file``), stopped by :func:`stop_profiles`.
    """
    exe = pyspy_path()
    if exe is None:
        print("py-spy not found: no profiles (pip install py-spy)", file=sys.stderr)
        return []
    out = []
    for role in roles:
        mine = sorted((t, p) for p, t in pids.items() if role_of(t) == role)
        if not mine:
            print(f"--profile: no {role} process", file=sys.stderr)
            continue
        title, pid = mine[0]
        path = out_dir / f"{stem}-{_slug(label)}-{_slug(title.removeprefix('shardserver: '))}.pyspy.txt"
        # --native needs py-spy to stop the target at each sample; otherwise it reads without stopping.
        flags = ["-r", str(rate), *([] if "--native" in extra else ["--nonblocking"]), *extra]
        proc = subprocess.Popen([exe, "record", "-p", str(pid), "-f", "raw", "-o", str(path), *flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        out.append({"proc": proc, "pid": pid, "title": title, "file": path, "flags": flags})
    return out


def stop_profiles(profs: list[dict[str, Any]], top: int = 15) -> list[dict[str, Any]]:
    """SIGINT each py-spy (it then writes its file), wait, and summarise: see :func:`pyspy_top`."""
    for pr in profs:
        if pr["proc"].poll() is None:
            pr["proc"].send_signal(signal.SIGINT)
    out = []
    for pr in profs:
        try:
            _, err = pr["proc"].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pr["proc"].kill()
            _, err = pr["proc"].communicate(timeout=10)
        entry: dict[str, Any] = {"pid": pr["pid"], "title": pr["title"], "file": str(pr["file"]), "flags": pr["flags"]}
        if pr["file"].exists():
            entry.update(pyspy_top(pr["file"].read_text(), top))
        else:
            entry["error"] = (err or "")[-500:]
        out.append(entry)
    return out


def _frame_key(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: py-spy's raw frames, aggregated per function."""
    name, _, loc = frame.partition(" (")
    file = loc.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({file.rsplit('/', 1)[-1]})" if file else name


def pyspy_top(raw: str, top: int = 15) -> dict[str, Any]:
    """Top functions of a py-spy ``-f raw`` profile (collapsed stacks: ``f1;f2;...;fn <count>`` per line).

    Returns ``{"samples": total, "top_self": [(function, samples, percent)], "top_total":
    [...]}``: *self* counts the samples where the function is the innermost Python frame (time in
    a C extension called from it counts as its own), *total* the samples where it is anywhere on
    the stack (once per sample), leaving out the trunk (functions on >= 90 % of the samples: the
    process entry and the event loop). Frames are aggregated per function and file, line numbers
    dropped.
    """
    self_c: dict[str, int] = {}
    total_c: dict[str, int] = {}
    n = 0
    for line in raw.splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        n += c
        frames = [_frame_key(f) for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        if not frames:
            continue
        self_c[frames[-1]] = self_c.get(frames[-1], 0) + c
        for f in set(frames):
            total_c[f] = total_c.get(f, 0) + c

    def best(d: dict[str, int]) -> list[tuple[str, int, float]]:
        return [(k, v, round(100 * v / max(n, 1), 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    # The common trunk (process start, event loop: on nearly every stack) says nothing; leave it out.
    branch = {k: v for k, v in total_c.items() if v < 0.9 * n}
    return {"samples": n, "top_self": best(self_c), "top_total": best(branch)}

# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(xs), q))


def run_one(spec: dict[str, Any], shards: int, front_ends: int, label: str, cores: dict[str, Any],
            driver_procs: int, progress_bar: bool, profile: list[str] | None = None, out_dir: Path | None = None,
            stem: str = "run", profile_rate: int = 100, profile_args: list[str] | None = None) -> dict[str, Any]:
    """Start a gateway (S=shards, F=front_ends), drive the scenario, measure, stop. Returns the record.

    ``profile``: roles (``front-end``, ``encoder``, ``supervisor``) whose first process is
    profiled with py-spy from go to the end of the run (files in ``out_dir``).
    """
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
    # The server announces the poller only in poller mode (per_request: as SDKs before 0.26.2 poll).
    env["SHARDSERVER_FUTURES__RETRIEVE_FUTURES"] = "true" if spec.get("mode") == "poller" else "false"
    # The run's own state directory (ID secret, futures journals), removed after the run: a
    # benchmark leaves nothing in the user's default server.state_dir.
    state_dir = tempfile.mkdtemp(prefix="shardserver-bench-state-")
    env.setdefault("SHARDSERVER_SERVER__STATE_DIR", state_dir)
    me = os.getpid()
    print(f"\n== {label}: {spec['requests']} x {spec['tokens']} tokens, "
          f"{spec['concurrency']} in flight, {spec['connections']} connections, engine delay "
          f"{spec['engine_delay_s']} s ({spec['engine_delay_kind']}), {spec.get('mode', 'per_request')} mode",
          file=sys.stderr, flush=True)
    # The server inherits the server cores; we (and the driver processes we spawn) keep the driver cores.
    os.sched_setaffinity(me, cores["server"])
    try:
        server = RunningServer(env=env, start_timeout=120).__enter__()
    finally:
        os.sched_setaffinity(me, cores["driver"])
    record: dict[str, Any] = {"label": label, "mode": spec.get("mode", "per_request"), "shards": shards,
                              "front_ends": front_ends,
                              "requests": spec["requests"], "tokens": spec["tokens"],
                              "concurrency": spec["concurrency"], "connections": spec["connections"],
                              "engine_delay_s": spec["engine_delay_s"], "driver_procs": driver_procs}
    procs: list[Any] = []
    profs: list[dict[str, Any]] = []
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
        # The floor, measured in this run: a bare parse of one engine body of this scenario's
        # shape, fetched from this run's simulator, timed on a server core while the server idles.
        sims = sim_pids(pgid)
        body, body_src = engine_body(spec, sims[0] if sims else None)
        os.sched_setaffinity(me, cores["server"])
        try:
            parse = bare_parse(body, int(spec["bare_parse_runs"]))
        finally:
            os.sched_setaffinity(me, cores["driver"])
        parse["source"] = body_src
        del body
        print(f"   bare simdjson parse of the engine body ({parse['body_bytes'] / 1e6:.2f} MB, from the {body_src}): "
              f"{parse['ms']:.2f} ms CPU, {parse['wall_ms']:.2f} ms wall (medians of {parse['n']})", file=sys.stderr, flush=True)
        stats0 = fetch_stats(server.url, timeout=30)
        spids = server_pids(pgid)
        cpu0 = cpu_of(list(spids))
        sim0 = cpu_of(sim_pids(pgid))
        profs = start_profiles(profile or [], spids, out_dir or HERE / "results", stem, label, profile_rate,
                               profile_args or [])
        t_go = time.monotonic()
        mon = Monitor(pgid, server.url, float(spec["mem_interval_s"]), float(spec["time_limit_s"]) + 900, t_go,
                      progress, driver_procs)
        mon.start()
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

        def tick() -> bool:
            nonlocal last
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
            return True

        outs = collect_driver_results(procs, results, hard_end, tick)
        if bar is not None:
            bar.close()
        wall_cpu_end = time.monotonic()
        end_pids = server_pids(pgid)
        cpu1 = cpu_of(list(end_pids))
        sim1 = cpu_of(sim_pids(pgid))
        profiles = stop_profiles(profs)
        mon.stop_ev.set()
        mon.join(30)
        stats1 = fetch_stats(server.url, timeout=30)
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
        by_proc, by_role = cpu_breakdown({**end_pids, **spids}, cpu0, cpu1, done, parse["ms"])
        dec_enc = None
        if stats0 is not None and stats1 is not None:
            dec_enc = round(1000 * (stats_summary(stats1)["decode_encode_s"] - stats_summary(stats0)["decode_encode_s"])
                            / max(done, 1), 3)
        record.update({
            "results": done,
            "failures": failures,
            "wall_s": round(wall, 3),
            "results_per_s": round(done / wall, 1),
            "server_cpu_s": round(server_cpu, 3),
            "server_cpu_ms_per_result": round(1000 * server_cpu / max(done, 1), 3),
            "bare_parse": parse,
            "server_cpu_x_bare_parse": round(1000 * server_cpu / max(done, 1) / parse["ms"], 2),
            "cpu_by_role": by_role,
            "cpu_by_process": by_proc,
            "decode_encode_wall_ms_per_result": dec_enc,
            "server_cpu_cores_busy": round(server_cpu / max(wall_cpu_end - t_go, 1e-9), 2),
            "sim_cpu_s": round(sum(sim1.get(p, 0) - sim0.get(p, 0) for p in sim1), 3),
            "driver_cpu_s": round(sum(r.cpu_s for r in res), 3),
            "peak_pss_bytes": mon.peak_pss,
            "peak_rss_bytes": mon.peak_rss,
            "peak_pss_by_role_bytes": mon.peak_pss_by_role,
            "pss_by_role_at_peak_bytes": mon.pss_by_role_at_peak,
            "peak_arena_used_bytes": mon.peak_arena_used,
            "ttr_p50_s": _pct(lat, 50),
            "ttr_p99_s": _pct(lat, 99),
            "ttr_max_s": max(lat) if lat else None,
            "bytes_delivered": bytes_delivered,
            "bytes_per_result": round(bytes_delivered / max(done, 1)),
            "poller_polls": sum(r.poller_polls for r in res),
            "retries": {k: v for k, v in sorted(counters.items()) if not k.startswith("fail_")},
            "failures_by_kind": {k[5:]: v for k, v in sorted(counters.items()) if k.startswith("fail_")},
            "first_errors": [e for r in res for e in r.first_errors][:10],
            "server_processes": {str(p): t for p, t in spids.items()},
            "server_processes_lost": lost,
            "server_processes_new": [p for p in end_pids if p not in spids],
            "placement": placement,
            "memory_samples": mon.samples,
            "profiles": profiles,
            "timeseries": mon.series,
            "stats_timeseries": mon.stats_series,
            "stats_failed_at_s": mon.stats_failed,
            "latencies_s": sorted(lat),
            "done_at_s": sorted(x for r in res for x in r.done_at_s),
        })
        try:
            record["server_stats"] = server.stats()
        except Exception as exc:  # noqa: BLE001
            record["server_stats"] = {"error": repr(exc)}
    finally:
        for pr in profs:                      # only when the run failed before stop_profiles
            if pr["proc"].poll() is None:
                pr["proc"].kill()
                pr["proc"].wait(10)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        sup_pid = server.proc.pid if server.proc is not None else 0
        rc = server.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
        record["server_exit_code"] = rc
        record["leftover_processes"] = bool(server.leftover_processes)
        record["leftover_segments"] = [s for s in our_shm_segments() if s.startswith(f"shardserver-{sup_pid}-")]
    print(f"   {record.get('results')} results, {record.get('failures')} failures, "
          f"{record.get('results_per_s')} results/s, {record.get('server_cpu_ms_per_result')} ms server CPU/result "
          f"(x{record.get('server_cpu_x_bare_parse')} bare parse), "
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
        if r.get("poller_polls"):
            retr += f" ({r['poller_polls']} retrieve_futures calls)"
        lines.append(f"| {r['label']} | {r['shards']} | {r['front_ends']} | {r['results']} | {r['failures']} "
                     f"| {r['results_per_s']} | {r['server_cpu_ms_per_result']} | {r['server_cpu_cores_busy']} "
                     f"| {_mib(r['peak_pss_bytes'])} | {_mib(r['peak_rss_bytes'])} | {_mib(r['peak_arena_used_bytes'])} "
                     f"| {_ms(r['ttr_p50_s'])} | {_ms(r['ttr_p99_s'])} | {r['bytes_delivered'] / 1e6:.0f} "
                     f"| {r['driver_cpu_s']:.1f}+{r['sim_cpu_s']:.1f} | {retr} |")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def role_table(runs: list[dict[str, Any]], nproc: int) -> str:
    """Markdown table: server CPU per result by role (ms and x the run's bare parse), PSS by role."""
    head = ("| run | S | F | bare parse ms (body MB) | server CPU ms/result | supervisor | encoders | front-ends "
            "| other | encoder decode+encode wall ms | peak PSS MiB sup / enc / fe | CPUs |")
    lines = [head, "|" + "---|" * 12]
    for r in runs:
        bp, rl = r["bare_parse"], r["cpu_by_role"]

        def cell(role: str) -> str:
            d = rl[role]
            return f"{d['ms_per_result']:.2f} ({_x(d['x_bare_parse'])})"

        pk = r["peak_pss_by_role_bytes"]
        de = r.get("decode_encode_wall_ms_per_result")
        lines.append(f"| {r['label']} | {r['shards']} | {r['front_ends']} | {bp['ms']:.2f} ({bp['body_bytes'] / 1e6:.2f}) "
                     f"| {r['server_cpu_ms_per_result']:.2f} ({_x(r['server_cpu_x_bare_parse'])}) "
                     f"| {cell('supervisor')} | {cell('encoder')} | {cell('front-end')} "
                     f"| {rl['other']['ms_per_result']:.2f} | {'-' if de is None else f'{de:.2f}'} "
                     f"| {_mib(pk['supervisor'])} / {_mib(pk['encoder'])} / {_mib(pk['front-end'])} | {nproc} |")
    return "\n".join(lines)


def per_process_lines(runs: list[dict[str, Any]]) -> list[str]:
    """One line per run: each server process's CPU per result (ms of all the run's results)."""
    out = []
    for r in runs:
        parts = [f"{d['title'].removeprefix('shardserver: ') or d['pid']} {d['ms_per_result']:.2f}"
                 + (" (lost)" if d.get("lost") else "") for d in r["cpu_by_process"] if d["role"] != "other"]
        out.append(f"{r['label']} per process, ms CPU per result: " + ", ".join(parts))
    return out


def scaling_table(runs: list[dict[str, Any]], nproc: int) -> str | None:
    """CPU per result at each shard count, side by side, with the ratio to the smallest S; None if one S."""
    main = sorted((r for r in runs if not r["label"].startswith("reference")), key=lambda r: r["shards"])
    if len({r["shards"] for r in main}) < 2:
        return None
    base = main[0]
    head = (f"| S | F | results | results/s | server CPU ms/result | x S={base['shards']} | x bare parse "
            f"| encoders ms | x S={base['shards']} | front-ends ms | supervisor ms | CPUs |")
    lines = [head, "|" + "---|" * 12]
    for r in main:
        e, b = r["cpu_by_role"]["encoder"]["ms_per_result"], base["cpu_by_role"]["encoder"]["ms_per_result"]
        lines.append(f"| {r['shards']} | {r['front_ends']} | {r['results']} | {r['results_per_s']} "
                     f"| {r['server_cpu_ms_per_result']:.2f} "
                     f"| {r['server_cpu_ms_per_result'] / max(base['server_cpu_ms_per_result'], 1e-9):.2f} "
                     f"| {_x(r['server_cpu_x_bare_parse'])} | {e:.2f} | {e / max(b, 1e-9):.2f} "
                     f"| {r['cpu_by_role']['front-end']['ms_per_result']:.2f} "
                     f"| {r['cpu_by_role']['supervisor']['ms_per_result']:.2f} | {nproc} |")
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
    if "cpu_per_result_growth_max" in g:
        lim = float(g["cpu_per_result_growth_max"])
        by_s = sorted(main, key=lambda r: r["shards"])
        if len({r["shards"] for r in by_s}) > 1:
            base = by_s[0]
            for r in by_s[1:]:
                ratio = r["server_cpu_ms_per_result"] / max(base["server_cpu_ms_per_result"], 1e-9)
                out.append((f"S={r['shards']}: server CPU per result <= {lim} x S={base['shards']} "
                            f"({base['server_cpu_ms_per_result']:.2f} ms): no contention between shards",
                            f"{r['server_cpu_ms_per_result']:.2f} ms ({ratio:.2f}x)", ratio <= lim))
    if "server_cpu_x_bare_parse_max" in g:
        lim = float(g["server_cpu_x_bare_parse_max"])
        for r in main:
            out.append((f"{r['label']}: server CPU per result <= {lim} x bare parse "
                        f"({r['bare_parse']['ms']:.2f} ms, same run) = {lim * r['bare_parse']['ms']:.2f} ms",
                        f"{r['server_cpu_ms_per_result']:.2f} ms ({_x(r['server_cpu_x_bare_parse'])})",
                        r["server_cpu_x_bare_parse"] <= lim))
    if "frontend_ms_per_result_max" in g:
        lim = float(g["frontend_ms_per_result_max"])
        for r in main:
            fe = r["cpu_by_role"]["front-end"]["ms_per_result"]
            out.append((f"{r['label']}: front-end CPU per result <= {lim} ms", f"{fe:.2f} ms", fe <= lim))
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


def results_per_s_series(done_at_s: list[float], wall_s: float, bins: int = 60) -> tuple[list[float], list[float], float]:
    """results/s over time from the completion times (s since go): (bin centres s, results/s, bin width s).

    The bin width is wall/``bins`` rounded up to 0.1 s (at least 0.1 s), so a 3 s burst and a
    15 min soak both give a curve rather than a point.
    """
    if not done_at_s:
        return [], [], 0.0
    end = max(max(done_at_s), wall_s, 1e-3)
    w = max(0.1, math.ceil(end / bins * 10) / 10)
    n = int(math.ceil(end / w)) or 1
    counts = [0] * n
    for x in done_at_s:
        counts[min(int(max(x, 0.0) / w), n - 1)] += 1
    return [round((i + 0.5) * w, 3) for i in range(n)], [c / w for c in counts], w


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower()


def plot_timeline(plt: Any, path: Path, title: str, r: dict[str, Any]) -> None:
    """One run as a story over time: results/s, PSS by role, arena bytes, futures in flight, retries by kind."""
    ts = r.get("timeseries") or {}
    t = ts.get("t_s", [])
    fig, axes = plt.subplots(5, 1, figsize=(8, 12), sharex=True)
    xs, ys, w = results_per_s_series(r.get("done_at_s", []), r.get("wall_s", 0.0))
    ax = axes[0]
    ax.step(xs, ys, where="mid", color="C0", label=f"results/s ({w:g} s bins)")
    ax.axhline(r["results_per_s"], color="gray", ls="--", lw=1, label=f"run mean {r['results_per_s']}/s")
    ax.set_ylabel("results/s")
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[1]
    if t:
        ys_roles = [[v / 2**20 for v in ts[f"pss_{role}"]] for role in ROLES]
        ax.stackplot(t, *ys_roles, labels=[ROLE_PLURAL[role] for role in ROLES], alpha=0.8)
    ax.set_ylabel("PSS MiB (stacked)")
    ax.legend(fontsize=8, loc="upper left")
    ss = r.get("stats_timeseries") or {}
    st_t = ss.get("t_s", [])
    ax = axes[2]
    if st_t:
        ax.plot(st_t, [v / 2**20 for v in ss["arena_used"]], marker=".", label="arena used (proto retained)")
        ax.plot(st_t, [v / 2**20 for v in ss["arena_reserved"]], marker=".", label="arena reserved")
    ax.set_ylabel("arena MiB (all shards)")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[3]
    if t:
        ax.plot(t, ts["in_flight"], marker=".", label="driver: submitted, no result yet")
    for st in ("pending", "completed"):
        if st_t:
            ax.plot(st_t, ss[st], marker=".", label=f"server: {st} (/stats, at its answer)")
    for i, x in enumerate(r.get("stats_failed_at_s", [])):
        for a in (axes[2], axes[3]):
            a.axvline(x, color="red", alpha=0.4, lw=1, label="/stats poll failed (> 5 s)" if i == 0 else None)
    ax.set_ylabel("futures")
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[4]
    kinds = [k for k in load_driver.RETRY_KINDS if t and ts[f"retry_{k}"][-1] > 0]
    for k in kinds:
        ax.plot(t, ts[f"retry_{k}"], marker=".", label=k)
    if t and ts["failed"][-1] > 0:
        ax.plot(t, ts["failed"], color="red", lw=2, label="FAILED samples")
    if not kinds:
        ax.text(0.5, 0.5, "no retries", transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_ylabel("retries (cumulative)")
    if kinds:
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_xlabel("time since go (s)")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_cpu_bars(plt: Any, path: Path, title: str, runs: list[dict[str, Any]]) -> None:
    """Stacked bars of server CPU per result by role for each run, with the run's bare-parse floor marked."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    labels = [r["label"] for r in runs]
    bottom = [0.0] * len(runs)
    for role in ROLES:
        vals = [r["cpu_by_role"][role]["ms_per_result"] for r in runs]
        ax.bar(labels, vals, bottom=bottom, label=ROLE_PLURAL[role])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        bp = r["bare_parse"]["ms"]
        ax.hlines(bp, i - 0.4, i + 0.4, colors="black", linestyles="--")
        ax.text(i, bottom[i], f"{r['server_cpu_ms_per_result']:.2f} ms\n{r['server_cpu_x_bare_parse']:.2f}x parse",
                ha="center", va="bottom", fontsize=8)
    ax.plot([], [], "k--", label="bare parse (same run)")
    ax.set_ylabel("server CPU ms per result")
    ax.set_ylim(0, max(bottom + [1e-3]) * 1.6)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.tick_params(axis="x", labelsize=8)
    names: list[str] = []
    for r in runs:
        for d in r["cpu_by_process"]:
            if d["role"] != "other":
                n = d["title"].removeprefix("shardserver: ")
                if n not in names:
                    names.append(n)
    width = 0.8 / max(len(runs), 1)
    for j, r in enumerate(runs):
        per = {d["title"].removeprefix("shardserver: "): d["ms_per_result"] for d in r["cpu_by_process"]}
        ax2.bar([i + j * width for i in range(len(names))], [per.get(n, 0.0) for n in names], width, label=r["label"])
    ax2.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))], names, fontsize=8, rotation=20)
    ax2.set_ylabel("ms CPU per result (of all results)")
    ax2.legend(fontsize=8)
    for a in (ax, ax2):
        a.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plots(out_dir: Path, stem: str, runs: list[dict[str, Any]], nproc: int | None = None) -> list[str]:
    """PNGs of the runs; [] when matplotlib is missing.

    * ``<stem>-<run>-timeline.png`` per run: results/s, PSS by role, arena bytes, futures in
      flight, retries by kind against time since go;
    * ``<stem>-cpu.png``: server CPU per result by role (stacked) and per process, with the bare parse;
    * ``<stem>-throughput.png`` (only with two or more shard counts): results/s and CPU per result vs S;
    * ``<stem>-ttr-cdf.png``: time-to-result CDF.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    cpus = f"{nproc or os.cpu_count()} CPUs"
    files = []
    for r in runs:
        p = out_dir / f"{stem}-{_slug(r['label'])}-timeline.png"
        plot_timeline(plt, p, f"{stem}: {r['label']} ({r['requests']} x {r['tokens']} tokens, {cpus})", r)
        files.append(str(p))
    p = out_dir / f"{stem}-cpu.png"
    plot_cpu_bars(plt, p, f"{stem}: server CPU per result by role ({cpus})", runs)
    files.append(str(p))
    main = sorted((r for r in runs if not r["label"].startswith("reference")), key=lambda r: r["shards"])
    if len({r["shards"] for r in main}) > 1:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["shards"] for r in main]
        ax.plot(xs, [r["results_per_s"] for r in main], marker="o", label="results/s")
        ax.plot(xs, [main[0]["results_per_s"] * x / xs[0] for x in xs], ls="--", color="gray", label="linear")
        ax.set_xlabel("shards (encoder processes)")
        ax.set_ylabel("results/s")
        ax.legend(fontsize=8)
        for role in ROLES[:3]:
            ax2.plot(xs, [r["cpu_by_role"][role]["ms_per_result"] for r in main], marker="o", label=ROLE_PLURAL[role])
        ax2.plot(xs, [r["server_cpu_ms_per_result"] for r in main], marker="o", color="black", label="server total")
        ax2.plot(xs, [r["bare_parse"]["ms"] for r in main], ls="--", color="gray", label="bare parse")
        ax2.set_xlabel("shards (encoder processes)")
        ax2.set_ylabel("CPU ms per result")
        ax2.set_ylim(bottom=0)
        ax2.legend(fontsize=8)
        for a in (ax, ax2):
            a.set_xticks(xs)
            a.grid(alpha=0.3)
        fig.suptitle(f"{stem}: scaling ({cpus})", fontsize=10)
        p = out_dir / f"{stem}-throughput.png"
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        files.append(str(p))
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        lat = r["latencies_s"]
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=r["label"])
    ax.set_xlabel("time to result (s)")
    ax.set_ylabel("fraction of results")
    ax.set_title(f"{stem}: time-to-result CDF ({cpus})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    p = out_dir / f"{stem}-ttr-cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=100)
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
    ap.add_argument("--profile", default="", metavar="ROLES",
                    help="py-spy the first process of these roles during each run, e.g. front-end,encoder")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default 100)")
    ap.add_argument("--profile-args", default="--gil", help="more py-spy record flags (default --gil: samples "
                    "holding the GIL only, i.e. not uvloop's idle epoll wait); e.g. '--gil --native'")
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
    modes = list(spec.get("modes") or [spec.get("mode", "per_request")])
    for m in modes:
        if m not in ("per_request", "poller"):
            raise SystemExit(f"unknown mode {m!r} (per_request or poller)")
    tag = (lambda m: f" {m}") if len(modes) > 1 or modes != ["per_request"] else (lambda m: "")
    plan = [(s, f, f"S={s} F={f}{tag(m)}", m) for m in modes for s in counts
            for f in [resolve_front_ends(spec, s, args.front_ends)]]
    if spec.get("reference") and not args.no_reference:
        plan.append((1, 1, f"reference S=1 F=1{tag(modes[0])}", modes[0]))
    for s, f, label, mode in plan:
        try:
            runs.append(run_one({**spec, "mode": mode}, s, f, label, cores, driver_procs, not args.no_progress,
                                [x.strip() for x in args.profile.split(",") if x.strip()], out_dir, stem,
                                args.profile_rate, args.profile_args.split()))
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
             f"{cores['driver']}, server cores {cores['server']}", "", tbl, "",
             f"Server CPU per result by role, ms (x the bare simdjson parse of this run's engine body, timed in "
             f"the same run on a server core; {os.cpu_count()} CPUs):", "", role_table(runs, os.cpu_count() or 0), "",
             *per_process_lines(runs), ""]
    for r in runs:
        for pr in r.get("profiles", []):
            if "error" in pr:
                lines += [f"{r['label']}: py-spy of {pr['title']} failed: {pr['error']}", ""]
                continue
            lines += [f"py-spy ({' '.join(pr['flags'])}) of {pr['title']} ({r['label']}): {pr['samples']} samples; "
                      f"raw stacks {pr['file']}. Top functions by own samples | by samples on the stack:", "", "```",
                      *[f"{a[2]:5.1f}% {a[1]:6d}  {a[0]:<60.60} | {b[2]:5.1f}% {b[1]:6d}  {b[0]}"
                        for a, b in zip(pr["top_self"], pr["top_total"])], "```", ""]
    sc = scaling_table(runs, os.cpu_count() or 0)
    if sc:
        lines += ["CPU per result vs shard count (same invocation, same machine):", "", sc, ""]
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
    pngs = plots(out_dir, stem, runs, os.cpu_count())
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
