"""Result lifetimes: TTLs, long-poll pacing, arena reuse under concurrent streaming, backpressure."""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib

import numpy as np
import pytest

from conftest import BASE_MODEL, Api, engine_body
from shardserver.shm.arena import ArenaWriter
from shardserver.testing import RunningServer, http_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

# One shard, one front-end, a 1 MiB arena: four 32k-token results fill it.
TINY_ONE_SHARD = {"SHARDSERVER_SHARDS__ARENA_BYTES": str(1 << 20), "SHARDSERVER_SHARDS__COUNT": "1",
                  "SHARDSERVER_SERVER__FRONT_ENDS": "1"}


def _sample(api: Api, ssid: str, tokens: list[int], seq_id: int, max_tokens: int = 4) -> str:
    return api.submit(ssid, tokens, seq_id, max_tokens)


def test_ttls_and_long_poll():
    env = {"SHARDSERVER_FUTURES__RETRIEVED_TTL_S": "0.5", "SHARDSERVER_FUTURES__COMPLETED_TTL_S": "30",
           "SHARDSERVER_FUTURES__PENDING_TTL_S": "1.5", "SHARDSERVER_FUTURES__LONG_POLL_S": "1",
           "SHARDSERVER_FUTURES__SWEEP_INTERVAL_S": "0.1", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        delivered = _sample(api, ssid, [1, 2], 0)
        undelivered = _sample(api, ssid, [1, 3], 1)
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": delivered})
        assert st == 200
        # A retry right after delivery (a lost response) still finds it ...
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": delivered})
        assert st == 200
        time.sleep(1.2)
        # ... but not after the retrieved TTL; the undelivered one is kept (completed TTL 30 s).
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": delivered})
        assert st == 410 and "resubmit" in json.loads(b)["error"]
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": undelivered})
        assert st == 200

    env.update({"SHARDSERVER_SIMULATOR__LATENCY_S": "4"})
    with RunningServer(env=env) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        slow = _sample(api, ssid, [4, 4], 0)
        t0 = time.monotonic()
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": slow})
        held = time.monotonic() - t0
        # Held for futures.long_poll_s, then a quiet try-again the SDK re-polls at once.
        assert st == 408 and json.loads(b) == {"type": "try_again", "request_id": slow, "queue_state": "active"}
        assert 0.9 <= held < 5.0  # held about futures.long_poll_s (1 s), the engine takes 4 s
        time.sleep(1.0)
        # Past the pending TTL the engine's late answer is no longer awaited: 410, the SDK resubmits.
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": slow})
        assert st == 410
        stats = s.stats()
        assert sum(sh["counters"].get("expired", 0) for sh in stats["shards"]) == 1


def test_engine_unreachable_fails_after_the_budget():
    """Connection refused: the request never reached the engine, so it is re-forwarded with
    backoff (an engine restart does not fail the RL step) for engine.unavailable_budget_s, then
    the future fails (category server) naming the engine (credentials masked) and the cause."""
    env = {"SHARDSERVER_ENGINE__URL": "http://bob:hunter2@127.0.0.1:9/v1",
           "SHARDSERVER_ENGINE__UNAVAILABLE_BUDGET_S": "1",
           "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_SHARDS__COUNT": "1",
           "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.2"}
    with RunningServer(env=env) as s:
        api = Api(s.url)
        st, _, b = http_json(s.url + "/readyz")
        assert st == 503 and json.loads(b)["engine_down"] == [0]
        rid = _sample(api, api.sampling_session(), [1], 0)
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
        err = json.loads(b)
        assert st == 200 and err["category"] == "server"
        assert err["error"].startswith("engine at http://***@127.0.0.1:9/v1/completions unavailable for 1.")
        assert "last: cannot connect to engine at http://***@127.0.0.1:9/v1/completions" in err["error"]
        c = s.stats()["shards"][0]["counters"]
        assert c["engine_budget_exhausted"] == 1 and c["engine_reforwards"] >= 3
        st, _, b = http_json(s.url + "/readyz")
        assert b"hunter2" not in b
    # Engine credentials appear nowhere: not in answers, not in the log.
    assert not [line for line in s.log_lines if "hunter2" in line]


async def _drive(url: str, jobs: list[tuple[list[int], int]], tokens: int, concurrency: int,
                 expected: dict[tuple, int]) -> dict[str, int]:
    """Sample every job with SDK-like retries; check each delivered body's CRC; return counts."""
    import aiohttp
    from tinker.proto import tinker_public_pb2

    counts = {"ok": 0, "asample_429": 0, "retrieve_410": 0, "second_poll_ok": 0, "second_poll_410": 0}
    api = Api(url)
    ssid = api.sampling_session()
    sem = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + 90
    async with aiohttp.ClientSession() as sess:
        async def one(idx: int, prompt: list[int], seed: int) -> None:
            async with sem:
                seq = idx * 1000
                while time.monotonic() < deadline:
                    body = {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
                            "prompt": {"chunks": [{"tokens": prompt}]},
                            "sampling_params": {"max_tokens": tokens, "seed": seed}}
                    async with sess.post(url + "/api/v1/asample", json=body) as r:
                        if r.status == 429:
                            counts["asample_429"] += 1
                            await asyncio.sleep(0.05)
                            continue  # the SDK re-sends the same seq_id after a 429
                        assert r.status == 200, await r.text()
                        rid = (await r.json())["request_id"]
                    polls = 0
                    while polls < 2:
                        async with sess.post(url + "/api/v1/retrieve_future", json={"request_id": rid},
                                             headers={"Accept": "application/x-protobuf"}) as r:
                            data = await r.read()
                            status = r.status
                        if status == 408:
                            continue
                        if status == 410:
                            key = "retrieve_410" if polls == 0 else "second_poll_410"
                            counts[key] += 1
                            if polls == 0:
                                seq += 1  # the SDK resubmits with a new seq_id
                                break
                            return
                        assert status == 200, data[:200]
                        m = tinker_public_pb2.SampleResponse()
                        m.ParseFromString(data)
                        crc = zlib.crc32(m.sequences[0].tokens + m.sequences[0].logprobs)
                        assert crc == expected[(tuple(prompt), seed)], f"corrupt body for job {idx}"
                        counts["ok" if polls == 0 else "second_poll_ok"] += 1
                        polls += 1
                    if polls == 2:
                        return
                raise AssertionError(f"job {idx} did not finish in time")

        await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(jobs)))
    return counts


