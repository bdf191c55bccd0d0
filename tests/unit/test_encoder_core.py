"""EncoderCore in-process (no sockets): reservations, eviction, stage counts, TTL sweep.

The engine is a stand-in object whose ``post`` returns the simulator's body for the request,
so the shard's bookkeeping can be checked step by step against exact arena numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random

import pytest

from shardserver.config import config_from_mapping
from shardserver.engine_sim import SimConfig, render_completion
from shardserver.ids import IdSigner
from shardserver.messages import (
    CancelReply,
    CancelRequest,
    PollGone,
    PollRequest,
    RefusalReason,
    SessionPollReply,
    SessionPollRequest,
    SubmitRefused,
    SubmitRequest,
)
from shardserver.metrics import future_stages
from shardserver.shm.arena import ArenaWriter, create_segment, segment_name, unlink_segment
from shardserver.workers.encoder import EncoderCore
from shardserver.api.sampling import REFUSAL_STATUS

SIM = SimConfig.from_mapping({"model_name": "m"})


class SimEngine:
    """``post(body, headers)`` like EngineClient, answered by the simulator in-process."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.answer_bytes = 0  # answers returned and not yet released (EngineClient.answer_bytes)

    async def post(self, body: bytes, headers: dict[str, str], ids=None) -> bytes:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        data = render_completion(json.loads(body), SIM)
        self.answer_bytes += len(data)
        return data

    def release(self, data: bytes) -> None:
        self.answer_bytes -= len(data)


@pytest.fixture
def core():
    name = segment_name(os.getpid(), "c0ffee00", random.randrange(10**6), 0)
    create_segment(name, 1 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1}}, env={})
    c = EncoderCore(cfg, 0, arena, SimEngine(), IdSigner(b"k", "0badcafe"))
    yield c
    arena.close()
    unlink_segment(name)


def _meta(seq: int, max_tokens: int, n: int = 1, sid: str = "s") -> tuple[SubmitRequest, bytes]:
    body = {"model": "m", "prompt": [seq % 50, 7], "n": n, "max_tokens": max_tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "logprobs": 1, "return_token_ids": True, "seed": seq}
    meta = SubmitRequest(sid=sid, seq=seq, owner="", n=n, prompt_logprobs=False, topk=0,
                         reserve_bytes=n * (8 * max_tokens + 32) + 32)
    return meta, json.dumps(body).encode()


def _check_stages(c: EncoderCore) -> None:
    assert c.stages() == future_stages(c.table.values())
    assert sum(c.state_counts.values()) == len(c.table)


def test_reserve_then_shrink_keeps_exact_bytes(core):
    async def go():
        meta, body = _meta(1, 1000)
        rid = core.submit(meta, body).request_id
        reserved = ArenaWriter.slot_bytes(8 * 1000 + 64)
        assert core.reserved_bytes == reserved and core.arena.used_bytes == reserved
        _check_stages(core)
        await asyncio.sleep(0.05)
        e = core.table[rid]
        assert e.state == "done" and e.reserve is None and core.reserved_bytes == 0
        # The slot shrank to the result: 1000 tokens x (4 + 4) bytes + framing.
        assert core.arena.used_bytes == ArenaWriter.slot_bytes(e.slot.length) and 8000 < e.slot.length < 8032
        _check_stages(core)

    asyncio.run(go())


def test_fragmented_arena_never_fails_an_accepted_request(core):
    """Delivered results retrieved out of order leave holes; a request is only accepted with a
    contiguous reservation, so its completion always fits (the 2nd review's repro)."""
    async def go():
        rids = []
        for i in range(4):  # 4 x ~240 KB in a 1 MiB arena
            meta, body = _meta(i, 30000)
            rids.append(core.submit(meta, body).request_id)
        await asyncio.sleep(0.3)
        assert [core.table[r].state for r in rids] == ["done"] * 4
        core.delivered_ok(rids[0])
        core.delivered_ok(rids[2])
        _check_stages(core)
        meta, body = _meta(10, 30000, n=2)  # ~480 KB: needs two adjacent holes, which do not exist
        reply = core.submit(meta, body)
        assert isinstance(reply, SubmitRefused) and reply.reason is RefusalReason.NO_ROOM
        assert REFUSAL_STATUS[reply.reason] == 429 and "no free block" in reply.message
        assert core.counters["evicted"] == 2  # both delivered ones went; undelivered B and D stay
        assert core.table[rids[1]].state == core.table[rids[3]].state == "done"
        meta, body = _meta(11, 30000)  # a ~240 KB request fits in a freed hole
        rid = core.submit(meta, body).request_id
        await asyncio.sleep(0.3)
        assert core.table[rid].state == "done"
        assert core.counters.get("failed_server", 0) == 0
        _check_stages(core)

    asyncio.run(go())


@contextlib.contextmanager
def _core_with(futures: dict, arena_bytes: int = 1 << 20, **sections: dict):
    """An EncoderCore on a fresh arena of ``arena_bytes`` with these ``futures`` keys (and other
    config sections); the arena is closed and its segment unlinked on leaving."""
    name = segment_name(os.getpid(), "c0ffee01", random.randrange(10**6), 0)
    create_segment(name, arena_bytes)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1}, "futures": futures, **sections}, env={})
    try:
        yield EncoderCore(cfg, 0, arena, SimEngine(), IdSigner(b"k", "0badcafe"))
    finally:
        arena.close()
        unlink_segment(name)


