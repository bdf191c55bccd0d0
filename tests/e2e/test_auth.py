"""API keys: loading, masking, 401s, and IDs bound to the key that created them."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from conftest import BASE_MODEL, Api
from shardserver.api.auth import (
    INVALID_KEY_MESSAGE,
    MISSING_KEY_MESSAGE,
    load_key_table,
    owner_fingerprint,
)
from shardserver.config import AuthConfig, config_from_mapping
from shardserver.errors import ConfigError
from shardserver.testing import REPO, RunningServer, http_json, metric_sum

pytestmark = pytest.mark.timeout(120)

KEY_A = "tml-alpha-0123456789abcdefghij"
KEY_B = "tml-bravo-0123456789abcdefghij"
KEY_C = "tml-charlie-0123456789abcdefgh"


# -- loading -----------------------------------------------------------------------------------
def test_keys_from_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# production keys\n\n{KEY_A}\n   {KEY_B}   # team b\n#{KEY_C}\n")
    table = load_key_table(AuthConfig(mode="keys", keys_file=str(f), keys_env="MY_KEYS"),
                           env={"MY_KEYS": f" {KEY_C} ,, {KEY_A}"})
    assert len(table) == 3 and table.sources == (str(f), "$MY_KEYS")
    assert table.owner(KEY_A) == owner_fingerprint(KEY_A) and len(table.owner(KEY_A)) == 16
    assert table.owner(KEY_B) == owner_fingerprint(KEY_B) != table.owner(KEY_A)
    assert table.owner(KEY_C) == owner_fingerprint(KEY_C)
    assert table.owner(KEY_A + "x") is None
    assert table.owner("") is None and table.owner(None) is None
    # Spawned children get a pickled copy that answers the same; it never shows its digests.
    clone = pickle.loads(pickle.dumps(table))
    assert clone.owner(KEY_B) == owner_fingerprint(KEY_B)
    assert repr(table) == f"KeyTable(mode='keys', keys=3, sources=({str(f)!r}, '$MY_KEYS'))"
    assert KEY_A not in repr(table.__dict__) and KEY_A.encode() not in pickle.dumps(table)


def test_keys_file_saved_by_a_windows_editor_loads(tmp_path):
    """A keys file with a UTF-8 byte-order mark and CRLF line ends (Notepad) gives its keys.
    Before: 'line 1: an API key must start with 'tml-'' (the BOM was part of the first key)."""
    f = tmp_path / "keys"
    f.write_bytes(f"\ufeff{KEY_A}\r\n# b\r\n{KEY_B}\r\n".encode("utf-8"))
    table = load_key_table(AuthConfig(mode="keys", keys_file=str(f)), env={})
    assert len(table) == 2 and table.owner(KEY_A) == owner_fingerprint(KEY_A)
    assert table.owner(KEY_B) == owner_fingerprint(KEY_B)


def test_open_mode_reads_nothing_and_accepts_everything(tmp_path):
    table = load_key_table(AuthConfig(mode="open", keys_file=str(tmp_path / "missing")), env={})
    assert table.mode == "open" and len(table) == 0
    assert table.owner(None) == "" and table.owner("tml-anything") == "" and table.owner("x") == ""


@pytest.mark.parametrize("text,env,key,reason", [
    (None, {}, "auth.keys_file", 'auth.mode = "keys" but no API key is configured (no file is set; '
                                 "$SHARDSERVER_API_KEYS is unset or empty)"),
    ("# nothing yet\n", {"SHARDSERVER_API_KEYS": " , "}, "auth.keys_file",
     "has no keys; $SHARDSERVER_API_KEYS is unset or empty)"),
    ("tml-short\n", {}, "auth.keys_file", "line 1: an API key needs at least 16 characters after 'tml-'"),
    (f"# c\n{KEY_A[4:]}\n", {}, "auth.keys_file", "line 2: an API key must start with 'tml-'"),
    (None, {"SHARDSERVER_API_KEYS": f"{KEY_A},sk-0123456789abcdefghijkl"}, "auth.keys_env",
     "$SHARDSERVER_API_KEYS entry 2: an API key must start with 'tml-'"),
    # An X-API-Key header carries ASCII: the SDK (httpx) cannot send this key, and raw UTF-8 bytes
    # never match it. Before: loaded, and every request with it answered 401.
    (f"{KEY_A}\ntml-schl\u00fcssel-0123456789abcdef\n", {}, "auth.keys_file",
     "line 2: an API key must be printable ASCII (it travels in the X-API-Key header"),
    (None, {"SHARDSERVER_API_KEYS": "tml-0123456789abcdef\x01"}, "auth.keys_env",
     "$SHARDSERVER_API_KEYS entry 1: an API key must be printable ASCII"),
])
def test_bad_keys_fail_with_the_key_and_never_echo_it(tmp_path, text, env, key, reason):
    f = tmp_path / "keys"
    if text is not None:
        f.write_text(text)
    cfg = AuthConfig(mode="keys", keys_file=str(f) if text is not None else "")
    with pytest.raises(ConfigError) as ei:
        load_key_table(cfg, env=env)
    assert ei.value.key == key and reason in ei.value.reason
    assert "sk-0123" not in str(ei.value) and "tml-short" not in str(ei.value) and KEY_A[4:] not in str(ei.value)


def test_missing_keys_file_and_a_key_in_keys_env(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_key_table(AuthConfig(mode="keys", keys_file=str(tmp_path / "nope")), env={})
    assert (ei.value.key, ei.value.reason) == ("auth.keys_file", f"file {str(tmp_path / 'nope')!r} does not exist")
    with pytest.raises(ConfigError) as ei:
        config_from_mapping({"auth": {"mode": "keys", "keys_env": KEY_A}}, env={})
    assert ei.value.key == "auth.keys_env" and KEY_A not in str(ei.value)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserver.cli", *args], capture_output=True, text=True,
                          timeout=30, cwd=str(REPO), env={**os.environ, **env})


def test_config_show_masks_secrets_and_counts_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{KEY_A}\n")
    env = {"SHARDSERVER_AUTH__MODE": "keys", "SHARDSERVER_AUTH__KEYS_FILE": str(f), "SHARDSERVER_API_KEYS": KEY_B,
           "SHARDSERVER_SERVER__ID_SECRET": "hunter2", "SHARDSERVER_ENGINE__URL": "http://bob:pw@10.0.0.5:8000",
           "SHARDSERVER_SIMULATOR__MODEL_NAME": "tml-looks-like-a-key-0123456789"}
    proc = _cli("config", "--show", "--config", str(REPO / "configs" / "demo.toml"), env=env)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["auth"] == {"mode": "keys", "keys_file": str(f), "keys_env": "SHARDSERVER_API_KEYS",
                             "key_share": 0.0, "keys_loaded": 2}
    assert shown["server"]["id_secret"] == "***"
    assert shown["engine"]["url"] == "http://***@10.0.0.5:8000"
    assert shown["simulator"]["model_name"] == "***"
    for secret in (KEY_A, KEY_B, "hunter2", "bob:pw", "tml-looks"):
        assert secret not in proc.stdout + proc.stderr


def test_keys_mode_without_keys_stops_serve_and_config_show():
    env = {"SHARDSERVER_AUTH__MODE": "keys", "SHARDSERVER_API_KEYS": ""}
    for args in (("serve", "--port", "0"), ("config", "--show")):
        proc = _cli(*args, "--config", str(REPO / "configs" / "demo.toml"), env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert ("shardserver: invalid configuration: config key 'auth.keys_file': auth.mode = \"keys\" but no "
                "API key is configured (no file is set; $SHARDSERVER_API_KEYS is unset or empty)") in proc.stderr


# -- a gateway in keys mode --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    f = tmp_path_factory.mktemp("auth") / "api_keys"
    f.write_text(f"# keys of the test\n{KEY_A}\n")
    f.chmod(0o600)
    env = {"SHARDSERVER_AUTH__MODE": "keys", "SHARDSERVER_AUTH__KEYS_FILE": str(f),
           "SHARDSERVER_API_KEYS": KEY_B, "SHARDSERVER_SHARDS__COUNT": "2", "SHARDSERVER_SERVER__FRONT_ENDS": "2",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 * 1024 * 1024)}
    with RunningServer(env=env) as s:
        yield s
    assert s.proc is not None and s.proc.returncode == 0
    assert not any(KEY_A in line or KEY_B in line for line in s.log_lines), "an API key was logged"
    assert any("auth: 2 API keys loaded from" in line for line in s.log_lines)


class KeyApi(Api):
    def __init__(self, url: str, key: str | None) -> None:
        super().__init__(url)
        self.key = key

    def post(self, path, body, headers=None, timeout=40.0):
        h = dict(headers or {})
        if self.key is not None:
            h["X-API-Key"] = self.key
        return super().post(path, body, headers=h, timeout=timeout)


def _sample(api: KeyApi, ssid: str, seq: int = 0) -> str:
    st, _, b = api.post("/api/v1/asample", {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
                                            "prompt": {"chunks": [{"tokens": [11, 12, 13]}]},
                                            "sampling_params": {"max_tokens": 4, "seed": 5}})
    assert st == 200, b
    return json.loads(b)["request_id"]


def test_missing_or_wrong_key_is_401(keyed):
    for key, message in ((None, MISSING_KEY_MESSAGE), ("", MISSING_KEY_MESSAGE), (KEY_C, INVALID_KEY_MESSAGE),
                         ("tml-not-a-configured-key-at-all", INVALID_KEY_MESSAGE)):
        api = KeyApi(keyed.url, key)
        for path, body in (("/api/v1/client/config", {"sdk_version": "0.38.0"}),
                           ("/api/v1/create_session", {"tags": []}), ("/api/v1/retrieve_future", {"request_id": "x"}),
                           ("/api/v1/no_such_endpoint", {}), ("/stats", None)):
            st, h, b = api.post(path, body)
            assert (st, json.loads(b)) == (401, {"error": message}), (key, path)
            assert h["content-type"] == "application/json"
            assert h["www-authenticate"] == 'ApiKey header="X-API-Key"'


def test_probes_and_metrics_need_no_key(keyed):
    for path in ("/healthz", "/readyz", "/metrics"):
        st, _, _ = http_json(keyed.url + path)
        assert st == 200, path
    st, _, b = http_json(keyed.url + "/readyz")
    # The embedded simulator reports its context window in GET /v1/models (issue 10).
    assert json.loads(b) == {"status": "ready", "encoders": 2, "max_model_len": {"Qwen/Qwen3-8B": 65536}}


def test_each_configured_key_works(keyed):
    for key in (KEY_A, KEY_B):
        api = KeyApi(keyed.url, key)
        st, _, b = api.post("/api/v1/client/config", {"sdk_version": "0.38.0"})
        assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": True})
        rid = _sample(api, api.sampling_session())
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 200


def test_ids_are_bound_to_the_key_that_created_them(keyed):
    a, b = KeyApi(keyed.url, KEY_A), KeyApi(keyed.url, KEY_B)
    st, _, body = a.post("/api/v1/create_session", {"tags": []})
    sid = json.loads(body)["session_id"]
    st, _, body = a.post("/api/v1/create_sampling_session", {"session_id": sid, "base_model": BASE_MODEL})
    ssid = json.loads(body)["sampling_session_id"]
    rid = _sample(a, ssid)

    # Another key: every ID of A's is unknown, answered exactly as an ID never issued.
    st, _, body = b.post("/api/v1/session_heartbeat", {"session_id": sid})
    assert (st, json.loads(body)) == (404, {"error": "unknown session_id"})
    st, _, body = b.post("/api/v1/create_sampling_session", {"session_id": sid, "base_model": BASE_MODEL})
    assert (st, json.loads(body)) == (404, {"error": f"unknown session_id {sid[:64]!r} (create_session first)"})
    st, _, body = b.post(f"/api/v1/samplers/{ssid}", None)
    assert (st, json.loads(body)) == (404, {"error": "unknown sampler id"})
    st, _, body = b.post("/api/v1/asample", {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 1,
                                             "prompt": {"chunks": [{"tokens": [11, 12, 13]}]},
                                             "sampling_params": {"max_tokens": 4, "seed": 5}})
    assert st == 404 and json.loads(body)["error"].startswith("unknown sampling_session_id")
    st_b, _, body_b = b.post("/api/v1/retrieve_future", {"request_id": rid})
    forged = rid[:-16] + ("0" * 16 if rid[-16:] != "0" * 16 else "1" * 16)
    st_f, _, body_f = b.post("/api/v1/retrieve_future", {"request_id": forged})
    assert st_b == st_f == 404
    assert json.loads(body_b) == {"error": f"unknown future {rid!r}: this server never issued it"}
    assert body_b == body_f.replace(forged.encode(), rid.encode())

    # The owner still gets everything (B's attempts changed nothing).
    st, _, body = a.post("/api/v1/session_heartbeat", {"session_id": sid})
    assert (st, json.loads(body)) == (200, {"type": "session_heartbeat"})
    st, _, body = a.post(f"/api/v1/samplers/{ssid}", None)
    assert st == 200
    st, h, body = a.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
    assert st == 200 and h["content-type"] == "application/x-protobuf"
    # Resubmitting (ssid, seq) under A dedupes to the same future.
    assert _sample(a, ssid) == rid


def test_401s_are_counted(keyed):
    before = metric_sum(keyed.url, "shardserver_auth_rejected_total", reason="invalid")
    st, _, _ = KeyApi(keyed.url, KEY_C).post("/api/v1/create_session", {"tags": []})
    assert st == 401
    assert metric_sum(keyed.url, "shardserver_auth_rejected_total", reason="invalid") == before + 1


@pytest.mark.sdk
def test_sdk_wrong_key_is_authentication_error_right_key_samples(keyed):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    # 0.38 fetches /client/config in the background: the 401 surfaces on the first call.
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        tinker.ServiceClient(base_url=keyed.url, api_key=KEY_C).create_sampling_client(
            base_model=BASE_MODEL).result(60)
    service = tinker.ServiceClient(base_url=keyed.url, api_key=KEY_B)
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result(60)
    resp = sampler.sample(prompt=types.ModelInput.from_ints([21, 22, 23]), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=5, seed=9)).result(60)
    assert len(resp.sequences) == 1 and len(resp.sequences[0].tokens) == 5
