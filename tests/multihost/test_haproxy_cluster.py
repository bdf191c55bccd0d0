"""Three gateway hosts behind a real HAProxy 2.6 on loopback, driven by the real tinker SDKs.

The HAProxy config is what ``shardserver haproxy-config`` generates (short health-check
interval); HAProxy runs in the foreground as a subprocess. Checked:

* SDK 0.38 (512 samples) and 0.24.1 (128): every result exact; futures spread over all three
  hosts; every poll reached the future's owner (per host, from ``/metrics``: retrieve_future
  200s equal the asample 200s, no 410 and no 404 anywhere);
* a host with the wrong ``server.host_id`` fails HAProxy's health check and gets no traffic;
* HAProxy answers ``client/config`` without the session-wide poller (a session's futures live
  on several hosts) and routes ``cancel_future`` to the owner;
* a host whose engine is unreachable (not ready) gets no new samples but still serves the
  finished results it owns (h3 runs against a standalone engine simulator that is killed);
* SIGKILL of one host mid-burst: every sample completes exactly, no error reaches the user (live
  hosts answered 410 for the dead host's futures and the SDK resubmitted); the host restarted
  on the same port with the same host id is UP again within its health-check interval and
  serves (and is polled for) new futures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import engine_body, expected_sequences, old_sdk_python
from conftest import Api
from shardserver.ids import future_host
from shardserver.testing import RunningHaproxy, RunningServer, find_haproxy, free_port, http_counts, http_json

pytestmark = [pytest.mark.sdk, pytest.mark.slow]

HOSTS = ("h1", "h2", "h3")
SECRET = "multihost-test-secret"
CHECK_MS, RISE = 300, 2
BURST_SCRIPT = str(Path(__file__).with_name("sdk_burst.py"))
TOKENS = 8
# (endpoint, code) pairs of shardserver_http_requests_total compared per host.
KEYS = {"asample": ("asample", "200"), "done": ("retrieve_future", "200"),
        "gone": ("retrieve_future", "410"), "unknown": ("retrieve_future", "404")}


# Results take a moment, so a host killed mid-burst holds pending futures.
SIM_ENV = {"SHARDSERVER_SIMULATOR__LATENCY_S": "0.2"}
ENGINE_HOST = "h3"  # runs against a standalone engine simulator (the others embed theirs)


def host_env(host_id: str, engine_port: int = 0) -> dict[str, str]:
    env = {"SHARDSERVER_SERVER__HOST_ID": host_id, "SHARDSERVER_SERVER__ID_SECRET": SECRET,
           "SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(32 * 1024 * 1024),
           # Each host announces the session-wide poller; HAProxy keeps it from the SDKs (a
           # session's futures are spread over the hosts), which the SDK bursts rely on.
           "SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "true", **SIM_ENV}
    if engine_port:
        env.update({"SHARDSERVER_ENGINE__URL": f"http://127.0.0.1:{engine_port}",
                    "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.2"})
    return env


class EngineSim:
    """``shardserver engine-sim`` as a process of its own on a fixed port (killed and restarted by a test)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "EngineSim":
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-m", "shardserver.cli", "engine-sim", "--port", str(self.port),
                                      "--config", str(repo / "configs" / "demo.toml")],
                                     env={**os.environ, **SIM_ENV}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=repo)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "engine-sim exited at start"
            try:
                if http_json(f"http://127.0.0.1:{self.port}/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("engine-sim did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def haproxy_bin() -> str:
    path, why = find_haproxy()
    if path is None:
        if os.environ.get("SHARDSERVER_OLD_SDKS_REQUIRED"):
            pytest.fail(f"{why}; make test requires it")
        pytest.skip(why)
    return path


class Cluster:
    def __init__(self) -> None:
        self.servers: dict[str, RunningServer] = {}
        self.haproxy: RunningHaproxy | None = None
        self.engine = EngineSim(free_port())

    def counts(self, host: str) -> dict[str, float]:
        c = http_counts(self.servers[host].url)
        return {k: c.get(v, 0.0) for k, v in KEYS.items()}

    def all_counts(self, hosts=HOSTS) -> dict[str, dict[str, float]]:
        return {h: self.counts(h) for h in hosts}


@pytest.fixture(scope="module")
def cluster(haproxy_bin, tmp_path_factory):
    c = Cluster()
    c.engine.start()
    with ThreadPoolExecutor(len(HOSTS)) as pool:
        started = {h: pool.submit(RunningServer(env=host_env(h, c.engine.port if h == ENGINE_HOST else 0)).__enter__)
                   for h in HOSTS}
    try:
        for h, f in started.items():
            c.servers[h] = f.result()
        c.haproxy = RunningHaproxy([(h, f"127.0.0.1:{c.servers[h].port}") for h in HOSTS],
                                   tmp_path_factory.mktemp("haproxy"), haproxy_bin, check_interval_ms=CHECK_MS,
                                   rise=RISE).__enter__()
        yield c
    finally:
        if c.haproxy is not None:
            c.haproxy.stop()
        for f in started.values():
            if f.exception() is None:
                f.result().stop()
        for s in c.servers.values():
            s.stop()
        c.engine.kill()
    for h, s in c.servers.items():
        assert s.proc is not None and s.proc.returncode == 0, "\n".join(s.log_lines[-30:])
        assert not s.leftover_processes, h


_expected: dict[int, dict] = {}


def expected(i: int) -> dict:
    if i not in _expected:
        _expected[i] = expected_sequences(engine_body([7, i], 1, TOKENS, i))[0]
    return _expected[i]


def start_burst(python: str, url: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen([python, BURST_SCRIPT, url, str(n), str(TOKENS)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_burst(proc: subprocess.Popen[str], n: int, version: str) -> float:
    """Wait for the burst; assert no error reached the user and every result is exact. Returns its seconds."""
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"SDK burst did not finish: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["version"] == version
    assert len(res["results"]) == n
    errors = [(i, r["error"]) for i, r in enumerate(res["results"]) if "error" in r]
    assert errors == [], errors[:5]
    wrong = []
    for i, r in enumerate(res["results"]):
        w = expected(i)
        if (r["tokens"], r["logprobs"], r["stop_reason"]) != (w["tokens"], [float(x) for x in w["logprobs"]],
                                                                w["stop_reason"]):
            wrong.append(i)
    assert wrong == [], f"{len(wrong)} wrong results, first {wrong[:5]}"
    return res["seconds"]


def delta(after: dict, before: dict) -> dict:
    return {h: {k: after[h][k] - before[h].get(k, 0.0) for k in after[h]} for h in after}


def assert_polls_reached_owners(d: dict[str, dict[str, float]], n: int) -> None:
    spread = {h: d[h]["asample"] for h in d}
    print("futures per host:", spread)
    assert sum(spread.values()) == n, d  # no resubmission: no future was lost or misrouted
    for h, c in d.items():
        assert c["asample"] >= n / 10, f"futures not spread over every host: {spread}"
        # Every future was retrieved on the host that issued it, and no poll went elsewhere.
        assert (c["done"], c["gone"], c["unknown"]) == (c["asample"], 0, 0), (h, d)


def sdk038_python() -> str:
    return sys.executable


def test_health_check_needs_the_matching_host_id(cluster, haproxy_bin, tmp_path):
    """A server whose name is not the host's server.host_id stays DOWN: h1 is checked under its own
    name and under "h9"; only the first is routed to."""
    h1 = f"127.0.0.1:{cluster.servers['h1'].port}"
    with RunningHaproxy([("h1", h1), ("h9", h1)], tmp_path, haproxy_bin, check_interval_ms=CHECK_MS,
                        rise=RISE, wait_all_up=False) as hp:
        hp.wait_state("h1", "UP", 10)
        hp.wait_state("h1", "UP", 10, backend="owners")
        time.sleep(CHECK_MS * (RISE + 2) / 1000)
        rows = {(r["pxname"], r["svname"]): r for r in hp.stats() if r["pxname"] in ("gateways", "owners")}
        for backend in ("gateways", "owners"):
            assert rows[backend, "h1"]["status"] == "UP", rows[backend, "h1"]
            # A 200 answer that fails the X-Shardserver-Host rule ("Layer7 wrong status").
            h9 = rows[backend, "h9"]
            assert (h9["status"], h9["check_status"], h9["check_code"]) == ("DOWN", "L7STS", "200"), h9
        for _ in range(4):
            st, hdr, _ = http_json(hp.url + "/healthz")
            assert st == 200 and hdr["x-shardserver-host"] == "h1"


@pytest.mark.timeout(240)
def test_sdk038_burst_through_haproxy_reaches_owners(cluster):
    before = cluster.all_counts()
    secs = finish_burst(start_burst(sdk038_python(), cluster.haproxy.url, 512), 512, "0.38.0")
    d = delta(cluster.all_counts(), before)
    print(f"512 samples in {secs:.1f} s")
    assert_polls_reached_owners(d, 512)
    backend = next(r for r in cluster.haproxy.stats() if r["pxname"] == "gateways" and r["svname"] == "BACKEND")
    assert backend["hrsp_5xx"] == "0", backend


@pytest.mark.timeout(240)
def test_sdk024_burst_through_haproxy_reaches_owners(cluster):
    py = old_sdk_python(".venv-sdk024")
    if py is None:
        pytest.skip("no tinker 0.24.1 environment (make test builds .venv-sdk024)")
    before = cluster.all_counts()
    finish_burst(start_burst(py, cluster.haproxy.url, 128), 128, "0.24.1")
    assert_polls_reached_owners(delta(cluster.all_counts(), before), 128)


@pytest.mark.timeout(120)
def test_balancer_keeps_sdks_off_the_poller_and_cancels_at_the_owner(cluster):
    """Each host announces the session-wide poller, but a session's futures are spread over the
    hosts: HAProxy answers client/config itself without it. cancel_future reaches the owner."""
    url = cluster.haproxy.url
    st, _, b = http_json(url + "/api/v1/client/config", {"sdk_version": "0.38.0"})
    assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False})
    st, _, b = http_json(cluster.servers["h1"].url + "/api/v1/client/config", {"sdk_version": "0.38.0"})
    assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": True})
    api = Api(url)
    ssid = api.sampling_session()
    rids = [api.submit(ssid, [5, i], seq_id=i, max_tokens=TOKENS) for i in range(9)]
    assert len({future_host(r) for r in rids}) >= 2, rids  # spread over the hosts (leastconn)
    for rid in rids:
        st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid})
        assert st == 200 and json.loads(b)["cancelled"] is True, (rid, st, b)
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 410  # its owner forgot it


