"""Checks the supervisor makes at start (issue 11): the ID signing secret (item 1), the file
descriptor limit (item 6), shared-memory space (item 10) and the listen backlog (item 11)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from shardserver.errors import ConfigError
from shardserver.shm.arena import unlink_segment
from shardserver.testing import REPO, our_shm_segments

API_KEY = "tml-startup-check-key-0123456789"


def _serve(config: str, env: dict[str, str], timeout: float = 30) -> tuple[int, int | None, str]:
    """``shardserver serve`` that is expected to stop during its start: (pid, exit code, stderr).
    A server that starts instead is killed (with its process group) after ``timeout`` s and gives
    exit code None."""
    proc = subprocess.Popen([sys.executable, "-m", "shardserver.cli", "serve", "--config",
                             str(REPO / "configs" / config), "--host", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                            env={**os.environ, **env}, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.pid, proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        for name in our_shm_segments():
            if name.startswith(f"shardserver-{proc.pid}-"):
                unlink_segment(name)
        return proc.pid, None, err


# -- item 1: the ID signing secret --------------------------------------------------------------
def test_id_secret_is_created_once_with_mode_600_and_read_back(tmp_path):
    from shardserver.ids import IdSigner, load_id_secret

    state = tmp_path / "state" / "shardserver"
    first = load_id_secret("", str(state), require_persistent=False)
    assert first.persistent and first.created and first.source == str(state / "id_secret")
    assert oct((state / "id_secret").stat().st_mode & 0o777) == "0o600"
    assert oct(state.stat().st_mode & 0o777) == "0o700"
    assert first.secret == (state / "id_secret").read_bytes().strip() and len(first.secret) == 64
    again = load_id_secret("", str(state), require_persistent=True)
    assert again.secret == first.secret and not again.created and again.warnings == ()
    assert os.listdir(state) == ["id_secret"]  # no temporary file left
    # Same secret, new run: a session ID of the first run is valid in the second.
    sid = IdSigner(first.secret, "0000aaaa").mint_session_id()
    assert IdSigner(again.secret, "1111bbbb").check_session_id(sid)


def test_id_secret_from_the_config_wins(tmp_path):
    from shardserver.ids import load_id_secret

    got = load_id_secret("hunter2-but-longer", str(tmp_path), require_persistent=True)
    assert got.secret == b"hunter2-but-longer" and got.source == "server.id_secret" and got.persistent
    assert os.listdir(tmp_path) == []


def test_unusable_state_dir_warns_by_default_and_is_an_error_when_required(tmp_path):
    from shardserver.ids import load_id_secret

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    state = str(blocker / "shardserver")  # a directory under a regular file: ENOTDIR
    got = load_id_secret("", state, require_persistent=False)
    assert not got.persistent and got.source == "random" and len(got.secret) == 32
    assert len(got.warnings) == 1 and "will not survive a restart" in got.warnings[0]
    assert f"cannot read or create the ID signing secret {state}/id_secret: Not a directory" in got.warnings[0]
    with pytest.raises(ConfigError) as exc:
        load_id_secret("", state, require_persistent=True)
    assert exc.value.key == "server.state_dir"
    assert "server.require_persistent_secret = true" in exc.value.reason


def test_short_or_group_readable_secret_file(tmp_path):
    from shardserver.ids import load_id_secret

    (tmp_path / "id_secret").write_text("short\n")
    with pytest.raises(ConfigError) as exc:
        load_id_secret("", str(tmp_path), require_persistent=False)
    assert "holds 5 characters; it needs at least 16" in exc.value.reason
    (tmp_path / "id_secret").write_text("0123456789abcdef0123\n")
    os.chmod(tmp_path / "id_secret", 0o644)
    got = load_id_secret("", str(tmp_path), require_persistent=True)
    assert got.secret == b"0123456789abcdef0123" and got.persistent
    assert got.warnings == (f"the ID signing secret {tmp_path}/id_secret is readable by group or others "
                            "(mode 644): chmod 600 it",)


def test_production_config_without_a_usable_secret_does_not_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _, code, err = _serve("production.toml", {"SHARDSERVER_ENGINE__URL": "", "SHARDSERVER_AUTH__KEYS_FILE": "",
                                              "SHARDSERVER_API_KEYS": API_KEY,
                                              "SHARDSERVER_SERVER__STATE_DIR": str(blocker / "state")})
    assert code == 2, err
    assert ("shardserver: invalid configuration: config key 'server.state_dir': cannot read or create the ID "
            f"signing secret {blocker}/state/id_secret: Not a directory (server.require_persistent_secret = true"
            in err)
    assert "Traceback" not in err


# -- item 6: open file limit ---------------------------------------------------------------------
def _soft_nofile(pid: int) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_supervisor_raises_the_soft_open_file_limit_to_the_hard_limit():
    """Started with `ulimit -n 512`, the supervisor and every child run with soft = hard limit,
    and one log line gives both numbers."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 512:
        pytest.skip(f"needs a finite hard RLIMIT_NOFILE above 512 (have {hard})")
    from shardserver.testing import RunningServer

    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # inherited by the server started now
    try:
        s = RunningServer(env={"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
                               "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 * 1024 * 1024)}).__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == s.proc.pid]
        assert len(pids) >= 5  # supervisor, encoder, front-end, simulator, resource tracker
        assert {_soft_nofile(p) for p in pids} == {(hard, hard)}
    finally:
        s.stop()
    assert f"RLIMIT_NOFILE (open files): soft limit raised from 512 to {hard} (hard limit {hard})" in \
        "\n".join(s.log_lines)


def _pgid(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[2])
    except OSError:
        return -1


# -- item 10: shared memory --------------------------------------------------------------------
def test_check_shm_space_counts_every_arena(tmp_path):
    from shardserver.shm.arena import SUPERBLOCK, check_shm_space, shm_free_bytes

    free, size = shm_free_bytes(str(tmp_path))
    st = os.statvfs(tmp_path)
    assert (free, size) == (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
    arena = 1024 * 1024
    assert check_shm_space(3, arena, str(tmp_path))[0] == 3 * (arena + SUPERBLOCK)
    too_big = free // 2 + 1
    with pytest.raises(ConfigError) as exc:
        check_shm_space(2, too_big, str(tmp_path))
    assert exc.value.key == "shards.arena_bytes"
    assert f"shards.count x shards.arena_bytes = 2 x {too_big} = {2 * (too_big + SUPERBLOCK)} bytes" in exc.value.reason
    assert f"but {tmp_path} has only " in exc.value.reason and f"free of {size} (" in exc.value.reason
    assert "Lower shards.arena_bytes or shards.count, or enlarge" in exc.value.reason


def test_arenas_larger_than_dev_shm_stop_the_start():
    """Two arenas that together exceed the free space of /dev/shm: exit code 2 with the numbers
    and the fix, before any segment or child is created (it used to start, then its encoders
    died of SIGBUS when results filled the pages that did not exist)."""
    st = os.statvfs("/dev/shm")
    arena = st.f_bavail * st.f_frsize // 2 + 64 * 1024 * 1024
    pid, code, err = _serve("demo.toml", {"SHARDSERVER_SHARDS__COUNT": "2",
                                          "SHARDSERVER_SHARDS__ARENA_BYTES": str(arena)})
    assert code == 2, err[-3000:]
    assert (f"shardserver: invalid configuration: config key 'shards.arena_bytes': the arenas need "
            f"shards.count x shards.arena_bytes = 2 x {arena} = {2 * (arena + 64)} bytes") in err
    assert "but /dev/shm has only " in err and "enlarge /dev/shm" in err
    assert "Traceback" not in err
    assert "encoder 0" not in err and not [n for n in our_shm_segments() if n.startswith(f"shardserver-{pid}-")]


# -- item 11: listen backlog ---------------------------------------------------------------------
def test_backlog_above_somaxconn_is_logged_with_both_numbers():
    from shardserver.testing import RunningServer

    cap = int(open("/proc/sys/net/core/somaxconn").read())
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 * 1024 * 1024), "SHARDSERVER_SERVER__BACKLOG": str(cap + 1000)}
    with RunningServer(env=env) as s:
        pass
    warned = [line for line in s.log_lines if "net.core.somaxconn" in line]
    assert len(warned) == 1, s.log_lines
    assert (f"WARNING shardserver.supervisor[{s.proc.pid}]: server.backlog = {cap + 1000} is above "
            f"net.core.somaxconn = {cap}: the kernel caps the listen backlog at {cap} "
            f"(raise it with: sysctl -w net.core.somaxconn={cap + 1000})") in warned[0]


# -- the session-wide poller needs its journals ---------------------------------------------------
def test_poller_is_turned_off_for_the_run_when_its_journals_cannot_be_kept(tmp_path):
    """``futures.retrieve_futures`` is on by default, but a poller-mode SDK learns of a future only
    from the server: without the journals (``<server.state_dir>/futures``) the futures in flight
    at a restart would never be reported and their samples would wait forever. A state directory
    whose ``futures`` entry is a plain file stops the announcement for the run, with a WARNING;
    SDKs then poll ``retrieve_future`` (410 for a lost future); the endpoint is still served."""
    import json

    from shardserver.testing import RunningServer, http_json

    state = tmp_path / "state"
    state.mkdir()
    (state / "futures").write_text("not a directory")
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 * 1024 * 1024), "SHARDSERVER_SERVER__STATE_DIR": str(state)}
    with RunningServer(env=env) as s:
        st, _, b = http_json(s.url + "/api/v1/client/config", {"sdk_version": "0.38.0"})
        assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False})
        st, _, b = http_json(s.url + "/api/v1/retrieve_futures", {"target": {"sampling_session_id": "x"},
                                                                  "prev_cursor": 0})
        # Not announced; still served (this session is unknown, not the endpoint).
        assert (st, json.loads(b)["error"][:32]) == (404, "unknown sampling_session_id (ses")
    warned = [line for line in s.log_lines if "the session-wide poller is not announced" in line]
    assert len(warned) == 1, s.log_lines
    assert (f"WARNING shardserver.supervisor[{s.proc.pid}]: the session-wide poller is not announced this run "
            f"(futures.retrieve_futures): the futures journals cannot be kept (cannot create {state}/futures: File "
            f"exists); new SDKs poll each sample with retrieve_future. Set server.state_dir to a writable "
            f"directory") in warned[0]
    # The same state directory with a real futures directory: the poller is announced.
    (state / "futures").unlink()
    with RunningServer(env=env) as s:
        st, _, b = http_json(s.url + "/api/v1/client/config", {"sdk_version": "0.38.0"})
        assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": True})
    assert not any("poller is not announced" in line for line in s.log_lines)


