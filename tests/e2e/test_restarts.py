"""Restarts that clients survive (issue 11, items 1-3): the real SDK keeps sampling while the
gateway is stopped (SIGTERM) or crashes (SIGKILL) and is started again on the same port, with
the session-wide poller (``retrieve_futures``, the default) and with per-request polling."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from conftest import BASE_MODEL, Api, engine_body, expected_sequences
from shardserver.testing import REPO, RunningServer, http_json, metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

API_KEY = "tml-restart-test-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(state_home, **extra: str) -> dict[str, str]:
    """A small gateway whose ID secret lives under ``state_home`` (via $XDG_STATE_HOME)."""
    return {"XDG_STATE_HOME": str(state_home), "SHARDSERVER_SHARDS__COUNT": "2",
            "SHARDSERVER_SERVER__FRONT_ENDS": "2", "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024),
            "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "1", **extra}


def _production_env(state_dir) -> dict[str, str]:
    """configs/production.toml on loopback: embedded simulator, the key from the environment,
    the state directory under the test's tmp_path; everything else as shipped."""
    return {"SHARDSERVER_ENGINE__URL": "", "SHARDSERVER_AUTH__KEYS_FILE": "", "SHARDSERVER_API_KEYS": API_KEY,
            "SHARDSERVER_SERVER__STATE_DIR": str(state_dir), "SHARDSERVER_SHARDS__COUNT": "2",
            "SHARDSERVER_SERVER__FRONT_ENDS": "2", "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024),
            "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "1"}


def _children(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``, its leader excluded."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != pgid:
            try:
                fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d))
    return out


def _check(resp, prompt: list[int], seed: int) -> None:
    want = expected_sequences(engine_body(prompt, 1, 12, seed))
    assert [list(s.tokens) for s in resp.sequences] == [w["tokens"] for w in want]
    for seq, w in zip(resp.sequences, want):
        assert np.array_equal(np.asarray(seq.logprobs, dtype=np.float32), w["logprobs"])


# Each case takes 11-21 s on 2 CPUs; `make test` runs the three that differ most (each signal,
# each config, each way of waiting). SHARDSERVER_TEST_FULL=1 adds the other two combinations.
_RESTART_CASES = [("demo", signal.SIGTERM, True), ("production", signal.SIGKILL, True), ("demo", signal.SIGKILL, False)]
if os.environ.get("SHARDSERVER_TEST_FULL"):
    _RESTART_CASES += [("production", signal.SIGTERM, True), ("demo", signal.SIGKILL, True)]


