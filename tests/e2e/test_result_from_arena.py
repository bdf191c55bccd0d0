"""A result is sent straight from the arena (no copy; issue 12 item 2), so the encoder may reuse
its slot while the bytes are still being sent. The front-end holds back the last
``RESULT_TAIL_BYTES`` until the rest left the process, then re-checks the slot's generation:
if the slot was freed (here: ``cancel_future``) and reused (here: another 8 MiB result written
over it) meanwhile, the connection is reset. The client must see a cut response (fewer body
bytes than Content-Length), never a complete one, the front-end counts
``retrieve_cut_slot_reused`` and the result is not reported delivered. A result sent the same
way to a client that reads it all arrives whole and byte-exact (the control case).
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from conftest import Api, engine_body, expected_sequences
from frontend_raw_http import open_result_poll
from shardserver.api.sampling import RESULT_TAIL_BYTES
from shardserver.testing import RunningServer, http_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

N, MAX_TOKENS, PROMPT = 16, 65_000, [21, 22, 23]


@pytest.fixture(scope="module")
def gateway():
    # One shard whose arena holds little more than one 8 MiB result: the second result takes the
    # space the cancelled one had.
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(12 << 20),
           "SHARDSERVER_SERVER__KEEP_ALIVE_S": "1"}
    with RunningServer(env=env) as s:
        yield s
    assert s.proc.returncode == 0


def _submit(api: Api, ssid: str, seq_id: int, seed: int) -> str:
    st, _, b = api.post("/api/v1/asample", {
        "sampling_session_id": ssid, "seq_id": seq_id, "num_samples": N, "prompt": {"chunks": [{"tokens": PROMPT}]},
        "sampling_params": {"max_tokens": MAX_TOKENS, "seed": seed}})
    assert st == 200, b
    return json.loads(b)["request_id"]


def _stats(url: str) -> dict:
    return json.loads(http_json(url + "/stats")[2])


def _read_to_end(s: socket.socket, rest: bytes, length: int) -> tuple[bytes, str]:
    """Read until Content-Length bytes, EOF or a reset; returns (body, how it ended)."""
    chunks = [rest]
    got = len(rest)
    for _ in range(100_000):
        if got >= length:
            return b"".join(chunks), "complete"
        try:
            c = s.recv(1 << 20)
        except ConnectionResetError:
            return b"".join(chunks), "reset"
        if not c:
            return b"".join(chunks), "eof"
        chunks.append(c)
        got += len(c)
    raise AssertionError("response neither ended nor completed")


def _wait_done(api: Api, rid: str) -> None:
    for _ in range(60):
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
        if st == 200:
            return
        assert st == 408, b[:300]
    raise AssertionError(f"{rid} never completed")


def test_result_read_whole_is_byte_exact_and_delivered(gateway):
    from tinker.proto import tinker_public_pb2

    api = Api(gateway.url)
    ssid = api.sampling_session()
    rid = _submit(api, ssid, 1, seed=7)
    _wait_done(api, rid)  # computed (and delivered once; the next poll is sent from the arena again)
    s, length, rest = open_result_poll(gateway.port, rid)
    with s:
        body, ended = _read_to_end(s, rest, length)
    assert ended == "complete" and len(body) == length > 8_000_000
    m = tinker_public_pb2.SampleResponse()
    m.ParseFromString(body)
    want = expected_sequences(engine_body(PROMPT, 1, MAX_TOKENS, 7))[0]
    assert np.frombuffer(m.sequences[0].tokens, dtype="<i4").tolist() == want["tokens"]
    assert np.array_equal(np.frombuffer(m.sequences[0].logprobs, dtype="<f4"), want["logprobs"])
    assert _stats(gateway.url)["counters"].get("retrieve_cut_slot_reused", 0) == 0
    api.post("/api/v1/cancel_future", {"request_id": rid})  # free its room for the next test


def test_slot_reused_while_sending_cuts_the_response(gateway):
    api = Api(gateway.url)
    ssid = api.sampling_session()
    rid = _submit(api, ssid, 2, seed=5)
    for _ in range(60):  # computed, never polled: not delivered
        if sum(sh["counters"].get("completed", 0) for sh in _stats(gateway.url)["shards"]) >= 2:
            break
        time.sleep(0.2)
    delivered0 = sum(sh["counters"].get("delivered", 0) for sh in _stats(gateway.url)["shards"])
    s, length, rest = open_result_poll(gateway.port, rid)  # the client stops reading: most of it waits
    with s:
        assert length > 8_000_000
        st, _, b = api.post("/api/v1/cancel_future", {"request_id": rid})  # the encoder frees the slot
        assert st == 200, b
        rid2 = _submit(api, ssid, 3, seed=6)  # another result is written into the freed space
        _wait_done(api, rid2)
        body, ended = _read_to_end(s, rest, length)
    assert ended in ("eof", "reset"), ended
    assert len(body) <= length - RESULT_TAIL_BYTES  # cut: the tail never went out
    st = _stats(gateway.url)
    assert st["counters"].get("retrieve_cut_slot_reused", 0) == 1
    # rid2's poll above was its only delivery; rid's cut response was not reported.
    assert sum(sh["counters"].get("delivered", 0) for sh in st["shards"]) == delivered0 + 1
