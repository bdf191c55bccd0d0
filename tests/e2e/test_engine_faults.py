"""Engine-facing resilience (issue 10): every way an engine fails a request, done by a real engine
process over real sockets, and what the gateway and the SDK make of it.

The engines are ``fake_engine.FakeEngine`` (a raw-asyncio HTTP server that resets, closes, cuts,
delays or refuses exactly as told, answering with the simulator's bodies) and ``shardserver
engine-sim`` run standalone (``fake_engine.SimEngineProcess``), SIGKILLed and restarted on the same
port. Results are checked token for token against ``conftest.engine_body``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import BASE_MODEL, Api, engine_body, expected_sequences
from fake_engine import TLS_CERT, FakeEngine, SimEngineProcess, free_port
from shardserver.config import EngineConfig
from shardserver.testing import RunningServer, http_json, mapped_distributions, metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def _warm_expected_bodies():
    """Build the simulator's token pool in this process before any timing matters."""
    engine_body([1], 1, 1, 1)


def gateway(engine_url: str, shards: int = 1, nofile: int | None = None, **engine: object) -> RunningServer:
    """A gateway (1 front-end) in front of ``engine_url``; ``engine`` overrides ``[engine]`` keys;
    ``nofile``: the gateway's RLIMIT_NOFILE."""
    env = {"SHARDSERVER_ENGINE__URL": engine_url, "SHARDSERVER_SHARDS__COUNT": str(shards),
           "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 << 20),
           "SHARDSERVER_FUTURES__LONG_POLL_S": "5", "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.3"}
    env.update({f"SHARDSERVER_ENGINE__{k.upper()}": str(v) for k, v in engine.items()})
    return RunningServer(env=env, nofile=nofile)


def submit(api: Api, ssid: str, first: int, seq: int) -> tuple[str, list[int]]:
    """asample one sample of MAX_TOKENS tokens, seed ``seq``; returns (request_id, prompt)."""
    prompt = [first, seq % 1000, 7]
    return api.submit(ssid, prompt, seq_id=seq, max_tokens=MAX_TOKENS, seed=seq), prompt


def retrieve(api: Api, rid: str, within_s: float = 60.0) -> tuple[int, dict, bytes]:
    """Poll like the SDK (408 try_again: poll again) until a final answer or ``within_s``."""
    end = time.monotonic() + within_s
    while True:
        st, h, body = api.post("/api/v1/retrieve_future", {"request_id": rid},
                               headers={"Accept": "application/x-protobuf"})
        if st != 408 or time.monotonic() > end:
            return st, h, body


def assert_result(st: int, h: dict, body: bytes, prompt: list[int], seed: int, tokens: int = MAX_TOKENS) -> None:
    """A 200 protobuf SampleResponse equal, token for token, to the simulator's answer for
    ``max_tokens = tokens``."""
    from tinker.proto import tinker_public_pb2

    assert st == 200 and h["content-type"] == "application/x-protobuf", (st, body[:300])
    m = tinker_public_pb2.SampleResponse()
    m.ParseFromString(body)
    want = expected_sequences(engine_body(prompt, 1, tokens, seed))[0]
    assert np.frombuffer(m.sequences[0].tokens, dtype="<i4").tolist() == want["tokens"]
    assert np.array_equal(np.frombuffer(m.sequences[0].logprobs, dtype="<f4"), want["logprobs"])


def sample_all_exactly(s: RunningServer, first: int, count: int) -> None:
    """``count`` samples submitted at once (prompts ``[first, i, 7]``, seed ``i``), then each
    retrieved and checked token for token (:func:`assert_result`)."""
    api = Api(s.url)
    ssid = api.sampling_session()
    jobs = [submit(api, ssid, first, i) for i in range(count)]
    for i, (rid, prompt) in enumerate(jobs):
        assert_result(*retrieve(api, rid), prompt, i)


def server_failure(s: RunningServer, first: int, seq: int) -> tuple[dict, float]:
    """One sample (:func:`submit`) retrieved until final, which must be a failure of category
    server: ``({"error", "category"}, seconds from submit to that answer)``."""
    api = Api(s.url)
    ssid = api.sampling_session()
    t0 = time.monotonic()
    rid, _ = submit(api, ssid, first, seq)
    st, _, body = retrieve(api, rid)
    took = time.monotonic() - t0
    err = json.loads(body)
    assert st == 200 and err["category"] == "server", err
    return err, took


def counters(s: RunningServer) -> dict[str, int]:
    """The encoders' counters, summed over shards."""
    out: dict[str, int] = {}
    for sh in s.stats()["shards"]:
        for k, v in sh["counters"].items():
            out[k] = out.get(k, 0) + v
    return out