def test_pending_ttl_below_the_engine_timeout_is_logged_with_both_numbers():
    """A future expires (410) after ``futures.pending_ttl_s`` even while the engine runs it, and the
    SDK resubmits: with the TTL below ``engine.max_request_s`` (how long a call on a live engine is
    awaited) a slow or long-queued sample is resubmitted forever."""
    from shardserver.testing import RunningServer

    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 * 1024 * 1024), "SHARDSERVER_FUTURES__PENDING_TTL_S": "60",
           "SHARDSERVER_ENGINE__TIMEOUT_S": "100", "SHARDSERVER_ENGINE__MAX_REQUEST_S": "120"}
    with RunningServer(env=env) as s:
        pass
    warned = [line for line in s.log_lines if "futures.pending_ttl_s" in line]
    assert len(warned) == 1, s.log_lines
    assert (f"WARNING shardserver.supervisor[{s.proc.pid}]: futures.pending_ttl_s = 60 s is below engine.max_request_s "
            f"= 120 s: a sample the engine takes longer than 60 s for expires (410) and the SDK resubmits it, again "
            f"each time; raise futures.pending_ttl_s above engine.max_request_s") in warned[0]
    # The shipped defaults (18000 s and 14400 s) say nothing.
    with RunningServer(env={k: v for k, v in env.items() if "TTL" not in k and "__MAX_REQ" not in k
                            and "TIMEOUT" not in k}) as s:
        pass
    assert not any("futures.pending_ttl_s" in line for line in s.log_lines)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) for a private tmpfs on /dev/shm")
