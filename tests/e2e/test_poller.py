"""The SDK's session-wide poller (``retrieve_futures``) and ``cancel_future`` through real gateways.

The real SDK 0.38.0 samples in-process and 0.26.2 in its own venv (``.venv-sdk026``), with the
poller announced (the default): results must equal the engine's body and the server must have
seen the poller's calls. The wire protocol is also checked by hand (cursor, ack, hold, the
404/410/503 answers), and a cancel (the SDK's own, and by hand) must stop the engine request
(the simulator counts aborted requests) and free the arena reservation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time

import pytest

from conftest import BASE_MODEL, Api, engine_body, expected_sequences, old_sdk_python
from shardserver.shm.arena import ArenaWriter
from shardserver.testing import RunningServer, http_json

pytestmark = [pytest.mark.timeout(180)]

POLLER_ON = {"SHARDSERVER_FUTURES__RETRIEVE_FUTURES": "true"}  # the default, stated so these tests keep it


@pytest.fixture(scope="module")
def server():
    """This module's gateway: as conftest's (S=2, F=2), with the session-wide poller on."""
    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
                            "SHARDSERVER_SHARDS__ARENA_BYTES": str(64 * 1024 * 1024), **POLLER_ON}) as s:
        yield s
    assert s.proc is not None and s.proc.returncode == 0, "\n".join(s.log_lines[-30:])
    assert not s.leftover_processes


def _http_count(url: str, endpoint: str, code: str = "200") -> int:
    """``shardserver_http_requests_total`` of ``endpoint`` and ``code``, over every front-end (/metrics)."""
    st, _, b = http_json(url + "/metrics")
    assert st == 200
    total = 0.0
    for line in b.decode().splitlines():
        if line.startswith("shardserver_http_requests_total{") and f'endpoint="{endpoint}"' in line \
                and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _shard_sum(url: str, key: str) -> int:
    js = json.loads(http_json(url + "/stats")[2])
    return sum(sh[key] for sh in js["shards"])


def _shard_counter(url: str, name: str) -> int:
    js = json.loads(http_json(url + "/stats")[2])
    return sum(sh["counters"].get(name, 0) for sh in js["shards"])


def _engine_url(server: RunningServer) -> str:
    """The embedded simulator's URL, from the supervisor's ready log line."""
    for line in server.log_lines:
        m = re.search(r"engine (http://127\.0\.0\.1:\d+)\)", line)
        if m:
            return m.group(1)
    raise AssertionError("no engine URL in the server log")


def _sim_stats(server: RunningServer) -> dict:
    st, _, b = http_json(_engine_url(server) + "/_sim/stats")
    assert st == 200
    return json.loads(b)


def _wait(pred, timeout: float = 10.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def _check(resp, body):
    import numpy as np

    want = expected_sequences(body)
    assert len(resp.sequences) == len(want)
    for seq, w in zip(resp.sequences, want):
        assert list(seq.tokens) == w["tokens"]
        assert np.array_equal(np.asarray(seq.logprobs, dtype=np.float32), w["logprobs"])
        assert seq.stop_reason == w["stop_reason"]


def _poll(api: Api, ssid: str, cursor: int = 0, timeout=None, acks=(), clone: int = 0, http_timeout: float = 40):
    body = {"target": {"type": "sampling_session", "sampling_session_id": ssid, "cloned_sampler_id": clone},
            "prev_cursor": cursor, "retrieved_request_ids": list(acks)}
    if timeout is not None:
        body["timeout"] = timeout
    st, _, b = api.post("/api/v1/retrieve_futures", body, timeout=http_timeout)
    return st, json.loads(b)


def _collect(api: Api, ssid: str, want: int, within_s: float = 30) -> dict[str, dict]:
    """Poll the session from cursor 0 (5 s holds; a 503 while a shard restarts is retried) until
    ``want`` completions came or ``within_s`` passed: ``{request_id: completion}``."""
    got: dict[str, dict] = {}
    cursor = 0
    deadline = time.monotonic() + within_s
    while len(got) < want and time.monotonic() < deadline:
        st, js = _poll(api, ssid, cursor, timeout=5, http_timeout=15)
        if st == 503:
            time.sleep(0.2)
            continue
        assert st == 200, js
        cursor = js["cursor"]
        got.update((c["request_id"], c) for c in js["completions"])
    return got


# -- the real SDKs, poller on -------------------------------------------------------------------
@pytest.mark.sdk
def test_sdk_038_samples_through_the_poller(server):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    before = _http_count(server.url, "retrieve_futures")
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-poller")
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
    assert service.holder.get_client_config().sample_use_retrieve_futures is True
    prompt = [400, 401, 402]
    resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                          sampling_params=types.SamplingParams(max_tokens=64, seed=11)).result(60)
    _check(resp, engine_body(prompt, 2, 64, 11))

    async def many():
        return await asyncio.gather(*(
            sampler.sample(prompt=types.ModelInput.from_ints([7, i]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=200, seed=i, temperature=0.8))
            for i in range(40)))

    for i, r in enumerate(asyncio.run(many())):
        _check(r, engine_body([7, i], 1, 200, i, temperature=0.8))
    assert sampler._futures_poller is not None  # the samples waited on the session's poller
    # The poller's calls reached the server, and its acks freed the results (arena back to 0
    # bytes once the final acks are in: the SDK sends them with its next, ack-only, poll).
    assert _http_count(server.url, "retrieve_futures") - before >= 2
    assert _wait(lambda: _shard_sum(server.url, "arena_used_bytes") == 0, timeout=15)
    assert _shard_counter(server.url, "acked") >= 41


@pytest.mark.sdk
def test_sdk_026_samples_through_the_poller(server):
    py = old_sdk_python(".venv-sdk026")
    if py is None:
        pytest.skip("no tinker 0.26.2 environment (make test builds .venv-sdk026)")
    before = _http_count(server.url, "retrieve_futures")
    proc = subprocess.run([py, os.path.join(os.path.dirname(os.path.dirname(__file__)), "sdk_scripts", "poller_sdk_sample.py"),
                           server.url], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == "0.26.2"
    assert out["use_retrieve_futures"] is True and out["cancel_enabled"] is True and out["poller"] is True
    for k, seqs in enumerate(out["results"]):
        want = expected_sequences(engine_body([11, 12, k], 2, 7 + k, 5 + k))
        assert [s["tokens"] for s in seqs] == [w["tokens"] for w in want]
        assert [s["logprobs"] for s in seqs] == [[float(x) for x in w["logprobs"]] for w in want]
        assert [s["stop_reason"] for s in seqs] == [w["stop_reason"] for w in want]
    assert _http_count(server.url, "retrieve_futures") - before >= 1


# -- the wire protocol by hand --------------------------------------------------------------------
def test_poller_cursor_ack_and_hold(server, api):
    ssid = api.sampling_session()
    # Nothing yet: an ack-only poll answers at once and keeps the cursor.
    t0 = time.monotonic()
    assert _poll(api, ssid, 0, timeout=0) == (200, {"completions": [], "cursor": 0})
    assert time.monotonic() - t0 < 2
    rids = [api.submit(ssid, [5, i], seq_id=i, max_tokens=3 + i, seed=i) for i in range(6)]
    got: dict[str, dict] = {}
    cursor = 0
    for _ in range(20):  # bounded: every completion comes within a few polls
        st, js = _poll(api, ssid, cursor)
        assert st == 200
        assert js["cursor"] > cursor
        cursor = js["cursor"]
        for c in js["completions"]:
            got[c["request_id"]] = c
        if len(got) == 6:
            break
    assert sorted(got) == sorted(rids)
    for rid in rids:
        st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
        assert st == 200 and got[rid] == {"state": "finished", "request_id": rid,
                                          "response_payload_uncompressed_size": len(b)}
    # Seen completions are not repeated; another clone of the session sees none of them.
    assert _poll(api, ssid, cursor, timeout=0) == (200, {"completions": [], "cursor": cursor})
    assert _poll(api, ssid, 0, timeout=0, clone=3) == (200, {"completions": [], "cursor": 0})
    used = _shard_sum(server.url, "arena_used_bytes")
    # Acks free the results at once (exactly their slots: the module's other tests keep theirs);
    # later polls of them answer 410.
    assert _poll(api, ssid, cursor, timeout=0, acks=rids) == (200, {"completions": [], "cursor": cursor})
    freed = sum(ArenaWriter.slot_bytes(got[r]["response_payload_uncompressed_size"]) for r in rids)
    assert used - _shard_sum(server.url, "arena_used_bytes") == freed
    st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rids[0]})
    assert st == 410
    # A held poll answers as soon as a completion arrives, with exactly that one.
    box: dict = {}

    def hold():
        box["t0"] = time.monotonic()
        box["r"] = _poll(api, ssid, cursor)
        box["t1"] = time.monotonic()

    th = threading.Thread(target=hold)
    th.start()
    time.sleep(1.0)
    late = api.submit(ssid, [6, 6], seq_id=100, max_tokens=4, seed=1)
    th.join(30)
    st, js = box["r"]
    assert st == 200 and [c["request_id"] for c in js["completions"]] == [late] and js["cursor"] > cursor
    assert 0.9 < box["t1"] - box["t0"] < 10  # held until the completion, well before long_poll_s (25 s)


def test_poller_cap_per_answer_and_failed_state(tmp_path):
    """futures.retrieve_futures_max_ids caps one answer; the rest comes with the next polls, none
    twice; an engine failure is reported as ``failed``."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[shards]\ncount = 2\narena_bytes = 8388608\n[server]\nfront_ends = 1\n'
                   '[futures]\nretrieve_futures = true\nretrieve_futures_max_ids = 4\n[simulator]\nmodel_name = "Qwen/Qwen3-8B"\n'
                   '[[simulator.faults]]\nkind = "status"\nfirst_token_id = 9001\nstatus = 500\n')
    with RunningServer(cfg) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [5, i], seq_id=i, max_tokens=2, seed=i) for i in range(11)]
        bad = api.submit(ssid, [9001, 1], seq_id=50)
        time.sleep(1.0)  # every one has completed
        cursor, seen, sizes = 0, [], []
        for _ in range(12):
            st, js = _poll(api, ssid, cursor, timeout=0)
            assert st == 200
            sizes.append(len(js["completions"]))
            seen += js["completions"]
            cursor = js["cursor"]
            if not js["completions"]:
                break
        assert max(sizes) <= 4 and sizes[-1] == 0
        ids = [c["request_id"] for c in seen]
        assert sorted(ids) == sorted(rids + [bad]) and len(ids) == len(set(ids))
        assert [c for c in seen if c["request_id"] == bad] == [{"state": "failed", "request_id": bad}]