@pytest.mark.parametrize("abandoned_after_s", [1.0, 0.0])
def test_results_never_retrieved_are_evicted_for_new_work_once_abandoned(abandoned_after_s):
    """Found by a break test: a trainer that submitted until the arena was full, then crashed
    (or finished its session) without retrieving, locked every later sample of that size out
    (429, which the SDK retries silently) for futures.completed_ttl_s, 30 min. Now a SUBMIT
    that finds no room evicts results completed over futures.abandoned_after_s ago and never
    delivered, oldest first; they answer 410 and count as evicted_abandoned. Younger ones stay,
    and 0 keeps the old rule (never)."""

    async def go():
        rids = []
        for i in range(4):  # 4 x ~240 KB in a 1 MiB arena: full
            meta, body = _meta(i, 30000)
            rids.append(core.submit(meta, body).request_id)
            await asyncio.sleep(0.05)  # completions in submission order
        await asyncio.sleep(0.2)
        assert [core.table[r].state for r in rids] == ["done"] * 4
        meta, body = _meta(10, 30000)
        refused = core.submit(meta, body)  # too young to count as abandoned
        assert isinstance(refused, SubmitRefused) and refused.reason is RefusalReason.NO_ROOM
        assert core.counters.get("evicted_abandoned", 0) == 0
        await asyncio.sleep(0.9)
        core._abandoned_scan_at = 0.0  # (the refusal above holds further walks back for 1 s)
        reply = core.submit(meta, body)
        if not abandoned_after_s:
            assert isinstance(reply, SubmitRefused) and reply.reason is RefusalReason.NO_ROOM
            assert [core.table[r].state for r in rids] == ["done"] * 4
            return
        assert not isinstance(reply, SubmitRefused)
        # the two oldest: each result's slot shrank to its size, so one hole is a little short
        assert core.counters["evicted_abandoned"] == 2
        assert [core.table[r].state for r in rids] == ["gone", "gone", "done", "done"]
        gone = await core.poll(PollRequest(fid=rids[0], timeout=0))
        assert isinstance(gone, PollGone) and gone.reason == (
            "abandoned: completed over 1 s ago and never retrieved; evicted to make room "
            "(futures.abandoned_after_s)")
        await asyncio.sleep(0.3)
        assert core.table[reply.request_id].state == "done"
        _check_stages(core)

    with _core_with({"abandoned_after_s": abandoned_after_s}) as core:
        asyncio.run(go())