@pytest.mark.timeout(120)
def test_owner_not_ready_still_serves_its_results(cluster):
    """h3's engine dies: h3 leaves "gateways" (no new samples) but stays in "owners", so the
    results it finished are still delivered through HAProxy; the engine returns, so does h3."""
    hp, host = cluster.haproxy, cluster.servers[ENGINE_HOST]
    via, direct = Api(hp.url), Api(host.url)
    ssid = via.sampling_session()
    before = http_counts(host.url)

    def completed() -> int:
        return host.stats()["shards"][0]["counters"].get("completed", 0)

    done0 = completed()
    fids = [direct.submit(ssid, [7, 900 + i], seq_id=i, max_tokens=TOKENS, seed=900 + i) for i in range(3)]
    assert {future_host(f) for f in fids} == {ENGINE_HOST}
    deadline = time.monotonic() + 30
    while completed() < done0 + 3:
        assert time.monotonic() < deadline, "h3 did not complete its 3 results"
        time.sleep(0.05)
    cluster.engine.kill()
    hp.wait_state(ENGINE_HOST, "DOWN", 10, backend="gateways")
    assert hp.server_states("owners")[ENGINE_HOST] == "UP"
    for i, fid in enumerate(fids):
        st, hdr, body = via.post("/api/v1/retrieve_future", {"request_id": fid})
        assert (st, hdr["x-shardserver-host"]) == (200, ENGINE_HOST), body
        seq = json.loads(body)["sequences"][0]
        w = expected_sequences(engine_body([7, 900 + i], 1, TOKENS, 900 + i))[0]
        assert (seq["tokens"], seq["logprobs"]) == (w["tokens"], [float(x) for x in w["logprobs"]])
    # New samples go to the ready hosts only.
    new = [via.submit(ssid, [7, 950 + i], seq_id=100 + i, max_tokens=TOKENS, seed=950 + i) for i in range(6)]
    assert ENGINE_HOST not in {future_host(f) for f in new}
    for fid in new:
        st, _, body = via.post("/api/v1/retrieve_future", {"request_id": fid})
        assert st == 200, body
    after = http_counts(host.url)
    assert after.get(("retrieve_future", "200"), 0) - before.get(("retrieve_future", "200"), 0) == 3
    cluster.engine.start()
    hp.wait_state(ENGINE_HOST, "UP", 15, backend="gateways")