def test_poller_errors(server, api):
    ssid = api.sampling_session()
    st, js = _poll(api, "ss-forged.0000", 0)
    assert st == 404 and "unknown sampling_session_id" in js["error"]
    st, _, b = api.post("/api/v1/retrieve_futures", {"prev_cursor": 0})
    assert st == 400 and "target" in json.loads(b)["error"]
    st, _, b = api.post("/api/v1/retrieve_futures", {"target": {"sampling_session_id": ssid}, "prev_cursor": -1})
    assert st == 400
    for field, where in (("prev_cursor", None), ("cloned_sampler_id", "target")):
        body = {"target": {"sampling_session_id": ssid}, "prev_cursor": 0, "timeout": 0}
        (body[where] if where else body)[field] = 2**70  # used to be a 500 (msgspec int64 overflow) or cursor 0
        st, _, b = api.post("/api/v1/retrieve_futures", body)
        assert st == 400 and field in json.loads(b)["error"], (field, st, b)
    # A cursor from the future (another clock) starts over instead of hiding completions.
    rid = api.submit(ssid, [8, 8], seq_id=1)
    time.sleep(0.5)
    st, js = _poll(api, ssid, 2**62, timeout=0)
    assert st == 200 and [c["request_id"] for c in js["completions"]] == [rid]


