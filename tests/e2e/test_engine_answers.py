"""Engine answers an encoder holds (issue 12, item 5): every answer counts in
``engine_answer_bytes`` from its headers until it is decoded, whatever its outcome, and a body
that would take them past ``engine.answer_budget_bytes`` waits unread in its socket until there
is room, so a burst of answers arriving together never sits in the encoder's memory at once.

Real gateways and real engine processes on 127.0.0.1: ``fake_engine.FakeEngine`` (cuts a body,
answers 400), and the embedded simulator holding every request for the same time so that the
answers of all running calls arrive together. Results are checked token for token. What this
saves in memory is measured by ``benchmarks/run_load.py --scenario soak-131k`` (README_load.md).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Api
from fake_engine import FakeEngine
from shardserver.testing import RunningServer
from test_engine_faults import assert_result, counters, gateway, retrieve, submit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _shard(s: RunningServer) -> dict:
    (sh,) = s.stats()["shards"]
    return sh


def test_answer_bytes_are_counted_until_decoded_and_released_after_every_outcome():
    with FakeEngine() as eng, gateway(eng.url, pool_size=64) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        sh = _shard(s)
        assert (sh["engine_answer_bytes"], sh["engine_call_limit"]) == (0, 64)
        rid, prompt = submit(api, ssid, 101, 1)
        assert_result(*retrieve(api, rid), prompt, 1)
        assert _shard(s)["engine_answer_bytes"] == 0
        c = counters(s)  # the answer was read into a new receive buffer, then kept for the next
        assert c["engine_buffers_new"] == 1 and "engine_buffers_reused" not in c
        eng.configure(truncate=1)  # half the body, then FIN: re-forwarded, the cut half released
        rid, prompt = submit(api, ssid, 102, 2)
        assert_result(*retrieve(api, rid), prompt, 2)
        assert _shard(s)["engine_answer_bytes"] == 0
        eng.configure(status=400)  # an error body: read, reported, released
        rid, _ = submit(api, ssid, 103, 3)
        st, _, body = retrieve(api, rid)
        assert st == 200 and json.loads(body)["category"] == "user"
        sh = _shard(s)
        assert (sh["engine_answer_bytes"], sh["engine_call_limit"]) == (0, 64)
        c = counters(s)
        assert c["completed"] == 2 and c["failed_user"] == 1 and "engine_calls_held_back" not in c
        # Four answers with a Content-Length, all in the 64 KiB size class: the three after the
        # first reused its buffer (the cut one and the 400's handed it back too).
        assert (c["engine_buffers_new"], c["engine_buffers_reused"]) == (1, 3)


def test_answers_over_the_budget_wait_unread_while_calls_keep_running():
    """The engine answers 64 calls at once (its ``gather``: a batch that finishes together),
    ~160 KB each: 10 MB against a 1 MiB budget. Each answer's body is admitted once there is
    room for it; the others wait unread in their sockets after their header sections (no
    receive buffer taken), so the bytes held stay within the budget, and the engine calls are
    not held back: the next batch still runs 64 at once. Every sample completes exactly and
    nothing stays counted. Before: all 64 answers were read at once, then calls were held back."""
    n, tokens = 128, 2000
    with FakeEngine(gather=64) as eng, gateway(eng.url, pool_size=64, answer_budget_bytes=1 << 20,
                                                 timeout_s=60) as s:
        sh = _shard(s)
        assert (sh["engine_call_limit"], sh["engine_answer_bytes"], sh["engine_answers_waiting"]) == (64, 0, 0)
        api = Api(s.url)
        ssid = api.sampling_session()
        with ThreadPoolExecutor(16) as pool:
            first = list(pool.map(lambda i: submit_n(api, ssid, i, tokens), range(64)))
            results = list(pool.map(lambda r: retrieve(api, r[0]), first))  # one batch of 64 answers
            sh = _shard(s)
            # at most 1 MiB / 160 KB + 1 answers held at once: most of the 64 waited (how many
            # depends on how many were decoded before the last header sections arrived)
            assert sh["counters"]["engine_answers_waited"] >= 32, sh
            assert "engine_calls_held_back" not in sh["counters"] and sh["engine_call_limit"] == 64, sh
            rest = list(pool.map(lambda i: submit_n(api, ssid, i, tokens), range(64, n)))
            results += list(pool.map(lambda r: retrieve(api, r[0]), rest))
        for (rid, prompt, seed), res in zip(first + rest, results):
            assert_result(*res, prompt, seed, tokens)
        sh = _shard(s)
        assert sh["counters"]["completed"] == n and sh["engine_answer_bytes"] == 0 and sh["engine_calls"] == 0, sh
        assert sh["engine_answers_waiting"] == 0 and sh["counters"]["engine_answers_waited"] >= 64, sh


def submit_n(api: Api, ssid: str, seq: int, tokens: int) -> tuple[str, list[int], int]:
    prompt = [200, seq % 1000, 7]
    return api.submit(ssid, prompt, seq_id=seq, max_tokens=tokens, seed=seq), prompt, seq
