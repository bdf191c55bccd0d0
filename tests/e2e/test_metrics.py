"""/metrics (Prometheus, aggregated over every process), /readyz with the engine probe, the access log."""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Api
from shardserver.api.access_log import make_access_log
from shardserver.metrics import (
    REGISTRY,
    FrontendCounters,
    HttpMetricsMiddleware,
    ShardCounters,
    endpoint_of,
    future_stages,
    render,
)
from shardserver.testing import RunningServer, http_json

pytestmark = pytest.mark.timeout(120)

ARENA = 8 * 1024 * 1024
METRICS_TOML = f"""
[server]
front_ends = 2
access_log = true
[shards]
count = 2
arena_bytes = {ARENA}
[engine]
max_abort_resubmits = 0
[futures]
long_poll_s = 5
[simulator]
model_name = "Qwen/Qwen3-8B"
[[simulator.faults]]
kind = "status"
first_token_id = 9001
status = 500
[[simulator.faults]]
kind = "status"
first_token_id = 9002
status = 400
message = "bad temperature"
"""


# -- units -------------------------------------------------------------------------------------------
def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_shard_counters_mirror_into_prometheus():
    c = ShardCounters(97)
    before_other = _value("shardserver_encoder_events_total", shard="97", event="something_new")
    c["completed"] += 1
    c["completed"] += 2
    c["failed_user"] += 1
    c["something_new"] += 5
    c["completed"] -= 1  # decrements stay in the dict only
    c.update(["evicted", "evicted"])
    assert dict(c) == {"completed": 2, "failed_user": 1, "something_new": 5, "evicted": 2}
    # Prometheus gets the increments at flush() (the encoder flushes before each STATS reply and at each sweep).
    assert _value("shardserver_results_completed_total", shard="97") == 0
    assert _value("shardserver_encoder_events_total", shard="97", event="something_new") == before_other
    c.flush()
    assert _value("shardserver_results_completed_total", shard="97") == 3
    assert _value("shardserver_results_failed_total", shard="97", category="user") == 1
    assert _value("shardserver_results_evicted_total", shard="97") == 2
    assert _value("shardserver_encoder_events_total", shard="97", event="something_new") == before_other + 5
    assert c["never"] == 0 and "never" not in c


def test_shard_counters_flush_adds_only_what_is_new():
    c = ShardCounters(96)
    c["completed"] += 1
    c.flush()
    c.flush()  # nothing new: nothing added
    c["completed"] += 4
    c["delivered"] += 2
    assert _value("shardserver_results_completed_total", shard="96") == 1
    c.flush()
    assert _value("shardserver_results_completed_total", shard="96") == 5
    assert _value("shardserver_results_delivered_total", shard="96") == 2


def test_encoder_timers_flush_observes_exactly_what_observe_would_have():
    """EncoderTimers keeps its timings until flush(); then the histograms hold exactly what one
    Histogram.observe per timing gives: the same float sum (added in the same order) and the
    same bucket counts, including values on a bucket bound, past the last finite bound, and NaN
    (in no bucket)."""
    import math
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from shardserver.metrics import DECODE_ENCODE, ENGINE_LATENCY, EncoderTimers, _observe_all

    rng = random.Random(3)
    values = [rng.random() * 0.02 for _ in range(500)] + [0.001, 0.0025, 1.0, 7.5, 0.0, 1e-9]
    rng.shuffle(values)
    buckets = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
    reg = CollectorRegistry()
    ref = Histogram("ref_seconds", "reference", registry=reg, buckets=buckets)
    mine = Histogram("mine_seconds", "batched", registry=reg, buckets=buckets)
    for h in (ref, mine):
        h.observe(0.3)  # a value there before
    for v in values:
        ref.observe(v)
    _observe_all(mine, values[:200])
    _observe_all(mine, values[200:])
    assert mine._sum.get() == ref._sum.get()
    assert [b.get() for b in mine._buckets] == [b.get() for b in ref._buckets]
    assert reg.get_sample_value("mine_seconds_count") == reg.get_sample_value("ref_seconds_count") == len(values) + 1
    ref.observe(math.nan)
    _observe_all(mine, [math.nan])
    assert math.isnan(mine._sum.get()) and math.isnan(ref._sum.get())
    assert [b.get() for b in mine._buckets] == [b.get() for b in ref._buckets]

    # Through EncoderTimers: nothing reaches the histograms before flush(), everything after it.
    ok0 = _value("shardserver_engine_request_duration_seconds_count", outcome="ok")
    err0 = _value("shardserver_engine_request_duration_seconds_count", outcome="error")
    de0 = _value("shardserver_decode_encode_duration_seconds_count")
    de_bucket0 = _value("shardserver_decode_encode_duration_seconds_bucket", le="0.001")
    t = EncoderTimers()
    for _ in range(3):
        t.engine(5.0, True)
    t.engine(0.2, False)
    t.decode_encode(0.0004)
    t.decode_encode(0.002)
    assert _value("shardserver_engine_request_duration_seconds_count", outcome="ok") == ok0
    t.flush()
    assert _value("shardserver_engine_request_duration_seconds_count", outcome="ok") == ok0 + 3
    assert _value("shardserver_engine_request_duration_seconds_count", outcome="error") == err0 + 1
    assert _value("shardserver_decode_encode_duration_seconds_count") == de0 + 2
    assert _value("shardserver_decode_encode_duration_seconds_bucket", le="0.001") == de_bucket0 + 1
    assert ENGINE_LATENCY.labels(outcome="ok") is t._engine_ok and DECODE_ENCODE is t._decode_encode