def test_cancel_over_http(server, api):
    ssid = api.sampling_session()
    rid = api.submit(ssid, [3, 3], seq_id=1, max_tokens=50)
    time.sleep(0.5)
    used = _shard_sum(server.url, "arena_used_bytes")
    st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid})
    assert (st, json.loads(b)) == (200, {"request_id": rid, "cancelled": True, "state": "done"})
    # The completed result was freed: one 50-token sequence (8 bytes a token + framing) fewer.
    assert 400 < used - _shard_sum(server.url, "arena_used_bytes") < 600
    st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
    assert st == 410
    st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid})  # nothing left to cancel
    assert st == 410 and "unknown or expired" in json.loads(b)["error"]
    st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid[:-4] + "0000"})  # bad MAC
    assert st == 404
    st, _, b = api.post("/api/v1/cancel_future", {"request_id": "f00000000" + rid[9:]})  # another run's prefix
    assert st == 410
    st, _, b = api.post("/api/v1/cancel_future", {})
    assert st == 400


# -- a cancelled sample stops its engine request ----------------------------------------------------
@pytest.fixture(scope="module")
def slow_server():
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024), "SHARDSERVER_SIMULATOR__LATENCY_S": "30",
           **POLLER_ON}
    with RunningServer(env=env) as s:
        yield s
    assert s.proc is not None and s.proc.returncode == 0


