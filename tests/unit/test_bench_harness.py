"""The load harness's measurements (benchmarks/run_load.py, benchmarks/load_driver.py).

Pure helpers on exact inputs (CPU breakdown by role, retry-kind slots, py-spy profile summary,
results/s binning), then the /proc and /stats sampling against a real gateway (S=2, F=2).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "benchmarks"))

import load_driver  # noqa: E402
import run_load  # noqa: E402


def test_role_of_titles() -> None:
    assert run_load.role_of("shardserver: supervisor") == "supervisor"
    assert run_load.role_of("shardserver: encoder 0") == "encoder"
    assert run_load.role_of("shardserver: encoder 11") == "encoder"
    assert run_load.role_of("shardserver: front-end 3") == "front-end"
    assert run_load.role_of("/venv/bin/python -B -c from multiprocessing.resource_tracker import main;main(5)") == "other"
    assert run_load.role_of("") == "other"


def test_cpu_breakdown_by_process_and_role() -> None:
    titles = {10: "shardserver: supervisor", 11: "shardserver: encoder 0", 12: "shardserver: encoder 1",
              13: "shardserver: front-end 0", 14: "shardserver: front-end 1", 15: "python resource_tracker",
              16: "shardserver: front-end 2"}
    cpu0 = {10: 1.0, 11: 10.0, 12: 20.0, 13: 5.0, 15: 0.5, 16: 3.0}
    cpu1 = {10: 1.1, 11: 14.0, 12: 24.5, 13: 6.0, 14: 0.5, 15: 0.5}      # 14 born during the run, 16 gone
    procs, roles = run_load.cpu_breakdown(titles, cpu0, cpu1, results=1000, parse_ms=4.0)
    assert [(d["title"], d["cpu_s"], d["ms_per_result"], d["x_bare_parse"]) for d in procs] == [
        ("shardserver: supervisor", 0.1, 0.1, 0.03),
        ("shardserver: encoder 0", 4.0, 4.0, 1.0),
        ("shardserver: encoder 1", 4.5, 4.5, 1.12),
        ("shardserver: front-end 0", 1.0, 1.0, 0.25),
        ("shardserver: front-end 1", 0.5, 0.5, 0.12),
        ("shardserver: front-end 2", 0.0, 0.0, 0.0),
        ("python resource_tracker", 0.0, 0.0, 0.0),
    ]
    assert [d.get("lost", False) for d in procs] == [False, False, False, False, False, True, False]
    assert roles == {
        "supervisor": {"processes": 1, "cpu_s": 0.1, "ms_per_result": 0.1, "x_bare_parse": 0.03},
        "encoder": {"processes": 2, "cpu_s": 8.5, "ms_per_result": 8.5, "x_bare_parse": 2.12},
        "front-end": {"processes": 3, "cpu_s": 1.5, "ms_per_result": 1.5, "x_bare_parse": 0.38},
        "other": {"processes": 1, "cpu_s": 0.0, "ms_per_result": 0.0, "x_bare_parse": 0.0},
    }


def test_retry_slots_and_driver_counts() -> None:
    k0 = load_driver.P_KIND0
    idx = {k: k0 + i for i, k in enumerate(load_driver.RETRY_KINDS)}
    assert load_driver.retry_slot("poll_408") == idx["poll_408"]
    assert load_driver.retry_slot("asample_timeout") == idx["asample_timeout"]
    assert load_driver.retry_slot("asample_503") == idx["asample_other"]
    assert load_driver.retry_slot("asample_408") == idx["asample_other"]
    assert load_driver.retry_slot("poll_503") == idx["poll_5xx"]
    assert load_driver.retry_slot("poll_400_empty") == idx["poll_400"]
    assert load_driver.retry_slot("something_new") == idx["other"]
    assert load_driver.retry_slot("futures_503") == idx["futures_status"]
    assert load_driver.retry_slot("futures_timeout") == idx["futures_timeout"]
    assert load_driver.N_SLOTS == k0 + len(load_driver.RETRY_KINDS)
    # A driver's count() lands in its own row: the total and the kind's slot.
    progress = [0] * (2 * load_driver.N_SLOTS)
    drv = load_driver.Driver("http://127.0.0.1:1", {"poll_timeout_s": 45.0}, [1], 1, 1, progress, 1, 0.0)
    for kind in ("poll_408", "poll_408", "asample_502", "resubmit_410"):
        drv.count(kind)
    row = progress[load_driver.N_SLOTS:]
    assert progress[:load_driver.N_SLOTS] == [0] * load_driver.N_SLOTS
    assert row[load_driver.P_RETRIES] == 4
    assert row[idx["poll_408"]] == 2 and row[idx["asample_other"]] == 1 and row[idx["resubmit_410"]] == 1
    assert sum(row[k0:]) == 4
    assert drv.counters == {"poll_408": 2, "asample_502": 1, "resubmit_410": 1}


def test_pyspy_top_self_and_total() -> None:
    raw = "\n".join([
        "main (app.py:1);loop (app.py:5);parse (codec/decode.py:10) 60",
        "main (app.py:1);loop (app.py:5);parse (codec/decode.py:12);helper (codec/decode.py:40) 20",
        "main (app.py:1);loop (app.py:6);send (net.py:3) 19",
        "main (app.py:1) 1",
        "not a stack line",
    ])
    top = run_load.pyspy_top(raw, top=3)
    assert top["samples"] == 100
    assert top["top_self"] == [("parse (decode.py)", 60, 60.0), ("helper (decode.py)", 20, 20.0),
                               ("send (net.py)", 19, 19.0)]
    # main (100 %) and loop (99 %) are the trunk (>= 90 %) and left out of the totals.
    assert top["top_total"] == [("parse (decode.py)", 80, 80.0), ("helper (decode.py)", 20, 20.0),
                                ("send (net.py)", 19, 19.0)]


def test_results_per_s_series_bins() -> None:
    xs, ys, w = run_load.results_per_s_series([0.05, 0.12, 0.15, 0.31, 0.31, 0.59], wall_s=0.6, bins=6)
    assert w == pytest.approx(0.1)
    assert xs == [0.05, 0.15, 0.25, 0.35, 0.45, 0.55]
    assert [round(y) for y in ys] == [10, 20, 0, 20, 0, 10]
    # 15 min soak: 60 bins of 15 s.
    xs, ys, w = run_load.results_per_s_series([1.0, 899.0], wall_s=900.0)
    assert w == pytest.approx(15.0) and len(xs) == 60 and ys[0] == pytest.approx(1 / 15)
    assert run_load.results_per_s_series([], wall_s=3.0) == ([], [], 0.0)


def test_monitor_engine_body_and_bare_parse_on_a_real_gateway(server) -> None:
    """Per-role PSS, /stats series, the simulator's own body and its bare parse, on a running S=2/F=2 gateway."""
    from shardserver.engine_sim import SimConfig, render_completion

    pgid = server.proc.pid
    pids = run_load.server_pids(pgid)
    roles = sorted(run_load.role_of(t) for t in pids.values())
    assert roles.count("supervisor") == 1 and roles.count("encoder") == 2 and roles.count("front-end") == 2
    progress = [0] * load_driver.N_SLOTS
    progress[load_driver.P_SUBMITTED], progress[load_driver.P_DONE] = 7, 3
    progress[load_driver.retry_slot("poll_408")] = 5
    mon = run_load.Monitor(pgid, server.url, 0.2, 30.0, time.monotonic(), progress, 1)
    mon.start()
    time.sleep(0.7)
    mon.stop_ev.set()
    mon.join(15)
    ts, ss = mon.series, mon.stats_series
    assert len(ts["t_s"]) >= 3 and all(len(col) == len(ts["t_s"]) for col in ts.values())
    for role in ("supervisor", "encoder", "front-end"):
        assert min(ts[f"pss_{role}"]) > 1 << 20, role            # every role's processes: > 1 MiB each
    assert ts["in_flight"][-1] == 4 and ts["retry_poll_408"][-1] == 5 and ts["retry_poll_410"][-1] == 0
    assert len(ss["t_s"]) >= 1 and all(len(col) == len(ss["t_s"]) for col in ss.values())
    assert ss["arena_used"][-1] >= 0 and ss["pending"][-1] == 0 and mon.stats_failed == []
    assert mon.peak_pss == max(sum(ts[f"pss_{r}"][i] for r in run_load.ROLES) for i in range(len(ts["t_s"])))

    sims = run_load.sim_pids(pgid)
    assert len(sims) == 1 and run_load.listen_port(sims[0]) is not None
    spec = {"prompt_tokens": 32, "tokens": 64, "num_samples": 2}
    body, src = run_load.engine_body(spec, sims[0])
    assert src == "simulator"
    req = load_driver.engine_request(load_driver.prompt_for(0, 32), 64, load_driver.seed_for(0), 2)
    local = json.loads(render_completion(req, SimConfig.from_mapping({"model_name": load_driver.BASE_MODEL})))
    assert json.loads(body)["choices"] == local["choices"]
    bp = run_load.bare_parse(body, 5)
    assert bp["n"] == 5 and bp["body_bytes"] == len(body) and 0 <= bp["ms_min"] <= bp["ms"] <= bp["ms_max"]