@pytest.mark.sdk
@pytest.mark.parametrize("config,sig,poller", _RESTART_CASES)
def test_sdk_keeps_sampling_across_a_restart(tmp_path, config, sig, poller):
    """32 samples in flight through SDK 0.38; the gateway is stopped (SIGTERM) or killed (SIGKILL)
    and started again on the same port (10 ms after the kill). Every sample completes with the
    right tokens and no error reaches the caller: futures of the old run answer 410 and are
    resubmitted, and the sampling session of the old run is still valid.

    ``poller``: the SDK waits on the session-wide poller (the shipped default; the new run's
    encoders report the futures the old run held as failed, from their journals), else on one
    ``retrieve_future`` per sample (the server's flag turned off)."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    port = _free_port()
    cfg_path = REPO / "configs" / f"{config}.toml"
    env = _production_env(tmp_path / "state") if config == "production" else _env(tmp_path)
    env["SHARDSERVER_SIMULATOR__LATENCY_S"] = "0.2"  # samples are in flight when the gateway stops
    # SIGKILL + restart 10 ms later through the poller failed in 2 of 3 runs until a closed
    # encoder refused SUBMITs (a future accepted while it wound down was never reported).
    env["SHARDSERVER_FUTURES__RETRIEVE_FUTURES"] = "true" if poller else "false"
    first = RunningServer(config=cfg_path, env=env, args=["--port", str(port)]).__enter__()
    second = None
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
        assert service.holder.get_client_config().sample_use_retrieve_futures is poller
        in_flight: dict[cf.Future, int] = {}
        done: dict[int, object] = {}
        errors: list[BaseException] = []
        next_i = 0

        def submit() -> None:
            nonlocal next_i
            prompt = [900, next_i]
            fut = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                                 sampling_params=types.SamplingParams(max_tokens=12, seed=next_i, temperature=1.0))
            in_flight[fut] = next_i
            next_i += 1

        for _ in range(32):
            submit()
        restarted_at = None
        deadline = time.monotonic() + 60
        while in_flight and time.monotonic() < deadline:
            ready, _ = cf.wait(list(in_flight), timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for fut in ready:
                i = in_flight.pop(fut)
                try:
                    done[i] = fut.result()
                except BaseException as exc:  # noqa: BLE001 - every error that reaches the user counts
                    errors.append(exc)
                # Keep 32 in flight until 64 samples completed after the restart.
                if restarted_at is None or len(done) < restarted_at + 64:
                    submit()
            if restarted_at is None and len(done) >= 32:
                restarted_at = len(done)
                if sig == signal.SIGTERM:
                    assert first.stop() == 0
                else:
                    os.kill(first.proc.pid, signal.SIGKILL)
                    first.proc.wait(5)
                    time.sleep(0.01)
                second = RunningServer(config=cfg_path, env=env, args=["--port", str(port)]).__enter__()
        assert not in_flight, f"{len(in_flight)} samples never finished"
        assert errors == []
        assert restarted_at is not None and len(done) >= restarted_at + 64
        for i, resp in done.items():
            _check(resp, [900, i], i)
        # The new run accepted samples and never answered 404 (an unknown session or future).
        m = http_json(f"http://127.0.0.1:{port}/metrics")[2].decode()
        assert 'shardserver_http_requests_total{code="200",endpoint="asample"}' in m
        assert 'code="404"' not in m
        # Futures the old run held that the new run's encoders took over from their journals.
        lost = metric_sum(m, "shardserver_encoder_events_total", event="restored_lost")
        if poller:
            # The samples waited on the poller, which got the old run's futures as failed; the
            # SDK asked for them (410) and resubmitted them.
            assert sampler._futures_poller is not None
            assert metric_sum(m, "shardserver_http_requests_total", code="200", endpoint="retrieve_futures") > 0
            assert lost > 0
            assert metric_sum(m, "shardserver_http_requests_total", code="410", endpoint="retrieve_future") > 0
        else:
            assert metric_sum(m, "shardserver_http_requests_total", endpoint="retrieve_futures") == 0
            # Not announced, but served (for SDKs that learned it from an earlier run).
            st, _, b = http_json(f"http://127.0.0.1:{port}/api/v1/retrieve_futures", method="POST",
                                 body={"target": {"sampling_session_id": sampler._sampling_session_id},
                                       "prev_cursor": 0, "timeout": 0},
                                 headers={"X-API-Key": API_KEY})
            assert st == 200 and set(json.loads(b)) == {"completions", "cursor"}
        assert second.proc.poll() is None
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not first.leftover_processes and not second.leftover_processes
    assert any("signing IDs with the secret from" in line and "sessions survive restarts" in line
               for line in second.log_lines)


@pytest.mark.sdk
def test_an_sdk_polling_keeps_sampling_after_a_restart_with_the_poller_not_announced(tmp_path):
    """SDK 0.38 reads /client/config once: a client that learned the poller keeps polling
    ``retrieve_futures`` after the gateway restarts with ``futures.retrieve_futures = false``.
    That run answered its polls 404, and every later sample failed (``TinkerError:
    retrieve_futures polling failed``); the flag now only stops the announcement to new clients."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    port = _free_port()
    env = {**_env(tmp_path), "SHARDSERVER_SIMULATOR__LATENCY_S": "0.05"}
    first = RunningServer(env={**env, "SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "true"},
                          args=["--port", str(port)]).__enter__()
    second = None
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)

        def sample(i: int):
            return sampler.sample(prompt=types.ModelInput.from_ints([900, i]), num_samples=1,
                                  sampling_params=types.SamplingParams(max_tokens=12, seed=i, temperature=1.0))

        for fut in [sample(i) for i in range(8)]:
            fut.result(60)
        assert sampler._futures_poller is not None
        assert first.stop() == 0
        second = RunningServer(env={**env, "SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "false"},
                               args=["--port", str(port)]).__enter__()
        st, _, b = http_json(f"http://127.0.0.1:{port}/api/v1/client/config", {"sdk_version": "0.38.0"})
        assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False})  # new clients are not told
        futs = {i: sample(i) for i in range(8, 24)}
        for i, fut in futs.items():
            _check(fut.result(60), [900, i], i)
        m = http_json(f"http://127.0.0.1:{port}/metrics")[2].decode()
        assert metric_sum(m, "shardserver_http_requests_total", code="200", endpoint="retrieve_futures") > 0
        assert metric_sum(m, "shardserver_http_requests_total", code="404", endpoint="retrieve_futures") == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not first.leftover_processes and not (second and second.leftover_processes)