def test_results_of_a_session_its_client_closed_are_evicted_for_new_work_at_once():
    """The SDK closes its session (sessions/{id}/finish, ServiceClient.close() in tinker >= 0.27)
    with results never retrieved: a SUBMIT that finds no room evicts those at once, long before
    futures.abandoned_after_s, and only those; another session's results stay."""
    from shardserver.ids import SamplingSession
    from shardserver.messages import SessionFinished

    signer = IdSigner(b"k", "0badcafe")  # (the core's: the same key and run)
    sessions = [signer.mint_session_id("") for _ in range(2)]
    ssids = [signer.mint_sampling_session_id(SamplingSession(session_id=s, base_model="m", model_path=None, seq=0))
             for s in sessions]

    async def go():
        rids = []
        for i in range(4):  # sessions 0, 0, 1, 1: the arena is full
            meta, body = _meta(i, 30000, sid=ssids[i // 2])
            rids.append(core.submit(meta, body).request_id)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        meta, body = _meta(10, 30000, sid=ssids[1])
        assert core.submit(meta, body).reason is RefusalReason.NO_ROOM
        assert await core.handle(SessionFinished(session=sessions[0][-16:], owner="other"), b"") is None
        assert core.submit(meta, body).reason is RefusalReason.NO_ROOM  # another owner's: not this session
        await core.handle(SessionFinished(session=sessions[0][-16:], owner=""), b"")
        reply = core.submit(meta, body)
        assert not isinstance(reply, SubmitRefused)
        assert core.counters["evicted_abandoned"] == 2 and core.counters["sessions_finished"] == 2
        assert [core.table[r].state for r in rids] == ["gone", "gone", "done", "done"]
        gone = await core.poll(PollRequest(fid=rids[0], timeout=0))
        assert isinstance(gone, PollGone) and gone.reason == (
            "abandoned: never retrieved, and its session was closed by the client (sessions/{id}/finish); "
            "evicted to make room (futures.abandoned_after_s)")
        _check_stages(core)

    with _core_with({"abandoned_after_s": 300}) as core:
        asyncio.run(go())


def test_sweep_drops_expired_and_counts_stay_consistent(core):
    async def go():
        core.engine.gate = asyncio.Event()
        pending_meta, body = _meta(20, 10)
        pending = core.submit(pending_meta, body).request_id
        core.engine.gate.set()
        await asyncio.sleep(0.05)
        meta, body = _meta(21, 10)
        done = core.submit(meta, body).request_id
        await asyncio.sleep(0.05)
        core.delivered_ok(done)
        _check_stages(core)
        import time

        assert core.sweep(time.monotonic() + core.cfg.futures.retrieved_ttl_s + 1) == 1  # the delivered one
        assert done not in core.table and pending in core.table
        assert core.sweep(time.monotonic() + core.cfg.futures.completed_ttl_s + 1) == 1
        assert core.table == {} and core.arena.used_bytes == 0 and core.reserved_bytes == 0
        _check_stages(core)

    asyncio.run(go())


def test_close_ends_pending_futures_and_engine_calls(core):
    async def go():
        core.engine.gate = asyncio.Event()  # the engine never answers
        meta, body = _meta(30, 10)
        rid = core.submit(meta, body).request_id
        await asyncio.sleep(0.01)
        task = core.table[rid].task
        core.close("server shutting down")
        await asyncio.sleep(0)
        assert task.cancelled()
        assert core.table[rid].state == "gone" and core.table[rid].gone_reason == "server shutting down"
        assert core.reserved_bytes == 0 and core.arena.used_bytes == 0
        assert await core.poll(PollRequest(fid=rid)) == PollGone(reason="server shutting down")
        _check_stages(core)

    asyncio.run(go())


def test_submit_after_close_is_refused_stopping_and_answers_503(core):
    """A gateway SIGKILLed and restarted at once: its encoders wind down while their event loops
    still read control frames, so a SUBMIT can arrive after ``close()`` (and after the journal
    was closed). Accepting it made a future nobody would ever answer or report (a poller-mode
    SDK waited for it forever); it is refused as STOPPING, which the front-end answers 503 with
    Retry-After (the SDK retries the same seq_id on the next run)."""
    async def go():
        meta, body = _meta(31, 10)
        core.close("server shutting down")
        reply = core.submit(meta, body)
        assert reply == SubmitRefused(reason=RefusalReason.STOPPING, message=(
            "shard 0 is shutting down; retry (the gateway's next run takes the request)"))
        assert core.table == {} and core.by_key == {} and core.arena.used_bytes == 0
        assert core.counters["rejected_stopping"] == 1 and core.counters["submitted"] == 0
        assert REFUSAL_STATUS[RefusalReason.STOPPING] == 503

    asyncio.run(go())


def test_engine_probe_is_a_constructor_argument(core):
    from shardserver.health import EngineProbe

    assert core.stats().engine is None  # no probe: readiness does not wait for this shard
    probe = EngineProbe("http://127.0.0.1:9", interval_s=0, timeout_s=1, shard=0)  # probing disabled
    c = EncoderCore(core.cfg, 0, core.arena, core.engine, core.signer, engine_probe=probe)
    eng = c.stats().engine
    assert (eng.ok, eng.reason, eng.age_s) == (True, "engine probing disabled (engine.health_interval_s = 0)", None)


def test_key_usage_follows_each_future_to_the_end():
    """auth.mode = "keys": what a key holds (pending, request bytes, arena) is counted at SUBMIT,
    moved from the reservation to the result at completion, and released at delivery, failure,
    expiry and close; a key with nothing left has no record."""
    import time

    name = segment_name(os.getpid(), "c0ffee00", random.randrange(10**6), 0)
    create_segment(name, 1 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1, "max_pending": 8}, "auth": {"mode": "keys", "key_share": 0.5}},
                              env={})
    engine = SimEngine()
    c = EncoderCore(cfg, 0, arena, engine, IdSigner(b"k", "0badcafe"))

    def submit(seq: int, owner: str, max_tokens: int = 100):
        meta, body = _meta(seq, max_tokens)
        return c.submit(SubmitRequest(sid=meta.sid, seq=seq, owner=owner, n=1, reserve_bytes=meta.reserve_bytes),
                        body), len(body)

    async def go():
        engine.gate = asyncio.Event()
        r1, b1 = submit(1, "a")
        r2, b2 = submit(2, "a")
        u = c.owners["a"]
        reserve = ArenaWriter.slot_bytes(8 * 100 + 64)
        assert (u.pending, u.request_bytes, u.arena_bytes) == (2, b1 + b2, 2 * reserve)
        for i in range(3, 5):
            assert submit(i, "a")[0].request_id
        refused, _ = submit(7, "a")  # a fifth pending future: over half of shards.max_pending=8
        assert isinstance(refused, SubmitRefused) and refused.reason == RefusalReason.KEY_QUOTA
        assert "shards.max_pending (auth.key_share=0.5 x 8 = 4)" in refused.message
        assert submit(8, "b")[0].request_id  # another key is not affected
        engine.gate.set()
        await asyncio.sleep(0.1)
        # Completed, not delivered: no longer pending, the results stay on the key's share.
        results = [e.slot.capacity for e in c.table.values() if e.owner == "a"]
        assert len(results) == 4 and all(e.state == "done" for e in c.table.values())
        assert c.owners["a"].pending == 0 and c.owners["a"].request_bytes == 0
        assert c.owners["a"].arena_bytes == sum(results) < 4 * reserve  # the results, shrunk from the reservations
        for fid, e in list(c.table.items()):
            if e.owner == "a":
                c.delivered_ok(fid)
        assert "a" not in c.owners  # delivered results can be evicted: nothing counted any more
        assert c.owners["b"].arena_bytes > 0
        c.sweep(time.monotonic() + cfg.futures.completed_ttl_s + 1)  # b's result expires undelivered
        assert c.owners == {}
        engine.gate = asyncio.Event()
        submit(9, "c")
        c.close()
        assert c.owners == {}

    try:
        asyncio.run(go())
    finally:
        arena.close()
        unlink_segment(name)