def metric(s: RunningServer, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in /metrics whose labels include ``labels``."""
    return metric_sum(s.url, name, **labels)


def completions(engine: FakeEngine) -> list[dict]:
    return engine.log()


def sample_in_turn(s: RunningServer, first: int, count: int, pause_s: float = 0.3) -> None:
    """``count`` samples one after the other (prompt ``[first, i, 7]``, seed i), each checked
    token for token, ``pause_s`` seconds apart (the pooled connection idles in between)."""
    api = Api(s.url)
    ssid = api.sampling_session()
    for i in range(count):
        rid, prompt = submit(api, ssid, first, i)
        assert_result(*retrieve(api, rid), prompt, i)
        time.sleep(pause_s)


def assert_models_learned(s: RunningServer, within_s: float = 10.0) -> None:
    """Every encoder's probe learns the fake engine's context window from ``GET /v1/models``."""
    end = time.monotonic() + within_s
    while _shard_models(s) != [{"Qwen/Qwen3-8B": 65536}] * len(s.stats()["shards"]) and time.monotonic() < end:
        time.sleep(0.1)
    assert _shard_models(s) == [{"Qwen/Qwen3-8B": 65536}] * len(s.stats()["shards"])


# -- input 1: the idle keep-alive race ---------------------------------------------------------------
def test_keepalive_reset_on_a_reused_connection_is_resent_on_a_fresh_one():
    """The engine answers one completion per keep-alive connection and resets it when the next
    request arrives on it (uvicorn closing an idle connection just as the gateway reuses it).
    Before: sample 2 failed with "engine request failed: [Errno 104] Connection reset by peer"."""
    with FakeEngine(reset_reused=True) as eng, gateway(eng.url) as s:
        sample_in_turn(s, 100, 4)
        log = completions(eng)
        # Samples 2 and 4 reuse the pooled connection of the sample before: reset, then sent again
        # on a new connection (not pooled, so sample 3 opens a new pooled one).
        assert [e["action"] for e in log] == ["ok", "reset", "ok", "ok", "reset", "ok"]
        assert all(e["nth"] == 1 for e in log if e["action"] == "ok")
        assert all(e["nth"] == 2 for e in log if e["action"] == "reset")
        c = counters(s)
        assert c.get("engine_keepalive_retries") == 2 and "engine_reforwards" not in c
        assert metric(s, "shardserver_engine_retries_total", kind="keepalive", shard="0") == 2
        assert c.get("failed_server", 0) == 0


def test_an_https_engine_samples_probes_and_rides_out_the_keepalive_race():
    """An ``https://`` engine (TLS, trusted through ``SSL_CERT_FILE``) goes through aiohttp: exact
    results, ``GET /health`` and ``GET /v1/models`` (with the API key) answered over TLS, and a
    reset of a reused keep-alive connection re-sent on a fresh one, as for ``http://``. Only then
    does an encoder load aiohttp: an ``http://`` engine's client and probe do without it."""
    with FakeEngine(tls=True, reset_reused=True, api_key="sk-tls") as eng:
        assert eng.url.startswith("https://127.0.0.1:")
        g = gateway(eng.url, api_key="sk-tls")
        g.env["SSL_CERT_FILE"] = str(TLS_CERT)
        with g as s:
            sample_in_turn(s, 150, 2)
            assert [e["action"] for e in completions(eng)] == ["ok", "reset", "ok"]
            c = counters(s)
            assert c.get("engine_keepalive_retries") == 1 and c.get("failed_server", 0) == 0
            assert_models_learned(s)
            st, _, b = http_json(s.url + "/readyz")
            assert (st, json.loads(b)["max_model_len"]) == (200, {"Qwen/Qwen3-8B": 65536})
            assert not [e for e in eng.log() if e.get("status") == 401]
            assert "aiohttp" in mapped_distributions(s.stats()["shards"][0]["pid"])
    with FakeEngine() as eng, gateway(eng.url) as s:
        sample_in_turn(s, 151, 1, pause_s=0)
        assert_models_learned(s)  # the probe ran, over engine_http
        assert not mapped_distributions(s.stats()["shards"][0]["pid"]) & {"aiohttp", "yarl", "multidict"}


def test_an_https_engine_with_an_untrusted_certificate_fails_samples_at_once_saying_so():
    """Found by a break test: a TLS engine whose certificate the gateway does not trust (no
    ``SSL_CERT_FILE``) was taken for an engine outage, each sample re-forwarded for
    ``engine.unavailable_budget_s`` (300 s), the cause at the end of "last: ...". It is a
    deployment fault no retry mends, like refused credentials: the sample fails at once."""
    with FakeEngine(tls=True) as eng, gateway(eng.url, unavailable_budget_s=60) as s:
        api = Api(s.url)
        t0 = time.monotonic()
        rid, _ = submit(api, api.sampling_session(), 152, 0)
        st, _, b = retrieve(api, rid)
        assert time.monotonic() - t0 < 10
        body = json.loads(b)
        assert (st, body["category"]) == (200, "server")
        assert body["error"].startswith(f"engine at {eng.url}/v1/completions: TLS certificate verification "
                                        f"failed (")
        assert "self-signed certificate" in body["error"] and "SSL_CERT_FILE" in body["error"]
        assert completions(eng) == []  # no request ever reached the engine
        assert "engine_reforwards" not in counters(s)


def test_idle_pooled_connections_are_dropped_before_the_engine_drops_them():
    """The pool's idle lifetime is a key (``engine.pool_idle_s``) whose default sits below vLLM's
    5 s keep-alive; with it below the engine's, an idle connection is never reused at all.
    Scaled down: the engine closes idle connections after 1.5 s, the gateway drops them after 0.5 s,
    samples come 0.8 s apart."""
    assert EngineConfig().pool_idle_s < 5
    with FakeEngine(reset_reused=True, idle_close_s=1.5) as eng, gateway(eng.url, pool_idle_s=0.5) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        for i in range(3):
            rid, prompt = submit(api, ssid, 101, i)
            assert_result(*retrieve(api, rid), prompt, i)
            time.sleep(0.8)
        log = completions(eng)
        assert [(e["action"], e["nth"]) for e in log] == [("ok", 1)] * 3
        assert "engine_keepalive_retries" not in counters(s)


# -- input 2: engine restart -------------------------------------------------------------------------
def test_in_flight_samples_survive_an_engine_sigkill_and_restart():
    """``shardserver engine-sim`` standalone; 128 samples in flight; SIGKILL it, start it again on
    the same port 2 s later. Before: every in-flight sample failed for good ("engine connection
    broke while reading the response: Server disconnected"). Now every one completes, exactly."""
    sim = SimEngineProcess(sim={"latency_s": 0.6})
    with sim, gateway(sim.url, shards=2) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        jobs = [submit(api, ssid, 200, i) for i in range(128)]
        time.sleep(0.2)
        assert sim.stats()["in_flight"] > 0
        sim.kill()
        time.sleep(2.0)
        sim.start()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda j: retrieve(api, j[0]), jobs))
        for i, ((_, prompt), ans) in enumerate(zip(jobs, answers)):
            assert_result(*ans, prompt, i)
        c = counters(s)
        assert c["completed"] == 128 and c.get("engine_reforwards", 0) >= 1
        assert "failed_server" not in c and "gone" not in c
        assert metric(s, "shardserver_engine_retries_total", kind="reforward") == c["engine_reforwards"]


def test_refused_connections_are_reforwarded_until_the_engine_listens():
    """Nothing listens on the engine port (engine restarting): the sample waits and completes
    once an engine starts there."""
    port = free_port()
    with gateway(f"http://127.0.0.1:{port}") as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, prompt = submit(api, ssid, 102, 0)
        time.sleep(1.5)
        with FakeEngine(port=port) as eng:
            assert_result(*retrieve(api, rid), prompt, 0)
            assert [e["request_id"] for e in completions(eng)][0].startswith(rid + "-a")
        c = counters(s)
        assert c.get("engine_reforwards", 0) >= 3 and "failed_server" not in c