def test_cancel_stops_the_engine_request_and_frees_the_reservation(slow_server):
    api = Api(slow_server.url)
    ssid = api.sampling_session()
    rid = api.submit(ssid, [4, 4], seq_id=1, max_tokens=1000)
    assert _wait(lambda: _sim_stats(slow_server)["in_flight"] == 1)
    assert _shard_sum(slow_server.url, "arena_reserved_bytes") >= 8000
    aborted = _sim_stats(slow_server)["aborted"]
    st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid})
    assert (st, json.loads(b)) == (200, {"request_id": rid, "cancelled": True, "state": "pending"})
    assert _shard_sum(slow_server.url, "arena_reserved_bytes") == 0
    assert _wait(lambda: _sim_stats(slow_server)["in_flight"] == 0)
    assert _sim_stats(slow_server)["aborted"] == aborted + 1
    st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
    assert st == 410
    assert _shard_counter(slow_server.url, "cancelled_pending") >= 1


@pytest.mark.sdk
@pytest.mark.filterwarnings("ignore:.*sample_async.*:FutureWarning")
def test_sdk_038_cancels_an_abandoned_sample(slow_server):
    """The caller stops waiting (``result_async(timeout)``): SDK 0.38 sends ``cancel_future`` (dynamic
    config ``sample_cancel_enabled``), the engine request is aborted and the reservation freed."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=slow_server.url, api_key="tml-cancel")
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
    aborted = _sim_stats(slow_server)["aborted"]
    cancels = _http_count(slow_server.url, "cancel_future")
    fut = sampler.sample(prompt=types.ModelInput.from_ints([9, 9, 9]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=500, seed=2))

    async def abandon():
        with pytest.raises(asyncio.TimeoutError):
            await fut.result_async(timeout=2.0)

    asyncio.run(abandon())
    assert _wait(lambda: _sim_stats(slow_server)["aborted"] == aborted + 1, timeout=20)
    assert _sim_stats(slow_server)["in_flight"] == 0
    assert _shard_sum(slow_server.url, "arena_reserved_bytes") == 0
    assert _http_count(slow_server.url, "cancel_future") == cancels + 1
    service.holder.close()


def test_sigterm_releases_a_held_poller_at_once():
    """Shutdown answers a held retrieve_futures at once (empty, cursor unchanged), not a 500 at
    the end of the graceful period."""
    import signal

    env = {"SHARDSERVER_SIMULATOR__LATENCY_S": "30", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "5", **POLLER_ON}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        api.submit(ssid, [3, 1], 1)  # pending for 30 s
        box: dict = {}

        def hold() -> None:
            box["r"] = _poll(api, ssid, 0)
            box["t"] = time.monotonic()

        th = threading.Thread(target=hold)
        th.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        th.join(15)
        assert s.proc.wait(15) == 0
    assert box["r"] == (200, {"completions": [], "cursor": 0})
    assert box["t"] - t0 < 4.0  # before the 5 s graceful period ends
    assert not any("Traceback" in line for line in s.log_lines)


@pytest.mark.sdk
def test_encoder_sigkill_its_futures_are_reported_failed_and_the_sdk_resubmits():
    """An encoder is SIGKILLed while futures wait for the engine on it; the supervisor respawns
    it. The new encoder reads the shard's journal and reports every future its predecessor held
    to that session's poller as ``failed``; ``retrieve_future`` answers 410 for them, and the SDK
    0.38 (waiting on the poller) resubmits: every sample finishes with the engine's exact tokens.
    Futures of the other shard are not touched."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import signal

    import tinker
    from tinker import types

    from shardserver.ids import shard_of

    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024), "SHARDSERVER_SIMULATOR__LATENCY_S": "5",
           **POLLER_ON}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [8, i], seq_id=i, max_tokens=4, seed=i) for i in range(6)]
        service = tinker.ServiceClient(base_url=s.url, api_key="tml-poller-kill")
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
        futs = [sampler.sample(prompt=types.ModelInput.from_ints([21, i]), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=12, seed=i, temperature=1.0))
                for i in range(16)]

        def pending() -> dict[int, int]:
            return {sh["shard"]: sh["futures"].get("pending", 0) for sh in s.stats()["shards"]}

        assert _wait(lambda: sum(pending().values()) == 22, timeout=20), pending()
        before = s.stats()["shards"]
        victim = shard_of(rids[0], 2)
        held = pending()[victim]
        os.kill([sh["pid"] for sh in before if sh["shard"] == victim][0], signal.SIGKILL)
        # By hand: the session's poller gets the victim's futures as failed (503 while the shard
        # restarts), the other shard's as finished once the engine answers.
        got = _collect(api, ssid, 6)
        assert sorted(got) == sorted(rids)
        for rid in rids:
            if shard_of(rid, 2) == victim:
                assert got[rid] == {"state": "failed", "request_id": rid}
                st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
                assert st == 410, b
            else:
                assert got[rid]["state"] == "finished"
        # The SDK's samples: every one finishes, exact, within a bounded time.
        t_end = time.monotonic() + 60
        results = [f.result(timeout=max(0.1, t_end - time.monotonic())) for f in futs]
        for i, r in enumerate(results):
            _check(r, engine_body([21, i], 1, 12, i))
        assert sampler._futures_poller is not None
        after = {sh["shard"]: sh for sh in s.stats()["shards"]}
        assert after[victim]["pid"] != [sh["pid"] for sh in before if sh["shard"] == victim][0]
        assert after[victim]["counters"].get("restored_lost", 0) == held
        assert after[1 - victim]["counters"].get("restored_lost", 0) == 0
        # Each lost SDK sample was asked for once more (410) and resubmitted (200).
        sdk_lost = held - sum(1 for r in rids if shard_of(r, 2) == victim)
        assert sdk_lost >= 0
        assert _http_count(s.url, "asample") == 6 + 16 + sdk_lost
        service.holder.close()


