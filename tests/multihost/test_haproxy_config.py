"""``shardserver haproxy-config``: the shipped configs/haproxy.cfg is its output, HAProxy accepts it,
adding a host is one line, and bad input is refused with a message naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardserver.haproxy import GatewayHost, parse_host, render_haproxy_config
from shardserver.testing import find_haproxy

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "haproxy.cfg"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardserver.cli", "haproxy-config", *args],
                          capture_output=True, text=True, timeout=30, cwd=REPO)


def test_sample_config_is_the_generators_output():
    text = SAMPLE.read_text()
    command = text.splitlines()[1].removeprefix("#   shardserver haproxy-config ").split()
    out = cli(*command)
    assert out.returncode == 0, out.stderr
    assert out.stdout == text


def test_adding_a_host_is_its_server_line_in_each_backend():
    two = [parse_host("h1=10.0.0.11:8000"), parse_host("h2=10.0.0.12:8000")]
    three = [*two, GatewayHost("h3", "10.0.0.13:8000")]

    def body(hosts: list[GatewayHost]) -> list[str]:
        return [ln for ln in render_haproxy_config(hosts).splitlines() if not ln.startswith("#")]

    a, b = body(two), body(three)
    assert len(b) == len(a) + 2
    assert [ln for ln in b if ln not in a] == ["    server h3 10.0.0.13:8000"] * 2
    # ...one in "gateways" (asample, /readyz) and one in "owners" (retrieve_future, /healthz).
    backends = [ln.split()[1] for ln in b if ln.startswith("backend ")]
    assert backends == ["gateways", "owners"]


def test_haproxy_accepts_the_generated_config(tmp_path):
    path, why = find_haproxy()
    if path is None:
        import os

        if os.environ.get("SHARDSERVER_OLD_SDKS_REQUIRED"):
            pytest.fail(f"{why}; make test requires it")
        pytest.skip(why)
    for hosts in (["h1=127.0.0.2:8000"], ["a=10.1.2.3:9000", "b7=localhost:8000", "c=[::1]:8001"]):
        out = cli(*[x for h in hosts for x in ("--host", h)], "--check-interval-ms", "500", "--bind", "127.0.0.1:9999")
        assert out.returncode == 0, out.stderr
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(out.stdout)
        check = subprocess.run([path, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "inter 500ms" in out.stdout and "bind 127.0.0.1:9999" in out.stdout


@pytest.mark.parametrize("args,message", [
    ([], "--host"),
    (["--host", "h1"], "HOST_ID=HOST:PORT"),
    (["--host", "H1=10.0.0.1:8000"], "host id 'H1'"),
    (["--host", "h-1=10.0.0.1:8000"], "host id 'h-1'"),
    (["--host", "h1=10.0.0.1"], "address of host h1"),
    (["--host", "h1=10.0.0.1:0"], "address of host h1"),
    (["--host", "h1=10.0.0.1:8000", "--host", "h1=10.0.0.2:8000"], "given twice"),
    (["--host", "h1=10.0.0.1:8000", "--check-interval-ms", "5"], "--check-interval-ms"),
    (["--host", "h1=10.0.0.1:8000", "--bind", "8080"], "--bind"),
])
def test_bad_input_is_refused(args, message):
    out = cli(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert message in out.stderr


@pytest.mark.timeout(60)
def test_no_host_up_polls_answer_410_and_submits_503(tmp_path):
    """Every host down: polls get 410 from HAProxy itself (the SDK resubmits, its asample retries
    back off on 503) instead of 503s that the SDK would re-poll at once, forever."""
    import json

    from shardserver.testing import RunningHaproxy, free_port, http_json

    path, why = find_haproxy()
    if path is None:
        import os

        if os.environ.get("SHARDSERVER_OLD_SDKS_REQUIRED"):
            pytest.fail(f"{why}; make test requires it")
        pytest.skip(why)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with RunningHaproxy([("h1", dead)], tmp_path, path, check_interval_ms=200, wait_all_up=False) as hp:
        hp.wait_state("h1", "DOWN", 10, backend="owners")
        hp.wait_state("h1", "DOWN", 10, backend="gateways")
        st, hdr, body = http_json(hp.url + "/api/v1/retrieve_future", {"request_id": "f0a1b2c3d-h1-" + "ab" * 16
                                                                        + "-" + "cd" * 8})
        assert st == 410 and hdr["content-type"] == "application/json", body
        assert json.loads(body) == {"error": "no gateway host is up; resubmit"}
        st, _, body = http_json(hp.url + "/api/v1/asample", {"sampling_session_id": "x"})
        assert st == 503, body