def test_a_keys_abandoned_results_make_room_within_its_own_share():
    """auth.mode = "keys": a trainer that crashed with its key's share of the arena full of
    results it never retrieved locked the restarted trainer (the same key) out with KEY_QUOTA
    429 for futures.completed_ttl_s. Once abandoned (futures.abandoned_after_s), that key's own
    results are evicted for its new sample; another key's results are never touched."""

    def submit(seq: int, owner: str):
        meta, body = _meta(seq, 30000)  # ~240 KB: two fill a key's half of the 1 MiB arena
        return c.submit(SubmitRequest(sid=meta.sid, seq=seq, owner=owner, n=1, reserve_bytes=meta.reserve_bytes),
                        body)

    async def go():
        a = [submit(1, "a").request_id, submit(2, "a").request_id]
        b = submit(3, "b").request_id
        await asyncio.sleep(0.3)
        refused = submit(4, "a")
        assert isinstance(refused, SubmitRefused) and refused.reason == RefusalReason.KEY_QUOTA
        await asyncio.sleep(1.0)
        c._abandoned_scan_at = 0.0  # (the refusal above holds further walks back for 1 s)
        assert not isinstance(submit(5, "a"), SubmitRefused)
        assert c.counters["evicted_abandoned"] == 1
        assert [c.table[f].state for f in (*a, b)] == ["gone", "done", "done"]

    with _core_with({"abandoned_after_s": 1.0}, auth={"mode": "keys", "key_share": 0.5}) as c:
        asyncio.run(go())


def _keyed_submit(c: EncoderCore, seq: int, owner: str, max_tokens: int):
    """SUBMIT a 1-sample request of ``max_tokens`` as API key owner ``owner`` (session "s")."""
    meta, body = _meta(seq, max_tokens)
    return c.submit(SubmitRequest(sid=meta.sid, seq=seq, owner=owner, n=1, reserve_bytes=meta.reserve_bytes), body)


def test_a_keys_cached_json_forms_stay_within_its_share():
    """Found by a break test (auth.mode = "keys"): the JSON form cached for an old SDK's poll
    (Accept: application/json, ~3.3x the proto) counted on no share, so a key that filled its
    share with results and polled them as JSON (never taking the bodies) filled the rest of the
    arena, and a key holding nothing got 429 for a request well under its share. Now a JSON
    form that would pass its key's share is not cached (the front-end derives it)."""
    from shardserver.messages import ResultForm

    async def go():
        a = [_keyed_submit(c, i, "a", 7500).request_id for i in range(8)]  # 8 x 60032 B: 480256 of a's 524288
        for f in a:
            await c.poll(PollRequest(fid=f, timeout=10))  # (held until it completes)
        results = sum(c.table[f].slot.capacity for f in a)
        assert results == 8 * 60032 and c.owners["a"].arena_bytes == results
        forms = [(await c.poll(PollRequest(fid=f, want=ResultForm.JSON))).form for f in a]
        b = _keyed_submit(c, 100, "b", 30000)  # 240 KB: under half of b's share, b holds nothing
        assert not isinstance(b, SubmitRefused), b.message
        # a 196032-byte JSON form would pass a's share: the front-end derives each one
        assert forms == [ResultForm.PROTO] * 8 and all(c.table[f].json_slot is None for f in a)
        assert c.counters["json_uncached"] == 8 and c.owners["a"].arena_bytes == results
        await c.poll(PollRequest(fid=b.request_id, timeout=10))
        assert c.table[b.request_id].state == "done"

    with _core_with({}, auth={"mode": "keys", "key_share": 0.5}) as c:
        asyncio.run(go())


def test_a_cached_json_form_counts_on_its_keys_share_until_freed():
    """A JSON form cached for an undelivered result counts on its key's share, once however
    often it is polled, and leaves it with the result: at delivery, cancel, ack and TTL expiry."""
    import time

    from shardserver.messages import ResultForm

    async def go():
        fids = [_keyed_submit(c, i, "a", 2000).request_id for i in range(4)]
        for f in fids:
            await c.poll(PollRequest(fid=f, timeout=10))  # (held until it completes)
        es = [c.table[f] for f in fids]
        held = sum(e.slot.capacity for e in es)
        assert c.owners["a"].arena_bytes == held
        for e in es:
            for _ in range(2):  # the second poll reuses the cached form
                reply = await c.poll(PollRequest(fid=e.fid, want=ResultForm.JSON))
                assert reply.form == ResultForm.JSON and reply.length == e.json_slot.length
        forms = [e.json_slot.capacity for e in es]
        assert all(f > 3 * e.slot.capacity for f, e in zip(forms, es)) and c.counters.get("json_uncached", 0) == 0
        held += sum(forms)
        assert c.owners["a"].arena_bytes == held == c.arena.used_bytes
        step = [e.slot.capacity + f for e, f in zip(es, forms)]
        c.delivered_ok(fids[0])
        held -= step[0]
        assert c.owners["a"].arena_bytes == held
        assert c.cancel(CancelRequest(fid=fids[1])).was == "done"
        held -= step[1]
        assert c.owners["a"].arena_bytes == held
        await c.session_poll(_sp(sid="s", acks=[fids[2]]))
        held -= step[2]
        assert c.owners["a"].arena_bytes == held == step[3]
        c.sweep(time.monotonic() + c.cfg.futures.completed_ttl_s + c.cfg.futures.retrieved_ttl_s + 1)
        assert c.owners == {} and c.table == {}
        c.arena.release_held(time.monotonic() + 3600)
        assert c.arena.used_bytes == 0

    with _core_with({}, auth={"mode": "keys", "key_share": 0.5}) as c:
        asyncio.run(go())


