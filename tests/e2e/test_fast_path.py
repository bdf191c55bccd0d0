"""The fast path of POST /api/v1/asample and /api/v1/retrieve_future (issue 12 item 2) answers
byte for byte what FastAPI's routing answered.

Two real gateways in keys mode, one with ``server.fast_path = false`` (every request through
FastAPI, as before the change) and one with it on, get the same requests on raw sockets: 200s,
400s (bad JSON, bad fields, refused prompts), 404, 410 (a future of the other gateway's run),
408 (pending), 413, 401 (missing and wrong key), 405. The raw responses must be equal except
the Date header and the IDs each run signs (same length; replaced by placeholders).
"""

from __future__ import annotations

import json
import socket
import time

from conftest import BASE_MODEL
from shardserver.testing import RunningServer

KEY = "tml-fastpath-test-key-0123456789abcdef"
OTHER_KEY = "tml-fastpath-test-key-fedcba9876543210"


def _raw(port: int, path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> bytes:
    """One request on a fresh connection (Connection: close); the whole raw response."""
    h = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
         "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head.encode() + body)
        chunks = []
        for _ in range(100_000):  # bounded: ends at EOF
            c = s.recv(1 << 16)
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def _body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _without_date(raw: bytes) -> bytes:
    head, body = raw.split(b"\r\n\r\n", 1)
    return b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")) + b"\r\n\r\n" + body


def _post(port: int, path: str, obj, key: str | None = KEY, **kw) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return _raw(port, path, body, {"X-API-Key": key} if key is not None else {}, **kw)


def _sample_req(ssid: str, seq: int, tokens=(11, 12, 13)) -> dict:
    return {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 2, "prompt": {"chunks": [{"tokens": list(tokens)}]},
            "sampling_params": {"max_tokens": 6, "seed": 7}}


def _exchange(port: int, other_rid: str) -> tuple[list[tuple[str, bytes]], dict[str, str]]:
    """The request set; returns (name, raw response) pairs and the IDs to replace."""
    st = _body(_post(port, "/api/v1/create_session", {"tags": [], "user_metadata": {}}))
    ssid = _body(_post(port, "/api/v1/create_sampling_session",
                       {"session_id": st["session_id"], "base_model": BASE_MODEL}))["sampling_session_id"]
    out: list[tuple[str, bytes]] = []
    ok = _post(port, "/api/v1/asample", _sample_req(ssid, 0))
    rid = _body(ok)["request_id"]
    out.append(("asample ok", ok))
    out.append(("retrieve pending (408)", _post(port, "/api/v1/retrieve_future", {"request_id": rid})))
    out += [
        ("asample not JSON", _post(port, "/api/v1/asample", b"{not json")),
        ("asample bad fields", _post(port, "/api/v1/asample", {"sampling_session_id": ssid, "num_samples": "x"})),
        ("asample empty prompt", _post(port, "/api/v1/asample", _sample_req(ssid, 1, tokens=()))),
        ("asample bad token", _post(port, "/api/v1/asample", _sample_req(ssid, 2, tokens=(-1,)))),
        ("asample unknown session", _post(port, "/api/v1/asample", _sample_req(ssid[:-4] + "AAAA", 3))),
        ("asample too large", _post(port, "/api/v1/asample", b"{" + b" " * 9000 + b"}")),
        ("asample nested 900", _post(port, "/api/v1/asample", b"[" * 900 + b"]" * 900)),
        ("asample nested 901", _post(port, "/api/v1/asample", b"[" * 901 + b"]" * 901)),
        ("retrieve nested 965", _post(port, "/api/v1/retrieve_future", b'{"a":' * 965 + b"1" + b"}" * 965)),
        ("asample missing key", _post(port, "/api/v1/asample", _sample_req(ssid, 4), key=None)),
        ("asample wrong key", _post(port, "/api/v1/asample", _sample_req(ssid, 4), key="tml-not-a-key")),
        ("asample other key's session", _post(port, "/api/v1/asample", _sample_req(ssid, 5), key=OTHER_KEY)),
        ("asample GET (405)", _post(port, "/api/v1/asample", b"", method="GET")),
        ("retrieve not JSON", _post(port, "/api/v1/retrieve_future", b"[1,")),
        ("retrieve bad fields", _post(port, "/api/v1/retrieve_future", {"request_id": 5})),
        ("retrieve unknown (404)", _post(port, "/api/v1/retrieve_future", {"request_id": "nope"})),
        ("retrieve other run (410)", _post(port, "/api/v1/retrieve_future", {"request_id": other_rid})),
        ("retrieve other key", _post(port, "/api/v1/retrieve_future", {"request_id": rid}, key=OTHER_KEY)),
        ("retrieve missing key", _post(port, "/api/v1/retrieve_future", {"request_id": rid}, key=None)),
        ("retrieve too large", _post(port, "/api/v1/retrieve_future", b"[" + b"1," * 5000 + b"1]")),
    ]
    done = b""
    for _ in range(50):  # the simulator answers after 1 s; each poll is held up to 0.3 s
        done = _post(port, "/api/v1/retrieve_future", {"request_id": rid})
        if done.startswith(b"HTTP/1.1 200"):
            break
    out.append(("retrieve done (JSON)", done))
    out.append(("retrieve done (proto)", _raw(port, "/api/v1/retrieve_future", json.dumps({"request_id": rid}).encode(),
                                              {"X-API-Key": KEY, "Accept": "application/x-protobuf"})))
    return out, {ssid: "<SSID>", st["session_id"]: "<SESSION>", rid: "<RID>"}


def test_fast_path_answers_byte_identical_to_fastapi(tmp_path):
    keys = tmp_path / "api_keys"
    keys.write_text(f"{KEY}\n{OTHER_KEY}\n")
    keys.chmod(0o600)
    env = {"SHARDSERVER_AUTH__MODE": "keys", "SHARDSERVER_AUTH__KEYS_FILE": str(keys),
           "SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(8 << 20), "SHARDSERVER_SERVER__MAX_REQUEST_BYTES": "8192",
           "SHARDSERVER_FUTURES__LONG_POLL_S": "0.3", "SHARDSERVER_SIMULATOR__LATENCY_S": "1",
           "SHARDSERVER_SERVER__ID_SECRET": "fast-path-test-secret-0123456789"}
    with RunningServer(env={**env, "SHARDSERVER_SERVER__FAST_PATH": "false"}) as slow, \
            RunningServer(env={**env, "SHARDSERVER_SERVER__FAST_PATH": "true"}) as fast:
        # A future of the other gateway's run: 410 on each (same secret and host, another run).
        st = _body(_post(slow.port, "/api/v1/create_session", {"tags": []}))
        ss = _body(_post(slow.port, "/api/v1/create_sampling_session",
                         {"session_id": st["session_id"], "base_model": BASE_MODEL}))["sampling_session_id"]
        slow_rid = _body(_post(slow.port, "/api/v1/asample", _sample_req(ss, 9)))["request_id"]
        st = _body(_post(fast.port, "/api/v1/create_session", {"tags": []}))
        fs = _body(_post(fast.port, "/api/v1/create_sampling_session",
                         {"session_id": st["session_id"], "base_model": BASE_MODEL}))["sampling_session_id"]
        fast_rid = _body(_post(fast.port, "/api/v1/asample", _sample_req(fs, 9)))["request_id"]
        t0 = time.monotonic()
        want, want_ids = _exchange(slow.port, fast_rid)
        got, got_ids = _exchange(fast.port, slow_rid)
        assert time.monotonic() - t0 < 60
    for ids in (want_ids, got_ids):
        assert [len(i) for i in ids] == [len(i) for i in want_ids]

    def norm(raw: bytes, ids: dict[str, str], other: str) -> bytes:
        raw = _without_date(raw)
        for real, name in {**ids, other: "<OTHER_RID>"}.items():
            raw = raw.replace(real.encode(), name.encode())
        return raw

    statuses = {}
    for (name, a), (name2, b) in zip(want, got, strict=True):
        assert name == name2
        statuses[name] = int(a.split(b" ", 2)[1])
        assert norm(b, got_ids, slow_rid) == norm(a, want_ids, fast_rid), name
    assert statuses == {
        "asample ok": 200, "retrieve pending (408)": 408, "asample not JSON": 400, "asample bad fields": 400,
        "asample empty prompt": 400, "asample bad token": 400, "asample unknown session": 404,
        "asample too large": 413, "asample nested 900": 400, "asample nested 901": 400, "retrieve nested 965": 400, "asample missing key": 401, "asample wrong key": 401,
        "asample other key's session": 404, "asample GET (405)": 405, "retrieve not JSON": 400,
        "retrieve bad fields": 400, "retrieve unknown (404)": 404, "retrieve other run (410)": 410,
        "retrieve other key": 404, "retrieve missing key": 401, "retrieve too large": 413,
        "retrieve done (JSON)": 200, "retrieve done (proto)": 200}
    # The X-Shardserver-* headers are part of what is compared; the 200s name their shard.
    for name in ("asample ok", "retrieve pending (408)", "asample not JSON", "retrieve other run (410)",
                 "asample missing key"):
        assert b"\r\nx-shardserver-front-end: 0\r\n" in dict(want)[name].lower(), name
    assert b"x-shardserver-shard: 0" in want[0][1].lower() and b"x-shardserver-shard: 0" in want[-1][1].lower()
    assert b"Input should be a valid dictionary" in dict(want)["asample nested 900"]
    assert b"nested too deeply" in dict(want)["asample nested 901"] and b"nested too deeply" in dict(want)["retrieve nested 965"]
    assert b"application/x-protobuf" in want[-1][1] and len(want[-1][1]) > 200
