"""Processes and shared memory: start, crash, restart, shutdown. Each test runs its own gateway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import Api
from shardserver.testing import REPO, RunningServer, http_json, mapped_distributions, metric_sum, our_shm_segments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _segments_of(pid: int) -> list[str]:
    return [n for n in our_shm_segments() if n.startswith(f"shardserver-{pid}-")]


def _group(pgid: int) -> list[tuple[int, str]]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append((int(d), cmd))
    return out


def _submit(api: Api, tokens: list[int], seq_id: int = 0, max_tokens: int = 4) -> str:
    return api.submit(api.sampling_session(), tokens, seq_id, max_tokens)


def test_process_titles_and_sigterm_cleanup():
    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2"}) as s:
        pid = s.proc.pid
        titles = sorted(cmd for _, cmd in _group(pid) if cmd.startswith("shardserver:"))
        assert titles == ["shardserver: encoder 0", "shardserver: encoder 1", "shardserver: engine-sim",
                          "shardserver: front-end 0", "shardserver: front-end 1", "shardserver: supervisor"]
        assert len(_segments_of(pid)) == 2
        # The supervisor runs no worker code: it spawns them by a target in a small module and
        # loads the simulator's config class without its renderer and server. It used to map
        # numpy, simdjson, protobuf, pydantic-core and aiohttp (57 MiB of PSS; now ~20). A
        # front-end loads the codec's numpy parts only to derive JSON for a pre-0.25 SDK
        # (49 -> 40 MiB idle).
        assert not mapped_distributions(pid) & {"numpy", "numpy.libs", "aiohttp", "csimdjson.abi3.so", "google",
                                                "pydantic_core", "uvloop", "httptools", "orjson"}, \
            sorted(mapped_distributions(pid))
        fe = next(p for p, cmd in _group(pid) if cmd == "shardserver: front-end 0")
        assert not mapped_distributions(fe) & {"numpy", "numpy.libs", "csimdjson.abi3.so", "google", "aiohttp"}, \
            sorted(mapped_distributions(fe))
        api = Api(s.url)
        rid = _submit(api, [1, 2, 3])
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 200
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 10
    assert _segments_of(pid) == []
    assert not s.leftover_processes
    assert any("[shutdown] supervisor: done" in line for line in s.log_lines)


def test_encoder_sigkill_answers_410_at_once_and_restarts():
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SIMULATOR__LATENCY_S": "20"}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        stats = s.stats()
        enc_pids = {sh["shard"]: sh["pid"] for sh in stats["shards"]}
        rid = _submit(api, [5, 5, 5])
        from shardserver.ids import shard_of

        shard = shard_of(rid, 2)
        other = 1 - shard
        rid_other = None
        for i in range(50):  # a future on the other shard, which must not notice the crash
            r = _submit(api, [6, 6, i], seq_id=i)
            if shard_of(r, 2) == other:
                rid_other = r
                break
        assert rid_other is not None
        result: dict = {}

        def poll() -> None:
            t = time.monotonic()
            result["status"], _, result["body"] = api.post("/api/v1/retrieve_future", {"request_id": rid})
            result["elapsed"] = time.monotonic() - t

        th = threading.Thread(target=poll)
        th.start()
        time.sleep(0.5)  # the poll is now held by the encoder
        old_segments = _segments_of(s.proc.pid)
        os.kill(enc_pids[shard], signal.SIGKILL)
        th.join(10)
        assert result["status"] == 410, result
        assert result["elapsed"] < 5.0  # at once: the long-poll would hold it 25 s
        # Restarted within 2 s, with a fresh arena; the old one is unlinked.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st, _, b = http_json(s.url + "/readyz")
            if st == 200:
                break
            time.sleep(0.05)
        assert st == 200
        new_pids = {sh["shard"]: sh["pid"] for sh in s.stats()["shards"]}
        assert new_pids[shard] != enc_pids[shard] and new_pids[other] == enc_pids[other]
        segs = _segments_of(s.proc.pid)
        assert len(segs) == 2 and set(segs) != set(old_segments)
        # The lost future answers 410 (the SDK resubmits); the other shard's future is still pending.
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 410
        stats = s.stats()
        other_stats = [sh for sh in stats["shards"] if sh["shard"] == other][0]
        assert other_stats["futures"].get("pending", 0) >= 1
        assert any("exited with code -9: restarting" in line for line in s.log_lines)


def _titled(pgid: int, title: str) -> list[int]:
    return [pid for pid, cmd in _group(pgid) if cmd == title]


def test_front_end_sigkill_others_keep_serving():
    with RunningServer(env={"SHARDSERVER_SERVER__FRONT_ENDS": "2"}) as s:
        (victim,) = _titled(s.proc.pid, "shardserver: front-end 0")
        (survivor,) = _titled(s.proc.pid, "shardserver: front-end 1")
        os.kill(victim, signal.SIGKILL)
        statuses = [http_json(s.url + "/healthz")[0] for _ in range(20)]
        assert statuses == [200] * 20
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not [p for p in _titled(s.proc.pid, "shardserver: front-end 0")
                                                   if p != victim]:
            time.sleep(0.05)
        (restarted,) = _titled(s.proc.pid, "shardserver: front-end 0")
        assert restarted != victim
        assert _titled(s.proc.pid, "shardserver: front-end 1") == [survivor]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
            time.sleep(0.05)
        api = Api(s.url)
        rid = _submit(api, [8, 8, 8])
        assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 200


def test_supervisor_sigkill_children_exit_and_next_start_cleans():
    s = RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2"}).__enter__()
    try:
        pid = s.proc.pid
        assert len(_segments_of(pid)) == 2
        os.kill(pid, signal.SIGKILL)
        s.proc.wait(5)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and _group(pid):
            time.sleep(0.1)
        assert _group(pid) == [], "children outlived a SIGKILLed supervisor"
        # Encoders unlink their own arenas when they notice; whatever is left goes at the next start.
        with RunningServer() as s2:
            assert _segments_of(pid) == []
            assert len(_segments_of(s2.proc.pid)) == 2
    finally:
        s.stop()


def test_invalid_config_stops_start_with_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[shards]\ncount = -1\n")
    proc = subprocess.run([sys.executable, "-m", "shardserver.cli", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert proc.returncode == 2
    assert "shards.count" in proc.stderr and "must be 1..256" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "shardserver.cli", "config", "--show", "--config",
                           str(REPO / "configs" / "demo.toml")], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SHARDSERVER_SHARDS__COUNT": "3",
                               "SHARDSERVER_SERVER__ID_SECRET": "hunter2"}, cwd=str(REPO))
    assert proc.returncode == 0
    shown = json.loads(proc.stdout)
    assert shown["shards"]["count"] == 3 and shown["server"]["id_secret"] == "***"


def test_sigterm_answers_held_polls_with_try_again():
    """Polls held by the long-poll get 408 try_again as soon as shutdown starts, not a 500 later."""
    env = {"SHARDSERVER_SIMULATOR__LATENCY_S": "30", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SERVER__GRACEFUL_SHUTDOWN_S": "5"}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [3, i], i) for i in range(6)]
        results: list = []

        def poll(rid: str) -> None:
            st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
            results.append((st, b, time.monotonic()))

        threads = [threading.Thread(target=poll, args=(r,)) for r in rids]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(15)
        assert s.proc.wait(15) == 0
        assert time.monotonic() - t0 < 10
    assert [st for st, _, _ in results] == [408] * 6
    assert all(json.loads(b)["type"] == "try_again" for _, b, _ in results)
    assert max(t for _, _, t in results) - t0 < 4.0  # before the 5 s graceful period ends
    assert not any("Traceback" in line for line in s.log_lines)


def test_port_in_use_is_a_one_line_error():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "shardserver.cli", "serve", "--config",
                               str(REPO / "configs" / "demo.toml"), "--port", str(port)],
                              capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (server.host / server.port)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_crash_looping_encoder_restarts_with_backoff():
    """An encoder that keeps dying right after its start is restarted after 0.5, 1, 2 ... s,
    not in a tight loop; once it stays up the gateway is ready again."""
    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}) as s:
        killed = []
        deadline = time.monotonic() + 30
        while len(killed) < 3 and time.monotonic() < deadline:
            pids = [p for p in _titled(s.proc.pid, "shardserver: encoder 0") if p not in killed]
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)
        assert len(killed) == 3
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
            time.sleep(0.1)
        assert http_json(s.url + "/readyz")[0] == 200
        api = Api(s.url)
        rid = _submit(api, [4, 4])
        assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 200
    held = [line for line in s.log_lines if "times in a row): restarting in" in line]
    assert any("restarting in 0.5 s" in line for line in held), held
    assert any("restarting in 1.0 s" in line for line in held), held


def test_an_arena_that_cannot_be_created_at_a_restart_is_retried_not_fatal():
    """Another program fills /dev/shm: an encoder dies of SIGBUS writing a result, and creating
    its fresh arena fails (ENOSPC). The supervisor logs why and tries again after a backoff; the
    rest of the gateway keeps serving, and the encoder comes back once the arena can be created.
    Here the creation fails the same way (``create_segment`` raising ``OSError``) because a file
    already holds the name of the encoder's next arena. Before: the OSError escaped the supervise
    loop and the supervisor stopped the whole gateway (exit code 1, connection refused)."""
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}
    with RunningServer(env=env) as s:
        pid = s.proc.pid
        (seg0,) = [n for n in _segments_of(pid) if "-a0." in n]
        assert seg0.endswith("-a0.0")
        squatter = os.path.join("/dev/shm", seg0[:-1] + "1")
        open(squatter, "xb").close()
        try:
            (enc0,) = _titled(pid, "shardserver: encoder 0")
            os.kill(enc0, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any("cannot create its arena" in ln for ln in s.log_lines):
                time.sleep(0.05)
            assert s.proc.poll() is None, "\n".join(s.log_lines[-20:])
            line = next(ln for ln in s.log_lines if "cannot create its arena" in ln)
            assert "ERROR" in line and "encoder 0" in line and "File exists" in line and "retrying in 1.0 s" in line
            # Meanwhile the other shard serves: a sample on it completes.
            api = Api(s.url)
            from shardserver.ids import shard_of

            ssid = api.sampling_session()
            answers = [api.post("/api/v1/asample", {
                "sampling_session_id": ssid, "seq_id": i, "num_samples": 1, "prompt": {"chunks": [{"tokens": [8, i]}]},
                "sampling_params": {"max_tokens": 4, "seed": 1}}) for i in range(16)]
            # asample for shard 0 is 503 (the SDK retries it), shard 1 takes the others.
            assert {(st, b) for st, _, b in answers if st != 200} == {
                (503, b'{"error":"shard 0 unavailable: encoder 0 is not connected; retry"}')}
            on1 = [json.loads(b)["request_id"] for st, _, b in answers if st == 200]
            assert on1 and all(shard_of(r, 2) == 1 for r in on1)
            assert api.post("/api/v1/retrieve_future", {"request_id": on1[0]})[0] == 200
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
                time.sleep(0.1)
            assert http_json(s.url + "/readyz")[0] == 200
            ours = [n for n in _segments_of(pid) if n != os.path.basename(squatter)]
            assert sorted(n.rsplit("-", 1)[1] for n in ours) == ["a0.2", "a1.0"]
            rid = next(r for r in (api.submit(ssid, [9, i], seq_id=100 + i) for i in range(40))
                       if shard_of(r, 2) == 0)
            assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 200
        finally:
            os.unlink(squatter)
        assert s.stop() == 0
    assert _segments_of(pid) == [] and not s.leftover_processes


def test_ctrl_c_to_the_process_group_shuts_down_in_order():
    """Ctrl-C in a terminal sends SIGINT to every process of the group: only the supervisor acts
    on it, stopping front-ends before encoders; no tracebacks, nothing left."""
    s = RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2"}).__enter__()
    try:
        pid = s.proc.pid
        os.killpg(pid, signal.SIGINT)
        assert s.proc.wait(15) == 0
    finally:
        s.stop()
    log = "\n".join(s.log_lines)
    assert "Traceback" not in log
    assert log.index("[shutdown] supervisor: stopping front-ends") < log.index("encoder 0 stopped")
    assert _segments_of(pid) == [] and not s.leftover_processes


def test_sighup_is_a_clean_shutdown():
    """SIGHUP (a closed terminal, a careless kill -HUP) stops the gateway like SIGTERM: exit 0, every
    segment unlinked, nothing left. Without a handler it killed the supervisor outright."""
    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}) as s:
        pid = s.proc.pid
        assert len(_segments_of(pid)) == 2
        s.proc.send_signal(signal.SIGHUP)
        assert s.proc.wait(15) == 0
    assert _segments_of(pid) == []
    assert not s.leftover_processes
    assert any("[shutdown] supervisor: done" in line for line in s.log_lines)


def test_stopped_front_end_and_encoder_are_killed_and_restarted():
    """A front-end and an encoder that stop answering (SIGSTOP: alive, sentinel silent, still holding
    their share of the accepted connections and of the futures) used to be kept forever. Their
    heartbeat stops, so the supervisor SIGKILLs and restarts each within server.liveness_timeout_s
    (2 s here), logs it, counts it, and requests are served after."""
    from prometheus_client.parser import text_string_to_metric_families

    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
           "SHARDSERVER_SERVER__LIVENESS_TIMEOUT_S": "2"}
    with RunningServer(env=env) as s:
        pgid = s.proc.pid
        (fe,) = _titled(pgid, "shardserver: front-end 0")
        (enc,) = _titled(pgid, "shardserver: encoder 1")
        others = sorted(_titled(pgid, "shardserver: front-end 1") + _titled(pgid, "shardserver: encoder 0"))
        t0 = time.monotonic()
        os.kill(fe, signal.SIGSTOP)
        os.kill(enc, signal.SIGSTOP)
        deadline = t0 + 20
        while time.monotonic() < deadline:
            if (fe not in _titled(pgid, "shardserver: front-end 0") and enc not in _titled(pgid, "shardserver: encoder 1")
                    and len(_titled(pgid, "shardserver: front-end 0")) == 1
                    and len(_titled(pgid, "shardserver: encoder 1")) == 1):
                break
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert fe not in _titled(pgid, "shardserver: front-end 0") and enc not in _titled(pgid, "shardserver: encoder 1"), \
            "\n".join(s.log_lines[-20:])
        assert 2.0 <= took < 8.0  # bound 2 s, a heartbeat every 0.5 s, checked every 0.2 s
        # The healthy children were left alone.
        assert sorted(_titled(pgid, "shardserver: front-end 1") + _titled(pgid, "shardserver: encoder 0")) == others
        for name, pid in (("front-end 0", fe), ("encoder 1", enc)):
            assert any(f"{name} (pid {pid}) missed its liveness check: no heartbeat for " in line
                       and "(server.liveness_timeout_s = 2; stopped, or its event loop blocked): killing it (SIGKILL) "
                           "and restarting it" in line for line in s.log_lines), name
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
            time.sleep(0.05)
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [9, 9, i], seq_id=i) for i in range(8)]  # both shards, a new connection each
        assert [api.post("/api/v1/retrieve_future", {"request_id": r})[0] for r in rids] == [200] * 8
        st, _, body = http_json(s.url + "/metrics")
        kills = {dict(smp.labels)["role"]: smp.value for fam in text_string_to_metric_families(body.decode())
                 for smp in fam.samples if smp.name == "shardserver_worker_hung_kills_total"}
        assert kills == {"front-end": 1.0, "encoder": 1.0}


def test_a_paused_and_resumed_process_group_keeps_its_children():
    """Found by a break test: SIGSTOP to the whole gateway for longer than
    server.liveness_timeout_s, then SIGCONT (`docker pause`, a VM stun, Ctrl-Z and `fg`), and the
    supervisor, first to run, found every child's heartbeat stale and SIGKILLed a healthy encoder,
    losing its futures in flight. Now a supervisor that itself did not run judges heartbeats from
    the resume: nothing is killed, and samples submitted before the pause complete after it."""
    env = {"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
           "SHARDSERVER_SERVER__LIVENESS_TIMEOUT_S": "2", "SHARDSERVER_SIMULATOR__LATENCY_S": "1.0"}
    with RunningServer(env=env) as s:
        pgid = s.proc.pid
        before = sorted(_group(pgid))
        api = Api(s.url)
        ssid = api.sampling_session()
        rids = [api.submit(ssid, [9, 9, i], seq_id=i) for i in range(8)]  # in the engine during the pause
        time.sleep(0.5)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            time.sleep(3.5)  # past the 2 s bound
        finally:
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(3.0)  # a bound and more after the resume: the children beat meanwhile
        assert sorted(_group(pgid)) == before, "\n".join(s.log_lines[-20:])
        assert not any("missed its liveness check" in line for line in s.log_lines), "\n".join(s.log_lines[-20:])
        assert any("the supervisor did not run for " in line and "WARNING" in line for line in s.log_lines), "\n".join(s.log_lines[-20:])
        got = [api.post("/api/v1/retrieve_future", {"request_id": r}) for r in rids]
        assert [st for st, _, _ in got] == [200] * 8, got
        assert all(len(json.loads(b)["sequences"]) == 1 for _, _, b in got), got


def test_a_run_directory_removed_by_a_tmp_cleaner_is_recreated_and_a_restarted_front_end_serves():
    """Found by a break test (stop 26): ``rm -rf`` of the run directory (what systemd-tmpfiles or
    tmpreaper do to /tmp) and then a front-end crash. The supervisor died at the restart (its
    first import of shardserver.metrics opened files in the removed directory), and once it
    survived that, the new front-end could not reach the encoders (their control sockets' paths
    were gone) and was restarted in a loop. Now the supervisor recreates the directory, the
    encoders bind their sockets again, and samples through the restarted front-end complete."""
    import glob
    import shutil

    def listeners(path: str) -> int:
        """Listening Unix sockets bound to ``path`` (/proc/net/unix; an unlinked one keeps its name)."""
        with open("/proc/net/unix") as f:
            return sum(1 for ln in f if ln.split()[-1] == path and ln.split()[3] == "00010000")

    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid = api.submit(ssid, [1, 2, 3], 0)
        assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 200
        (run_dir,) = glob.glob(f"/tmp/shardserver-run-{s.proc.pid}-*")
        sock0 = os.path.join(run_dir, "enc-0.sock")
        requests0 = metric_sum(s.url, "shardserver_http_requests_total")
        results0 = metric_sum(s.url, "shardserver_results_completed_total")
        assert requests0 >= 4 and results0 >= 1
        for _ in range(2):  # removed twice: the encoders bind again each time, one listener each
            shutil.rmtree(run_dir)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not os.path.exists(sock0):
                time.sleep(0.1)
            assert os.path.exists(sock0)
        # The counts of the processes that lived through the removals come back within their
        # upkeep round (5 s), not restarted from 0 (they went on into the unlinked files before).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
                metric_sum(s.url, "shardserver_http_requests_total") >= requests0
                and metric_sum(s.url, "shardserver_results_completed_total") >= results0):
            time.sleep(0.5)
        assert metric_sum(s.url, "shardserver_http_requests_total") >= requests0
        assert metric_sum(s.url, "shardserver_results_completed_total") >= results0
        assert listeners(sock0) == 1
        # The front-end's connections from before the removals still serve.
        rid = api.submit(ssid, [1, 2, 3, 9], 9)
        assert api.post("/api/v1/retrieve_future", {"request_id": rid})[0] == 200
        (victim,) = _titled(s.proc.pid, "shardserver: front-end 0")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        statuses = []
        for i in range(1, 5):  # each seq_id lands on one of the two shards
            st, b = None, b"(no answer: the gateway is down)"
            while time.monotonic() < deadline:
                try:
                    st, _, b = api.post("/api/v1/asample", {
                        "sampling_session_id": ssid, "seq_id": i, "prompt": {"chunks": [{"tokens": [1, 2, 3, i]}]},
                        "sampling_params": {"max_tokens": 4, "seed": 1}}, timeout=5)
                except OSError:
                    st = None  # the front-end is restarting
                if st == 200:
                    break
                time.sleep(0.2)
            assert st == 200, b
            statuses.append(api.post("/api/v1/retrieve_future", {"request_id": json.loads(b)["request_id"]})[0])
        assert statuses == [200] * 4
        assert s.proc.poll() is None  # the supervisor is alive
        assert os.path.isdir(os.path.join(run_dir, "metrics"))
        assert sorted(os.listdir(run_dir)) >= ["enc-0.sock", "enc-1.sock", "metrics"]
    assert s.proc.returncode == 0


def test_a_restarted_encoders_old_arena_is_unmapped_by_the_front_ends():
    """Found by a break test (stop 26): a front-end closed a shard's old arena reader only when it
    first read a result from the new arena, so after an encoder restart with no such read the
    unlinked arena stayed mapped and tmpfs kept its pages (6 MiB per restart there). Now the
    front-end drops readers of unlinked segments when its control connection comes back."""
    def deleted_arenas(pid: int, sup: int) -> list[str]:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({ln.split()[-2] for ln in f if f"shardserver-{sup}-" in ln and "(deleted)" in ln})

    with RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}) as s:
        api = Api(s.url)
        rid = _submit(api, [4, 4, 4], max_tokens=2048)
        assert api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})[0] == 200
        (fe,) = _titled(s.proc.pid, "shardserver: front-end 0")
        (enc,) = _titled(s.proc.pid, "shardserver: encoder 0")
        os.kill(enc, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and http_json(s.url + "/readyz")[0] != 200:
            time.sleep(0.1)
        assert http_json(s.url + "/readyz")[0] == 200
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and deleted_arenas(fe, s.proc.pid):
            time.sleep(0.1)
        assert deleted_arenas(fe, s.proc.pid) == []


def test_sigterm_before_ready_abandons_the_start_without_announcing_ready():
    """A stop signal during the start (here 0.3 s in: the workers are still importing) ends the
    start: exit 0, no "ready" line (a wrapper waiting for it would take a stopping gateway for a
    serving one), nothing left behind. Before, every worker finished starting, the gateway
    printed "shardserver ready on ..." and only then stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "shardserver.cli", "serve", "--config",
                             str(REPO / "configs" / "demo.toml"), "--host", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                            start_new_session=True)
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert proc.returncode == 0, out
    assert "shardserver ready on" not in out, out
    assert "SIGTERM arrived while starting: the start is abandoned" in out, out
    time.sleep(0.2)
    assert _group(proc.pid) == [] and _segments_of(proc.pid) == []