def test_connection_closed_or_reset_before_the_response_or_cut_mid_body_is_reforwarded():
    """Fresh connections the engine closes (FIN) or resets (RST) before any response byte, and a
    body cut after half its bytes: each sample is sent again and completes exactly. A complete
    body over engine.max_body_bytes is not re-sent: it fails (category server)."""
    with FakeEngine(drop_before_response=2, drop_how="close") as eng, gateway(eng.url, max_body_bytes=1 << 20) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, prompt = submit(api, ssid, 103, 0)
        assert_result(*retrieve(api, rid), prompt, 0)
        assert [e["action"] for e in completions(eng)] == ["drop", "drop", "ok"]
        assert counters(s)["engine_reforwards"] == 2
        eng.configure(drop_before_response=2, drop_how="reset")
        rid, prompt = submit(api, ssid, 103, 1)
        assert_result(*retrieve(api, rid), prompt, 1)
        assert [e["action"] for e in completions(eng)][3:] == ["drop", "drop", "ok"]
        # The first drop hit the pooled connection of sample 1 before any response byte: sent
        # again at once (keep-alive retry); the second one, on a fresh connection, after a backoff.
        c = counters(s)
        assert c["engine_reforwards"] == 3 and c["engine_keepalive_retries"] == 1
        eng.configure(truncate=1)
        rid, prompt = submit(api, ssid, 103, 2)
        assert_result(*retrieve(api, rid), prompt, 2)
        assert [e["action"] for e in completions(eng)][6:] == ["truncate", "ok"]
        c = counters(s)
        assert c["engine_reforwards"] == 4 and c["completed"] == 3 and "failed_server" not in c
        rid = api.submit(ssid, [103, 9], seq_id=3, max_tokens=20000, seed=3)
        st, _, body = retrieve(api, rid)
        err = json.loads(body)
        assert st == 200 and err["category"] == "server"
        assert re.fullmatch(r"engine body of \d+ bytes exceeds engine.max_body_bytes=1048576", err["error"])
        assert [e["action"] for e in completions(eng)][8:] == ["ok"] and counters(s)["engine_reforwards"] == 4


def _each_status_is_reforwarded_until_answered(eng: FakeEngine, s: RunningServer, first_token: int,
                                               cases: list[tuple[int, str]]) -> tuple[Api, str]:
    """For each ``(status, body kind)``: the engine answers it for 1.8 s, then a completion; one
    sample must complete with the right result after at least 1.8 s, every attempt before the
    last having met the status (at least 4 attempts). Checks the re-forward count and that no
    sample failed; returns the ``(Api, sampling_session_id)`` used."""
    api = Api(s.url)
    ssid = api.sampling_session()
    seen = 0
    for i, (status, body) in enumerate(cases):
        eng.configure(status=status, status_body=body, status_for_s=1.8)
        t0 = time.monotonic()
        rid, prompt = submit(api, ssid, first_token, i)
        assert_result(*retrieve(api, rid), prompt, i)
        assert time.monotonic() - t0 >= 1.8
        acts = [e["action"] for e in completions(eng)][seen:]
        seen += len(acts)
        assert acts[-1] == "ok" and set(acts[:-1]) == {"status"} and len(acts) >= 4, (status, body, acts)
    c = counters(s)
    assert c["engine_reforwards"] == seen - len(cases) and "failed_server" not in c
    return api, ssid


def test_never_ran_statuses_are_reforwarded_while_they_last():
    """408/429/503 (a router's queue, vLLM admission control) for 1.5 s, then answers: each sample
    completes. Before, each answered 410 after engine.connect_retries (1.5 s of backoff)."""
    with FakeEngine() as eng, gateway(eng.url) as s:
        _each_status_is_reforwarded_until_answered(eng, s, 105, [(503, "vllm"), (429, "empty"), (408, "empty"),
                                                               (503, "router")])


def test_proxy_and_router_errors_for_an_unreachable_engine_are_reforwarded_while_they_last():
    """What sits between the gateway and a restarting vLLM answers for it: nginx (or an ingress)
    502 with its HTML page, a load balancer's 504 (its connection to the restarting pod timed
    out; tester's proxy_504.py: 0/8 samples before, 8/8 for a 502), vllm-router 500 ``Request failed: ...`` (could not reach the worker)
    or ``Failed to get response body: ...`` (the worker's body broke), and vLLM's own 500 for an
    engine core that died (``EngineDeadError``; tester's enginedead.py: 0/8 samples before, with the
    server restarted 3 s later). vLLM itself never answers 502, and these bodies wrap exactly the
    transport failures the gateway re-forwards when it meets them directly: for 1.8 s, then
    answers, and each sample completes. vLLM's own 500
    (its JSON envelope) still fails at once. Before: each failed at its first attempt with
    ``engine returned HTTP 502: <html>...`` / ``HTTP 500: Request failed: ...`` (category server)."""
    with FakeEngine() as eng, gateway(eng.url) as s:
        api, ssid = _each_status_is_reforwarded_until_answered(eng, s, 111, [(502, "proxy"), (500, "router_send"),
                                                                             (500, "router_read"), (502, "empty"),
                                                                             (504, "proxy"), (500, "engine_dead")])
        seen = len(completions(eng))
        eng.configure(status=500, status_body="vllm", status_for_s=0)
        rid, _ = submit(api, ssid, 111, 9)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b) == {
            "error": "engine returned HTTP 500: The engine is currently busy and cannot accept new requests.",
            "category": "server"}
        assert [e["request_id"] for e in completions(eng)][seen:] == [f"{rid}-a1"]