# -- the session-wide poller (SESSION_POLL) and CANCEL ----------------------------------------------
def _sp(sid="s", clone=0, after=0, upto=None, limit=100, acks=(), timeout=0.0) -> SessionPollRequest:
    import time

    return SessionPollRequest(sid=sid, clone=clone, after=after, upto=time.monotonic_ns() if upto is None else upto,
                              limit=limit, acks=list(acks), timeout=timeout)


def test_session_poll_reports_each_completion_once_per_session_and_clone(core):
    async def go():
        rids = [core.submit(*_meta(i, 10)).request_id for i in range(3)]
        other = core.submit(*_meta(5, 10, sid="t")).request_id               # another session
        clone = core.submit(*_meta(2 * 10**9 + 1, 10)).request_id            # clone 2 of session s
        await asyncio.sleep(0.05)
        r = await core.session_poll(_sp())
        assert [e.fid for e in r.events] == rids and not r.more and not r.woke
        stamps = [e.stamp for e in r.events]
        assert stamps == sorted(stamps) and len(set(stamps)) == 3
        for e in r.events:  # finished, with the proto's exact size
            assert e.ok and e.size == core.table[e.fid].slot.length
        assert [e.fid for e in (await core.session_poll(_sp(sid="t"))).events] == [other]
        assert [e.fid for e in (await core.session_poll(_sp(clone=2))).events] == [clone]
        # upto bounds the answer; limit cuts it (more); after forgets what the client has seen.
        assert [e.fid for e in (await core.session_poll(_sp(upto=stamps[1]))).events] == rids[:2]
        r = await core.session_poll(_sp(limit=2))
        assert [e.fid for e in r.events] == rids[:2] and r.more
        r = await core.session_poll(_sp(after=stamps[0]))
        assert [e.fid for e in r.events] == rids[1:]
        assert list(core.session_logs[("s", 0)]) == rids[1:]
        assert (await core.session_poll(_sp(after=stamps[2]))) == SessionPollReply()
        assert ("s", 0) not in core.session_logs and rids[0] in core.table  # forgotten by the log, still held
        _check_stages(core)

    asyncio.run(go())


def test_session_poll_acks_free_results_of_that_session_only(core):
    async def go():
        core.engine.gate = asyncio.Event()
        pending = core.submit(*_meta(1, 10)).request_id
        core.engine.gate.set()
        await asyncio.sleep(0.05)
        done = core.submit(*_meta(2, 10)).request_id
        theirs = core.submit(*_meta(3, 10, sid="t")).request_id
        await asyncio.sleep(0.05)
        used = core.arena.used_bytes
        slot = core.table[done].slot
        await core.session_poll(_sp(acks=[done, theirs, "f-unknown"]))
        assert done not in core.table and theirs in core.table and core.counters["acked"] == 1
        assert core.arena.used_bytes == used - ArenaWriter.slot_bytes(slot.length)
        assert await core.poll(PollRequest(fid=done)) == PollGone(reason="unknown or expired future (its result was "
                                                                         "not kept)")
        assert [e.fid for e in (await core.session_poll(_sp())).events] == [pending]
        _check_stages(core)

    asyncio.run(go())


def test_a_session_poll_after_the_arena_closed_acks_without_touching_it(core):
    """Found by a break test: on SIGTERM to the whole process group, an encoder closes its arena
    while its control connections may still deliver a SESSION_POLL; the poll's acks freed their
    results' slots in the closed mapping (``TypeError: argument must be read-write bytes-like
    object, not mmap.mmap`` in the log). Freeing after close is now nothing (the segment goes with
    the process); the acks are still taken (the futures leave the table)."""
    async def go():
        done = core.submit(*_meta(2, 10)).request_id
        await asyncio.sleep(0.05)
        assert core.table[done].state == "done"
        core.close("server shutting down")
        core.arena.close()
        await core.session_poll(_sp(acks=[done]))
        assert done not in core.table and core.counters["acked"] == 1

    asyncio.run(go())


