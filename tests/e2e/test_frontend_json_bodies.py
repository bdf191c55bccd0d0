"""Deeply nested JSON bodies (issue 11, item 7): 400 with a clear message on every JSON endpoint,
no traceback in the log (the stdlib parser recurses once per nesting level)."""

from __future__ import annotations

import json

import pytest

from shardserver.testing import RunningServer, http_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ENDPOINTS = ["/api/v1/telemetry", "/api/v1/asample", "/api/v1/retrieve_future", "/api/v1/create_session",
             "/api/v1/create_sampling_session", "/api/v1/session_heartbeat", "/api/v1/sessions/s-x/finish",
             "/api/v1/client/config"]
NESTED_ERROR = {"error": "request body is not valid JSON: arrays/objects nested too deeply"}


@pytest.fixture(scope="module")
def gateway():
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(4 << 20)}
    with RunningServer(env=env) as s:
        yield s
    assert s.proc.returncode == 0


@pytest.mark.parametrize("depth", [965, 100_000])
def test_deeply_nested_body_is_400_on_every_json_endpoint(gateway, depth):
    before = len(gateway.log_lines)
    for path in ENDPOINTS:
        st, _, body = http_json(gateway.url + path, b"[" * depth + b"]" * depth)
        assert (st, json.loads(body)) == (400, NESTED_ERROR), (path, st, body[:300])
        st, _, body = http_json(gateway.url + path, b'{"a":' * depth + b"1" + b"}" * depth)
        assert (st, json.loads(body)) == (400, NESTED_ERROR), (path, st, body[:300])
    st, _, _ = http_json(gateway.url + "/healthz")
    assert st == 200
    new = gateway.log_lines[before:]
    assert not [ln for ln in new if "Traceback" in ln or "ERROR" in ln or "Exception" in ln], new[:20]


def test_nested_bodies_refused_leave_no_memory_behind(gateway):
    """Found by a leak hunt: the 400 for a too-deep body was a local of read_json, held by its own
    traceback's frame; the cycle kept the whole body until the cyclic GC ran, which a front-end
    does rarely: 30 bodies of 8 MiB of ``[`` took a front-end from 55 to 792 MB RSS."""
    st, _, b = http_json(gateway.url + "/healthz")
    pid = json.loads(b)["pid"]

    def rss_mib() -> float:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024

    body = b"[" * (8 << 20)
    http_json(gateway.url + "/api/v1/asample", body)  # the first one sizes the allocator's arenas
    before = rss_mib()
    for _ in range(10):
        st, _, out = http_json(gateway.url + "/api/v1/asample", body)
        assert (st, json.loads(out)) == (400, NESTED_ERROR)
    grew = rss_mib() - before
    assert grew < 60, f"front-end RSS grew {grew:.0f} MiB over 10 refused 8 MiB bodies"