def test_small_arena_reuse_under_concurrent_streaming():
    """Fill and reuse 1 MiB arenas while 24 clients stream: every delivered body matches its CRC."""
    tokens = 4096  # 32 KB of proto per result; a 1 MiB arena holds ~30 results or reservations
    env = {"SHARDSERVER_SHARDS__ARENA_BYTES": str(1 << 20), "SHARDSERVER_SHARDS__COUNT": "2",
           "SHARDSERVER_FUTURES__RETRIEVED_TTL_S": "30", "SHARDSERVER_SERVER__FRONT_ENDS": "2"}
    jobs = [([700 + i % 7, 1, 2], i % 11) for i in range(240)]
    expected = {}
    for p, seed in set((tuple(p), s) for p, s in jobs):
        ch = engine_body(list(p), 1, tokens, seed)["choices"][0]
        expected[(p, seed)] = zlib.crc32(np.asarray(ch["token_ids"], dtype="<i4").tobytes()
                                         + np.asarray(ch["logprobs"]["token_logprobs"], dtype="<f4").tobytes())
    with RunningServer(env=env) as s:
        counts = asyncio.run(_drive(s.url, jobs, tokens, 24, expected))
        stats = s.stats()
    evicted = sum(sh["counters"].get("evicted", 0) for sh in stats["shards"])
    rejected = sum(sh["counters"].get("rejected_429", 0) for sh in stats["shards"])
    assert counts["ok"] == len(jobs)  # every job delivered, each body checked
    assert counts["retrieve_410"] == 0, "an undelivered result was evicted"
    assert evicted > 100, "the arena was not reused"
    assert rejected == counts["asample_429"]
    assert counts["second_poll_ok"] + counts["second_poll_410"] == len(jobs)