def test_ttl_heap_stays_bounded_when_futures_are_acked_and_ttls_still_fire(core, monkeypatch):
    """Every future pushes a TTL heap item at SUBMIT (futures.pending_ttl_s, 5 h by default), at
    completion and at delivery; an ack drops the future but used to leave its items in the heap
    until their deadlines: ~3 items (~0.5 KB with the fid) per result for up to an hour, so a
    gateway at 500 results/s grew by ~0.8 GB (burst-32k with 64 tokens, 150,000 results: encoder
    PSS 73 -> 141 MiB). The heap is rebuilt from the table once stale items dominate."""
    import shardserver.workers.encoder as enc

    monkeypatch.setattr(enc, "HEAP_SLACK", 64)

    async def go():
        keep = core.submit(*_meta(0, 10)).request_id  # completed, never delivered: its TTL must still fire
        for seq in range(1, 601):
            rid = core.submit(*_meta(seq, 10)).request_id
            await asyncio.sleep(0)
            for _ in range(50):
                if core.table[rid].state != "pending":
                    break
                await asyncio.sleep(0.001)
            core.delivered_ok(rid)
            await core.session_poll(_sp(acks=[rid]))
            assert len(core._timers) <= 2 * 2 + 64 + 1  # the table never held more than 2 futures at a push
        assert list(core.table) == [keep] and core.counters["acked"] == 600
        assert core.counters["ttl_heap_rebuilds"] >= 1
        # The kept future's TTL item survived the rebuilds: it expires at its deadline, not before.
        deadline = core.table[keep].deadline
        assert core.sweep(now=deadline - 1.0) == 0 and keep in core.table
        assert core.sweep(now=deadline) == 1 and keep not in core.table
        _check_stages(core)

    asyncio.run(go())


def test_session_poll_holds_until_a_completion_or_a_newer_poll(core):
    async def go():
        import time

        core.engine.gate = asyncio.Event()
        t0 = time.monotonic()
        assert await core.session_poll(_sp(timeout=0.2)) == SessionPollReply()   # nothing came: timed out
        assert 0.15 < time.monotonic() - t0 < 2
        core.submit(*_meta(1, 10))
        held = asyncio.ensure_future(core.session_poll(_sp(timeout=20)))
        await asyncio.sleep(0.05)
        assert not held.done() and ("s", 0) in core.session_waiters
        core.engine.gate.set()                                                   # the completion arrives
        assert await asyncio.wait_for(held, 5) == SessionPollReply(woke=True)
        assert core.session_waiters == {}
        # A completion newer than `after` but past `upto` wakes at once; a newer poll supersedes.
        assert await core.session_poll(_sp(upto=1, timeout=20)) == SessionPollReply(woke=True)
        stamp = next(iter(core.session_logs[("s", 0)].values()))
        held = asyncio.ensure_future(core.session_poll(_sp(after=stamp, timeout=20)))
        await asyncio.sleep(0.05)
        assert not held.done()
        assert await core.session_poll(_sp(after=stamp)) == SessionPollReply()
        assert await asyncio.wait_for(held, 5) == SessionPollReply(woke=True)

    asyncio.run(go())


def test_cancel_pending_stops_the_engine_call_and_frees_the_reservation(core):
    async def go():
        core.engine.gate = asyncio.Event()  # the engine never answers
        rid = core.submit(*_meta(1, 1000)).request_id
        await asyncio.sleep(0.01)
        task = core.table[rid].task
        assert core.reserved_bytes == ArenaWriter.slot_bytes(8 * 1000 + 64)
        waiting = asyncio.ensure_future(core.poll(PollRequest(fid=rid, timeout=20)))
        await asyncio.sleep(0.01)
        assert core.cancel(CancelRequest(fid=rid)) == CancelReply(was="pending")
        await asyncio.sleep(0)
        assert task.cancelled()
        assert core.reserved_bytes == 0 and core.arena.used_bytes == 0 and rid not in core.table
        assert await asyncio.wait_for(waiting, 5) == PollGone(reason="cancelled by the client")
        assert core.cancel(CancelRequest(fid=rid)) == CancelReply(was="unknown")
        assert core.session_logs == {}  # a cancelled future is not reported to the poller
        assert core.counters["cancelled_pending"] == 1
        # A completed one: its result is freed.
        core.engine.gate.set()
        done = core.submit(*_meta(2, 10)).request_id
        await asyncio.sleep(0.05)
        assert core.arena.used_bytes > 0
        assert core.cancel(CancelRequest(fid=done)) == CancelReply(was="done")
        assert core.arena.used_bytes == 0 and core.session_logs == {}
        _check_stages(core)

    asyncio.run(go())


def test_pending_ttl_makes_the_future_gone_and_reports_it(core):
    async def go():
        import time

        core.engine.gate = asyncio.Event()
        rid = core.submit(*_meta(1, 10)).request_id
        await asyncio.sleep(0.01)
        task = core.table[rid].task
        assert core.sweep(time.monotonic() + core.cfg.futures.pending_ttl_s + 1) == 1
        await asyncio.sleep(0)
        assert task.cancelled() and core.reserved_bytes == 0
        e = core.table[rid]
        assert e.state == "gone" and e.gone_reason.startswith("expired")
        assert await core.poll(PollRequest(fid=rid)) == PollGone(reason=e.gone_reason)
        r = await core.session_poll(_sp())
        assert [(ev.fid, ev.ok, ev.size) for ev in r.events] == [(rid, False, 0)]
        assert core.counters["expired"] == 1
        # Dropped after futures.completed_ttl_s, counted as expired once.
        assert core.sweep(time.monotonic() + core.cfg.futures.pending_ttl_s + core.cfg.futures.completed_ttl_s + 2) == 1
        assert core.table == {} and core.counters["expired"] == 1 and core.session_logs == {}
        _check_stages(core)

    asyncio.run(go())


