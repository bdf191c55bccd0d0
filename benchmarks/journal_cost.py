"""CPU one encoder spends on its futures journal per future (shardserver/workers/journal.py).

Each future costs two records: ``+`` when the SUBMIT is accepted and ``-`` when the shard owes
no report for it any more (the poller's cursor passed it, or it left the table), plus its share
of the compactions (the live set rewritten when the file passes ``2 × live + COMPACT_SLACK``
records). The script times, in one process:

* ``records``: ``FutureJournal.add`` + ``end`` for N futures with a real sampling-session ID,
  ``live`` futures kept in flight (so compactions happen at the rate they would);
* ``core``: the same futures through ``EncoderCore.submit`` and a session poll whose cursor
  passes them (the engine never answers: no decode or encode is timed), with and without a
  journal; the difference is the journal's cost inside the shard.

Run: ``.venv/bin/python benchmarks/journal_cost.py [--futures 20000] [--live 4096]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import tempfile
import time

from shardserver.config import config_from_mapping
from shardserver.ids import IdSigner, SamplingSession
from shardserver.messages import SessionPollRequest, SubmitRequest
from shardserver.shm.arena import ArenaWriter, create_segment, segment_name, unlink_segment
from shardserver.workers.encoder import EncoderCore
from shardserver.workers.journal import FutureJournal, JournalRecord, journal_tag


class _SilentEngine:
    """An engine that never answers: futures stay pending, so only the bookkeeping is timed."""

    answer_bytes = 0  # EngineClient.answer_bytes: it holds no answer

    async def post(self, body: bytes, headers: dict[str, str], ids=None) -> bytes:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def time_records(directory: str, sid: str, futures: int, live: int) -> tuple[float, int]:
    """Seconds per future of ``add`` + ``end`` (with compactions), and how many compactions ran."""
    signer = IdSigner(b"bench-secret", "0badcafe")
    fids = [signer.mint_future_id(0, 1) for _ in range(futures)]
    j, _ = FutureJournal.open(directory, journal_tag("127.0.0.1", 1), 0, 1)
    window: collections.OrderedDict[str, None] = collections.OrderedDict()
    t0 = time.perf_counter()
    for fid in fids:
        j.add(fid, sid, 0)
        window[fid] = None
        if len(window) > live:
            old, _ = window.popitem(last=False)
            j.end(old)
            if j.needs_compaction:
                j.compact(JournalRecord(f, sid, 0) for f in window)
    dt = time.perf_counter() - t0
    n = j.compactions
    for fid in window:
        j.end(fid)
    j.close()
    return dt / futures, n


def time_core(directory: str | None, sid: str, futures: int, batch: int) -> float:
    """Seconds per future of SUBMIT + one session poll passing it, with a journal in ``directory``
    (None: without)."""
    name = segment_name(os.getpid(), "be0c0000", random.randrange(10**6), 0)
    create_segment(name, 256 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1, "max_pending": 1 << 20},
                               "engine": {"pool_size": 1}}, env={})
    journal = FutureJournal.open(directory, journal_tag("127.0.0.1", 2), 0, 1)[0] if directory else None
    core = EncoderCore(cfg, 0, arena, _SilentEngine(), IdSigner(b"bench-secret", "0badcafe"), journal=journal)
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "n": 1, "max_tokens": 8, "seed": 1}).encode()

    async def go() -> float:
        spent = 0.0
        cursor = 0
        seq = 0
        for _ in range(futures // batch):
            t0 = time.perf_counter()
            fids = []
            for _ in range(batch):
                meta = SubmitRequest(sid=sid, seq=seq, owner="", n=1, prompt_logprobs=False, topk=0, reserve_bytes=64)
                seq += 1
                fids.append(core.submit(meta, body).request_id)
            for fid in fids:  # the engine "answered": each leaves PENDING (GONE here: no decode timed)
                core._gone(core.table[fid], "bench")
            r = await core.session_poll(SessionPollRequest(sid=sid, clone=0, after=cursor,
                                                           upto=time.monotonic_ns(), limit=batch))
            cursor = r.events[-1].stamp
            await core.session_poll(SessionPollRequest(sid=sid, clone=0, after=cursor, upto=cursor, limit=1,
                                                       acks=fids))
            spent += time.perf_counter() - t0
        return spent / (futures // batch * batch)

    try:
        return asyncio.run(go())
    finally:
        core.close()
        if journal is not None:
            journal.close()
        arena.close()
        unlink_segment(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--futures", type=int, default=20000)
    ap.add_argument("--live", type=int, default=4096, help="futures in flight while timing the records")
    ap.add_argument("--batch", type=int, default=256, help="futures per session poll in the core timing")
    ap.add_argument("--repeat", type=int, default=5, help="core timings of each kind (the fastest counts)")
    args = ap.parse_args()
    signer = IdSigner(b"bench-secret", "0badcafe")
    sid = signer.mint_sampling_session_id(SamplingSession(signer.mint_session_id(), "Qwen/Qwen3-8B", None, 0))
    with tempfile.TemporaryDirectory(prefix="journal-cost-") as d:
        per, compactions = time_records(d, sid, args.futures, args.live)
        print(f"records: {per * 1e6:.2f} us per future (add + end, {compactions} compactions, "
              f"sid {len(sid)} chars)")
        time_core(None, sid, min(args.futures, 2048), args.batch)  # warm-up
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):  # alternated, so load on the machine hits both alike
            runs[False].append(time_core(None, sid, args.futures, args.batch))
            runs[True].append(time_core(d, sid, args.futures, args.batch))
        without, with_j = min(runs[False]), min(runs[True])
        print(f"core: {without * 1e6:.2f} us per future without a journal, {with_j * 1e6:.2f} us with "
              f"(+{(with_j - without) * 1e6:.2f} us)")


if __name__ == "__main__":
    main()
