"""The shard's futures journal (shardserver/workers/journal.py): records, compaction, take-over
(also across a change of shard count, and from a holder that keeps its lock a while), cut and
corrupt lines, and an EncoderCore that restores what its predecessor owed as GONE futures its
session's poller is told about."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import zlib

import pytest

from shardserver.config import config_from_mapping
from shardserver.ids import IdSigner
from shardserver.messages import PollGone, PollRequest, SessionPollRequest, SubmitRequest
from shardserver.shm.arena import ArenaWriter, create_segment, segment_name, unlink_segment
from shardserver.workers import journal as jmod
from shardserver.workers.encoder import EncoderCore
from shardserver.workers.journal import FutureJournal, JournalRecord, journal_tag, read_journal

TAG = journal_tag("127.0.0.1", 8123)


def _fid(i: int) -> str:
    return f"f0badcafe-h0-{i:032x}-{i:016x}"


def _files(d) -> list[str]:
    return sorted(os.listdir(d))


def test_tag_is_a_safe_file_name():
    assert journal_tag("127.0.0.1", 8123) == "127.0.0.1_8123"
    assert journal_tag("::1", 80) == "__1_80"
    assert journal_tag("0.0.0.0", 0) == "0.0.0.0_0"


NOW = 1_796_000_000  # the unix seconds records are stamped with in these tests (journal._unix_now)


@pytest.fixture(autouse=True)
def _fixed_clock(monkeypatch):
    monkeypatch.setattr(jmod, "_unix_now", lambda: NOW)


def test_lines_are_exact_and_replay_keeps_the_live_set(tmp_path):
    j, took = FutureJournal.open(str(tmp_path), TAG, 0, 2)
    assert (took.records, took.files, took.bad_lines) == ([], 0, 0)
    j.add(_fid(1), "sidA", 0)
    j.add(_fid(2), "sidB", 3)
    j.add(_fid(3), "sidA", 0)
    j.end(_fid(2))
    assert (j.live, j.records) == (2, 4)
    data = (tmp_path / f"{TAG}.0.journal").read_bytes()
    first = f"+{_fid(1)} sidA 0 {NOW}".encode()
    assert data.startswith(first + b" %08x\n" % zlib.crc32(first))
    assert data.endswith(f"-{_fid(2)}".encode() + b" %08x\n" % zlib.crc32(f"-{_fid(2)}".encode()))
    live, bad = read_journal(data)
    assert (list(live.values()), bad) == ([JournalRecord(_fid(1), "sidA", 0, NOW),
                                           JournalRecord(_fid(3), "sidA", 0, NOW)], 0)
    j.close()
    assert _files(tmp_path) == [f"{TAG}.0.journal"]  # two futures still owed: the file stays


def test_an_empty_journal_is_removed_at_close(tmp_path):
    j, _ = FutureJournal.open(str(tmp_path), TAG, 1, 2)
    j.add(_fid(1), "s", 0)
    j.end(_fid(1))
    j.close()
    assert _files(tmp_path) == []


def test_cut_and_corrupt_lines_are_ignored(tmp_path):
    good = jmod.add_line(_fid(1), "s", 0) + jmod.add_line(_fid(2), "s", 1)
    flipped = bytearray(jmod.add_line(_fid(3), "s", 0))
    flipped[5] ^= 0x01  # one bit of the fid: the CRC no longer matches
    bad_crc_end = jmod.end_line(_fid(1))[:-3] + b"zz\n"  # the end of fid 1 is unreadable: fid 1 stays live
    cut = jmod.add_line(_fid(4), "s", 0)[:-7]  # the last write was cut short (no newline)
    data = good + bytes(flipped) + b"\xff\xfe garbage\n" + bad_crc_end + b"\n" + cut
    live, bad = read_journal(data)
    assert list(live) == [_fid(1), _fid(2)]
    assert bad == 5  # flipped, garbage, bad CRC, the empty line, the cut tail
    (tmp_path / f"{TAG}.0.journal").write_bytes(data)
    j, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
    assert took.records == [JournalRecord(_fid(1), "s", 0), JournalRecord(_fid(2), "s", 1)]
    assert (took.files, took.bad_lines) == (1, 5)
    # The new file holds exactly the two live records (rewritten, the bad lines gone).
    assert (tmp_path / f"{TAG}.0.journal").read_bytes() == good
    j.close()


def test_compaction_rewrites_the_live_set_and_appending_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(jmod, "COMPACT_SLACK", 10)
    j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
    live: dict[str, JournalRecord] = {}
    for i in range(30):
        j.add(_fid(i), "s", i % 2)
        live[_fid(i)] = JournalRecord(_fid(i), "s", i % 2, NOW)
        if i % 3:
            j.end(_fid(i))
            del live[_fid(i)]
        if j.needs_compaction:
            j.compact(live.values())
    assert j.compactions >= 1 and j.live == len(live) == 10
    j.add(_fid(99), "t", 7)
    live[_fid(99)] = JournalRecord(_fid(99), "t", 7, NOW)
    path = tmp_path / f"{TAG}.0.journal"
    got, bad = read_journal(path.read_bytes())
    assert (got, bad) == (live, 0)
    assert len(path.read_bytes().splitlines()) == j.records < 2 * j.live + 10 + 1
    j.close()
    assert _files(tmp_path) == [f"{TAG}.0.journal"]


def test_take_over_maps_old_shards_onto_the_new_count(tmp_path):
    """4 shards before, 2 after: shard 0 takes journals 0 and 2, shard 1 takes 1 and 3; a
    gateway on another address keeps its own files; a cut rewrite's temporary file goes."""
    for k in range(4):
        (tmp_path / f"{TAG}.{k}.journal").write_bytes(jmod.add_line(_fid(k), f"s{k}", k))
    other = journal_tag("127.0.0.1", 9999)
    (tmp_path / f"{other}.0.journal").write_bytes(jmod.add_line(_fid(50), "x", 0))
    (tmp_path / f"{TAG}.2.journal.tmp.12345").write_bytes(b"half")
    j0, t0 = FutureJournal.open(str(tmp_path), TAG, 0, 2)
    j1, t1 = FutureJournal.open(str(tmp_path), TAG, 1, 2)
    assert [r.fid for r in t0.records] == [_fid(0), _fid(2)] and t0.files == 2
    assert [r.fid for r in t1.records] == [_fid(1), _fid(3)] and t1.files == 2
    assert _files(tmp_path) == sorted([f"{other}.0.journal", f"{TAG}.0.journal", f"{TAG}.1.journal"])
    # A second take-over (another restart) still finds them: they stay until ended.
    j0.close()
    j0, t0 = FutureJournal.open(str(tmp_path), TAG, 0, 2)
    assert [r.fid for r in t0.records] == [_fid(0), _fid(2)]
    for r in t0.records:
        j0.end(r.fid)
    j0.close()
    j1.close()
    assert _files(tmp_path) == sorted([f"{other}.0.journal", f"{TAG}.1.journal"])