def test_a_proxy_4xx_page_is_a_server_fault_not_the_users():
    """nginx in front of vLLM refusing the gateway's request body (413, ``client_max_body_size``
    1m by default: a prompt of ~150k tokens) answers its HTML page: the gateway's deployment is at
    fault, not the user's request, so the sample fails with category server; so does a router's
    plain-text 4xx (here a 422). vLLM's own 4xx (its JSON error envelope) stays category user.
    Before: category user."""
    with FakeEngine(status=413, status_body="proxy") as eng, gateway(eng.url) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, _ = submit(api, ssid, 113, 0)
        st, _, b = retrieve(api, rid)
        err = json.loads(b)
        assert st == 200 and err["category"] == "server", err
        assert err["error"].startswith("engine returned HTTP 413: <html>") and "413 Request Entity Too Large" in err["error"]
        eng.configure(status=400, status_body="vllm")
        rid, _ = submit(api, ssid, 113, 1)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b)["category"] == "user"
        eng.configure(status=422, status_body="router")
        rid, _ = submit(api, ssid, 113, 2)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b) == {
            "error": "engine returned HTTP 422: No available workers (all circuits open or unhealthy)",
            "category": "server"}
        assert [e["action"] for e in completions(eng)] == ["status"] * 3


def test_an_engine_refusing_the_gateways_credentials_is_a_server_fault_not_the_users():
    """vLLM started with ``--api-key`` (or an ingress checking its own key) answers every request
    of a gateway without that key 401 ``{"error":"Unauthorized"}``: JSON, like vLLM's errors for a
    bad parameter, but about the gateway's deployment, never about the sample, so the sample fails
    with category server; so does a 403. Before: category user (the SDK logs a user error)."""
    with FakeEngine(status=401, status_body="auth") as eng, gateway(eng.url) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, _ = submit(api, ssid, 114, 0)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b) == {"error": "engine returned HTTP 401: Unauthorized",
                                               "category": "server"}
        eng.configure(status=403)
        rid, _ = submit(api, ssid, 114, 1)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b) == {"error": "engine returned HTTP 403: Unauthorized",
                                               "category": "server"}
        assert [e["action"] for e in completions(eng)] == ["status"] * 2  # final: not re-forwarded
        eng.configure(status=None)
        rid, prompt = submit(api, ssid, 114, 2)
        assert_result(*retrieve(api, rid), prompt, 2)


def test_engine_api_key_is_sent_as_a_bearer_token_to_completions_and_probes():
    """``engine.api_key`` for a vLLM started with ``--api-key`` (every ``/v1/*`` request needs
    ``Authorization: Bearer <key>``): completions sample exactly, the probe learns the context
    window from ``GET /v1/models``, and no request is refused. Without the key, the sample fails
    as a server fault. Before: no such key, so the only way in was Basic credentials in the URL,
    which vLLM refuses."""
    with FakeEngine(api_key="sk-test-1") as eng, gateway(eng.url, api_key="sk-test-1") as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, prompt = submit(api, ssid, 115, 0)
        assert_result(*retrieve(api, rid), prompt, 0)
        assert_models_learned(s)
        assert not [e for e in eng.log() if e.get("status") == 401]
        assert not [ln for ln in s.log_lines if "sk-test-1" in ln]  # a secret: never logged
    with FakeEngine(api_key="sk-test-1") as eng, gateway(eng.url) as s:
        api = Api(s.url)
        rid, _ = submit(api, api.sampling_session(), 115, 1)
        st, _, b = retrieve(api, rid)
        assert st == 200 and json.loads(b) == {"error": "engine returned HTTP 401: Unauthorized",
                                               "category": "server"}


def _shard_models(s: RunningServer) -> list[dict]:
    return [sh["engine"]["models"] for sh in s.stats()["shards"]]


def test_an_engine_that_aborts_every_request_fails_samples_after_the_budget():
    """vLLM answering ``finish_reason: abort`` to everything (a weight sync that never ends, an
    engine paused for good): each future is re-forwarded engine.max_abort_resubmits times and
    answers 410, and the SDK resubmits it as a new future. Once the engine has aborted every
    answer for engine.unavailable_budget_s (2 s here), the next future that runs out of abort
    re-forwards fails (category server) naming the engine and both keys, so the sample ends;
    one answer that is not aborted ends that outage, and a single abort is re-forwarded as
    before. Before: 410 for every resubmission, forever (the SDK waited until the caller's own
    timeout)."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    with FakeEngine(abort=10_000) as eng, gateway(eng.url, unavailable_budget_s=2) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        t0 = time.monotonic()
        answers = []
        for seq in range(200):  # resubmit after each 410, as the SDK does
            rid, _ = submit(api, ssid, 115, seq)
            st, _, body = retrieve(api, rid)
            answers.append(st)
            if st != 410:
                break
            time.sleep(0.05)
        took = time.monotonic() - t0
        err = json.loads(body)
        assert st == 200 and err["category"] == "server" and set(answers[:-1]) == {410}, (answers, body)
        assert re.fullmatch(rf"engine at {re.escape(eng.url)}/v1/completions aborted every request for 2\.\d s "
                            r"\(engine\.unavailable_budget_s = 2\); this one 3 times \(engine\.max_abort_resubmits = 2\)",
                            err["error"]), err
        assert 2.0 <= took < 6.0, took
        assert counters(s)["engine_budget_exhausted"] == 1
        # The real SDK: RequestFailedError, not an endless resubmission.
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-t").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        with pytest.raises(tinker.RequestFailedError) as ei:
            sampler.sample(prompt=types.ModelInput.from_ints([115, 5]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result(30)
        assert "aborted every request for" in str(ei.value)
        # An answer ends the outage; after it a single abort is re-forwarded transparently again.
        eng.configure(abort=0)
        rid, prompt = submit(api, ssid, 115, 500)
        assert_result(*retrieve(api, rid), prompt, 500)
        eng.configure(abort=1)
        rid, prompt = submit(api, ssid, 115, 501)
        assert_result(*retrieve(api, rid), prompt, 501)


def _peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set, KiB) of a live process."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))


def test_engine_body_over_max_body_bytes_is_refused_while_it_arrives():
    """engine.max_body_bytes bounds what the encoder holds, not only a Content-Length: a 200 body of
    48 MiB sent chunked (no Content-Length), then gzip-compressed (a ~50 KiB Content-Length that
    inflates to 48 MiB), with a 1 MiB bound. Each sample fails (category server) naming the bound,
    the encoder's peak RSS grows by less than 16 MiB, and the next sample is answered normally on
    a clean connection. Before: the whole body was read (and inflated) first, so the encoder's
    peak RSS grew by about the body's size each time (a larger body: the encoder runs out of memory)."""
    with FakeEngine() as eng, gateway(eng.url, max_body_bytes=1 << 20) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        pid = s.stats()["shards"][0]["pid"]
        rid, prompt = submit(api, ssid, 112, 0)
        assert_result(*retrieve(api, rid), prompt, 0)
        base = _peak_rss_kib(pid)
        for i, how in enumerate(["chunked", "gzip"], 1):
            eng.configure(pad_bytes=48 << 20, pad_how=how)
            rid, _ = submit(api, ssid, 112, i)
            st, _, b = retrieve(api, rid)
            err = json.loads(b)
            assert st == 200 and err["category"] == "server", b
            assert re.fullmatch(r"engine body exceeds engine\.max_body_bytes=1048576 \(stopped reading after "
                                r"\d+ bytes\)", err["error"]), err
            grew_mib = (_peak_rss_kib(pid) - base) / 1024
            assert grew_mib < 16, (how, grew_mib)
            rid, prompt = submit(api, ssid, 112, 10 + i)
            assert_result(*retrieve(api, rid), prompt, 10 + i)
        assert [e["action"] for e in completions(eng)] == ["ok", "pad", "ok", "pad", "ok"]
        c = counters(s)
        assert c["failed_server"] == 2 and c["completed"] == 3 and "engine_reforwards" not in c