def test_dev_shm_filled_after_the_start_answers_410_then_429_and_no_encoder_dies():
    """Another program fills ``/dev/shm`` after the start (the arenas are sparse, checked only at
    start). Before: the encoder writing a result into a page tmpfs could not back died of SIGBUS,
    was restarted, died again (16 restarts in 40 s, every future lost). Now the pages are taken
    with ``posix_fallocate`` before the result is written: the future answers 410 ("... /dev/shm
    is full; resubmit"), new samples 429 while it stays full, an ERROR line, no encoder dies; once
    the space is back a sample completes. Two samples are pending when it fills, so the second's
    slot lies on pages never backed: freeing it must not write there either (break tester round
    2, F3: it did, SIGBUS). Runs in a private mount namespace whose ``/dev/shm`` is
    a 64 MiB tmpfs (``tests/e2e/shm_full_child.py``)."""
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_full_child.py")
    cmd = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {child}"
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                          text=True, timeout=100, cwd=str(REPO))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    seen = json.loads(line[len("RESULT "):])
    assert seen["first_asample"] == [200, 200]
    for st, body in seen["first_retrieve"]:  # (the second one's slot header lies on a page never backed)
        assert st == 410 and re.fullmatch(r"future could not be stored \(/dev/shm has no room for the \d+ bytes of "
                                          r"a result in arena shardserver-\d+-\w+-a0\.0\); resubmit",
                                          body["error"]), body
    st, body = seen["while_full"]
    assert st == 429 and body["error"].startswith("/dev/shm is full (") \
        and "shard 0 cannot store results; retry later" in body["error"], body
    assert seen["after"] == 200 and seen["after_retrieve"][0] == 200 and seen["after_retrieve"][1] > 30000
    errors = seen["lines"]  # (a second line, 10 s on, would fold the later events into a count)
    assert errors and all("ERROR" in ln and "encoder 0: /dev/shm has no room for the " in ln
                          and "/dev/shm is full" in ln for ln in errors), errors