def test_frontend_counters_feed_bytes_delivered():
    before = _value("shardserver_bytes_delivered_total")
    c = FrontendCounters()
    c["bytes_delivered"] = c.get("bytes_delivered", 0) + 1000
    c["bytes_delivered"] = c.get("bytes_delivered", 0) + 24
    c["retrieve_done"] = 2
    assert c == {"bytes_delivered": 1024, "retrieve_done": 2}
    assert _value("shardserver_bytes_delivered_total") == before + 1024


def test_endpoint_labels_are_bounded():
    assert endpoint_of("/api/v1/asample") == "asample"
    assert endpoint_of("/api/v1/retrieve_future") == "retrieve_future"
    assert endpoint_of("/api/v1/client/config") == "client_config"
    assert endpoint_of("/api/v1/samplers/ss-abc.def") == "samplers"
    assert endpoint_of("/api/v1/sessions/s-xyz/finish") == "session_finish"
    assert endpoint_of("/api/v1/forward_backward") == "other"
    assert endpoint_of("/anything/else") == "other"
    assert endpoint_of("/metrics") == "metrics"


def test_future_stages():
    class E:
        def __init__(self, state, delivered=False):
            self.state, self.delivered = state, delivered

    entries = [E("pending"), E("pending"), E("done"), E("failed"), E("done", True), E("failed", True), E("gone")]
    assert future_stages(entries) == {"pending": 2, "completed": 2, "retrieved": 2, "gone": 1}


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_render_shard_gauges():
    replies = [{"shard": 0, "arena_bytes": 1000, "arena_used_bytes": 300, "arena_reserved_bytes": 200,
                "stages": {"pending": 1, "completed": 2, "retrieved": 3, "gone": 0},
                "engine": {"ok": False, "reason": "down", "age_s": 1.0}},
               {"shard": 1, "error": "encoder 1 is not connected"}]
    m = _parse(render(replies).decode())
    assert m[("shardserver_encoder_up", (("shard", "0"),))] == 1
    assert m[("shardserver_encoder_up", (("shard", "1"),))] == 0
    assert m[("shardserver_engine_up", (("shard", "0"),))] == 0
    assert m[("shardserver_arena_free_bytes", (("shard", "0"),))] == 500
    assert m[("shardserver_arena_used_bytes", (("shard", "0"),))] == 300
    assert m[("shardserver_arena_reserved_bytes", (("shard", "0"),))] == 200
    assert m[("shardserver_futures", (("shard", "0"), ("stage", "retrieved")))] == 3
    assert ("shardserver_arena_size_bytes", (("shard", "1"),)) not in m


def test_http_middleware_counts_errors_and_logs(caplog):
    async def app(scope, receive, send):
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b"teapot"})

    mw = HttpMetricsMiddleware(app, access_log=make_access_log(True, 3))
    sent = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.request", "body": b""}

    before_418 = _value("shardserver_http_requests_total", endpoint="telemetry", code="418")
    before_500 = _value("shardserver_http_requests_total", endpoint="other", code="500")
    scope = {"type": "http", "method": "POST", "path": "/api/v1/telemetry", "client": ("10.1.2.3", 555),
             "shardserver.owner": "0123456789abcdef"}
    with caplog.at_level(logging.INFO, logger="shardserver.access"):
        asyncio.run(mw(scope, receive, send))
        with pytest.raises(RuntimeError):
            asyncio.run(mw({**scope, "path": "/boom", "shardserver.owner": ""}, receive, send))
    assert [m.get("status") for m in sent] == [418, None]
    assert _value("shardserver_http_requests_total", endpoint="telemetry", code="418") == before_418 + 1
    assert _value("shardserver_http_requests_total", endpoint="other", code="500") == before_500 + 1
    lines = [r.getMessage() for r in caplog.records if r.name == "shardserver.access"]
    assert len(lines) == 2
    assert lines[0].startswith('10.1.2.3:555 "POST /api/v1/telemetry" 418 6B ')
    assert lines[0].endswith("ms key=01234567 fe=3")
    assert lines[1].startswith('10.1.2.3:555 "POST /boom" 500 0B ') and lines[1].endswith("key=- fe=3")
    assert make_access_log(False, 0) is None