# -- input 3: waiting for a pooled connection is not engine time --------------------------------------
def test_waiting_for_a_pooled_connection_is_not_engine_time():
    """pool_size 2, timeout_s 3, each engine call takes 1.2 s, 6 samples at once. Before: samples
    5 and 6 failed with "engine timed out after 3.0 s" after 2.4 s of waiting for a connection."""
    with FakeEngine(delay_s=1.2) as eng, gateway(eng.url, pool_size=2, timeout_s=3) as s:
        sample_all_exactly(s, 106, 6)
        t = sorted(e["t"] for e in completions(eng))
        assert len(t) == 6
        # Two at a time: the engine saw three waves, 1.2 s apart.
        assert t[2] - t[1] > 1.0 and t[4] - t[3] > 1.0
        assert "failed_server" not in counters(s)


def test_samples_queued_inside_a_busy_engine_wait_past_timeout_s():
    """Found by a break test: vLLM runs max_num_seqs requests at once and queues the rest inside
    itself, where the gateway's queue cannot see them. Here the engine generates 2 at a time, 1 s
    each, and 10 samples arrive at once; engine.timeout_s is 2 s. Before: every sample queued in
    the engine for 2 s or more failed with "engine timed out after 2 s". The engine answers other
    requests and its health probes meanwhile, so it is alive: all 10 are served, token for token."""
    with FakeEngine(max_running=2, delay_s=1.0) as eng, gateway(eng.url, timeout_s=2) as s:
        sample_all_exactly(s, 109, 10)
        log = completions(eng)
        assert len(log) == 10 and all(e["request_id"].endswith("-a1") for e in log)  # none was sent twice
        # The last ones waited in the engine's queue well past timeout_s before they even started.
        assert max(e["started"] - e["t"] for e in log) > 3.0
        c = counters(s)
        assert "failed_server" not in c and c["engine_waits_past_timeout"] >= 4, c


def test_an_encoder_that_heard_nothing_asks_the_engine_before_judging_it_silent():
    """Found by a second break test: each encoder judges the engine's life by what it heard itself.
    Two shards, probing off, an engine that generates one request at a time (1 s each): three
    samples of shard 0 are ahead of shard 1's only one in the engine's queue. At timeout_s (2 s)
    shard 1 has had no answer at all, while shard 0 had two; before, its sample failed "none to
    any other request or health probe". Now it asks the engine (GET /health) first: alive, so the
    sample waits its turn (4 s) and is served, token for token."""
    from shardserver.ids import shard_of

    with FakeEngine(max_running=1, delay_s=1.0) as eng, \
            gateway(eng.url, shards=2, timeout_s=2, health_interval_s=0) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        seqs = {0: [], 1: []}
        for seq in range(100):
            seqs[shard_of(f"{ssid}#{seq}", 2)].append(seq)
        order = seqs[0][:3] + seqs[1][:1]
        jobs = [(seq, *submit(api, ssid, 113, seq)) for seq in order]
        for seq, rid, prompt in jobs:
            assert_result(*retrieve(api, rid), prompt, seq)
        log = completions(eng)
        assert [e["request_id"] for e in log] == [f"{rid}-a1" for _, rid, _ in jobs]  # in order, each once
        c = counters(s)
        assert "failed_server" not in c and c["engine_waits_past_timeout"] >= 2, c


def test_a_request_the_engine_never_answers_fails_at_timeout_s_when_silent_else_at_max_request_s():
    """The bounds that are left. An engine that answers health probes (alive) but never this
    request: the attempt waits past engine.timeout_s (1 s) and fails at engine.max_request_s (3 s),
    saying so. An engine that answers nothing at all (SIGSTOPped: its kernel still accepts
    connections), with periodic probing off: at timeout_s the encoder asks it (GET /health, bounded
    by engine.connect_timeout_s = 1 s), hears nothing, and the sample fails, saying nothing answered."""
    with FakeEngine(delay_s=60) as eng:
        with gateway(eng.url, timeout_s=1, max_request_s=3) as s:
            err, took = server_failure(s, 110, 0)
            assert err["error"].startswith("engine timed out after 3.") and err["error"].endswith(
                "(engine.max_request_s = 3): no answer to this request, though the engine answers others"), err
            assert 3.0 <= took < 6.0, took
        with gateway(eng.url, timeout_s=1, max_request_s=30, health_interval_s=0, connect_timeout_s=1) as s:
            api = Api(s.url)
            ssid = api.sampling_session()
            t0 = time.monotonic()
            rid, _ = submit(api, ssid, 110, 1)
            deadline = time.monotonic() + 5
            while len(completions(eng)) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(eng.proc.pid, signal.SIGSTOP)
            try:
                st, h, body = retrieve(api, rid)
                took = time.monotonic() - t0
            finally:
                os.kill(eng.proc.pid, signal.SIGCONT)
            err = json.loads(body)
            assert st == 200 and err["category"] == "server", err
            assert err["error"].startswith("engine timed out after ") and err["error"].endswith(
                "(engine.timeout_s = 1): no answer to this request, and none to any other request or health probe "
                "since the gateway started"), err
            assert 2.5 <= took < 6.0, took