def test_old_runs_futures_answer_410_and_its_sessions_stay_valid(tmp_path):
    """Futures that could not finish before the stop answer 410 after the restart (never 404),
    and the old run's session and sampling session work in the new run: heartbeat, new samples."""
    port = _free_port()
    env = _env(tmp_path, SHARDSERVER_SIMULATOR__LATENCY_S="30", SHARDSERVER_SHARDS__COUNT="1",
               SHARDSERVER_SERVER__FRONT_ENDS="1")
    with RunningServer(env=env, args=["--port", str(port)]) as first:
        api = Api(first.url)
        st, _, b = api.post("/api/v1/create_session", {"tags": [], "user_metadata": {}})
        session_id = json.loads(b)["session_id"]
        st, _, b = api.post("/api/v1/create_sampling_session", {"session_id": session_id, "base_model": BASE_MODEL})
        ssid = json.loads(b)["sampling_session_id"]
        rids = [api.submit(ssid, [5, i], seq_id=i) for i in range(4)]
    assert first.proc.returncode == 0
    with RunningServer(env={**env, "SHARDSERVER_SIMULATOR__LATENCY_S": "0"}, args=["--port", str(port)]) as second:
        api = Api(second.url)
        for rid in rids:
            st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
            assert st == 410, b
        st, _, b = api.post("/api/v1/session_heartbeat", {"session_id": session_id})
        assert st == 200, b
        rid = api.submit(ssid, [5, 0], seq_id=0)
        assert rid[1:9] != rids[0][1:9]  # a future of the new run
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 200, b
        want = expected_sequences(engine_body([5, 0], 1, 4, 1))
        assert [s["tokens"] for s in json.loads(b)["sequences"]] == [want[0]["tokens"]]
    secret_file = tmp_path / "shardserver" / "id_secret"
    assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    assert oct(secret_file.parent.stat().st_mode & 0o777) == "0o700"
    assert len(secret_file.read_text().strip()) == 64


def test_new_server_starts_10ms_after_a_supervisor_sigkill(tmp_path):
    """SIGKILL the supervisor while a long poll is held and engine requests are in flight, start
    a new server on the same port 10 ms later: it starts, and every child of the killed run is
    gone within about a second (the kernel's parent-death signal, not a polling loop)."""
    port = _free_port()
    env = _env(tmp_path, SHARDSERVER_SIMULATOR__LATENCY_S="30")
    first = RunningServer(env=env, args=["--port", str(port)]).__enter__()
    second = None
    try:
        api = Api(first.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [6, i], seq_id=i) for i in range(4)]
        polls: list[int] = []

        def poll(rid: str) -> None:
            try:
                polls.append(api.post("/api/v1/retrieve_future", {"request_id": rid}, timeout=20)[0])
            except OSError:
                polls.append(0)

        threads = [threading.Thread(target=poll, args=(r,), daemon=True) for r in rids]
        for t in threads:
            t.start()
        pid = first.proc.pid
        old = _children(pid)  # 2 encoders, 2 front-ends, the simulator, multiprocessing's resource tracker
        titles = sorted(open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0].decode().strip() for p in old)
        assert titles.count("shardserver: encoder 0") == titles.count("shardserver: front-end 1") == 1, titles
        assert len(old) == 6, titles
        time.sleep(0.5)  # the polls are held
        gone_at: dict[int, float] = {}
        stop_watch = threading.Event()

        def watch() -> None:
            while not stop_watch.is_set() and len(gone_at) < len(old):
                alive = set(_children(pid))
                now = time.monotonic()
                for p in old:
                    if p not in alive and p not in gone_at:
                        gone_at[p] = now
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        watcher.start()
        first.proc.wait(5)
        time.sleep(0.01)
        second = RunningServer(env=env, args=["--port", str(port)]).__enter__()
        watcher.join(10)
        stop_watch.set()
        assert sorted(gone_at) == sorted(old), f"children of the killed run still alive: {_children(pid)}"
        last = max(gone_at.values()) - t0
        assert last < 1.5, f"the last child of the killed run exited {last:.2f} s after the kill"
        assert second.proc.poll() is None and http_json(second.url + "/healthz")[0] == 200
        for t in threads:
            t.join(20)
        # Held polls were answered 408 try_again by the draining front-ends (or cut by the kill):
        # never a 5xx.
        assert all(st in (408, 0) for st in polls), polls
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not second.leftover_processes
    assert not any("Address already in use" in line for line in second.log_lines)


