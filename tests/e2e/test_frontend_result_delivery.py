"""A result cut mid-body (issue 11, item 9): a client polls an 8 MiB result, reads 256 KiB and
closes. The result must not count as delivered (its retrieved TTL must not start): a re-poll
after ``futures.retrieved_ttl_s`` still gets 200 with the same bytes. A result read to the end
does count (the control case: its re-poll after the TTL answers 410)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import Api, engine_body, expected_sequences
from frontend_raw_http import open_result_poll
from shardserver.testing import RunningServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

RETRIEVED_TTL_S = 1.0
N, MAX_TOKENS, SEED, PROMPT = 16, 65_000, 5, [11, 12, 13]
CUT_AT = 256 * 1024


@pytest.fixture(scope="module")
def gateway():
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(48 << 20),
           "SHARDSERVER_FUTURES__RETRIEVED_TTL_S": str(RETRIEVED_TTL_S),
           "SHARDSERVER_FUTURES__SWEEP_INTERVAL_S": "0.2"}
    with RunningServer(env=env) as s:
        yield s
    assert s.proc.returncode == 0


def _submit(api: Api, ssid: str, seq_id: int) -> str:
    st, _, b = api.post("/api/v1/asample", {
        "sampling_session_id": ssid, "seq_id": seq_id, "num_samples": N, "prompt": {"chunks": [{"tokens": PROMPT}]},
        "sampling_params": {"max_tokens": MAX_TOKENS, "seed": SEED}})
    assert st == 200, b
    return json.loads(b)["request_id"]


def _poll_and_cut(port: int, rid: str) -> tuple[int, bytes]:
    """retrieve_future on a raw socket with a small receive buffer; read CUT_AT bytes of the
    body, then close. Returns (announced Content-Length, the body bytes read)."""
    s, length, rest = open_result_poll(port, rid)
    while len(rest) < CUT_AT:
        rest += s.recv(65536)
    s.close()  # unread bytes in the receive buffer: the kernel answers with a reset
    return length, rest[:CUT_AT]


def test_result_cut_mid_body_is_not_delivered(gateway):
    from tinker.proto import tinker_public_pb2

    api = Api(gateway.url)
    ssid = api.sampling_session()
    rid = _submit(api, ssid, 1)
    length, prefix = _poll_and_cut(gateway.port, rid)
    assert length > 8_000_000  # far more than the socket buffers on both sides hold
    time.sleep(RETRIEVED_TTL_S + 1.0)
    st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
    assert st == 200, b[:300]
    assert len(b) == length and b[:CUT_AT] == prefix
    m = tinker_public_pb2.SampleResponse()
    m.ParseFromString(b)
    assert [len(seq.tokens) for seq in m.sequences] == [4 * MAX_TOKENS] * N  # little-endian int32 each
    want = expected_sequences(engine_body(PROMPT, 1, MAX_TOKENS, SEED))[0]  # choice 0 uses the seed itself
    assert np.frombuffer(m.sequences[0].tokens, dtype="<i4").tolist() == want["tokens"]
    assert np.array_equal(np.frombuffer(m.sequences[0].logprobs, dtype="<f4"), want["logprobs"])
    # That full read counted: after the retrieved TTL the future is gone.
    time.sleep(RETRIEVED_TTL_S + 1.0)
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
    assert st == 410, b[:300]