def test_a_request_the_engine_aborts_every_time_fails_instead_of_looping_through_resubmits():
    """Found by the third break test: an engine that answers finish_reason abort to one request
    every time, and the others normally. Each future answered 410 after its abort re-forwards,
    the SDK resubmitted the sample (same content, new seq_id), and so on forever: the other
    answers kept resetting the shard-wide abort budget, and nothing was logged. Now aborts are
    also counted per request content across resubmissions: past ABORT_ROUNDS x
    (engine.max_abort_resubmits + 1) = 3 aborts, each right after an answer that was not
    aborted, over engine.unavailable_budget_s (2 s), the next one fails (category server),
    saying so; the 410s before it are logged (WARNING, folded)."""
    from shardserver.workers.encoder import ABORT_ROUNDS

    with FakeEngine(abort_prompt=777) as eng, gateway(eng.url, unavailable_budget_s=2, max_abort_resubmits=0) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        answers = []
        t0 = time.monotonic()
        for seq in range(0, 400, 2):  # the SDK's resubmission after each 410: same content, new seq_id
            rid = api.submit(ssid, [116, 777, 7], seq_id=seq, max_tokens=MAX_TOKENS, seed=5)
            st, _, body = retrieve(api, rid)
            answers.append(st)
            if st != 410:
                break
            other, prompt = submit(api, ssid, 116, seq + 1)  # another sample, answered meanwhile
            assert_result(*retrieve(api, other), prompt, seq + 1)
            time.sleep(0.05)
        took = time.monotonic() - t0
        err = json.loads(body)
        assert st == 200 and err["category"] == "server" and set(answers[:-1]) == {410}, (answers, body)
        assert len(answers) > ABORT_ROUNDS + 1 and took >= 2.0, (answers, took)  # the count, then the time
        n = len(answers)
        assert re.fullmatch(rf"engine at {re.escape(eng.url)}/v1/completions aborted this request {n} times in "
                            rf"[2-9]\.\d s right after finishing others, its resubmissions included \({n - 1} others "
                            r"finished; more than 3 x "
                            r"\(engine\.max_abort_resubmits \+ 1\) = 3, over more than engine\.unavailable_budget_s "
                            r"= 2\); it is not sent again", err["error"]), err
        warned = [ln for ln in s.log_lines if "answers 410 and the SDK resubmits the sample" in ln]
        assert warned and "the engine aborted future" in warned[0], s.log_lines[-20:]


def test_an_abort_streak_ends_with_a_quiet_time_so_a_later_short_sync_fails_nothing():
    """Found by the fourth break test: the shard's "aborting since" clock was reset only by an
    answer that was not aborted. A future aborted engine.max_abort_resubmits + 1 times (410) and
    then a quiet time longer than engine.unavailable_budget_s (a trainer's step between two
    rollouts) left it running, so the next short abort burst (a weight sync) failed the next
    sample at once, "aborted every request for" the whole quiet time. Now a streak ends after
    min(ABORT_STREAK_GAP_S, budget / 2) without any answer: that sample answers 410 and its
    resubmission is served."""
    with FakeEngine() as eng, gateway(eng.url, unavailable_budget_s=2) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        eng.configure(abort=3)
        rid, _ = submit(api, ssid, 118, 0)
        assert retrieve(api, rid)[0] == 410
        time.sleep(2.5)  # quiet: no engine answer at all
        eng.configure(abort=3)
        rid, _ = submit(api, ssid, 118, 1)
        st, _, body = retrieve(api, rid)
        assert st == 410, body  # before: 200 {"error": "engine at ... aborted every request for 2.5 s ..."}
        rid, prompt = submit(api, ssid, 118, 2)  # the SDK's resubmission (the same as a new sample here)
        assert_result(*retrieve(api, rid), prompt, 2)
        assert "failed_server" not in counters(s)


def test_identical_requests_aborted_together_in_storms_are_not_taken_for_one_singled_out():
    """The other side of the rule above: a weight sync aborts every request in flight, and an RL
    group often sends the same content several times (same prompt, no seed). 4 identical
    requests aborted together, 3 storms in a row with answers in between: 12 aborts of that
    content, over 3 x (max_abort_resubmits + 1) within engine.unavailable_budget_s, yet only
    the first abort of each storm counts (3), so every one answers 410 (the SDK resubmits), and
    once the storms stop the same content is served, token for token."""
    with FakeEngine() as eng, gateway(eng.url, unavailable_budget_s=2, max_abort_resubmits=0) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        prompt, seed = [117, 5, 7], 9
        seq = 0
        t0 = time.monotonic()
        for storm in range(3):
            eng.configure(abort=4)
            rids = []
            for _ in range(4):
                rids.append(api.submit(ssid, prompt, seq_id=seq, max_tokens=MAX_TOKENS, seed=seed))
                seq += 1
            assert [retrieve(api, rid)[0] for rid in rids] == [410] * 4, storm
            other, other_prompt = submit(api, ssid, 117, 1000 + storm)  # the sync is over: answered
            assert_result(*retrieve(api, other), other_prompt, 1000 + storm)
            time.sleep(1.1)
        assert time.monotonic() - t0 >= 2.0
        rid = api.submit(ssid, prompt, seq_id=seq, max_tokens=MAX_TOKENS, seed=seed)
        assert_result(*retrieve(api, rid), prompt, seed)
        assert counters(s)["engine_aborts"] == 12 and "failed_server" not in counters(s)