def test_state_dir_deleted_mid_run_the_journal_is_written_again_and_a_respawn_reports_its_futures(tmp_path):
    """Break tester F1: ``server.state_dir`` deleted mid-run (a tmp cleaner, ``rm -rf``) left the
    encoder appending to an unlinked journal, so the next encoder of the shard found nothing to
    take over and those samples waited forever. The encoder's sweep now writes the journal again
    (its directory made again) with every future owed a report, logging a WARNING; its
    successor (the encoder SIGKILLed and respawned) reports them all as failed."""
    import glob
    import shutil
    import signal

    from shardserver.workers.journal import read_journal

    state = tmp_path / "state"
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024), "SHARDSERVER_SIMULATOR__LATENCY_S": "30",
           "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "1", "SHARDSERVER_SERVER__STATE_DIR": str(state), **POLLER_ON}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [9, i], seq_id=i, max_tokens=4, seed=i) for i in range(3)]
        secret = (state / "id_secret").read_bytes()
        shutil.rmtree(state)
        rids.append(api.submit(ssid, [9, 3], seq_id=3, max_tokens=4, seed=3))  # accepted after the removal

        def journaled() -> set[str]:
            files = glob.glob(str(state / "futures" / "*.0.journal"))
            return set(read_journal(open(files[0], "rb").read())[0]) if len(files) == 1 else set()

        assert _wait(lambda: journaled() == set(rids), timeout=5), (journaled(), rids)
        assert _wait(lambda: any("WARNING" in ln and "journal" in ln and "was removed" in ln for ln in s.log_lines),
                     timeout=2), s.log_lines[-10:]
        assert (state.stat().st_mode & 0o777, (state / "futures").stat().st_mode & 0o777) == (0o700, 0o700)
        old_pid = s.stats()["shards"][0]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        got = _collect(api, ssid, len(rids))
        assert got == {rid: {"state": "failed", "request_id": rid} for rid in rids}
        assert s.stats()["shards"][0]["counters"].get("restored_lost", 0) == len(rids)
        assert not any("journal" in ln and "ERROR" in ln for ln in s.log_lines)
        # The ID signing secret went with the directory: written again, the same, so the next start
        # signs as this run does (before: a new secret, and every session of this run got 404).
        path = state / "id_secret"
        assert _wait(lambda: path.exists(), timeout=7), s.log_lines[-10:]
        assert path.read_bytes() == secret and path.stat().st_mode & 0o777 == 0o600
        assert any("WARNING" in ln and "the ID signing secret file" in ln and "written again" in ln
                   for ln in s.log_lines)