@pytest.mark.timeout(300)
def test_host_sigkilled_mid_burst_then_back(cluster):
    victim, live = "h2", ("h1", "h3")
    hp = cluster.haproxy
    port = cluster.servers[victim].port
    before = cluster.all_counts()
    live_410_before = sum(cluster.servers[h].stats()["counters"].get("retrieve_410_other_host", 0) for h in live)
    proc = start_burst(sdk038_python(), hp.url, 512)
    # Kill while the victim holds accepted futures that were not delivered yet.
    deadline = time.monotonic() + 90
    while True:
        c = cluster.counts(victim)
        if c["asample"] - before[victim]["asample"] >= 20 and c["asample"] - c["done"] >= 5:
            break
        assert proc.poll() is None and time.monotonic() < deadline, f"burst ended before the kill: {c}"
        time.sleep(0.02)
    os.killpg(cluster.servers[victim].proc.pid, signal.SIGKILL)
    cluster.servers[victim].proc.wait(10)
    finish_burst(proc, 512, "0.38.0")
    # The dead host's pending futures were answered 410 by live hosts; the SDK resubmitted them there.
    live_410 = sum(cluster.servers[h].stats()["counters"].get("retrieve_410_other_host", 0) for h in live)
    print(f"killed {victim}: live hosts answered {live_410 - live_410_before} polls for its futures with 410")
    assert live_410 - live_410_before >= 1
    d = delta(cluster.all_counts(live), {h: before[h] for h in live})
    assert all(d[h]["unknown"] == 0 for h in live), d
    assert hp.server_states("gateways")[victim] == hp.server_states("owners")[victim] == "DOWN"

    # The host comes back on the same port with the same host id: UP again within its check interval.
    cluster.servers[victim] = RunningServer(env=host_env(victim), args=["--port", str(port)]).__enter__()
    waited = max(hp.wait_state(victim, "UP", timeout=30, backend=b) for b in ("gateways", "owners"))
    print(f"{victim} UP in HAProxy {waited:.2f} s after /readyz answered 200 (inter {CHECK_MS} ms, rise {RISE})")
    assert waited <= RISE * CHECK_MS / 1000 + 3.0
    before = cluster.all_counts()
    finish_burst(start_burst(sdk038_python(), hp.url, 96), 96, "0.38.0")
    assert_polls_reached_owners(delta(cluster.all_counts(), before), 96)