class StepEngine(SimEngine):
    """SimEngine whose calls finish one per permit the test grants (``answer(k)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = asyncio.Semaphore(0)

    async def post(self, body: bytes, headers: dict[str, str], ids=None) -> bytes:
        self.calls += 1
        await self.permits.acquire()
        data = render_completion(json.loads(body), SIM)
        self.answer_bytes += len(data)
        return data

    async def answer(self, k: int) -> None:
        for _ in range(k):
            self.permits.release()
        for _ in range(20):  # let the k calls finish and their replacements start
            await asyncio.sleep(0)


@pytest.mark.parametrize("budget", [1 << 20, 0])
def test_answers_held_over_the_budget_are_not_replaced_by_new_engine_calls(budget):
    """engine.answer_budget_bytes: while the engine answers held undecoded pass the budget, a
    finished engine call is not replaced (the limit shrinks by one); back under it, each finished
    call is replaced and the limit grows by one per LIMIT_GROW_EVERY (4) of them. 0: off."""
    from shardserver.workers.encoder import LIMIT_GROW_EVERY

    assert LIMIT_GROW_EVERY == 4
    name = segment_name(os.getpid(), "c0ffee02", random.randrange(10**6), 0)
    create_segment(name, 4 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1}, "engine": {"pool_size": 16, "answer_budget_bytes": budget}},
                              env={})
    engine = StepEngine()
    core = EncoderCore(cfg, 0, arena, engine, IdSigner(b"k", "0badcafe"))

    async def go():
        rids = [core.submit(*_meta(i, 100)).request_id for i in range(40)]
        await asyncio.sleep(0)
        assert engine.calls == 16 and core.engine_calls == 16 and core.engine_call_limit == 16
        engine.answer_bytes += 2 << 20  # 2 MiB of other answers still being received
        await engine.answer(4)
        if budget:
            # 4 calls finished over the budget: none replaced, the limit is 12.
            assert (engine.calls, core.engine_calls, core.engine_call_limit) == (16, 12, 12)
            assert core.counters["engine_calls_held_back"] == 4
        else:
            assert (engine.calls, core.engine_calls, core.engine_call_limit) == (20, 16, 16)
        engine.answer_bytes -= 2 << 20  # those answers were decoded
        await engine.answer(4)
        if budget:
            # Under the budget: each finished call replaced, and one more after the 4th.
            assert (engine.calls, core.engine_calls, core.engine_call_limit) == (21, 13, 13)
            st = core.stats()
            assert (st.engine_call_limit, st.engine_calls, st.engine_answer_bytes) == (13, 13, 0)
        else:
            assert (engine.calls, core.engine_calls, core.engine_call_limit) == (24, 16, 16)
        # Never below min(8, pool_size): 2 MiB held again while every call finishes.
        engine.answer_bytes += 2 << 20
        await engine.answer(40)
        assert core.engine_call_limit == (8 if budget else 16)
        engine.answer_bytes -= 2 << 20
        await engine.answer(40)
        assert [core.table[r].state for r in rids] == ["done"] * 40
        assert engine.answer_bytes == 0 and core.engine_calls == 0
        assert core.counters.get("engine_calls_held_back", 0) == (4 + 5 if budget else 0)

    try:
        asyncio.run(go())
    finally:
        core.close()
        arena.close()
        unlink_segment(name)


def test_stats_flushes_the_prometheus_counts_kept_since_the_last_flush(core):
    """The shard's counters and timings reach Prometheus when STATS is answered (a /metrics
    scrape asks every encoder for STATS before it reads the metric files): exact values then,
    unchanged before."""
    from shardserver.metrics import REGISTRY

    def v(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    shard = str(core.shard)
    names = [("shardserver_submits_total", {"shard": shard}),
             ("shardserver_results_completed_total", {"shard": shard}),
             ("shardserver_engine_request_duration_seconds_count", {"outcome": "ok"}),
             ("shardserver_decode_encode_duration_seconds_count", {})]
    core.flush_metrics()
    before = [v(n, **ls) for n, ls in names]

    async def go():
        for seq in range(3):
            meta, body = _meta(seq, 16)
            core.submit(meta, body)
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert core.counters["completed"] == 3
    assert [v(n, **ls) for n, ls in names] == before
    st = core.stats()
    assert st.counters["submitted"] == st.counters["completed"] == 3
    assert [v(n, **ls) - b for (n, ls), b in zip(names, before)] == [3, 3, 3, 3]


def test_a_queued_future_holds_its_entry_and_body_only_and_a_pool_wait_miss_frees_them():
    """What a future waiting for an engine connection holds (issue 12, soak memory): its entry,
    with the request body and one sid str per session (each SUBMIT is decoded into a str of its
    own); no waiter list and no job tuple. One that waited past engine.pool_wait_s leaves the
    queue with its body bytes uncounted (pending_request_bytes back to 0, no stale queue item)."""
    from shardserver.messages import Kind, decode_request, encode_meta

    name = segment_name(os.getpid(), "c0ffee01", random.randrange(10**6), 0)
    create_segment(name, 1 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1}, "engine": {"pool_size": 1, "pool_wait_s": 0.05}}, env={})
    eng = SimEngine()
    eng.gate = asyncio.Event()
    c = EncoderCore(cfg, 0, arena, eng, IdSigner(b"k", "0badcafe"))

    async def go():
        rids, bodies = [], []
        for seq in range(3):
            meta, body = _meta(seq, 10, sid="ss-" + "x" * 60)
            req = decode_request(Kind.SUBMIT, encode_meta(meta))
            rids.append(c.submit(req, body).request_id)
            bodies.append(body)
        await asyncio.sleep(0)
        first, second, third = (c.table[r] for r in rids)
        assert second.key[0] is third.key[0] is first.key[0]
        assert (second.body is bodies[1], second.task, second.waiters, second.plp) == (True, None, None, None)
        assert first.task is not None and c.engine_calls == 1 and len(c.engine_queue) == 2
        assert c.pending_request_bytes == sum(map(len, bodies))
        await asyncio.sleep(0.1)  # the two queued ones now waited past engine.pool_wait_s
        eng.gate.set()
        for _ in range(100):
            if first.state == "done":
                break
            await asyncio.sleep(0.01)
        assert [c.table[r].state for r in rids] == ["done", "gone", "gone"]
        assert c.counters["engine_pool_wait_exceeded"] == 2
        assert (c.pending_request_bytes, c._queue_stale, len(c.engine_queue)) == (0, 0, 0)
        assert all(c.table[r].body is None for r in rids)

    try:
        asyncio.run(go())
    finally:
        arena.close()
        unlink_segment(name)


class OrderEngine(SimEngine):
    """SimEngine that records the ``seed`` (the test's seq) of each request in the order sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []

    async def post(self, body: bytes, headers: dict[str, str], ids=None) -> bytes:
        self.sent.append(json.loads(body)["seed"])
        return await super().post(body, headers, ids)


@pytest.mark.parametrize("mode", ["keys", "open"])
def test_engine_queue_serves_owners_round_robin_and_stays_fifo_for_one_owner(mode):
    """Break tester f2: with one engine connection, key "a" queues a backlog, key "b" two
    requests after it: the free connection goes to each key's oldest request in turn (a cancelled
    queued request does not use up its key's turn), so "b" waits behind one of "a"'s requests,
    not all of them. Open mode (one owner, "") keeps plain submission order."""
    name = segment_name(os.getpid(), "c0ffee03", random.randrange(10**6), 0)
    create_segment(name, 1 << 20)
    arena = ArenaWriter(name)
    auth = {"mode": "keys", "key_share": 1.0} if mode == "keys" else {}
    cfg = config_from_mapping({"shards": {"count": 1}, "engine": {"pool_size": 1}, "auth": auth}, env={})
    eng = OrderEngine()
    eng.gate = asyncio.Event()
    c = EncoderCore(cfg, 0, arena, eng, IdSigner(b"k", "0badcafe"))
    # seq 1x: key a; 2x: key b (all owner "" in open mode)
    plan = [(10, "a"), (11, "a"), (12, "a"), (13, "a"), (20, "b"), (21, "b"), (14, "a")]

    async def go():
        rids = {}
        for seq, owner in plan:
            meta, body = _meta(seq, 10)
            meta = SubmitRequest(sid=meta.sid, seq=seq, owner=owner if mode == "keys" else "", n=1,
                                 reserve_bytes=meta.reserve_bytes)
            rids[seq] = c.submit(meta, body).request_id
        await asyncio.sleep(0)
        assert eng.sent == [10] and len(c.engine_queue) == 6
        assert c.cancel(CancelRequest(fid=rids[12])) == CancelReply(was="pending")
        assert c.stats().engine_queued == 5  # the cancelled one is not counted
        eng.gate.set()
        for _ in range(200):
            if len(eng.sent) == 6 and c.engine_calls == 0:
                break
            await asyncio.sleep(0.005)
        if mode == "keys":
            assert eng.sent == [10, 11, 20, 13, 21, 14]
        else:
            assert eng.sent == [10, 11, 13, 20, 21, 14]
        assert [c.table[rids[s]].state for s in eng.sent] == ["done"] * 6
        assert (len(c.engine_queue), c._queue_stale, c.stats().engine_queued) == (0, 0, 0)

    try:
        asyncio.run(go())
    finally:
        c.close()
        arena.close()
        unlink_segment(name)


def test_engine_queue_compaction_keeps_each_owners_order_and_the_turns():
    """EngineQueue.compact drops the entries that left the pending state (body None) and keeps
    each owner's FIFO and the owners' turn order; an owner left with nothing loses its turn."""
    from shardserver.workers.encoder import EngineQueue, FutureEntry

    q = EngineQueue()
    entries = [FutureEntry(fid=f"{owner}{i}", key=None, owner=owner, body=b"x")
               for owner, i in [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("a", 2)]]
    for e in entries:
        q.append(e)
    for e in entries:
        if e.fid in ("a0", "b0", "b1"):
            e.body = None
    q.compact()
    assert len(q) == 3
    assert [q.popleft().fid for _ in range(3)] == ["a1", "c0", "a2"]
    assert len(q) == 0 and not q
