"""The typed control messages: every message through the frame codec, malformed frames, and the
ERROR reply that replaces the old mixed-shape fallback (over a real Unix socket)."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile

import msgspec
import pytest

from shardserver.control import ControlClient, Frame, encode_frame, read_frame, serve_control
from shardserver.errors import ControlError
from shardserver.messages import (
    CancelReply,
    CancelRequest,
    CompletionEvent,
    ControlProtocolError,
    Delivered,
    EngineOutage,
    EngineReachability,
    ErrorReply,
    FutureState,
    Kind,
    PollDone,
    PollFailed,
    PollGone,
    PollPending,
    PollRequest,
    RefusalReason,
    ResultForm,
    SessionPollReply,
    SessionPollRequest,
    StatsReply,
    StatsRequest,
    SubmitAccepted,
    SubmitRefused,
    SubmitRequest,
    decode_error,
    decode_reply,
    decode_request,
    encode_meta,
)
from shardserver.api.sampling import REFUSAL_STATUS

pytestmark = pytest.mark.timeout(30)

STATS = StatsReply(
    shard=1, pid=4242, futures={"pending": 2, "done": 1}, delivered_held=1, arena_bytes=1 << 20,
    arena_used_bytes=8192, arena_reserved_bytes=4096, decode_encode_s=0.25,
    counters={"submitted": 3, "completed": 1}, stages={"pending": 2, "completed": 0, "retrieved": 1, "gone": 0},
    engine=EngineReachability(ok=False, reason="engine answered GET http://e/health with HTTP 503", age_s=1.5))

# (frame kind, the request kind whose reply it is (None: a request), message, blob)
CASES = [
    (Kind.SUBMIT, None, SubmitRequest(sid="ss-abc", seq=17, owner="k1", n=4, prompt_logprobs=True, topk=2,
                                      reserve_bytes=123456, prompt=[0, 7, 2**31 - 1]), b'{"prompt":[0,7]}'),
    (Kind.SUBMIT, None, SubmitRequest(sid="ss-abc", seq=0, n=1, reserve_bytes=64), b""),
    (Kind.POLL, None, PollRequest(fid="f0badcafe-x", timeout=29.5, want=ResultForm.JSON), b""),
    (Kind.DELIVERED, None, Delivered(fid="f0badcafe-y"), b""),
    (Kind.STATS, None, StatsRequest(), b""),
    (Kind.REPLY, Kind.SUBMIT, SubmitAccepted(request_id="f0badcafe-z", duplicate=True), b""),
    (Kind.REPLY, Kind.SUBMIT, SubmitRefused(reason=RefusalReason.NO_ROOM, message="no free block"), b""),
    (Kind.REPLY, Kind.SUBMIT, SubmitRefused(reason=RefusalReason.TOO_LARGE, message="bigger than the arena"), b""),
    (Kind.REPLY, Kind.POLL, PollDone(arena="ss-1-0badcafe-0.0", offset=4096, length=8021, generation=9,
                                     form=ResultForm.PROTO), b""),
    (Kind.REPLY, Kind.POLL, PollPending(), b""),
    (Kind.REPLY, Kind.POLL, PollPending(draining=True), b""),
    (Kind.REPLY, Kind.POLL, PollFailed(error="engine answered 400: bad prompt", category="user"), b""),
    (Kind.REPLY, Kind.POLL, PollGone(reason="evicted"), b""),
    (Kind.REPLY, Kind.STATS, STATS, b""),
    (Kind.REPLY, Kind.STATS, msgspec.structs.replace(STATS, engine=None), b""),
    (Kind.SESSION_POLL, None, SessionPollRequest(sid="ss-abc", clone=7, after=10**15, upto=10**15 + 9, limit=512,
                                                 acks=["f0badcafe-a", "f0badcafe-b"], timeout=25.0), b""),
    (Kind.SESSION_POLL, None, SessionPollRequest(sid="ss-abc", upto=1, limit=1), b""),
    (Kind.CANCEL, None, CancelRequest(fid="f0badcafe-c"), b""),
    (Kind.REPLY, Kind.SESSION_POLL, SessionPollReply(events=[
        CompletionEvent(fid="f0badcafe-a", stamp=10**15 + 1, ok=True, size=262150),
        CompletionEvent(fid="f0badcafe-b", stamp=10**15 + 2, ok=False)], more=True), b""),
    (Kind.REPLY, Kind.SESSION_POLL, SessionPollReply(woke=True), b""),
    (Kind.REPLY, Kind.SESSION_POLL, SessionPollReply(), b""),
    (Kind.REPLY, Kind.CANCEL, CancelReply(was="pending"), b""),
    (Kind.REPLY, Kind.CANCEL, CancelReply(was="unknown"), b""),
]


def _read_all(data: bytes) -> list[Frame]:
    async def go() -> list[Frame]:
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        out = []
        while not r.at_eof():
            out.append(await read_frame(r))
        return out

    return asyncio.run(go())


def _case_id(v: object) -> str | None:
    return type(v).__name__ if isinstance(v, msgspec.Struct) else None


@pytest.mark.parametrize("kind,reply_to,msg,blob", CASES, ids=_case_id)
def test_every_message_roundtrips_through_a_frame(kind, reply_to, msg, blob):
    data = encode_frame(kind, 0xABCDEF, msg, blob)
    meta = encode_meta(msg)
    # u32 length (after itself) | u8 kind | u32 tag | u32 meta length | meta | blob
    assert data[:13] == struct.pack("<IBII", 1 + 4 + 4 + len(meta) + len(blob), kind, 0xABCDEF, len(meta))
    assert data[13:] == meta + blob
    (frame,) = _read_all(data)
    assert frame == Frame(kind, 0xABCDEF, meta, blob)
    back = decode_request(kind, frame.meta) if reply_to is None else decode_reply(reply_to, frame.meta)
    assert type(back) is type(msg)
    assert back == msg
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(msg)


def test_exact_field_values_after_decoding():
    (f,) = _read_all(encode_frame(Kind.REPLY, 3, PollDone(arena="a.0", offset=64, length=10, generation=2,
                                                          form=ResultForm.JSON)))
    done = decode_reply(Kind.POLL, f.meta)
    assert (done.arena, done.offset, done.length, done.generation, done.form) == ("a.0", 64, 10, 2, "json")
    assert done.form is ResultForm.JSON
    (f,) = _read_all(encode_frame(Kind.SUBMIT, 1, CASES[0][2], CASES[0][3]))
    sub = decode_request(Kind.SUBMIT, f.meta)
    assert (sub.sid, sub.seq, sub.owner, sub.n, sub.prompt_logprobs, sub.topk, sub.reserve_bytes, sub.prompt) == \
        ("ss-abc", 17, "k1", 4, True, 2, 123456, [0, 7, 2**31 - 1])
    assert f.blob == b'{"prompt":[0,7]}'
    # STATS as /stats shows it: plain JSON types, every field, the engine probe nested.
    assert msgspec.to_builtins(decode_reply(Kind.STATS, encode_meta(STATS))) == {
        "shard": 1, "pid": 4242, "futures": {"pending": 2, "done": 1}, "delivered_held": 1,
        "arena_bytes": 1048576, "arena_used_bytes": 8192, "arena_reserved_bytes": 4096, "decode_encode_s": 0.25,
        "counters": {"submitted": 3, "completed": 1},
        "stages": {"pending": 2, "completed": 0, "retrieved": 1, "gone": 0},
        "engine": {"ok": False, "reason": "engine answered GET http://e/health with HTTP 503", "age_s": 1.5,
                   "models": {}},
        "pending_request_bytes": 0, "engine_calls": 0, "engine_call_limit": 0, "engine_queued": 0,
        "engine_answer_bytes": 0, "engine_answers_waiting": 0, "engine_unavailable": None}
    # An engine outage and the learned context windows (issue 10) travel the same way.
    outage = msgspec.structs.replace(
        STATS, engine=EngineReachability(ok=True, reason="", age_s=0.5, models={"Qwen/Qwen3-8B": 4096}),
        engine_unavailable=EngineOutage(for_s=3.25, reason="engine returned HTTP 503: busy", budget_s=300.0,
                                        url="http://e/v1/completions"))
    back = msgspec.to_builtins(decode_reply(Kind.STATS, encode_meta(outage)))
    assert back["engine"] == {"ok": True, "reason": "", "age_s": 0.5, "models": {"Qwen/Qwen3-8B": 4096}}
    assert back["engine_unavailable"] == {"for_s": 3.25, "reason": "engine returned HTTP 503: busy", "budget_s": 300.0,
                                          "url": "http://e/v1/completions"}


def test_session_poll_wire_form():
    """Completions travel as compact arrays (fid, stamp, ok, size); request defaults stay off the wire."""
    reply = SessionPollReply(events=[CompletionEvent(fid="fa", stamp=5, ok=True, size=300),
                                     CompletionEvent(fid="fb", stamp=6, ok=False)])
    assert msgspec.msgpack.decode(encode_meta(reply)) == {"events": [["fa", 5, True, 300], ["fb", 6, False, 0]]}
    assert msgspec.msgpack.decode(encode_meta(SessionPollRequest(sid="s", upto=9, limit=2))) == \
        {"sid": "s", "upto": 9, "limit": 2}
    back = decode_reply(Kind.SESSION_POLL, encode_meta(reply))
    assert [(e.fid, e.stamp, e.ok, e.size) for e in back.events] == [("fa", 5, True, 300), ("fb", 6, False, 0)]
    assert (back.more, back.woke) == (False, False)
    with pytest.raises(ControlProtocolError, match="missing required field `upto`"):
        decode_request(Kind.SESSION_POLL, msgspec.msgpack.encode({"sid": "s", "limit": 1}))
    with pytest.raises(ControlProtocolError, match="unknown field `ackz`"):
        decode_request(Kind.SESSION_POLL, msgspec.msgpack.encode({"sid": "s", "upto": 1, "limit": 1, "ackz": []}))
    with pytest.raises(ControlProtocolError, match=r"Expected `array`, got `str` - at `\$.acks`"):
        decode_request(Kind.SESSION_POLL, msgspec.msgpack.encode({"sid": "s", "upto": 1, "limit": 1, "acks": "f"}))
    with pytest.raises(ControlProtocolError, match="malformed reply to CANCEL"):
        decode_reply(Kind.CANCEL, encode_meta(PollPending()))


def test_poll_tags_are_the_future_states():
    for msg, state in ((PollDone(arena="a", offset=0, length=1, generation=1, form=ResultForm.PROTO), FutureState.DONE),
                       (PollPending(), FutureState.PENDING),
                       (PollFailed(error="e", category="server"), FutureState.FAILED),
                       (PollGone(reason="expired"), FutureState.GONE)):
        assert msgspec.msgpack.decode(encode_meta(msg))["state"] == state.value


def test_refusals_map_to_the_http_statuses_of_before():
    assert REFUSAL_STATUS == {RefusalReason.NO_ROOM: 429, RefusalReason.TOO_LARGE: 400,
                              RefusalReason.INVALID: 400, RefusalReason.INTERNAL: 500,
                              # issue 11: the pending bounds (the SDK backs off and retries)
                              RefusalReason.PENDING_LIMIT: 429, RefusalReason.PENDING_BYTES: 429,
                              RefusalReason.KEY_QUOTA: 429,
                              # a resubmitted (sid, seq) with a different request
                              RefusalReason.CONFLICT: 409,
                              # an encoder shutting down (the SDK retries; the next run takes it)
                              RefusalReason.STOPPING: 503}


# -- malformed frames ------------------------------------------------------------------------------
def test_unknown_request_kind_is_a_clear_error():
    with pytest.raises(ControlProtocolError, match="unknown control message kind 9"):
        decode_request(9, encode_meta(StatsRequest()))
    with pytest.raises(ControlProtocolError, match="DELIVERED has no reply"):
        decode_reply(Kind.DELIVERED, encode_meta(PollPending()))


@pytest.mark.parametrize("meta,match", [
    (b"\xc1", "malformed POLL request"),                                          # not MessagePack
    (msgspec.msgpack.encode({"timeout": 1.0}), "missing required field `fid`"),
    (msgspec.msgpack.encode({"fid": 7}), r"Expected `str`, got `int` - at `\$.fid`"),
    (msgspec.msgpack.encode({"fid": "f", "wnat": "json"}), "unknown field `wnat`"),  # a misspelt field
    (msgspec.msgpack.encode({"fid": "f", "want": "xml"}), "Invalid enum value 'xml'"),
])
def test_malformed_request_meta_is_a_clear_error(meta, match):
    with pytest.raises(ControlProtocolError, match=match):
        decode_request(Kind.POLL, meta)


def test_a_reply_of_another_kind_is_refused():
    with pytest.raises(ControlProtocolError, match="malformed reply to SUBMIT.*`outcome`"):
        decode_reply(Kind.SUBMIT, encode_meta(PollPending()))
    with pytest.raises(ControlProtocolError, match="malformed reply to POLL: Object missing required field `state`"):
        decode_reply(Kind.POLL, encode_meta(SubmitAccepted(request_id="f")))
    with pytest.raises(ControlProtocolError, match="malformed ERROR reply"):
        decode_error(encode_meta(PollGone(reason="x")))


@pytest.mark.parametrize("data,match", [
    (struct.pack("<IBI", 4, 1, 0), "length 4 out of range"),
    (struct.pack("<IBI", (1 << 30) + 1, 1, 0), "out of range"),
    (struct.pack("<IBII", 9, 1, 0, 5), "meta length 5 exceeds the frame"),
])
def test_malformed_frame_lengths_are_a_clear_error(data, match):
    with pytest.raises(ControlProtocolError, match=match):
        _read_all(data)
    assert issubclass(ControlProtocolError, ValueError)  # ends a connection like any broken frame


# -- over a real socket ------------------------------------------------------------------------------
def test_error_replies_keep_the_connection_and_fold_into_each_reply_type():
    """The encoder side answers a request it cannot handle with an ERROR frame (one shape); the
    client turns it into a 500 refusal, a failed future of category server, or ControlError."""
    seen: list[object] = []

    async def handler(msg, blob):
        seen.append((msg, blob))
        if isinstance(msg, (SubmitRequest, PollRequest, StatsRequest, SessionPollRequest, CancelRequest)) \
                and getattr(msg, "sid", "") != "ok":
            raise RuntimeError("boom")
        return SubmitAccepted(request_id="f-ok")

    async def go():
        d = tempfile.mkdtemp(prefix="ssmsg-", dir="/tmp")
        path = os.path.join(d, "enc-0.sock")
        server = await serve_control(path, handler)
        client = ControlClient(path, 0)
        client.start()
        try:
            assert await client.wait_connected(5)
            sub = SubmitRequest(sid="s", seq=1, n=1, reserve_bytes=64)
            assert await client.submit(sub, b"{}", timeout=5) == SubmitRefused(
                reason=RefusalReason.INTERNAL, message="internal error: boom")
            assert await client.poll(PollRequest(fid="f"), timeout=5) == PollFailed(
                error="internal error: boom", category="server")
            with pytest.raises(ControlError, match="encoder 0 could not answer STATS: internal error: boom"):
                await client.stats(timeout=5)
            with pytest.raises(ControlError, match="could not answer SESSION_POLL: internal error: boom"):
                await client.session_poll(SessionPollRequest(sid="s", upto=1, limit=1), timeout=5)
            with pytest.raises(ControlError, match="could not answer CANCEL: internal error: boom"):
                await client.cancel("f-x", timeout=5)
            assert seen[-1] == (CancelRequest(fid="f-x"), b"")
            # An unknown kind with a tag is answered (ERROR), and the connection stays up.
            assert await client.request(Kind.ERROR, StatsRequest(), timeout=5) == ErrorReply(
                message="unknown control message kind 129")
            ok = SubmitRequest(sid="ok", seq=2, n=1, reserve_bytes=64)
            assert await client.submit(ok, b"body", timeout=5) == SubmitAccepted(request_id="f-ok")
            assert seen[-1] == (ok, b"body")
            assert client.delivered("f-done") is True
            for _ in range(100):  # one-way: wait (bounded) for the handler to see it
                if seen[-1][0] == Delivered(fid="f-done"):
                    break
                await asyncio.sleep(0.01)
            assert seen[-1] == (Delivered(fid="f-done"), b"")
            assert client.connects == 1
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
            os.unlink(path)
            os.rmdir(d)

    asyncio.run(go())


def test_replies_made_in_one_loop_iteration_go_out_in_one_write(monkeypatch):
    """serve_control writes the replies its handlers make in one event-loop iteration together
    (one ``writelines``, in the order they were made), not one write system call each: 40
    SUBMITs sent in one write are answered with one write, every reply carrying its own tag and
    request id. A reply made in a later iteration (a POLL answered after an await) goes out by
    itself."""
    import asyncio as _asyncio

    calls: list[int] = []
    real_write, real_writelines = _asyncio.StreamWriter.write, _asyncio.StreamWriter.writelines

    def write(self, data):
        calls.append(1)
        return real_write(self, data)

    def writelines(self, data):
        data = list(data)
        calls.append(len(data))
        return real_writelines(self, data)

    monkeypatch.setattr(_asyncio.StreamWriter, "write", write)
    monkeypatch.setattr(_asyncio.StreamWriter, "writelines", writelines)

    async def handler(msg, blob):
        if isinstance(msg, PollRequest):
            await asyncio.sleep(0.05)
            return PollPending()
        return SubmitAccepted(request_id=f"f-{msg.seq}")

    async def go():
        d = tempfile.mkdtemp(prefix="ssmsg-", dir="/tmp")
        path = os.path.join(d, "enc-0.sock")
        server = await serve_control(path, handler)
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            frames = [encode_frame(Kind.SUBMIT, 100 + i, SubmitRequest(sid="s", seq=i, n=1, reserve_bytes=64), b"{}")
                      for i in range(40)]
            frames.append(encode_frame(Kind.POLL, 7, PollRequest(fid="f-0", timeout=1.0)))
            real_write(writer, b"".join(frames))
            calls.clear()
            got = []
            for _ in range(41):
                f = await asyncio.wait_for(read_frame(reader), 5)
                got.append((f.tag, decode_reply(Kind.POLL if f.tag == 7 else Kind.SUBMIT, f.meta)))
            assert got[:40] == [(100 + i, SubmitAccepted(request_id=f"f-{i}")) for i in range(40)]
            assert got[40] == (7, PollPending())
            assert calls == [40, 1]
        finally:
            writer.close()
            server.close()
            await server.wait_closed()
            os.unlink(path)
            os.rmdir(d)

    asyncio.run(go())
