"""One API key cannot lock out the others (issue 11, item 5). ``auth.mode = "keys"`` with three
keys, so each may hold a third (``auth.key_share`` = 0: an equal share) of the shard's arena and
pending bounds:

* key A sends ``num_samples=64`` requests to an engine that does not answer them: refused 429
  once its reservations reach a third of the arena, then refused once its pending futures reach
  a third of ``shards.max_pending``; each refusal names the quota;
* key C fills its third of the arena with results it never retrieves: refused 429 (quota);
* key B's 16-token requests are all accepted meanwhile, and their results retrieved.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import numpy as np
import pytest

from conftest import BASE_MODEL, engine_body, expected_sequences
from shardserver.api.auth import TOO_MANY_CONNECTIONS_MESSAGE
from shardserver.testing import RunningServer, http_json, metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KEY_A = "tml-key-share-test-aaaaaaaaaaaaaaaa"
KEY_B = "tml-key-share-test-bbbbbbbbbbbbbbbb"
KEY_C = "tml-key-share-test-cccccccccccccccc"
ARENA = 4 << 20
MAX_PENDING = 60
HUNG = 9100  # prompts starting with this token stall in the simulator for the whole test
CONFIG = f"""
[shards]
count = 1
arena_bytes = {ARENA}
max_pending = {MAX_PENDING}
[server]
front_ends = 1
[auth]
mode = "keys"
[simulator]
model_name = "{BASE_MODEL}"
[[simulator.faults]]
kind = "stall"
stall_s = 90.0
first_token_id = {HUNG}
"""


class KeyApi:
    """The SDK's wire calls by hand, with one API key."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key

    def post(self, path: str, body) -> tuple[int, dict, dict]:
        st, h, b = http_json(self.url + path, body, headers={"X-API-Key": self.key,
                                                              "Accept": "application/x-protobuf"})
        return st, h, (json.loads(b) if h.get("content-type", "").startswith("application/json") else b)

    def sampling_session(self) -> str:
        st, _, b = self.post("/api/v1/create_session", {"tags": [], "user_metadata": {}})
        assert st == 200, b
        st, _, b = self.post("/api/v1/create_sampling_session", {"session_id": b["session_id"],
                                                                 "base_model": BASE_MODEL})
        assert st == 200, b
        return b["sampling_session_id"]

    def asample(self, ssid: str, seq: int, tokens: list[int], n: int, max_tokens: int):
        return self.post("/api/v1/asample", {
            "sampling_session_id": ssid, "seq_id": seq, "num_samples": n, "prompt": {"chunks": [{"tokens": tokens}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 3}})


def _until_refused(submit, limit: int) -> tuple[list[dict], tuple[int, dict, dict]]:
    """Call ``submit(i)`` until it is not 200 (at most ``limit`` times): (accepted bodies, the
    refusal, or ``(200, {}, {})`` when none came)."""
    ok = []
    for i in range(limit):
        st, h, b = submit(i)
        if st != 200:
            return ok, (st, h, b)
        ok.append(b)
    return ok, (200, {}, {})


def test_a_key_over_its_share_does_not_lock_out_another(tmp_path):
    cfg = tmp_path / "keys.toml"
    cfg.write_text(CONFIG)
    env = {"SHARDSERVER_API_KEYS": ",".join((KEY_A, KEY_B, KEY_C))}
    with RunningServer(cfg, env=env) as s:
        a, b, c = KeyApi(s.url, KEY_A), KeyApi(s.url, KEY_B), KeyApi(s.url, KEY_C)
        sa, sb, sc = a.sampling_session(), b.sampling_session(), c.sampling_session()
        third = int(ARENA / 3)

        # A: 64-sample requests that the engine never finishes (207 KB reservations each), then
        # small ones; C: results it never retrieves (32 KB each).
        a_big, a_big_refusal = _until_refused(lambda i: a.asample(sa, i, [HUNG, i], 64, 400), 40)
        a_small, a_small_refusal = _until_refused(lambda i: a.asample(sa, 100 + i, [HUNG, i], 1, 4), 40)
        held, c_refusal = _until_refused(lambda i: c.asample(sc, i, [7, i], 1, 4000), 140)

        # B, under its share: never refused because A and C are over theirs.
        rids = []
        for i in range(10):
            st, _, body = b.asample(sb, i, [11, 12, i], 1, 16)
            assert st == 200, body
            rids.append(body["request_id"])
        from tinker.proto import tinker_public_pb2

        for i, rid in enumerate(rids):
            st, h, body = b.post("/api/v1/retrieve_future", {"request_id": rid})
            assert st == 200 and h["content-type"] == "application/x-protobuf", body
            m = tinker_public_pb2.SampleResponse()
            m.ParseFromString(body)
            want = expected_sequences(engine_body([11, 12, i], 1, 16, 3))[0]
            assert np.frombuffer(m.sequences[0].tokens, dtype="<i4").tolist() == want["tokens"]

        # A was refused at a third of the arena, then at a third of shards.max_pending.
        st, h, err = a_big_refusal
        assert len(a_big) == third // 206912 and st == 429 and h["retry-after"] == "1", (len(a_big), st, err)
        assert err["error"] == (
            f"API key quota: this API key holds {len(a_big) * 206912} bytes of shard 0's arena (reservations and "
            f"results not retrieved yet); 206912 more would pass its share of shards.arena_bytes "
            f"(auth.key_share=0.3333 x {ARENA} = {third}); retrieve its results or retry later")
        st, _, err = a_small_refusal
        assert len(a_big) + len(a_small) == MAX_PENDING // 3 and st == 429
        assert err["error"] == ("API key quota: this API key has 20 futures waiting for the engine on shard 0, its "
                                "share of shards.max_pending (auth.key_share=0.3333 x 60 = 20); retrieve its "
                                "results or retry later")
        # C was refused at a third of the arena.
        st, _, err = c_refusal
        assert st == 429 and err["error"].startswith("API key quota: this API key holds "), err
        assert "(reservations and results not retrieved yet)" in err["error"]
        assert len(held) * 32128 <= third < (len(held) + 1) * 32128

        # C retrieves one result: that frees room in its share, so it is accepted again.
        st, _, _ = c.post("/api/v1/retrieve_future", {"request_id": held[0]["request_id"]})
        assert st == 200
        st, _, body = c.asample(sc, 1000, [7, 1000], 1, 4000)
        assert st == 200, body

        st, _, metrics = http_json(s.url + "/metrics")
        refused = [float(v) for v in re.findall(r'^shardserver_asample_refused_total\{reason="key_quota"\} (\S+)$',
                                                metrics.decode(), re.M)]
        assert refused == [3.0]


def test_a_key_cannot_hold_every_connection_slot(tmp_path):
    """Found by a break test (stop 26): per-key shares covered the arena and the pending bounds,
    not connections, so one key holding server.max_connections open connections (long-polls,
    never idle enough to evict) left the other keys' SDKs waiting in the listen backlog. Now a
    key's first request on a connection past its share of the front-end's connections
    (auth.key_share x server.max_connections = 16 of 48 here) is refused with Connection: close
    (429; a retrieve_future 408 try_again a second later, which the SDK polls again: SDK 0.15
    fails a sample on a 429 there, break tester round 3), unless one of the key's own connections
    sits idle (that one is closed instead: round 3, an SDK's idle pooled connections used up its
    share and its poller got 429 forever). While a refused poll waits for its 408 the front-end
    closes it at once if it needs the slot (round 4: a key flooding refused polls kept the
    others in the listen backlog)."""
    cfg = tmp_path / "keys.toml"
    cfg.write_text(CONFIG.replace("front_ends = 1", "front_ends = 1\nmax_connections = 48"))
    env = {"SHARDSERVER_API_KEYS": ",".join((KEY_A, KEY_B, KEY_C))}
    with RunningServer(cfg, env=env) as s:
        b = KeyApi(s.url, KEY_B)
        sb = b.sampling_session()
        _, _, fb = b.asample(sb, 0, [HUNG, 1], 1, 4)
        poll = _raw_request("POST", "/api/v1/retrieve_future", KEY_B, json.dumps({"request_id": fb["request_id"]}).encode())
        held: list[socket.socket] = []
        try:
            for _ in range(60):  # key B's long-polls: 16 held, the others refused (more than the cap)
                c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
                c.sendall(poll)
                held.append(c)
            t0 = time.monotonic()  # key A is served at once: a refused poll makes room
            st, _, _ = http_json(s.url + "/api/v1/create_session", {"tags": [], "user_metadata": {}},
                                 headers={"X-API-Key": KEY_A}, timeout=10)
            waited = time.monotonic() - t0
            assert st == 200 and waited < 0.9, (st, waited)
            time.sleep(1.8)
            answered, closed = [], []
            for c in held:
                c.setblocking(False)
                try:
                    data = c.recv(65536)
                except BlockingIOError:
                    continue
                c.setblocking(True)
                if not data:
                    closed.append(c)  # refused, then closed to make room
                    continue
                head, body = data.split(b"\r\n\r\n", 1)
                assert head.lower().startswith(b"http/1.1 408") and b"connection: close" in head.lower(), data
                assert json.loads(body) == {"type": "try_again", "queue_state": "paused_capacity",
                                            "queue_state_reason": TOO_MANY_CONNECTIONS_MESSAGE}
                answered.append(c)
            assert len(answered) + len(closed) == 60 - 16 and closed, (len(answered), len(closed))
            for c in answered + closed:
                held.remove(c)
                c.close()
            # Key A opens 17 connections one after the other and keeps each open, idle between
            # requests: the 17th passes A's share, so A's oldest idle connection is closed for it
            # instead of a 429.
            session = _raw_request("POST", "/api/v1/create_session", KEY_A, b'{"tags": [], "user_metadata": {}}')
            mine = []
            for _ in range(17):
                c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
                held.append(c)
                mine.append(c)
                c.sendall(session)
                assert _read_response(c, 10)[0] == 200
            assert _read_response(mine[0], 2) == (0, b"")  # closed by the server to make room
        finally:
            for c in held:
                c.close()


def test_connections_that_never_complete_a_request_make_room_at_the_cap(tmp_path):
    """A key's share of the connections is counted from its first authenticated request, so
    connections that never complete one hold no key's share: silent ones, and unauthenticated
    requests with a large ``Content-Length`` (answered 401 at once, then the rest of the body is
    read for up to ``server.body_timeout_s``). Before: they were never closed to make room (only
    idle keep-alive connections were), so a peer holding ``server.max_connections`` of them, no
    key needed, left every key's clients in the listen backlog (break tester's F1: key B got no
    answer). Now, at the cap, the connection that has waited longest on its client is closed
    once it waited a second; key B is answered at once."""
    cfg = tmp_path / "keys.toml"
    cfg.write_text(CONFIG)
    cap = 16
    env = {"SHARDSERVER_API_KEYS": ",".join((KEY_A, KEY_B, KEY_C)),
           "SHARDSERVER_SERVER__MAX_CONNECTIONS": str(cap)}
    with RunningServer(cfg, env=env) as s:
        head = (b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n{")
        flood = []
        try:
            for i in range(cap + 8):  # more than the cap: the last ones wait in the backlog
                c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
                if i % 4:
                    c.sendall(head)  # (every 4th sends nothing at all)
                flood.append(c)
            time.sleep(1.5)  # past EVICT_MIN_IDLE_S for the first ones
            t0 = time.monotonic()
            st, _, body = http_json(s.url + "/api/v1/session_heartbeat", {"session_id": "x"},
                                    headers={"X-API-Key": KEY_B}, timeout=10)
            waited = time.monotonic() - t0
            # The key was checked (not 401) and the body read: the route's own answer.
            assert st == 404 and waited < 3.0, (st, body, waited)
            closed = 0
            for c in flood[:4]:  # the oldest were closed to make room
                c.settimeout(2)
                try:
                    data = c.recv(65536)
                    while data:
                        data = c.recv(65536)
                    closed += 1
                except OSError:
                    closed += 1
            assert closed == 4
        finally:
            for c in flood:
                c.close()
        assert metric_sum(s.url, "shardserver_connections_evicted_total") >= 9


def _raw_request(method: str, path: str, key: str | None, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if key is not None:
        head += f"X-API-Key: {key}\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _read_response(c: socket.socket, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one response with a Content-Length; (0, b"") when the peer closed first."""
    c.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = c.recv(65536)
        if not chunk:
            return 0, b""
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        chunk = c.recv(65536)
        if not chunk:
            return 0, b""
        rest += chunk
    return int(head.split()[1]), rest[:length]


def test_at_the_cap_a_slow_upload_that_keeps_sending_stays_and_unkeyed_pingers_make_room(tmp_path):
    """Connection cap 16, all held: 13 long-polls of keys A and C, a slow but steady ``asample`` upload
    (80 KB at 40 KB/s), a slowloris (half a request head, then nothing) and a client without a
    key re-sending ``GET /healthz`` (a public path) every 0.3 s. Then key B and key C connect.

    * B takes the slowloris's slot: it waited a second without progress; it is answered 503
      (``Retry-After``) before being closed.
    * C takes the key-less pinger's slot at once (keys mode: a connection that never
      authenticated makes room first). Before, it was never idle a whole second, so such
      pingers held every slot against every key (break tester round 2, F2).
    * The upload keeps its slot and is answered 200: each 4 KiB received moves its clock. Before,
      a request was closed a second after its first byte however fast it was arriving (F1).
    """
    cfg = tmp_path / "keys.toml"
    cfg.write_text(CONFIG)
    env = {"SHARDSERVER_API_KEYS": ",".join((KEY_A, KEY_B, KEY_C)), "SHARDSERVER_SERVER__MAX_CONNECTIONS": "16"}
    with RunningServer(cfg, env=env) as s:
        a, b, c = KeyApi(s.url, KEY_A), KeyApi(s.url, KEY_B), KeyApi(s.url, KEY_C)
        sa, sb, sc = a.sampling_session(), b.sampling_session(), c.sampling_session()
        _, _, fa = a.asample(sa, 0, [HUNG, 0], 1, 4)
        _, _, fb = b.asample(sb, 0, [HUNG, 1], 1, 4)
        _, _, fc = c.asample(sc, 0, [HUNG, 2], 1, 4)
        conns: list[socket.socket] = []
        stop = threading.Event()
        out: dict[str, object] = {}

        def connect() -> socket.socket:
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            conns.append(c)
            return c

        def poll_body(rid: str) -> bytes:
            return json.dumps({"request_id": rid}).encode()

        def upload() -> None:
            c = connect()
            body = json.dumps({"sampling_session_id": sa, "seq_id": 1, "num_samples": 1,
                               "prompt": {"chunks": [{"tokens": list(range(100000, 113000))}]},
                               "sampling_params": {"max_tokens": 4, "seed": 1}}).encode()
            req = _raw_request("POST", "/api/v1/asample", KEY_A, body)
            t0 = time.monotonic()
            try:
                for i in range(0, len(req), 4096):
                    c.sendall(req[i:i + 4096])
                    time.sleep(0.1)
                out["upload"] = _read_response(c, 10)
            except OSError as exc:
                out["upload"] = (0, repr(exc).encode())
            out["upload_s"] = time.monotonic() - t0

        def pinger() -> None:
            c = connect()
            n = 0
            try:
                while not stop.is_set() and n < 100:
                    c.sendall(_raw_request("GET", "/healthz", None))
                    if _read_response(c, 5)[0] != 200:
                        break
                    n += 1
                    time.sleep(0.3)
            except OSError:
                pass
            out["pings"] = n

        try:
            # 16 = 7 + 6 held long-polls (a key may hold 8 connections of a front-end), the upload
            # (key A's 8th), the pinger, the slowloris.
            for key, f, n in ((KEY_A, fa, 7), (KEY_C, fc, 6)):
                for _ in range(n):
                    connect().sendall(_raw_request("POST", "/api/v1/retrieve_future", key, poll_body(f["request_id"])))
            threads = [threading.Thread(target=upload), threading.Thread(target=pinger)]
            for t in threads:
                t.start()
            loris = connect()
            loris.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\n")
            time.sleep(1.3)
            t0 = time.monotonic()
            cb = connect()
            cb.sendall(_raw_request("POST", "/api/v1/retrieve_future", KEY_B, poll_body(fb["request_id"])))
            st, body = _read_response(loris, 5)  # evicted to make room for B
            assert (st, body) == (503, b"request not complete within 1 s while the front-end is at "
                                       b"server.max_connections; retry\n"), (st, body)
            waited_b = time.monotonic() - t0
            t0 = time.monotonic()
            st, _, _ = http_json(s.url + "/api/v1/create_session", {"tags": [], "user_metadata": {}},
                                 headers={"X-API-Key": KEY_C}, timeout=10)
            waited_c = time.monotonic() - t0
            assert st == 200
            for t in threads:
                t.join(20)
            assert out["upload"][0] == 200 and b'"request_id"' in out["upload"][1], out
            assert waited_b < 1.0 and waited_c < 1.0, (waited_b, waited_c)
            assert 3 <= out["pings"] <= 10, out  # it was pinging, and its connection was taken
        finally:
            stop.set()
            for c in conns:
                c.close()