def test_a_hung_engine_core_that_still_answers_health_fails_its_samples_at_timeout_s():
    """A real vLLM failure: the engine core hangs (a stuck collective or CUDA kernel) while the
    API server goes on answering GET /health, since the core process is alive. Before, every
    health probe counted as a sign of life, so a sample waited out engine.max_request_s (30 s
    here, 4 h by default) before failing "though the engine answers others". Now a probe counts
    only while vLLM's token counters in /metrics move: frozen, the sample fails at timeout_s
    (2 s, plus the probe it asks for), saying the core runs nothing. The same request on an
    engine whose counters move (a working core that takes 4 s for it) waits past timeout_s and
    is served, token for token; so it is when the probe finds counters that do not move on an
    engine that holds no request (found by the fourth break test: HAProxy ``balance leastconn``
    sent the probes to an idle replica while the other generated the sample, and the first
    version failed it as hung)."""
    with FakeEngine(delay_s=60, metrics="frozen") as eng, \
            gateway(eng.url, timeout_s=2, max_request_s=30, connect_timeout_s=1) as s:
        err, took = server_failure(s, 114, 0)
        assert err["error"].startswith("engine timed out after ") and err["error"].endswith(
            "(engine.timeout_s = 2): no answer to this request or any other, and though the engine answers "
            "GET /health, it holds requests and its token counters (vllm:generation_tokens_total, "
            "vllm:prompt_tokens_total in /metrics) have not moved since the gateway started: its engine core "
            "runs nothing (hung?)"), err
        assert any("giving up engine calls waiting past engine.timeout_s" in ln for ln in s.log_lines)
        assert 2.0 <= took < 8.0, took
        assert len(completions(eng)) == 1  # sent once, given up (its connection closed: vLLM aborts it)
        for waits, metrics in enumerate(("live", "idle"), start=1):  # the same engine, working again
            eng.configure(delay_s=4, metrics=metrics)
            sample_all_exactly(s, 114, 1)
            c = counters(s)
            assert c["failed_server"] == 1 and c["engine_waits_past_timeout"] == waits, (metrics, c)


def test_a_pinned_engine_model_the_engine_no_longer_serves_is_the_deployments_fault():
    """Found by a break test: with engine.model pinned, an engine that came back serving another
    name answered vLLM's 404 "The model ... does not exist", and the sample failed with category
    user while /readyz said ready. The user chose no model here: category server, and /readyz is
    503 naming both names until the engine serves the pinned one again."""
    with FakeEngine(model="Qwen/Qwen3-8B-renamed") as eng, gateway(eng.url, model="Qwen/Qwen3-8B") as s:
        def ready() -> tuple[int, dict]:
            deadline = time.monotonic() + 10
            while True:
                st, _, b = http_json(s.url + "/readyz")
                body = json.loads(b)
                if "max_model_len" in body or time.monotonic() > deadline:
                    return st, body

        st, body = ready()
        assert st == 503 and body["engine_model_missing"] == "Qwen/Qwen3-8B", body
        assert "the engine serves Qwen/Qwen3-8B-renamed, not engine.model = 'Qwen/Qwen3-8B' (GET /v1/models)" \
            in body["reason"], body
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, _ = submit(api, ssid, 111, 0)
        st, _, b = retrieve(api, rid)
        err = json.loads(b)
        assert st == 200 and err == {"error": "engine returned HTTP 404: The model `Qwen/Qwen3-8B` does not exist.",
                                     "category": "server"}, err
        eng.configure(model="Qwen/Qwen3-8B")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
            time.sleep(0.1)
        assert http_json(s.url + "/readyz")[0] == 200
        rid, prompt = submit(api, ssid, 111, 1)
        assert_result(*retrieve(api, rid), prompt, 1)


def test_an_unusable_200_body_is_sent_again_once_then_fails():
    """Found by a break test: a 200 whose body is whole by its Content-Length but broken JSON (a
    proxy's or the network's corruption; vLLM never sends one) failed the sample at once. It is
    sent again (engine.bad_body_resends = 1): one broken answer costs nothing; an engine whose
    every answer is broken still fails the sample, after two attempts, saying so."""
    with FakeEngine(garble=1) as eng, gateway(eng.url) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, prompt = submit(api, ssid, 112, 0)
        assert_result(*retrieve(api, rid), prompt, 0)
        assert [(e["request_id"], e["action"]) for e in completions(eng)] == [(f"{rid}-a1", "garble"),
                                                                              (f"{rid}-a2", "ok")]
        assert counters(s)["engine_bad_bodies_resent"] == 1
        eng.configure(garble=5)
        rid, _ = submit(api, ssid, 112, 1)
        st, _, b = retrieve(api, rid)
        err = json.loads(b)
        assert st == 200 and err["category"] == "server", err
        assert err["error"].startswith("bad engine body") and err["error"].endswith(
            "(the engine's answer was unusable 2 times; engine.bad_body_resends = 1)"), err
        assert [e["action"] for e in completions(eng)][2:] == ["garble", "garble"]


def test_no_pooled_connection_within_pool_wait_answers_410():
    """A request that never got a connection was never sent: 410 (the SDK resubmits), not a failure."""
    with FakeEngine(delay_s=2.0) as eng, gateway(eng.url, pool_size=1, pool_wait_s=0.5) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        (rid1, p1), (rid2, _) = submit(api, ssid, 107, 0), submit(api, ssid, 107, 1)
        st, _, body = retrieve(api, rid2)
        assert st == 410
        assert "no engine connection free within 0.5 s (all engine.pool_size = 1 in use" in json.loads(body)["error"]
        assert_result(*retrieve(api, rid1), p1, 0)
        assert len(completions(eng)) == 1
        assert counters(s)["engine_pool_wait_exceeded"] == 1


