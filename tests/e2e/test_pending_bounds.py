"""Pending requests have a bound (issue 11, item 4): with an engine that does not answer,
``asample`` beyond ``shards.max_pending`` futures or ``shards.max_pending_request_bytes`` of
engine request bodies on a shard gets 429 (``Retry-After: 1``, the SDK backs off), naming the
bound; ``/stats`` and ``/metrics`` show what is held and why requests were refused.

The memory a pending future holds besides its request body is measured by
``benchmarks/pending_memory.py`` (no timed or sized assertion here)."""

from __future__ import annotations

import json

import pytest

from conftest import Api
from shardserver.testing import RunningServer, metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

MAX_PENDING = 20
MAX_BYTES = 1 << 20
BIG_PROMPT = list(range(1000, 21_000))  # 20,000 tokens: an engine body of about 130 KB


def _asample(api: Api, ssid: str, seq: int, tokens: list[int]) -> tuple[int, dict, dict]:
    st, h, b = api.post("/api/v1/asample", {
        "sampling_session_id": ssid, "seq_id": seq, "num_samples": 1, "prompt": {"chunks": [{"tokens": tokens}]},
        "sampling_params": {"max_tokens": 1, "seed": 1}})
    return st, h, json.loads(b)


def test_pending_futures_and_request_bytes_are_bounded_per_shard():
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1",
           "SHARDSERVER_SHARDS__ARENA_BYTES": str(16 << 20),
           "SHARDSERVER_SHARDS__MAX_PENDING": str(MAX_PENDING),
           "SHARDSERVER_SHARDS__MAX_PENDING_REQUEST_BYTES": str(MAX_BYTES),
           "SHARDSERVER_SIMULATOR__LATENCY_S": "60"}  # the engine answers nothing during the test
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        # Large prompts: the request-bytes bound is reached first.
        big = [_asample(api, ssid, i, BIG_PROMPT) for i in range(10)]
        accepted = [r for r in big if r[0] == 200]
        body_bytes = s.stats()["shards"][0]["pending_request_bytes"] // len(accepted)
        assert 100_000 < body_bytes < 200_000
        assert len(accepted) == MAX_BYTES // body_bytes  # every body is the same size but its seed
        for st, h, b in big[len(accepted):]:
            assert st == 429 and h["retry-after"] == "1", (st, b)
            assert "shards.max_pending_request_bytes=1048576" in b["error"], b
        # Small prompts fit in the bytes left; the count bound is reached next.
        small = [_asample(api, ssid, 100 + i, [5, 6, i]) for i in range(MAX_PENDING - len(accepted) + 5)]
        assert [st for st, _, _ in small] == [200] * (MAX_PENDING - len(accepted)) + [429] * 5
        for st, h, b in small[-5:]:
            assert h["retry-after"] == "1"
            assert b["error"] == (f"shard 0 holds {MAX_PENDING} futures waiting for the engine "
                                  f"(shards.max_pending={MAX_PENDING}); retry later")
        shard = s.stats()["shards"][0]
        assert shard["futures"] == {"pending": MAX_PENDING}
        assert shard["engine_calls"] + shard["engine_queued"] == MAX_PENDING
        refused_bytes = len(big) - len(accepted)
        assert metric_sum(s.url, "shardserver_asample_refused_total", reason="pending_bytes") == refused_bytes
        assert metric_sum(s.url, "shardserver_asample_refused_total", reason="pending_limit") == 5
        assert metric_sum(s.url, "shardserver_pending_request_bytes", shard="0") == shard["pending_request_bytes"]
        # A resubmission of a pending (sid, seq) is still answered with its future, not refused.
        st, _, b = _asample(api, ssid, 0, BIG_PROMPT)
        assert st == 200 and b["request_id"] == big[0][2]["request_id"]