def test_sigterm_refuses_new_connections_once_the_front_ends_stopped(tmp_path):
    """While the supervisor stops its encoders and the simulator (a request is still in flight
    there), a new connection is refused: the listening socket was closed before anything
    else, so the kernel no longer queues connections that nobody would accept (and then reset)."""
    env = _env(tmp_path, SHARDSERVER_SIMULATOR__LATENCY_S="30", SHARDSERVER_SHARDS__COUNT="1",
               SHARDSERVER_SERVER__FRONT_ENDS="1")
    with RunningServer(env=env) as s:
        api = Api(s.url)
        api.submit(api.sampling_session(), [7, 7])  # keeps the simulator busy: its stop takes a while
        pid = s.proc.pid
        front_end = [p for p in _children(pid)
                     if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"shardserver: front-end")]
        assert len(front_end) == 1
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and front_end[0] in _children(pid):
            time.sleep(0.01)
        assert front_end[0] not in _children(pid)
        assert s.proc.poll() is None  # still stopping the encoder and the simulator
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
        assert s.proc.wait(15) == 0


def test_a_cursor_from_another_clock_does_not_pass_the_futures_a_restart_lost(tmp_path):
    """A gateway with 4 futures in flight is SIGKILLed and started again on its port; the new
    run's encoders restore the 4 from their journals, stamped when they start. A poller whose
    cursor comes from another clock (the host rebooted, or the state directory moved to another
    host, while the SDK kept its cursor) may carry any number, also one between the new run's
    start and now: it must still get the 4 as failed (then 410, and the SDK resubmits). Such a
    cursor used to be taken as a point of this run's clock, which passed the 4 unreported: their
    samples waited forever. Cursors of a run are congruent to its tag modulo 1024 (1..1023);
    this one (a multiple of 1024) is not."""
    port = _free_port()
    env = _env(tmp_path, SHARDSERVER_SIMULATOR__LATENCY_S="30", SHARDSERVER_SERVER__FRONT_ENDS="1")
    first = RunningServer(env=env, args=["--port", str(port)]).__enter__()
    second = None
    try:
        api = Api(first.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [5, i], seq_id=i) for i in range(4)]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        second = RunningServer(env=env, args=["--port", str(port)]).__enter__()
        now = time.monotonic_ns()  # after the new encoders restored the 4: the worst such cursor
        foreign = now - now % 1024

        def poll(cursor: int) -> tuple[int, dict]:
            st, _, b = api.post("/api/v1/retrieve_futures", {
                "target": {"type": "sampling_session", "sampling_session_id": ssid, "cloned_sampler_id": 0},
                "prev_cursor": cursor, "retrieved_request_ids": [], "timeout": 0})
            return st, json.loads(b)

        st, js = poll(foreign)
        assert st == 200
        assert sorted(c["request_id"] for c in js["completions"]) == sorted(rids)
        assert all(c == {"state": "failed", "request_id": c["request_id"]} for c in js["completions"])
        for rid in rids:
            assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 410
        # The cursor of this run passes them: reported once.
        assert poll(js["cursor"]) == (200, {"completions": [], "cursor": js["cursor"]})
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not second.leftover_processes