# -- input 4: engine unavailable for good --------------------------------------------------------------
def test_engine_unavailable_for_good_fails_after_the_budget_and_recovers():
    """503 to every request for longer than engine.unavailable_budget_s (2 s here): the sample fails
    (category server) naming the engine, the status and how long; /readyz says why meanwhile; a
    sample started once the outage outlasted the budget fails after two attempts; the first
    answer ends the outage. Before:
    410 after engine.connect_retries, and the SDK resubmitted forever."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    with FakeEngine(status=503) as eng, gateway(eng.url, unavailable_budget_s=2) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        t0 = time.monotonic()
        rid, _ = submit(api, ssid, 108, 0)
        time.sleep(0.8)
        st, _, b = http_json(s.url + "/readyz")
        ready = json.loads(b)
        # The gauge while a sample is being re-forwarded (a probe, which still answers, ends the
        # outage only once no request is re-forwarded, so it is read here and not after the failures).
        assert metric(s, "shardserver_engine_unavailable_seconds", shard="0") >= 0.7
        assert st == 503 and ready["engine_unavailable"] == [0] and ready["engine_down"] == []
        assert re.search(r"encoder 0: engine requests to http://127\.0\.0\.1:\d+/v1/completions failing for "
                         r"[0-9.]+ s, last: engine returned HTTP 503: The engine is currently busy", ready["reason"])
        assert ready["reason"].endswith("each is re-forwarded for up to engine.unavailable_budget_s = 2 s, then fails")
        st, h, body = retrieve(api, rid)
        took = time.monotonic() - t0
        err = json.loads(body)
        assert st == 200 and h["content-type"].startswith("application/json") and err["category"] == "server"
        assert err["error"].startswith(f"engine at {eng.url}/v1/completions unavailable for 2.")
        assert "(engine.unavailable_budget_s = 2); last: engine returned HTTP 503: The engine is currently busy" \
            in err["error"]
        assert 2.0 <= took < 5.0
        # Each of its attempts had its own request id.
        ids = [e["request_id"] for e in completions(eng)]
        assert ids == [f"{rid}-a{i}" for i in range(1, len(ids) + 1)] and len(ids) >= 4
        # A sample that starts once the outage is older than the budget fails after two attempts.
        n_before = len(completions(eng))
        t1 = time.monotonic()
        rid2, _ = submit(api, ssid, 108, 1)
        st, _, body = retrieve(api, rid2)
        assert st == 200 and json.loads(body)["category"] == "server" and time.monotonic() - t1 < 1.5
        assert [e["request_id"] for e in completions(eng)][n_before:] == [f"{rid2}-a1", f"{rid2}-a2"]
        # The real SDK raises RequestFailedError (no endless resubmission).
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-t").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        with pytest.raises(tinker.RequestFailedError) as ei:
            sampler.sample(prompt=types.ModelInput.from_ints([108, 5]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result(30)
        assert "unavailable for" in str(ei.value) and "HTTP 503" in str(ei.value)
        c = counters(s)
        assert c["engine_budget_exhausted"] == 3 and c["failed_server"] == 3
        assert metric(s, "shardserver_engine_budget_exhausted_total", shard="0") == 3
        # Recovery is automatic once the engine answers.
        eng.configure(status=None)
        rid3, prompt3 = submit(api, ssid, 108, 2)
        assert_result(*retrieve(api, rid3), prompt3, 2)
        st, _, b = http_json(s.url + "/readyz")
        assert (st, json.loads(b)) == (200, {"status": "ready", "encoders": 1, "max_model_len": {BASE_MODEL: 65536}})
        assert metric(s, "shardserver_engine_unavailable_seconds", shard="0") == 0



def test_readyz_turns_200_as_soon_as_the_engine_answers_again():
    """The engine is down when the gateway starts (every encoder's probe failed) and comes up
    later, with a sample being re-forwarded meanwhile. /readyz used to stay 503 until each encoder's
    next probe, up to engine.health_interval_s (30 s here) after the engine answered; now an encoder
    whose engine is down probes every 0.5 s, and any answer (probe or request) ends its outage."""
    port = free_port()
    with gateway(f"http://127.0.0.1:{port}", shards=2, health_interval_s=30, unavailable_budget_s=60) as s:
        st, _, b = http_json(s.url + "/readyz")
        assert st == 503 and json.loads(b)["engine_down"] == [0, 1]
        api = Api(s.url)
        ssid = api.sampling_session()
        rid, prompt = submit(api, ssid, 109, 0)  # re-forwarded with backoff while the engine is down
        time.sleep(0.5)
        st, _, b = http_json(s.url + "/readyz")
        assert st == 503 and len(json.loads(b)["engine_unavailable"]) == 1
        with FakeEngine(port=port) as eng:
            t0 = time.monotonic()
            while True:
                st, _, b = http_json(s.url + "/readyz")
                if st == 200 or time.monotonic() - t0 > 12:
                    break
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert (st, json.loads(b)) == (200, {"status": "ready", "encoders": 2,
                                                 "max_model_len": {BASE_MODEL: 65536}}), b
            assert took < 6.0  # the re-forward backoff is at most 2 s; the probe of a down engine 0.5 s
            assert_result(*retrieve(api, rid), prompt, 0)
            assert len(completions(eng)) >= 1


# -- input 7: one request id per attempt ----------------------------------------------------------------
def test_every_attempt_carries_its_own_request_id():
    """Two dropped connections, one abort, then the answer: four attempts, four X-Request-Ids
    ``<future_id>-a1`` .. ``-a4``. Before: all four carried the future id itself."""
    with FakeEngine(drop_before_response=2, abort=1) as eng, gateway(eng.url) as s:
        api = Api(s.url)
        rid, prompt = submit(api, api.sampling_session(), 109, 0)
        assert_result(*retrieve(api, rid), prompt, 0)
        log = completions(eng)
        assert [e["action"] for e in log] == ["drop", "drop", "abort", "ok"]
        assert [e["request_id"] for e in log] == [f"{rid}-a{i}" for i in range(1, 5)]
        c = counters(s)
        assert c["engine_reforwards"] == 2 and c["engine_aborts"] == 1


def test_an_fd_limit_below_engine_pool_size_lowers_the_pool_instead_of_failing_samples():
    """Found by a break test (stop 26): with RLIMIT_NOFILE below engine.pool_size an encoder
    opened engine connections until EMFILE, took "Too many open files" for the engine being
    down, and failed the samples of a healthy engine once engine.unavailable_budget_s passed
    (/readyz 503 meanwhile). Now the encoder lowers its pool to what the limit leaves, says so
    at start, and the rest of the samples wait their turn: 200 samples of a 2 s engine under a
    limit of 200 files, all exact."""
    with FakeEngine(delay_s=2.0) as eng, gateway(eng.url, nofile=200, unavailable_budget_s=1) as s:
        sample_all_exactly(s, 127, 200)
        assert any("engine.pool_size=512 lowered to 151" in line for line in s.log_lines), \
            [line for line in s.log_lines if "RLIMIT" in line]
        assert "failed_server" not in counters(s)