def test_full_arena_answers_429_and_keeps_undelivered_results():
    with RunningServer(env=TINY_ONE_SHARD) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rids, status = [], 200
        for i in range(40):  # 32768 tokens reserve 256 KB each: the 5th does not fit
            st, h, b = api.post("/api/v1/asample", {
                "sampling_session_id": ssid, "seq_id": i, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": [i, 5]}]}, "sampling_params": {"max_tokens": 32768, "seed": 1}})
            if st != 200:
                status = st
                assert h.get("retry-after") == "1" and "has no free block" in json.loads(b)["error"]
                break
            rids.append(json.loads(b)["request_id"])
        assert status == 429 and len(rids) == 3
        for rid in rids:  # nothing undelivered was evicted to make room
            st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
            # JSON asked for; the full arena cannot cache the JSON form, so it is derived per response.
            assert st == 200 and h["content-type"].startswith("application/json")
            assert len(json.loads(b)["sequences"][0]["tokens"]) == 32768
        # Delivered results are evicted for new work, oldest delivery first.
        st, _, b = api.post("/api/v1/asample", {
            "sampling_session_id": ssid, "seq_id": 100, "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [9, 5]}]}, "sampling_params": {"max_tokens": 32768, "seed": 1}})
        assert st == 200
        counters = s.stats()["shards"][0]["counters"]
        assert counters["rejected_429"] == 1 and counters["evicted"] >= 1 and counters["json_uncached"] >= 3
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rids[0]})
        assert st == 410


def test_sdk_backs_off_on_429_and_completes():
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    env = {**TINY_ONE_SHARD, "SHARDSERVER_FUTURES__RETRIEVED_TTL_S": "0.2"}
    with RunningServer(env=env) as s:
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-t").create_sampling_client(
            base_model=BASE_MODEL).result(60)

        async def go():
            return await asyncio.gather(*(sampler.sample(
                prompt=types.ModelInput.from_ints([i, 3]), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=32768, seed=2)) for i in range(8)))

        results = asyncio.run(go())
        assert [len(r.sequences[0].tokens) for r in results] == [32768] * 8
        want = engine_body([5, 3], 1, 32768, 2)["choices"][0]["token_ids"]
        assert list(results[5].sequences[0].tokens) == want
        assert s.stats()["shards"][0]["counters"]["rejected_429"] >= 1


def test_json_poll_of_a_delivered_result_in_a_full_arena_does_not_leak():
    """Caching the JSON form may evict other delivered results, never the one being answered."""
    with RunningServer(env=TINY_ONE_SHARD) as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        rid = api.submit(ssid, [1, 2], 0, max_tokens=32768)
        st, _, _ = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
        assert st == 200
        for _ in range(2):  # JSON twice: derived per response (no room to cache), same bytes
            st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/json"})
            assert st == 200 and len(json.loads(b)["sequences"][0]["tokens"]) == 32768
        shard = s.stats()["shards"][0]
        assert shard["futures"] == {"done": 1}
        assert shard["arena_used_bytes"] == ArenaWriter.slot_bytes(32768 * 8 + 12)
        # The arena can still take a new large request once the delivered result is evicted.
        rid2 = api.submit(ssid, [1, 3], 1, max_tokens=32768)
        rid3 = api.submit(ssid, [1, 4], 2, max_tokens=32768)
        assert rid2 != rid3