# -- a real gateway ----------------------------------------------------------------------------------
def scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    st, h, body = http_json(url + "/metrics")
    assert st == 200 and h["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return h["x-shardserver-front-end"], _parse(body.decode())


def total(m: dict, name: str, **labels: str) -> float:
    """Sum of every sample ``name`` whose labels include ``labels`` (e.g. over all shards)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("metrics") / "metrics.toml"
    cfg.write_text(METRICS_TOML)
    with RunningServer(config=cfg) as s:
        yield s
    assert s.proc is not None and s.proc.returncode == 0
    assert not glob.glob(f"/tmp/shardserver-run-{s.proc.pid}-*"), "run directory (and metrics/) left behind"


def _sample(api: Api, ssid: str, first: int, seq: int) -> str:
    st, _, b = api.post("/api/v1/asample", {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
                                            "prompt": {"chunks": [{"tokens": [first, 2, 3]}]},
                                            "sampling_params": {"max_tokens": 6, "seed": seq}})
    assert st == 200, b
    return json.loads(b)["request_id"]


def test_metrics_aggregate_every_process(gw):
    api = Api(gw.url)
    ssid = api.sampling_session()
    rids = [_sample(api, ssid, 100 + i, i) for i in range(6)]
    bad = [_sample(api, ssid, 9001, 50), _sample(api, ssid, 9002, 51)]
    delivered_bytes = 0
    for rid in rids:
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid},
                            headers={"Accept": "application/x-protobuf"})
        assert st == 200
        delivered_bytes += len(b)
    for rid, cat in zip(bad, ("server", "user")):
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 200 and json.loads(b)["category"] == cat
    forged = rids[0][:-16] + ("0" * 16 if rids[0][-16:] != "0" * 16 else "1" * 16)
    assert api.post("/api/v1/retrieve_future", {"request_id": forged})[0] == 404
    earlier_run = "f00000000-" + rids[0].split("-", 1)[1]
    assert api.post("/api/v1/retrieve_future", {"request_id": earlier_run})[0] == 410

    # DELIVERED reaches the encoders after the responses: wait for the retrieved stage to settle.
    deadline = time.monotonic() + 10
    while True:
        fe, m = scrape(gw.url)
        if total(m, "shardserver_futures", stage="retrieved") == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert total(m, "shardserver_futures", stage="retrieved") == 8
    assert total(m, "shardserver_futures", stage="pending") == total(m, "shardserver_futures", stage="completed") == 0
    assert total(m, "shardserver_results_completed_total") == 6
    assert total(m, "shardserver_results_failed_total", category="server") == 1
    assert total(m, "shardserver_results_failed_total", category="user") == 1
    assert total(m, "shardserver_results_delivered_total") == 8
    assert total(m, "shardserver_submits_total") == 8
    assert total(m, "shardserver_http_requests_total", endpoint="asample", code="200") == 8
    assert total(m, "shardserver_http_requests_total", endpoint="retrieve_future", code="200") == 8
    assert total(m, "shardserver_http_requests_total", endpoint="retrieve_future", code="404") == 1
    assert total(m, "shardserver_http_requests_total", endpoint="retrieve_future", code="410") == 1
    assert total(m, "shardserver_retrieve_duration_seconds_count", code="200") == 8
    assert total(m, "shardserver_http_request_duration_seconds_count", endpoint="asample") == 8
    assert total(m, "shardserver_bytes_delivered_total") == delivered_bytes
    assert total(m, "shardserver_engine_request_duration_seconds_count", outcome="ok") == 6
    assert total(m, "shardserver_engine_request_duration_seconds_count", outcome="error") == 2
    assert total(m, "shardserver_decode_encode_duration_seconds_count") == 6
    assert 0 < total(m, "shardserver_decode_encode_duration_seconds_sum") < 5
    for shard in ("0", "1"):
        sl = (("shard", shard),)
        assert m[("shardserver_encoder_up", sl)] == 1 and m[("shardserver_engine_up", sl)] == 1
        assert m[("shardserver_arena_size_bytes", sl)] == ARENA
        assert m[("shardserver_arena_free_bytes", sl)] == (ARENA - m[("shardserver_arena_used_bytes", sl)]
                                                           - m[("shardserver_arena_reserved_bytes", sl)])
    assert total(m, "shardserver_arena_used_bytes") > delivered_bytes

    # Every front-end answers the same totals (they read the same files).
    seen = {fe: m}
    for _ in range(60):
        fe, m2 = scrape(gw.url)
        seen[fe] = m2
        if len(seen) == 2:
            break
    assert set(seen) == {"0", "1"}
    for name in ("shardserver_results_completed_total", "shardserver_bytes_delivered_total"):
        assert total(seen["0"], name) == total(seen["1"], name)


def test_access_log_lines(gw):
    api = Api(gw.url)
    api.post("/api/v1/telemetry", {"events": []})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [ln for ln in gw.log_lines if 'shardserver.access[' in ln and '"POST /api/v1/telemetry" 200 ' in ln]
        if lines:
            break
        time.sleep(0.05)
    assert lines, gw.log_lines[-10:]
    msg = lines[-1].split("]: ", 1)[1]
    assert msg.startswith("127.0.0.1:") and " 21B " in msg and msg.endswith(" key=- fe=" + msg[-1])
    # uvicorn's own access logger stays off (no duplicate lines).
    assert not [ln for ln in gw.log_lines if "uvicorn.access" in ln]


def test_no_access_log_by_default(server):
    Api(server.url).post("/api/v1/telemetry", {"events": []})
    time.sleep(0.2)
    assert not [ln for ln in server.log_lines if "shardserver.access" in ln or "uvicorn.access" in ln]


def test_counts_survive_an_encoder_restart(gw):
    _, m = scrape(gw.url)
    completed = total(m, "shardserver_results_completed_total")
    assert completed >= 6
    pid = {sh["shard"]: sh["pid"] for sh in gw.stats()["shards"]}[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st, _, _ = http_json(gw.url + "/readyz")
        new = {sh["shard"]: sh.get("pid") for sh in gw.stats()["shards"]}
        if st == 200 and new.get(0) not in (None, pid):
            break
        time.sleep(0.05)
    # A front-end that has not reconnected to the new encoder yet waits for it (up to 0.6 s)
    # rather than report shard 0 down, whichever front-end answers the scrape.
    _, m = scrape(gw.url)
    assert m[("shardserver_encoder_up", (("shard", "0"),))] == 1
    assert total(m, "shardserver_worker_restarts_total", role="encoder") == 1
    assert total(m, "shardserver_results_completed_total") == completed  # the dead encoder's counts are kept
    assert m[("shardserver_futures", (("shard", "0"), ("stage", "retrieved")))] == 0  # its futures are gone
    # ... folded into the run's files of dead processes: none of the dead encoder's files is left.
    (metrics_dir,) = glob.glob(f"/tmp/shardserver-run-{gw.proc.pid}-*/metrics")
    names = {os.path.basename(f) for f in glob.glob(os.path.join(metrics_dir, "*.db"))}
    assert {"counter_dead.db", "histogram_dead.db"} <= names and not any(f"_{pid}.db" in n for n in names), names


# -- readiness ---------------------------------------------------------------------------------------
def test_readyz_reports_an_unreachable_engine():
    env = {"SHARDSERVER_ENGINE__URL": "http://127.0.0.1:9", "SHARDSERVER_SHARDS__COUNT": "2",
           "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.5"}
    with RunningServer(env=env) as s:
        st, _, b = http_json(s.url + "/readyz")
        body = json.loads(b)
        assert st == 503
        assert {k: v for k, v in body.items() if k != "reason"} == {
            "status": "not ready", "encoders_down": [], "engine_down": [0, 1], "engine_unknown": []}
        parts = body["reason"].split("; ")
        assert [p.split(": ", 1)[0] for p in parts] == ["encoder 0", "encoder 1"]
        assert all(p.split(": ", 1)[1].startswith("cannot reach engine at http://127.0.0.1:9/health: ")
                   for p in parts)
        _, m = scrape(s.url)
        assert m[("shardserver_engine_up", (("shard", "0"),))] == 0
        assert m[("shardserver_encoder_up", (("shard", "1"),))] == 1
        assert any("encoder 0: engine unreachable: cannot reach engine at" in ln for ln in s.log_lines)


def test_readyz_without_engine_probing():
    env = {"SHARDSERVER_ENGINE__URL": "http://127.0.0.1:9", "SHARDSERVER_SHARDS__COUNT": "1",
           "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0"}
    with RunningServer(env=env) as s:
        st, _, b = http_json(s.url + "/readyz")
        assert (st, json.loads(b)) == (200, {"status": "ready", "encoders": 1})
