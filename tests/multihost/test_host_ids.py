"""The owner in the future ID: server.host_id, its fixed position, the MAC over it, 410 vs 404.

Unit level (IdSigner, config) plus two real gateways sharing one id_secret on loopback: a poll
for the other host's future (valid MAC) is 410, never 404; a poll whose host part was edited is
404 on every host; sessions minted on one host serve on the other.
"""

from __future__ import annotations

import json

import pytest

from conftest import BASE_MODEL, Api
from shardserver.config import config_from_mapping
from shardserver.errors import ConfigError
from shardserver.ids import FutureIdStatus, IdSigner, future_host, shard_of
from shardserver.testing import RunningServer, http_json

SECRET = b"shared-secret-of-all-hosts"


def _edit_host(fid: str, host: str) -> str:
    parts = fid.split("-")
    parts[1] = host
    return "-".join(parts)


def test_host_id_is_the_second_field_and_covered_by_the_mac():
    h1, h2 = IdSigner(SECRET, "0a1b2c3d", "h1"), IdSigner(SECRET, "99999999", "h2")
    for shard in range(3):
        fid = h1.mint_future_id(shard, 3, owner="key-a")
        run, host, rnd, mac = fid.split("-")
        assert (run, host, len(rnd), len(mac)) == ("f0a1b2c3d", "h1", 32, 16)
        assert future_host(fid) == "h1"
        assert shard_of(fid, 3) == shard
        assert h1.check_future_id(fid, "key-a") == FutureIdStatus.OK
        # Another host with the shared secret: 410 material, whatever its run.
        assert h2.check_future_id(fid, "key-a") == FutureIdStatus.FOREIGN_HOST
        # Another API key's ID stays unknown everywhere (404).
        assert h1.check_future_id(fid, "key-b") == FutureIdStatus.INVALID
        assert h2.check_future_id(fid, "key-b") == FutureIdStatus.INVALID
        # A client that rewrites the host part to send the poll elsewhere breaks the MAC: no host
        # serves it. The issuing host answers 404; the host it now names sees another run's ID
        # (whose secret it cannot know in general) and answers 410, as for any earlier run.
        edited = _edit_host(fid, "h2")
        assert h1.check_future_id(edited, "key-a") == FutureIdStatus.INVALID
        assert h2.check_future_id(edited, "key-a") == FutureIdStatus.FOREIGN_RUN
        assert IdSigner(SECRET, "77777777", "h3").check_future_id(edited, "key-a") == FutureIdStatus.INVALID
    # Without the shared secret a foreign host cannot vouch for the ID: 404, not 410.
    assert IdSigner(b"other", "99999999", "h2").check_future_id(h1.mint_future_id(0, 1)) == FutureIdStatus.INVALID
    # An earlier run of the same host: 410 as before (that run's secret may have been random).
    assert IdSigner(b"other", "12345678", "h1").check_future_id(h1.mint_future_id(0, 1)) == FutureIdStatus.FOREIGN_RUN
    # IDs minted before host ids existed (f<run>-<random>-<mac>) are from an earlier run: 410.
    assert h1.check_future_id("f0a1b2c3d-" + "ab" * 16 + "-" + "cd" * 8) == FutureIdStatus.FOREIGN_RUN
    for bad in ("f0a1b2c3d-H1-" + "ab" * 16 + "-" + "cd" * 8, "f0a1b2c3d--" + "ab" * 16 + "-" + "cd" * 8,
                "f0a1b2c3d-" + "x" * 17 + "-" + "ab" * 16 + "-" + "cd" * 8):
        assert h1.check_future_id(bad) == FutureIdStatus.INVALID


def test_host_id_config_is_validated():
    assert config_from_mapping({}, env={}).server.host_id == "h0"
    assert config_from_mapping({"server": {"host_id": "gw07"}}, env={}).server.host_id == "gw07"
    assert config_from_mapping({}, env={"SHARDSERVER_SERVER__HOST_ID": "b2"}).server.host_id == "b2"
    for bad in ("", "H1", "h-1", "h_1", "a" * 17, "h1 "):
        with pytest.raises(ConfigError) as ei:
            config_from_mapping({"server": {"host_id": bad}}, env={})
        assert ei.value.key == "server.host_id"
    with pytest.raises(ValueError):
        IdSigner(SECRET, "0a1b2c3d", "H1")


def _host_env(host_id: str) -> dict[str, str]:
    return {"SHARDSERVER_SERVER__HOST_ID": host_id, "SHARDSERVER_SERVER__ID_SECRET": SECRET.decode(),
            "SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
            "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 * 1024 * 1024)}


@pytest.mark.timeout(90)
def test_two_hosts_410_for_the_other_hosts_future_404_for_an_edited_one():
    with RunningServer(env=_host_env("ha")) as a, RunningServer(env=_host_env("hb")) as b:
        api_a, api_b = Api(a.url), Api(b.url)
        # A session minted on host a serves on host b (shared id_secret).
        ssid = api_a.sampling_session()
        fid = api_b.submit(ssid, [5, 6, 7], seq_id=1)
        assert future_host(fid) == "hb"
        st, hdr, body = api_b.post("/api/v1/retrieve_future", {"request_id": fid})
        assert st == 200 and hdr["x-shardserver-host"] == "hb", body
        # The same ID polled on host a: 410 (the SDK resubmits there), counted as another host's.
        st, hdr, body = api_a.post("/api/v1/retrieve_future", {"request_id": fid})
        assert (st, hdr["x-shardserver-host"]) == (410, "ha"), body
        assert "another gateway host" in json.loads(body)["error"]
        assert a.stats()["counters"].get("retrieve_410_other_host") == 1
        # cancel_future on the wrong host is refused the same way (nothing reaches its shards).
        st, _, body = api_a.post("/api/v1/cancel_future", {"request_id": fid})
        assert st == 410 and "another gateway host" in json.loads(body)["error"], body
        assert a.stats()["counters"].get("cancel_410_other_host") == 1
        # Editing the host part does not get the result served anywhere: host b (the issuer)
        # answers 404; host a, now named, sees an ID of another run and answers 410.
        edited = _edit_host(fid, "ha")
        st, _, body = api_b.post("/api/v1/retrieve_future", {"request_id": edited})
        assert st == 404, body
        st, _, body = api_a.post("/api/v1/retrieve_future", {"request_id": edited})
        assert st == 410 and "earlier run" in json.loads(body)["error"], body
        # /readyz names the host: what HAProxy's health check compares with its server name.
        st, hdr, body = http_json(a.url + "/readyz")
        assert st == 200 and hdr["x-shardserver-host"] == "ha"
        st, _, body = api_b.post("/api/v1/create_sampling_session",
                                 {"session_id": "s-forged.000", "base_model": BASE_MODEL})
        assert st == 404