def test_take_over_waits_for_the_old_holder_then_sees_its_last_records(tmp_path):
    """A stopping encoder still holds the lock and writes; the new one waits for it and reads
    what it wrote last. A holder that never lets go is waited for only ``lock_wait_s``."""
    old, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
    old.add(_fid(1), "s", 0)

    def finish() -> None:
        time.sleep(0.3)
        old.add(_fid(2), "s", 0)
        old.end(_fid(1))
        os.close(old.fd)  # the process exits: its lock goes

    t = threading.Thread(target=finish)
    t.start()
    new, took = FutureJournal.open(str(tmp_path), TAG, 0, 1, lock_wait_s=5.0)
    t.join()
    assert [r.fid for r in took.records] == [_fid(2)]
    assert 0.2 < took.waited_s < 3 and took.lock_timeouts == 0
    # A holder that never lets go (``new`` keeps its lock): bounded wait, then taken over anyway.
    t0 = time.monotonic()
    newer, took = FutureJournal.open(str(tmp_path), TAG, 0, 1, lock_wait_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 2 and took.lock_timeouts == 1
    assert [r.fid for r in took.records] == [_fid(2)]
    os.close(new.fd)
    newer.close()
    assert _files(tmp_path) == [f"{TAG}.0.journal"]


# -- EncoderCore with a journal --------------------------------------------------------------

class _Engine:
    """An engine that never answers (futures stay pending)."""

    answer_bytes = 0  # EngineClient.answer_bytes: it holds no answer

    async def post(self, body: bytes, headers: dict[str, str], ids=None) -> bytes:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


@pytest.fixture
def make_core(tmp_path):
    made = []

    def make(journal: FutureJournal, engine: object | None = None) -> EncoderCore:
        name = segment_name(os.getpid(), "c0ffee01", random.randrange(10**6), 0)
        create_segment(name, 1 << 20)
        arena = ArenaWriter(name)
        cfg = config_from_mapping({"shards": {"count": 1}}, env={})
        c = EncoderCore(cfg, 0, arena, engine or _Engine(), IdSigner(b"k", "0badcafe"), journal=journal)
        made.append((c, arena, name))
        return c

    yield make
    for c, arena, name in made:
        c.close()
        arena.close()
        unlink_segment(name)


def _submit(core: EncoderCore, sid: str, seq: int) -> str:
    body = {"model": "m", "prompt": [1, 2], "n": 1, "max_tokens": 4, "temperature": 1.0, "seed": seq}
    meta = SubmitRequest(sid=sid, seq=seq, owner="", n=1, prompt_logprobs=False, topk=0, reserve_bytes=256)
    return core.submit(meta, json.dumps(body).encode()).request_id


def test_a_new_core_reports_what_its_predecessor_held_as_failed_once(tmp_path, make_core):
    async def go():
        j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        a = make_core(j)
        pend = [_submit(a, "sidA", 5), _submit(a, "sidA", 1_000_000_007), _submit(a, "sidB", 9)]
        await asyncio.sleep(0.01)
        # The encoder dies (no close: SIGKILL); a new one takes the journal over.
        os.close(j.fd)
        j2, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        assert [(r.fid, r.sid, r.clone) for r in took.records] == [
            (pend[0], "sidA", 0), (pend[1], "sidA", 1), (pend[2], "sidB", 0)]
        b = make_core(j2)
        assert b.restore(took.records) == 3 and b.counters["restored_lost"] == 3
        assert b.stages()["gone"] == 3
        # Each session's poller gets its own, as failed (ok=False), once.
        r = await b.session_poll(SessionPollRequest(sid="sidA", clone=0, after=0, upto=time.monotonic_ns(), limit=10))
        assert [(ev.fid, ev.ok) for ev in r.events] == [(pend[0], False)]
        cursor = r.events[0].stamp
        r = await b.session_poll(SessionPollRequest(sid="sidA", clone=1, after=0, upto=time.monotonic_ns(), limit=10))
        assert [(ev.fid, ev.ok) for ev in r.events] == [(pend[1], False)]
        # retrieve_future answers 410 (PollGone).
        assert isinstance(await b.poll(PollRequest(fid=pend[0], timeout=0)), PollGone)
        # The cursor passed pend[0]: its report is done and its record ended.
        r = await b.session_poll(SessionPollRequest(sid="sidA", clone=0, after=cursor, upto=time.monotonic_ns(),
                                                    limit=10))
        assert r.events == []
        assert b.table[pend[0]].journaled is False and j2.live == 2
        # A second restart still reports the two not yet passed.
        os.close(j2.fd)
        j3, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        assert [r.fid for r in took.records] == [pend[1], pend[2]]
        # The TTL drops them and ends their records.
        c = make_core(j3)
        c.restore(took.records)
        c.sweep(time.monotonic() + c.cfg.futures.completed_ttl_s + 1)
        assert c.table == {} and j3.live == 0
        j3.close()
        assert _files(tmp_path) == []

    asyncio.run(go())


def test_stale_journals_of_other_gateways_are_removed_unless_held(tmp_path):
    old = journal_tag("127.0.0.1", 7001)
    held = journal_tag("127.0.0.1", 7002)
    fresh = journal_tag("127.0.0.1", 7003)
    for t in (old, held, fresh):
        (tmp_path / f"{t}.0.journal").write_bytes(jmod.add_line(_fid(1), "s", 0))
    long_ago = time.time() - 7200
    for t in (old, held):
        os.utime(tmp_path / f"{t}.0.journal", (long_ago, long_ago))
    # Its own stale file is taken over, never removed.
    (tmp_path / f"{TAG}.0.journal").write_bytes(jmod.add_line(_fid(2), "s", 0))
    os.utime(tmp_path / f"{TAG}.0.journal", (long_ago, long_ago))
    keeper, _ = FutureJournal.open(str(tmp_path), held, 0, 1)  # a live gateway holds its file
    os.utime(keeper.path, (long_ago, long_ago))
    j, took = FutureJournal.open(str(tmp_path), TAG, 0, 1, stale_s=3600)
    assert [r.fid for r in took.records] == [_fid(2)]
    assert _files(tmp_path) == sorted([f"{held}.0.journal", f"{fresh}.0.journal", f"{TAG}.0.journal"])
    keeper.close()
    j.close()


def _encoder_cfg(state_dir, shards: int):
    return config_from_mapping({"server": {"state_dir": str(state_dir)}, "shards": {"count": shards}}, env={})


def test_a_journal_file_that_cannot_be_opened_does_not_stop_the_take_over(tmp_path):
    """Shard 0 of 2 owns ``<tag>.0.journal`` and ``<tag>.2.journal`` (an earlier run with 4
    shards). The second cannot be opened (here a directory stands in its place; an I/O error or
    a file of another user does the same): the encoder still takes the first over, reports its
    futures and keeps a journal for its own, and leaves the unreadable one alone. (It used to
    give up on the whole take-over: no journal for the run, its predecessor's futures never
    reported, so a poller-mode sample waited forever.)"""
    from shardserver.workers.encoder import EncoderProc

    d = tmp_path / "futures"
    d.mkdir()
    (d / f"{TAG}.0.journal").write_bytes(jmod.add_line(_fid(1), "s", 0) + jmod.add_line(_fid(2), "s", 3))
    (d / f"{TAG}.2.journal").mkdir()
    journal, records = EncoderProc._open_journal(_encoder_cfg(tmp_path, 2), 0, TAG)
    assert journal is not None
    assert records == [JournalRecord(_fid(1), "s", 0), JournalRecord(_fid(2), "s", 3)]
    journal.add(_fid(3), "s", 0)
    assert read_journal((d / f"{TAG}.0.journal").read_bytes()) == (
        {_fid(i): JournalRecord(_fid(i), "s", c, NOW if i == 3 else 0) for i, c in ((1, 0), (2, 3), (3, 0))}, 0)
    assert (d / f"{TAG}.2.journal").is_dir()
    journal.close()


_NO_ROOM_CHILD = r"""
import json, resource, signal, sys
from shardserver.config import config_from_mapping
from shardserver.workers.encoder import EncoderProc
# Files larger than 2 KiB cannot be written (EFBIG instead of SIGXFSZ): the new journal does not fit.
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
cfg = config_from_mapping({"server": {"state_dir": sys.argv[1]}, "shards": {"count": 1}}, env={})
journal, records = EncoderProc._open_journal(cfg, 0, sys.argv[2])
print(json.dumps({"journal": journal is not None, "records": [[r.fid, r.sid, r.clone] for r in records]}))
"""


def test_futures_read_from_the_old_journal_are_reported_even_when_the_new_one_cannot_be_written(tmp_path):
    """The new encoder reads its predecessor's journal (64 futures owed a report) but cannot
    write its own (a real EFBIG: the process's RLIMIT_FSIZE is below the journal's size; a full
    disk gives ENOSPC the same way). It runs without a journal, as before, but still restores
    the 64 futures it read so their sessions' pollers get them as failed, and leaves the old
    file in place for the next run. (It used to drop what it had read: 64 samples waiting
    forever.)"""
    import subprocess
    import sys

    d = tmp_path / "futures"
    d.mkdir()
    data = b"".join(jmod.add_line(_fid(i), "ss-session", i % 2) for i in range(64))
    assert len(data) > 2048
    (d / f"{TAG}.0.journal").write_bytes(data)
    out = subprocess.run([sys.executable, "-c", _NO_ROOM_CHILD, str(tmp_path), TAG], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"journal": False, "records": [[_fid(i), "ss-session", i % 2] for i in range(64)]}
    assert _files(d) == [f"{TAG}.0.journal"] and (d / f"{TAG}.0.journal").read_bytes() == data


def test_stamps_carry_the_runs_cursor_tag_and_never_precede_their_logging(tmp_path, make_core):
    """With a cursor tag (a run's :func:`shardserver.ids.cursor_tag`) every completion stamp is
    congruent to it modulo 1024, at or after the monotonic time it was logged, less than 1024 ns
    after it unless the previous stamp pushes it, and strictly increasing."""
    from shardserver.ids import CURSOR_TAG_SPAN, cursor_tag

    assert cursor_tag("00000000") == 1 and cursor_tag("ffffffff") == 1 + 0xFFFFFFFF % 1023
    assert all(1 <= cursor_tag(f"{i:08x}") < CURSOR_TAG_SPAN for i in range(0, 1 << 32, 7919 * 4099))
    core = make_core(None)
    core.cursor_tag = 5
    t0 = time.monotonic_ns()
    assert core.restore([JournalRecord(_fid(i), "s", 0) for i in range(50)]) == 50
    t1 = time.monotonic_ns()
    stamps = [core.table[_fid(i)].stamp for i in range(50)]
    assert all(st % CURSOR_TAG_SPAN == 5 for st in stamps)
    assert all(b > a for a, b in zip(stamps, stamps[1:]))
    assert t0 <= stamps[0] < t1 + CURSOR_TAG_SPAN and stamps[-1] < t1 + 50 * CURSOR_TAG_SPAN


def test_a_future_whose_client_got_its_answer_is_owed_nothing_after_a_restart(tmp_path, make_core):
    """Found by a leak hunt: a result delivered by retrieve_future stayed journaled while kept for
    futures.retrieved_ttl_s, so each encoder restart brought every recently delivered future back
    as a lost one (GONE, with a fresh futures.completed_ttl_s), and restarts closer together than
    that piled them up (158 -> 693 "gone" over 6 kills 8 s apart). A delivered result, and a lost
    future answered 410, now end their records."""
    from test_encoder_core import SimEngine

    async def go():
        j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        a = make_core(j, SimEngine())
        delivered, undelivered = _submit(a, "sidA", 1), _submit(a, "sidA", 2)
        for _ in range(200):
            if a.stages()["completed"] == 2:
                break
            await asyncio.sleep(0.01)
        assert a.stages()["completed"] == 2
        a.delivered_ok(delivered)  # the front-end sent it to its client
        assert (a.table[delivered].journaled, a.table[undelivered].journaled, j.live) == (False, True, 1)
        os.close(j.fd)  # SIGKILL
        j2, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        assert [r.fid for r in took.records] == [undelivered]
        b = make_core(j2)
        assert b.restore(took.records) == 1
        # Its client asks for it (retrieve_future): 410; nothing is owed any more.
        assert isinstance(await b.poll(PollRequest(fid=undelivered, timeout=0)), PollGone)
        assert b.table[undelivered].journaled is False and j2.live == 0
        os.close(j2.fd)  # SIGKILL again: nothing comes back
        j3, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        assert took.records == []
        j3.close()

    asyncio.run(go())


def test_a_restored_future_keeps_its_first_age_over_restarts(tmp_path, make_core):
    """Found by a leak hunt: a lost future restored at each encoder restart got a whole
    futures.completed_ttl_s again each time, so under restarts closer together than that, lost
    futures nobody asked about never expired. The ``+`` record now carries when the shard first
    accepted the future, and the TTL counts from then; a record of an older gateway (no time)
    is still read, its age unknown."""
    async def go():
        j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        a = make_core(j)
        ttl = a.cfg.futures.completed_ttl_s
        fid = _submit(a, "sidA", 1)
        os.close(j.fd)  # SIGKILL; the record says it was accepted at NOW
        j2, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
        assert [(r.fid, r.since) for r in took.records] == [(fid, NOW)]
        # Restored 100 s later (the wall clock of the encoder), its deadline is TTL - 100 s away.
        from shardserver.workers import encoder as enc_mod
        real = enc_mod.time.time
        enc_mod.time.time = lambda: NOW + 100.0
        try:
            b = make_core(j2)
            assert b.restore(took.records) == 1
            left = b.table[fid].deadline - time.monotonic()
            assert ttl - 101 < left <= ttl - 99, left
            os.close(j2.fd)  # SIGKILL again: the takeover rewrite keeps the first time
            j3, took = FutureJournal.open(str(tmp_path), TAG, 0, 1)
            assert [(r.fid, r.since) for r in took.records] == [(fid, NOW)]
            # Past its TTL since first accepted: restored already expired, dropped at the sweep.
            enc_mod.time.time = lambda: NOW + ttl + 5.0
            c = make_core(j3)
            c.restore(took.records)
            c.sweep(time.monotonic() + 0.01)
            assert c.table == {} and j3.live == 0
        finally:
            enc_mod.time.time = real
        j3.close()
        # An older gateway's record (no time) restores with a whole TTL, as before.
        rec = read_journal(jmod.add_line("f-old", "s", 0))[0]["f-old"]
        assert rec == JournalRecord("f-old", "s", 0, 0)

    asyncio.run(go())


# -- the journal's file removed under it (server.state_dir deleted mid-run) -------------------

def test_a_removed_or_replaced_journal_is_written_again_with_what_is_owed(tmp_path):
    """Break tester F1: ``server.state_dir`` removed mid-run (a tmp cleaner, ``rm -rf``) left the
    encoder appending to an unlinked file, so a restart found nothing to take over. ``check``
    (at most every CHECK_INTERVAL_S) now makes the directories again (0700) and writes the
    futures owed a report to a new file; a file put in its place is replaced the same way."""
    import shutil
    import stat

    state = tmp_path / "state"
    d = state / "futures"
    path = d / f"{TAG}.0.journal"
    j, _ = FutureJournal.open(str(d), TAG, 0, 1)
    live = {_fid(i): JournalRecord(_fid(i), "s", i, NOW) for i in range(3)}
    for r in live.values():
        j.add(r.fid, r.sid, r.clone)
    j.end(_fid(1))
    del live[_fid(1)]
    assert j.check(lambda: live.values(), now=100.0) is None  # the file is there: nothing done
    shutil.rmtree(state)
    j.add(_fid(7), "t", 7)  # still succeeds (the unlinked file)
    live[_fid(7)] = JournalRecord(_fid(7), "t", 7, NOW)
    assert j.check(lambda: live.values(), now=100.0 + jmod.CHECK_INTERVAL_S / 2) is None  # not due yet
    assert not state.exists()
    assert j.check(lambda: live.values(), now=100.0 + jmod.CHECK_INTERVAL_S) == "removed"
    assert stat.S_IMODE(state.stat().st_mode) == stat.S_IMODE(d.stat().st_mode) == 0o700 & ~_umask()
    assert read_journal(path.read_bytes()) == (live, 0)
    assert (j.live, j.records, j.recreations, j.compactions) == (3, 3, 1, 0)
    j.end(_fid(0))  # appending goes on to the new file
    del live[_fid(0)]
    assert read_journal(path.read_bytes()) == (live, 0)
    # Another file put in its place (nobody holds it): replaced by the owed set.
    path.unlink()
    path.write_bytes(jmod.add_line(_fid(50), "x", 0))
    assert j.check(lambda: live.values(), now=200.0) == "replaced"
    assert read_journal(path.read_bytes()) == (live, 0) and j.recreations == 2
    # A restart takes over exactly what is owed.
    os.close(j.fd)  # SIGKILL
    j2, took = FutureJournal.open(str(d), TAG, 0, 1)
    assert took.records == list(live.values()) == [JournalRecord(_fid(2), "s", 2, NOW),
                                                   JournalRecord(_fid(7), "t", 7, NOW)]
    j2.close()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_a_successors_journal_is_left_alone(tmp_path):
    """A new encoder of the shard took the journal over (it renamed its file over the path and
    holds its lock) while the old one still runs: ``check`` leaves the successor's file alone."""
    j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
    j.add(_fid(1), "s", 0)
    j2, took = FutureJournal.open(str(tmp_path), TAG, 0, 1, lock_wait_s=0.0)
    assert [r.fid for r in took.records] == [_fid(1)]
    j2.end(_fid(1))
    before = (tmp_path / f"{TAG}.0.journal").read_bytes()
    assert j.check(lambda: [JournalRecord(_fid(9), "z", 0)], now=1.0) == "superseded"
    assert j.superseded and j.check(lambda: [], now=10.0) is None
    assert (tmp_path / f"{TAG}.0.journal").read_bytes() == before and j.recreations == 0
    os.close(j.fd)
    j2.close()


def test_the_core_rewrites_a_removed_journal_or_reports_once_that_it_cannot(tmp_path, make_core, caplog):
    """The encoder's sweep (``EncoderCore.check_journal``): ``state_dir`` deleted and a file put
    in its place (the journal cannot be made again): one ERROR and ``journal_errors`` 1 however
    often it is tried; once the way is clear, a WARNING, ``journal_recreated`` 1, and the file
    holds every future owed a report, which a new encoder reports as failed."""
    import logging
    import shutil

    async def go():
        state = tmp_path / "state"
        d = state / "futures"
        j, _ = FutureJournal.open(str(d), TAG, 0, 1)
        a = make_core(j)
        pend = [_submit(a, "sidA", 1), _submit(a, "sidA", 2)]
        shutil.rmtree(state)
        state.write_bytes(b"not a directory")
        pend.append(_submit(a, "sidB", 3))
        with caplog.at_level(logging.WARNING, logger="shardserver.encoder"):
            for k in range(3):
                a.check_journal(now=1000.0 + k)
            assert a.counters["journal_errors"] == 1 and a.counters["journal_recreated"] == 0
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and str(d / f"{TAG}.0.journal") in errors[0].getMessage()
            assert a.journal is j  # kept, and tried again
            state.unlink()
            a.check_journal(now=1010.0)
            a.check_journal(now=1020.0)
        assert a.counters["journal_errors"] == 1 and a.counters["journal_recreated"] == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "was removed" in warnings[0] and "3 futures" in warnings[0]
        os.close(j.fd)  # SIGKILL
        j2, took = FutureJournal.open(str(d), TAG, 0, 1)
        assert [(r.fid, r.sid, r.clone) for r in took.records] == [(pend[0], "sidA", 0), (pend[1], "sidA", 0),
                                                                   (pend[2], "sidB", 0)]
        b = make_core(j2)
        assert b.restore(took.records) == 3
        r = await b.session_poll(SessionPollRequest(sid="sidB", clone=0, after=0, upto=time.monotonic_ns(), limit=10))
        assert [(ev.fid, ev.ok) for ev in r.events] == [(pend[2], False)]
        j2.close()

    asyncio.run(go())


def test_a_journal_on_a_state_dir_that_became_read_only_is_still_read_and_reported(tmp_path, monkeypatch):
    """The last run's journal, then ``server.state_dir`` mounted read-only for the next run
    (break tester round 3, F1: a read-only bind mount): the new encoder cannot write a journal,
    but it must still read the old one, so that the futures it holds are reported as failed to
    the SDK's poller. Before, the file was opened read-write only: EROFS, "cannot be opened", its
    futures never reported, and an SDK 0.38 that learned the poller in the last run waited for
    them forever. Here writes fail with EROFS (what a read-only mount answers; root ignores
    file modes, so a chmod would not show it)."""
    import errno

    j, _ = FutureJournal.open(str(tmp_path), TAG, 0, 1)
    j.add(_fid(1), "sidA", 0)
    j.add(_fid(2), "sidB", 1)
    os.close(j.fd)  # the gateway was killed: the file stays as it was
    real_open = os.open

    def read_only_fs(path, flags, *args, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(jmod.os, "open", read_only_fs)
    with pytest.raises(jmod.JournalUnwritable) as e:
        FutureJournal.open(str(tmp_path), TAG, 0, 1)
    took = e.value.takeover
    assert [r.fid for r in took.records] == [_fid(1), _fid(2)] and took.unreadable == 0
    assert _files(tmp_path) == [f"{TAG}.0.journal"]  # left for a later run that can write