def test_driver_poller_mode_on_a_real_gateway() -> None:
    """Poller mode: 24 samples in flight over 2 connections; each waits on the driver's one
    retrieve_futures poller, then fetches its result once (no held retrieve_future), verified."""
    from shardserver.testing import RunningServer

    spec = {**run_load.DEFAULTS, "requests": 24, "tokens": 48, "distinct": 4, "mode": "poller"}
    progress = [0] * load_driver.N_SLOTS
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "true"}  # as run_load.py sets it in poller mode
    with RunningServer(env=env) as server:
        drv = load_driver.Driver(server.url, spec, list(range(24)), 24, 2, progress, 0, time.monotonic() + 60)
        drv.prepare()
        _drive_poller_mode(drv)
    assert (drv.res.done, drv.res.failures, drv.res.first_errors) == (24, 0, [])
    assert drv.counters == {}                          # no retry of any kind, no held poll answered 408
    assert 1 <= drv.poller.polls <= 48 and drv.poller.completions == {} and drv.poller.retrieved == set()
    assert progress[load_driver.P_DONE] == 24


def _drive_poller_mode(drv) -> None:
    import asyncio

    import aiohttp

    async def go() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as session, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as poll_session:
            await drv.setup(session)
            drv.poller = load_driver.SessionPoller(drv, poll_session)
            t0 = time.monotonic()
            await asyncio.gather(*(drv.one(session, i, t0) for i in range(24)))
            for _ in range(100):  # the last acknowledgements go out with an ack-only poll (bounded wait)
                if not drv.poller.retrieved and drv.poller.cursor <= drv.poller.acked_cursor:
                    break
                await asyncio.sleep(0.05)
            drv.poller.task.cancel()
            await asyncio.gather(drv.poller.task, return_exceptions=True)

    asyncio.run(go())


def _report_ok(q) -> None:
    q.put(("ok", 42))


def _crash(code: int) -> None:
    import os

    os._exit(code)  # like a segfault: no "error" is put


def test_a_driver_that_dies_without_a_result_stops_the_wait() -> None:
    """A driver process that crashed reported nothing: the harness waited for the hard limit
    (seen once: 24576/24576 done, then nothing for 500 s). Now a dead process's missing result
    becomes an error after the grace, with its exit code; results put before exiting still count."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_report_ok, args=(q,)), ctx.Process(target=_crash, args=(3,))]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    outs = run_load.collect_driver_results(procs, q, time.monotonic() + 120, grace_s=1.0)
    for p in procs:
        p.join(5)
    assert outs == [("ok", 42), ("error", "a driver process exited without a result (exit codes [0, 3])")]
    assert time.monotonic() - t0 < 60  # stopped long before the 120 s hard limit
    q2 = ctx.Queue()
    procs = [ctx.Process(target=_report_ok, args=(q2,)) for _ in range(2)]
    for p in procs:
        p.start()
    assert run_load.collect_driver_results(procs, q2, time.monotonic() + 120, grace_s=1.0) == [("ok", 42)] * 2
    for p in procs:
        p.join(5)