def test_a_result_that_can_never_fit_the_arena_is_400_naming_the_numbers():
    """The SDK leaves max_tokens unset by default (tinker SamplingParams.max_tokens = None), which
    reserves the whole context window per sequence. When one request's reservation exceeds a whole
    shard's arena, waiting can never make room: asample answers 400 naming num_samples, max_tokens
    (and that it was unset), the bytes and shards.arena_bytes; the real SDK raises at once instead
    of retrying. A request that fits an empty arena is still accepted."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    with RunningServer(env=TINY_ONE_SHARD) as s:
        st, _, b = http_json(s.url + "/readyz")
        assert st == 200 and json.loads(b)["max_model_len"] == {BASE_MODEL: 65536}
        api = Api(s.url)
        ssid = api.sampling_session()
        req = {"sampling_session_id": ssid, "seq_id": 1, "num_samples": 4,
               "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, "sampling_params": {"seed": 1}}
        st, h, b = api.post("/api/v1/asample", req)
        assert (st, json.loads(b)) == (400, {"error": (
            "num_samples=4 with max_tokens unset, i.e. up to 65533 tokens (the context window of 65536 tokens minus "
            "the 3-token prompt) can produce a result of 2097280 bytes, more than a shard's whole arena "
            "(shards.arena_bytes=1048576); set or lower max_tokens, lower num_samples, or raise shards.arena_bytes")})
        st, _, b = api.post("/api/v1/asample", {**req, "sampling_params": {"seed": 1, "max_tokens": 70000}})
        assert st == 400 and "exceeds the engine's context window" in json.loads(b)["error"]
        st, _, b = api.post("/api/v1/asample", {**req, "num_samples": 64, "sampling_params": {"seed": 1, "max_tokens": 2400}})
        assert (st, json.loads(b)) == (400, {"error": (
            "num_samples=64 with max_tokens=2400 can produce a result of 1230912 bytes, more than a shard's whole "
            "arena (shards.arena_bytes=1048576); set or lower max_tokens, lower num_samples, or raise "
            "shards.arena_bytes")})
        # Unset max_tokens with num_samples=1 fits an empty arena: accepted.
        st, _, b = api.post("/api/v1/asample", {**req, "num_samples": 1})
        assert st == 200, b
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-t").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        t0 = time.monotonic()
        with pytest.raises(tinker.BadRequestError, match="more than a shard's whole arena"):
            sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=4,
                           sampling_params=types.SamplingParams(seed=1)).result(60)
        assert time.monotonic() - t0 < 30
        assert s.stats()["shards"][0]["counters"].get("rejected_429", 0) == 0


def test_a_closed_sessions_unretrieved_results_make_room_for_another_trainer():
    """Found by a break test: a trainer that filled the arena, then closed its session
    (``sessions/{id}/finish``, what tinker >= 0.27 sends on ``ServiceClient.close()``) without
    retrieving, locked every other trainer's samples of that size out (429, retried silently by
    the SDK) for futures.completed_ttl_s (30 min). Now the finish reaches every shard and those
    results are evicted for the next sample that finds no room; they answer 410. A finish for a
    session ID the server did not sign changes nothing."""
    with RunningServer(env=TINY_ONE_SHARD) as s:
        api = Api(s.url)
        st, _, b = api.post("/api/v1/create_session", {"tags": [], "user_metadata": {}})
        session = json.loads(b)["session_id"]
        st, _, b = api.post("/api/v1/create_sampling_session", {"session_id": session, "base_model": BASE_MODEL})
        ssid_a = json.loads(b)["sampling_session_id"]
        big = {"num_samples": 1, "sampling_params": {"max_tokens": 32768, "seed": 1}}
        rids = [json.loads(api.post("/api/v1/asample", {**big, "sampling_session_id": ssid_a, "seq_id": i,
                                                         "prompt": {"chunks": [{"tokens": [i, 5]}]}})[2])["request_id"]
                for i in range(3)]
        time.sleep(1.0)  # all three completed, none retrieved
        ssid_b = api.sampling_session()
        ask_b = {**big, "sampling_session_id": ssid_b, "seq_id": 0, "prompt": {"chunks": [{"tokens": [7, 7]}]}}
        assert api.post("/api/v1/asample", ask_b)[0] == 429
        assert api.post("/api/v1/sessions/s-not-ours/finish", {"reason": {"type": "success"}}) [:1] == (200,)
        assert api.post("/api/v1/asample", ask_b)[0] == 429
        st, _, b = api.post(f"/api/v1/sessions/{session}/finish", {"reason": {"type": "success"}})
        assert (st, json.loads(b)) == (200, {})
        deadline = time.monotonic() + 5
        st = 429
        while st == 429 and time.monotonic() < deadline:  # (the one-way message reaches the shard first)
            st, _, b = api.post("/api/v1/asample", ask_b)
            time.sleep(0.05)
        assert st == 200, b
        rid_b = json.loads(b)["request_id"]
        gone = [api.post("/api/v1/retrieve_future", {"request_id": r}) for r in rids]
        assert [g[0] for g in gone].count(410) >= 1
        assert all(json.loads(g[2])["error"].startswith("future abandoned: never retrieved, and its session was closed")
                   for g in gone if g[0] == 410), [(g[0], g[2][:300]) for g in gone]
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid_b})
        assert st == 200 and len(json.loads(b)["sequences"][0]["tokens"]) == 32768
        assert s.stats()["shards"][0]["counters"]["evicted_abandoned"] == [g[0] for g in gone].count(410)
