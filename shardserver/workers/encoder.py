"""Encoder workers: one process per shard, the only writer of that shard's arena.

:class:`EncoderCore` is the shard's logic with no sockets: the future table,
``(sampling_session_id, seq_id)`` dedupe, arena reservations and eviction,
TTLs, engine calls, decode and encode. :class:`EncoderProc` wraps it in a
process: event loop, control socket, signals, parent watch.

Life of a future in a shard::

    SUBMIT ──> PENDING ──engine 200──> decode ──> encode into arena ──> DONE ──DELIVERED──> (retrieved TTL) ──> freed
                  │  └─ finish_reason abort ──> re-forward (engine.max_abort_resubmits) ──> GONE (410);
                  │     FAILED (server) instead once every answer was aborted for engine.unavailable_budget_s
                  ├─ refused / broken connection, cut body, 408/429/503 ──> re-forwarded inside EngineClient
                  │     (backoff, within engine.unavailable_budget_s; then FAILED(server))
                  ├─ 200 with an unusable body ──> sent again (engine.bad_body_resends), then FAILED(server)
                  └─ engine 4xx ──> FAILED(user);  5xx / timeout ──> FAILED(server)

A contiguous arena slot is reserved at SUBMIT for the largest result the
request can produce; the completion is encoded into it and the unused tail
is given back, so a completion always finds room. When no free block is
large enough, delivered results in their grace window are evicted oldest
first, then results completed over ``futures.abandoned_after_s`` ago and never
delivered (their client is gone), oldest first; if that is not enough the SUBMIT
is refused (the front-end answers 429). Other undelivered results are never evicted.

Pending futures are bounded per shard: ``shards.max_pending`` futures and
``shards.max_pending_request_bytes`` of engine request bodies, beyond which
SUBMIT is refused (429). At most ``engine.pool_size`` engine calls run at
once; the other pending futures wait in a queue holding only their entry and
their request body (~0.7 KB besides the body; benchmarks/pending_memory.py), not a task. One that
waited longer than ``engine.pool_wait_s`` is not sent when its turn comes: it
answers 410 and the SDK resubmits it.

With ``auth.mode = "keys"`` each API key (the SUBMIT's ``owner``) may hold at
most ``auth.key_share`` of the shard's arena (reservations plus results not
delivered yet, with the JSON forms cached for them), of ``shards.max_pending`` and of
``shards.max_pending_request_bytes`` (:class:`OwnerUsage`); beyond it SUBMIT
is refused with reason KEY_QUOTA (429), so one key cannot lock out another.

Completions per sampling session (for the SDK's session-wide poller, ``retrieve_futures``):
every future that leaves PENDING gets a stamp (``time.monotonic_ns()`` moved up to the run's
cursor tag, :func:`shardserver.ids.cursor_tag`; strictly increasing within the shard) and goes into its session's log, keyed by ``(sampling_session_id,
seq_id // 10**9)`` (the SDK's ``cloned_sampler_id``). A SESSION_POLL returns a session's stamps
in a range and forgets those the client's cursor has passed; an entry also leaves the log when
its future leaves the table (TTL, eviction, ack, cancel), so the logs never hold more than the
table. A pending future whose TTL passes becomes GONE (kept for ``futures.completed_ttl_s``) so
that the poller reports it and the SDK resubmits.

With the poller on, the shard journals the futures it owes a report for
(:mod:`shardserver.workers.journal`): one record at SUBMIT, one when its session's cursor passes
it or it leaves the table. A new encoder of the shard restores its predecessor's as GONE entries
(:meth:`EncoderCore.restore`), which the next SESSION_POLL reports as failed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..aio import RateLimitedLog
from ..codec import CompletionDecoder, encode_sample_response, plan_sample_response, sample_response_to_json
from ..config import Config, mask_url
from ..control import serve_control
from ..engine_client import AttemptIds, EngineClient
from ..errors import EngineBodyError, EngineError
from ..ids import CURSOR_TAG_SPAN, IdSigner, cursor_tag
from ..messages import (
    CancelReply,
    CancelRequest,
    CompletionEvent,
    Delivered,
    SessionFinished,
    ErrorReply,
    FutureState,
    PollDone,
    PollFailed,
    PollGone,
    PollPending,
    PollReply,
    PollRequest,
    RefusalReason,
    ResultForm,
    SessionPollReply,
    SessionPollRequest,
    StatsReply,
    StatsRequest,
    SubmitAccepted,
    SubmitRefused,
    SubmitReply,
    SubmitRequest,
)
from ..metrics import EncoderTimers, ShardCounters
from ..shm.arena import ARENA_READ_HOLD_S, SHM_DIR, ArenaSpaceError, ArenaWriter, Slot, shm_free_bytes
from .journal import CHECK_INTERVAL_S as JOURNAL_CHECK_INTERVAL_S
from .journal import JOURNAL_DIR, FutureJournal, JournalRecord, JournalUnwritable
from .ttl import DeadlineBuckets

if TYPE_CHECKING:
    from ..health import EngineProbe

__all__ = ["EncoderCore", "EncoderProc", "FutureEntry", "OwnerUsage"]

log = logging.getLogger("shardserver.encoder")


@dataclass(slots=True, eq=False)
class FutureEntry:
    """One future in a shard's table.

    From SUBMIT until the engine answered (or the future left the pending state), ``body``
    holds the engine request body (its size counted in ``EncoderCore.pending_request_bytes``);
    ``n`` and ``plp`` are the decode parameters. The
    entry is all a pending future holds: ~1 KB with a 32-token prompt's body
    (``benchmarks/pending_memory.py``), 131,072 of them in the full soak.
    """

    fid: str
    key: tuple[str, int] | None
    state: FutureState = FutureState.PENDING
    created: float = 0.0
    deadline: float = 0.0
    reserve: Slot | None = None   # arena slot reserved at SUBMIT for the largest possible result
    slot: Slot | None = None
    json_slot: Slot | None = None
    error: str = ""
    category: str = ""
    gone_reason: str = ""
    delivered: bool = False
    waiters: list[asyncio.Future[None]] | None = None  # held POLLs (a list once one waits)
    task: asyncio.Task[None] | None = None  # its engine call, once started (None while queued)
    body: bytes | None = None     # the engine request body while the future is pending
    n: int = 1                    # num_samples
    plp: tuple[int, np.ndarray | None] | None = None  # (topk, prompt ids) when prompt logprobs are asked
    fill: bool = False            # SubmitRequest.fill_context: the body's max_tokens is the gateway's
    owner: str = ""               # the API key's owner tag (per-key shares, auth.key_share)
    charged: int = 0              # arena bytes counted against the owner's share (result + JSON form)
    stamp: int = 0                # monotonic ns when it left PENDING (its place in the session's log)
    expired: bool = False         # its pending TTL passed (counted as ``expired`` once)
    digest: bytes = b""           # SubmitRequest.digest: a resubmission of its key must match it
    journaled: bool = False       # its record is live in the shard's journal (a report is owed)
    readers: int = 0              # POLL answers that handed out its slot, less the DELIVEREDs: a
                                  # front-end may be copying from it (its free is then held)

    @property
    def session_key(self) -> tuple[str, int] | None:
        """``(sampling_session_id, cloned_sampler_id)``: the SDK's poller target, or None."""
        return None if self.key is None else (self.key[0], self.key[1] // CLONE_SEQ_SPAN)


# Superseded or dropped items the TTL index (workers.ttl.DeadlineBuckets) may hold beyond twice
# the live futures before it is rebuilt (EncoderCore._set_deadline).
HEAP_SLACK = 4096

# The SDK numbers a cloned SamplingClient's requests from cloned_sampler_id * 10**9
# (tinker 0.38 ``SamplingClient._request_id_counter``; FuturesRetrieveRequest's target docstring).
CLONE_SEQ_SPAN = 1_000_000_000

# The fewest engine calls engine.answer_budget_bytes can leave running (or engine.pool_size if smaller).
MIN_ENGINE_CALLS = 8
# Under the budget the limit of engine calls grows by one per this many finished calls. A new
# call's answer comes one engine latency later, so growing by one per finished call (doubling
# per latency) overshot: with 5 s engine queueing the limit was back at engine.pool_size, and
# the answers over the budget again, within one latency of being cut.
LIMIT_GROW_EVERY = 4
# While a SUBMIT finds no room and no result is old enough to count as abandoned, the table is
# walked for such results at most once per this many seconds (EncoderCore._evict_abandoned_until).
ABANDONED_SCAN_S = 1.0
# The most closed sessions an encoder remembers (EncoderCore.finished_sessions; ~200 bytes each).
FINISHED_SESSIONS_KEPT = 10_000
# Receive buffers (shardserver.engine_http.BodyBuffers) no engine answer used for this long
# (seconds) are freed at the next sweep.
BUFFER_IDLE_S = 10.0
#: Seconds between an encoder's looks at its control socket's path (bound again when a /tmp
#: cleaner removed the run directory; the supervisor recreates the directory as often).
SOCKET_CHECK_S = 5.0
#: A request (its content, ``SubmitRequest.digest``: the SDK resubmits a sample after a 410 with
#: the same content and a new seq_id) that the engine aborted more than this many rounds of
#: ``engine.max_abort_resubmits + 1`` attempts, over at least ``engine.unavailable_budget_s``,
#: each time right after an answer that was not aborted (not in an abort storm), fails instead of
#: answering 410 once more: the engine singles it out, and the SDK would resubmit it forever.
#: Each encoder counts the attempts it makes (the SDK's resubmissions go to any shard), so with S
#: shards such a sample ends after about S times as many resubmissions.
ABORT_ROUNDS = 3
#: An abort streak (``EncoderCore._aborting_since``) ends when the engine answered nothing at all
#: for this long, or half of ``engine.unavailable_budget_s`` if shorter (seconds): a quiet time
#: (a trainer's step between rollouts) is no evidence that the engine went on aborting.
ABORT_STREAK_GAP_S = 60.0
#: Request contents whose aborts are remembered (the oldest is forgotten past this).
ABORT_HISTORY_MAX = 4096
#: Seconds between WARNING lines about futures answered 410 after their abort re-forwards.
ABORT_LOG_EVERY_S = 10.0
#: After /dev/shm had no room for a result's pages (ArenaSpaceError), each SUBMIT checks its free
#: space for this long (seconds; one statvfs) and is refused 429 while it cannot hold the reservation.
SHM_FULL_CHECK_S = 30.0
#: Seconds between two ERROR lines about /dev/shm being full.
SHM_FULL_LOG_EVERY_S = 10.0


# vLLM's refusal of prompt + max_tokens over its context window (vllm serving_engine's
# _validate_input; spec §1): "This model's maximum context length is 2048 tokens. However, ...".
_CONTEXT_WINDOW_RE = re.compile(r"maximum context length is (\d+) tokens")


def refit_to_window(body: bytes, exc: EngineError) -> bytes | None:
    """The engine request ``body`` again with ``max_tokens`` = the context window the engine's 400
    ``exc`` names less the prompt's length, or None when ``exc`` is not such a refusal or that
    would not leave ``max_tokens`` >= 1 below the body's. Only for a body whose ``max_tokens``
    the gateway chose (the client left it unset: up to the end of the context), whose window went
    stale when the engine restarted with a smaller ``--max-model-len``."""
    m = _CONTEXT_WINDOW_RE.search(str(exc)) if exc.status == 400 else None
    if m is None:
        return None
    req = json.loads(body)
    fitted = int(m.group(1)) - len(req.get("prompt") or ())
    if not 1 <= fitted < req.get("max_tokens", 0):
        return None
    req["max_tokens"] = fitted
    return json.dumps(req, separators=(",", ":")).encode()


def _resolve(w: asyncio.Future, value: object) -> None:
    """A held poll's timer: the time is up, answer with ``value`` unless it was answered already."""
    if not w.done():
        w.set_result(value)


@dataclass(slots=True)
class OwnerUsage:
    """What one API key holds in a shard, checked against its share (``auth.key_share``).

    Attributes:
        pending: its futures waiting for the engine.
        request_bytes: engine request bodies those futures hold (bytes).
        arena_bytes: arena bytes reserved for its pending futures plus the slots of its results
            not delivered yet and of the JSON forms cached for them (bytes; delivered results can
            be evicted, so they do not count). A JSON form that would pass the share is not cached
            (the front-end derives it for that one response).
    """

    pending: int = 0
    request_bytes: int = 0
    arena_bytes: int = 0


class EngineQueue:
    """Futures waiting for an engine connection: one FIFO per owner (API key; ``""`` in open
    mode), served round robin, one future per owner in turn, so one key's backlog delays another
    key's future by at most one future per key and free engine connection. With one owner the
    order is plain FIFO. Every operation is O(1) (:meth:`compact` aside).

    Entries that left the pending state while queued (``body`` None) stay until they are popped
    or compacted; popping one does not use up its owner's turn.
    """

    __slots__ = ("_fifos", "_turns", "_len")

    def __init__(self) -> None:
        self._fifos: dict[str, collections.deque[FutureEntry]] = {}
        self._turns: collections.deque[str] = collections.deque()  # owners with entries, next first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, e: FutureEntry) -> None:
        """Queue ``e`` behind its owner's other entries (an owner new to the queue takes its turn last)."""
        fifo = self._fifos.get(e.owner)
        if fifo is None:
            fifo = self._fifos[e.owner] = collections.deque()
            self._turns.append(e.owner)
        fifo.append(e)
        self._len += 1

    def popleft(self) -> FutureEntry:
        """Take the oldest entry of the owner whose turn it is (IndexError when empty). The turn
        passes to the next owner unless the entry taken is stale."""
        owner = self._turns[0]
        fifo = self._fifos[owner]
        e = fifo.popleft()
        self._len -= 1
        if not fifo:
            del self._fifos[owner]
            self._turns.popleft()
        elif e.body is not None:
            self._turns.rotate(-1)
        return e

    def compact(self) -> None:
        """Drop every stale entry, keeping each owner's order and the owners' turn order."""
        for owner in list(self._turns):
            fifo = collections.deque(e for e in self._fifos[owner] if e.body is not None and e.task is None)
            if fifo:
                self._fifos[owner] = fifo
            else:
                del self._fifos[owner]
        self._turns = collections.deque(o for o in self._turns if o in self._fifos)
        self._len = sum(map(len, self._fifos.values()))


class EncoderCore:
    """The logic of one shard.

    Args:
        cfg: the whole config (``futures``, ``engine`` and ``shards`` sections are used).
        shard: this shard's index.
        arena: the writer of this shard's arena.
        engine: a started :class:`EngineClient`.
        signer: mints future IDs that hash to this shard.
        engine_probe: the engine reachability probe whose last result STATS reports (``/readyz``
            waits for it); None: this shard does not probe (STATS ``engine`` is None and
            readiness does not wait for it). The caller starts and closes it.
        journal: the shard's journal of futures owed a report
            (:class:`~shardserver.workers.journal.FutureJournal`); None: none is kept (futures
            in flight when the encoder dies are never reported to a poller). The caller opens
            it, passes what it took over to :meth:`restore`, and closes it.
        cursor_tag: the run's :func:`~shardserver.ids.cursor_tag`: every completion stamp is
            congruent to it modulo :data:`~shardserver.ids.CURSOR_TAG_SPAN` (and at or after the
            moment it is logged); 0: plain ``time.monotonic_ns()`` stamps.

    The arena, the engine client and the probe stay the caller's: :meth:`close` ends only the
    shard's own work.
    """

    def __init__(self, cfg: Config, shard: int, arena: ArenaWriter, engine: EngineClient, signer: IdSigner,
                 engine_probe: EngineProbe | None = None, journal: FutureJournal | None = None,
                 cursor_tag: int = 0) -> None:
        self.cfg = cfg
        self.shard = shard
        self.arena = arena
        self.engine = engine
        self.signer = signer
        self.decoder = CompletionDecoder()
        self.table: dict[str, FutureEntry] = {}
        self.by_key: dict[tuple[str, int], str] = {}
        # Delivered results (DONE futures whose bytes a client got) in delivery order, oldest first:
        # the only results a full arena may evict.
        self.eviction_queue: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._abandoned_scan_at = 0.0  # monotonic s before which no walk for abandoned results is made
        # Sessions their SDK closed (SESSION_FINISHED): (session ID's last 16 chars, owner) -> when
        # (monotonic s); forgotten after futures.completed_ttl_s, at most FINISHED_SESSIONS_KEPT.
        self.finished_sessions: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.reserved_bytes = 0
        self.state_counts: collections.Counter[str] = collections.Counter()
        self.delivered_count = 0  # futures in the table that were delivered at least once
        self._timers = DeadlineBuckets()  # TTL deadlines (monotonic s) by future ID
        self.counters: collections.Counter[str] = ShardCounters(shard)  # also feeds Prometheus
        self.decode_encode_s = 0.0
        self.timers = EncoderTimers()
        self.engine_probe = engine_probe
        # Engine calls: at most engine.pool_size run at once (one engine connection each); the
        # other pending futures wait in ``engine_queue`` (one FIFO per owner, served round robin)
        # holding only their FutureEntry (and body).
        self.max_engine_calls = cfg.engine.pool_size
        self.engine_calls = 0
        # engine.answer_budget_bytes: while the engine answers received and not yet decoded
        # (EngineClient.answer_bytes) pass it, finished calls are not replaced (the limit shrinks
        # by one each); below it each finished call is replaced and the limit grows by one.
        self.answer_budget = cfg.engine.answer_budget(getattr(engine, "url", ""))
        self.min_engine_calls = min(MIN_ENGINE_CALLS, self.max_engine_calls)
        self.engine_call_limit = self.max_engine_calls
        self._grow_credit = 0  # calls finished under the budget since the limit last grew
        self.engine_queue = EngineQueue()  # per-owner FIFOs served round robin
        self._queue_stale = 0  # entries in engine_queue that left the pending state meanwhile
        self.pending_request_bytes = 0  # engine request bodies held by pending futures
        self._closed = False
        # Per-key shares (auth.mode = "keys"; the supervisor sets key_share to 1/keys when it is 0).
        self.key_share = cfg.auth.key_share if cfg.auth.mode == "keys" else 0.0
        self.owners: dict[str, OwnerUsage] = {}
        # Completions not yet passed by their session's cursor: session key -> {fid: stamp}, in
        # stamp order; and the one held SESSION_POLL of a session key, if any.
        self.session_logs: dict[tuple[str, int], dict[str, int]] = {}
        self.session_waiters: dict[tuple[str, int], asyncio.Future[bool]] = {}
        self._last_stamp = 0
        self.cursor_tag = cursor_tag
        self.journal = journal
        self._journal_lost = False  # check_journal logged that the journal cannot be written again
        # Monotonic time of the first ``finish_reason: abort`` since the engine's last answer that
        # was not aborted, or since its last quiet time (ABORT_STREAK_GAP_S); None: it answers.
        # Past engine.unavailable_budget_s, a future out of abort re-forwards fails instead of
        # answering 410 (which the SDK would resubmit forever).
        self._aborting_since: float | None = None
        self._answered_at = 0.0  # monotonic time of the engine's last answer, aborted or not (ABORT_STREAK_GAP_S)
        # Aborts per request content across its resubmissions (digest -> [monotonic time of the
        # first, aborts, self._finished when it came]), and engine answers that were not aborted:
        # see ABORT_ROUNDS. An entry goes when its content is answered, or past ABORT_HISTORY_MAX.
        self._abort_history: collections.OrderedDict[bytes, list] = collections.OrderedDict()
        self._finished = 0
        self._abort_log = RateLimitedLog(log, logging.WARNING, ABORT_LOG_EVERY_S)  # 410s after aborts
        self._shm_full_at = 0.0  # monotonic time /dev/shm last had no room for a result (0: never)
        self._shm_full_log = RateLimitedLog(log, logging.ERROR, SHM_FULL_LOG_EVERY_S)

    # -- helpers -------------------------------------------------------------------------
    def _set_deadline(self, e: FutureEntry, ttl: float, now: float | None = None) -> None:
        """Give ``e`` a new TTL deadline (``now`` + ``ttl`` s, monotonic). The TTL index keeps the
        superseded items and those of dropped futures until their own deadlines (up to
        ``futures.pending_ttl_s``, 5 h by default): once they outnumber the live ones, it is rebuilt from
        the table, so it never holds more than ``2 × (the most futures the table held) + HEAP_SLACK + 1``
        items."""
        e.deadline = (time.monotonic() if now is None else now) + ttl
        timers = self._timers
        timers.add(e.fid, e.deadline)
        if len(timers) > 2 * len(self.table) + HEAP_SLACK:
            timers.rebuild((x.fid, x.deadline) for x in self.table.values())
            self.counters["ttl_heap_rebuilds"] += 1

    def _set_state(self, e: FutureEntry, state: FutureState) -> None:
        """Move a future (still in the table) to ``state``, keeping the per-state counts that
        STATS reports (O(1) per scrape instead of a walk over every future). A future that leaves
        PENDING goes into its session's completion log."""
        if e.fid in self.table:
            self.state_counts[e.state] -= 1
            self.state_counts[state] += 1
            if e.state == FutureState.PENDING and state != FutureState.PENDING:
                self._log_completion(e)
        if state != FutureState.PENDING:
            self._left_pending(e)
        e.state = state

    def _log_completion(self, e: FutureEntry) -> None:
        """Stamp ``e`` and append it to its session's log; wake that session's held SESSION_POLL."""
        key = e.session_key
        if key is None:
            return
        now = time.monotonic_ns()
        step = 1
        if self.cursor_tag:  # the next value >= now that is congruent to the run's tag
            step = CURSOR_TAG_SPAN
            stamp = now - now % step + self.cursor_tag
            if stamp < now:
                stamp += step
        else:
            stamp = now
        if stamp <= self._last_stamp:
            stamp = self._last_stamp + step
        self._last_stamp = e.stamp = stamp
        log_ = self.session_logs.get(key)
        if log_ is None:
            log_ = self.session_logs[key] = {}
        log_[e.fid] = stamp
        w = self.session_waiters.pop(key, None)
        if w is not None and not w.done():
            w.set_result(True)

    def _unlog(self, e: FutureEntry) -> None:
        """Remove ``e`` from its session's completion log (it left the table)."""
        key = e.session_key
        log_ = self.session_logs.get(key) if key is not None else None
        if log_ is not None and log_.pop(e.fid, None) is not None and not log_:
            del self.session_logs[key]

    def _unjournal(self, e: FutureEntry) -> None:
        """``e`` is owed no report any more: end its journal record (rewriting the journal when
        it has grown past its bound)."""
        if not e.journaled:
            return
        e.journaled = False
        j = self.journal
        if j is None:
            return
        try:
            j.end(e.fid)
            if j.needs_compaction:
                j.compact(self._journal_live())
                self.counters["journal_compactions"] += 1
        except OSError as exc:
            self._journal_failed(exc)

    def _journal_live(self) -> Iterator[JournalRecord]:
        """The records of the futures the journal owes a report for (those journaled in the
        table), ``since`` from their creation time."""
        wall = time.time() - time.monotonic()  # unix time = monotonic time + wall
        return (JournalRecord(x.fid, x.key[0], x.key[1] // CLONE_SEQ_SPAN,  # type: ignore[index]
                              int(x.created + wall))
                for x in self.table.values() if x.journaled)

    def _journal_failed(self, exc: OSError) -> None:
        log.error("shard %d: the futures journal %s failed (%s); futures in flight at a restart will not be "
                  "reported to pollers", self.shard, self.journal.path if self.journal else "", exc)
        self.counters["journal_errors"] += 1
        self.journal = None

    def check_journal(self, now: float | None = None) -> None:
        """Have the journal see that its file is still there (called at every sweep;
        :meth:`FutureJournal.check` looks at most every
        :data:`~shardserver.workers.journal.CHECK_INTERVAL_S`, ``now`` monotonic s). A file that
        was removed (``server.state_dir`` deleted) or replaced is written again with what is
        owed now: a WARNING and ``journal_recreated``. One that cannot be: an ERROR and
        ``journal_errors``, once until it is written again; it is tried again at each check
        (appends go on meanwhile, to the unlinked file)."""
        j = self.journal
        if j is None:
            return
        try:
            what = j.check(self._journal_live, now)
        except OSError as exc:
            if not self._journal_lost:
                self._journal_lost = True
                self.counters["journal_errors"] += 1
                log.error("shard %d: the futures journal %s is gone and cannot be written again (%s); futures in "
                          "flight at a restart will not be reported to pollers until it is (tried again every "
                          "%.1f s)", self.shard, j.path, exc, JOURNAL_CHECK_INTERVAL_S)
            return
        if what == "superseded":
            log.warning("shard %d: the futures journal %s was taken over by a new encoder of the shard; left to it",
                        self.shard, j.path)
        elif what is not None:
            self._journal_lost = False
            self.counters["journal_recreated"] += 1
            log.warning("shard %d: the futures journal %s was %s (server.state_dir deleted? a tmp cleaner?): made "
                        "its directory again and wrote the %d futures owed a report to a new journal",
                        self.shard, j.path, what, j.live)

    def restore(self, records: list[JournalRecord]) -> int:
        """Hold the futures a predecessor owed a report for (``records``, from the journals
        taken over) as GONE entries with no result, stamped now, so the next
        ``retrieve_futures`` of their session reports them failed; ``retrieve_future`` for them
        answers 410 and the SDK resubmits. They stay journaled until the session's cursor
        passes them, a ``retrieve_future`` is answered 410 for them, or they leave the table
        (ack, ``futures.completed_ttl_s`` after the shard first accepted them). Returns how
        many were added (a fid the table holds already is skipped)."""
        n = 0
        now, wall = time.monotonic(), time.time()
        ttl = self.cfg.futures.completed_ttl_s
        for r in records:
            if r.fid in self.table:
                continue
            # Its TTL counts from when the shard first accepted it (the record's ``since``), so a
            # future restored at restart after restart still leaves futures.completed_ttl_s after
            # that (before, each restart gave it a whole TTL again).
            age = min(max(0.0, wall - r.since), ttl) if r.since else 0.0
            e = FutureEntry(fid=r.fid, key=(r.sid, r.clone * CLONE_SEQ_SPAN), created=now - age)
            e.gone_reason = "lost when its encoder or the gateway restarted; resubmit the request"
            e.state, e.journaled = FutureState.GONE, self.journal is not None
            self.table[r.fid] = e
            self.state_counts[FutureState.GONE] += 1
            self._log_completion(e)
            self._set_deadline(e, ttl - age, now)
            n += 1
        if n:
            self.counters["restored_lost"] += n
        return n

    def _wake(self, e: FutureEntry) -> None:
        waiters, e.waiters = e.waiters, None
        for w in waiters or ():
            if not w.done():
                w.set_result(None)

    def _release_reserve(self, e: FutureEntry) -> None:
        if e.reserve is not None:
            self.reserved_bytes -= e.reserve.capacity
            self.arena.free(e.reserve)
            e.reserve = None

    def _usage(self, owner: str) -> OwnerUsage | None:
        """The usage record of ``owner`` (created on demand), or None when shares are off."""
        if not self.key_share:
            return None
        u = self.owners.get(owner)
        if u is None:
            u = self.owners[owner] = OwnerUsage()
        return u

    def _settle(self, owner: str, u: OwnerUsage) -> None:
        if not (u.pending or u.request_bytes or u.arena_bytes):
            self.owners.pop(owner, None)  # the table stays as large as the keys with something held

    def _charge(self, e: FutureEntry, arena_bytes: int) -> None:
        """Count ``arena_bytes`` (instead of what was counted so far) against the future's owner."""
        if e.charged == arena_bytes:
            return
        u = self._usage(e.owner)
        if u is not None:
            u.arena_bytes += arena_bytes - e.charged
            self._settle(e.owner, u)
        e.charged = arena_bytes

    def _json_room(self, e: FutureEntry) -> int | None:
        """Arena bytes the share of ``e``'s owner (``auth.key_share``) leaves for caching the JSON
        form of ``e``'s undelivered result (0 or less: none); None when there is no limit (shares
        off, or the result was delivered: then both forms can be evicted and count on no share)."""
        if e.delivered or not self.key_share:
            return None
        u = self.owners.get(e.owner)
        return int(self.key_share * self.arena.size) - (u.arena_bytes if u is not None else 0)

    def _release_body(self, e: FutureEntry, queued: bool = True) -> None:
        """Drop the future's engine request body and its counts (``queued``: False when it was
        taken out of ``engine_queue`` without an engine call)."""
        if e.body is None:
            return
        size = len(e.body)
        e.body = e.plp = None
        if e.task is None and queued:
            self._queue_stale += 1  # it stays in engine_queue until it is skipped or compacted
        self.pending_request_bytes -= size
        u = self._usage(e.owner)
        if u is not None:
            u.request_bytes -= size
            self._settle(e.owner, u)

    def _left_pending(self, e: FutureEntry) -> None:
        """The future stopped waiting for the engine: its owner has one pending future less."""
        u = self._usage(e.owner) if e.state == FutureState.PENDING else None
        if u is not None:
            u.pending -= 1
            self._settle(e.owner, u)

    def _release(self, e: FutureEntry) -> None:
        self._charge(e, 0)
        self._release_body(e)
        self._release_reserve(e)
        hold = e.readers > 0  # a front-end may be copying it right now (ArenaWriter.free)
        for s in (e.slot, e.json_slot):
            if s is not None:
                self.arena.free(s, hold=hold)
        e.slot = e.json_slot = None

    def _drop(self, e: FutureEntry) -> None:
        """Remove an entry entirely (expiry or eviction); later polls answer 410."""
        if self.table.pop(e.fid, None) is not None:
            self.state_counts[e.state] -= 1
            self.delivered_count -= e.delivered
            self._left_pending(e)
        if e.key is not None and self.by_key.get(e.key) == e.fid:
            del self.by_key[e.key]
        self._unlog(e)
        self._unjournal(e)
        self.eviction_queue.pop(e.fid, None)
        if e.task is not None and not e.task.done():
            e.task.cancel()
        self._release(e)
        e.state = FutureState.GONE
        e.gone_reason = e.gone_reason or "expired"
        self._wake(e)

    def _evict_delivered_until(self, fits, keep: str | None = None, need: int = 0) -> bool:
        """Evict delivered results, oldest delivery first, until ``fits()`` is true.

        ``keep``: a future that must survive (the one being answered); it keeps its place.
        ``need``: the arena bytes asked for; when the arena holds at least that much in slots
        freed a moment ago (``ArenaWriter.hold_s``), nothing more is evicted (what an eviction
        frees is held too, so it would not make room now): False, and the caller's 429 is
        retried once they are back.
        """
        kept = keep is not None and self.eviction_queue.pop(keep, False) is None
        try:
            while not fits():
                if not self.eviction_queue:
                    return False
                if need and self.arena.held_bytes >= need:
                    return False
                fid, _ = self.eviction_queue.popitem(last=False)
                e = self.table.get(fid)
                if e is not None:
                    e.gone_reason = "evicted"
                    self._drop(e)
                    self.counters["evicted"] += 1
            return True
        finally:
            if kept:
                self.eviction_queue[keep] = None
                self.eviction_queue.move_to_end(keep, last=False)

    def _evict_abandoned_until(self, fits, owner: str | None = None) -> bool:
        """Evict results never delivered whose session the client closed (SESSION_FINISHED), then
        those completed over ``futures.abandoned_after_s`` ago, oldest completion first, until
        ``fits()`` is true; each becomes GONE (its polls answer 410 ``abandoned``, so a client
        still waiting resubmits) and counts as ``evicted_abandoned``. ``owner``: only that API
        key's results (its share of the arena is full, ``auth.key_share``).

        A live SDK fetches a result within seconds of its completion, so such results belong to
        clients that crashed or left: without this they held the arena for
        ``futures.completed_ttl_s`` (30 min) and every new sample of their size got 429. The table
        is walked at most once per :data:`ABANDONED_SCAN_S` while nothing old enough is found.
        """
        after = self.cfg.futures.abandoned_after_s
        now = time.monotonic()
        if after <= 0 or now < self._abandoned_scan_at:
            return False
        # (a DONE future's deadline is its completion + completed_ttl_s)
        cutoff = now - after + self.cfg.futures.completed_ttl_s
        finished = self.finished_sessions
        old = []
        for e in self.table.values():
            if e.state != FutureState.DONE or e.delivered or e.slot is None or (owner is not None and e.owner != owner):
                continue
            closed = bool(finished) and self._session_closed(e)
            if closed or e.deadline < cutoff:
                old.append((not closed, e.deadline, e.fid))  # closed sessions' results first
        old.sort()
        for not_closed, _, fid in old:
            if fits():
                return True
            e = self.table[fid]
            why = (f"completed over {after:g} s ago and never retrieved" if not_closed
                   else "never retrieved, and its session was closed by the client (sessions/{id}/finish)")
            self._gone(e, f"abandoned: {why}; evicted to make room (futures.abandoned_after_s)")
            self.counters["evicted_abandoned"] += 1
        if fits():
            return True
        self._abandoned_scan_at = now + ABANDONED_SCAN_S
        return False

    def _session_closed(self, e: FutureEntry) -> bool:
        """Whether the session of ``e``'s sampling session was closed (SESSION_FINISHED)."""
        if e.key is None:
            return False
        sess = self.signer.open_sampling_session_id(e.key[0], e.owner)
        return sess is not None and (sess.session_id, e.owner) in self.finished_sessions

    def session_finished(self, session: str, owner: str) -> None:
        """SESSION_FINISHED: the client closed the session whose ID ends in ``session`` (16
        characters; bound to ``owner``). Its sampling sessions' results never retrieved count as
        abandoned from now on (:meth:`_evict_abandoned_until`). Remembered for
        ``futures.completed_ttl_s`` (every such result is gone by then), at most
        :data:`FINISHED_SESSIONS_KEPT` sessions."""
        now = time.monotonic()
        f = self.finished_sessions
        f[(session, owner)] = now
        f.move_to_end((session, owner))
        ttl = self.cfg.futures.completed_ttl_s
        while f and (len(f) > FINISHED_SESSIONS_KEPT or next(iter(f.values())) < now - ttl):
            f.popitem(last=False)
        self._abandoned_scan_at = 0.0  # the next SUBMIT that finds no room looks again
        self.counters["sessions_finished"] += 1

    # -- SUBMIT --------------------------------------------------------------------------
    def submit(self, req: SubmitRequest, body: bytes) -> SubmitReply:
        """Register a sample request and start its engine call.

        ``req``: the SUBMIT message (``reserve_bytes`` is the largest SampleResponse this request
        can produce). ``body``: the engine request JSON bytes.

        Returns :class:`SubmitAccepted` (also for a duplicate (sid, seq) with the same ``digest``,
        with ``duplicate``), or :class:`SubmitRefused` with reason CONFLICT (a duplicate (sid, seq)
        whose ``digest`` differs from the first request's), or
        :class:`SubmitRefused` with reason NO_ROOM (no free arena block for the reservation, even
        after evicting delivered results), TOO_LARGE (the reservation exceeds the whole arena) or
        INVALID (the prompt cannot be held as int32 tokens), or STOPPING once :meth:`close` ran (a
        future accepted then would never be answered nor journaled: the encoder's event loop
        still serves its control connections while it winds down).
        """
        if self._closed:
            self.counters["rejected_stopping"] += 1
            return SubmitRefused(reason=RefusalReason.STOPPING, message=(
                f"shard {self.shard} is shutting down; retry (the gateway's next run takes the request)"))
        # One str per session (the SUBMIT decoder makes a new one per message: ~100 bytes each
        # of up to shards.max_pending futures).
        key = (sys.intern(req.sid), req.seq)
        fid = self.by_key.get(key)
        if fid is not None and fid in self.table:
            first = self.table[fid].digest
            if first and req.digest and first != req.digest:
                self.counters["rejected_conflict"] += 1
                return SubmitRefused(reason=RefusalReason.CONFLICT, message=(
                    f"seq_id {req.seq} of this sampling session already names future {fid}, submitted with a "
                    f"different request (prompt, num_samples or sampling params); a retry must resend the same "
                    f"request, a new request needs a new seq_id"))
            self.counters["deduplicated"] += 1
            return SubmitAccepted(request_id=fid, duplicate=True)
        # Everything that can fail happens before the table or the arena is touched.
        try:
            prompt_arr = np.asarray(req.prompt, dtype=np.int32) if req.prompt is not None else None
        except (OverflowError, ValueError, TypeError) as exc:
            return SubmitRefused(reason=RefusalReason.INVALID, message=f"invalid sample request: {exc}")
        n, want_plp, topk = req.n, req.prompt_logprobs, req.topk
        payload = req.reserve_bytes
        need = ArenaWriter.slot_bytes(payload)
        if need > self.arena.size:
            return SubmitRefused(reason=RefusalReason.TOO_LARGE, message=(
                f"the result of this request can reach {need} bytes, more than the shard's arena "
                f"({self.arena.size} bytes, shards.arena_bytes); lower max_tokens or num_samples"))
        refused = self._key_quota(req.owner, len(body), need) or self._pending_limit(len(body))
        if refused is None and self._shm_full_at and time.monotonic() - self._shm_full_at < SHM_FULL_CHECK_S:
            refused = self._shm_room(need)
        if refused is not None:
            return refused
        # Reserve a real, contiguous slot now: the completion writes into it and gives back the
        # tail, so it can never fail for lack of (contiguous) space.
        slot = self.arena.alloc(payload)
        if slot is None and (self._evict_delivered_until(lambda: self.arena.largest_free() >= need, need=need)
                             or self._evict_abandoned_until(lambda: self.arena.largest_free() >= need)):
            slot = self.arena.alloc(payload)
        if slot is None:
            self.counters["rejected_429"] += 1
            return SubmitRefused(reason=RefusalReason.NO_ROOM, message=(
                f"shard {self.shard} arena has no free block of {need} bytes "
                f"({self.arena.used_bytes - self.reserved_bytes} bytes of results, {self.reserved_bytes} reserved, "
                f"{self.arena.size} in all); retry later"))
        fid = self.signer.mint_future_id(self.shard, self.cfg.shards.count, req.owner)
        e = FutureEntry(fid=fid, key=key, created=time.monotonic(), reserve=slot, owner=req.owner,
                        digest=req.digest)
        self.reserved_bytes += slot.capacity
        self.table[fid] = e
        self.state_counts[FutureState.PENDING] += 1
        self.by_key[key] = fid
        self._set_deadline(e, self.cfg.futures.pending_ttl_s)
        if self.journal is not None:
            try:
                self.journal.add(fid, req.sid, req.seq // CLONE_SEQ_SPAN)
                e.journaled = True
            except OSError as exc:
                self._journal_failed(exc)
        e.body, e.n, e.fill = body, n, req.fill_context
        if want_plp:
            e.plp = (topk, prompt_arr)
        self.pending_request_bytes += len(body)
        u = self._usage(req.owner)
        if u is not None:
            u.pending += 1
            u.request_bytes += len(body)
        self._charge(e, slot.capacity)
        self.engine_queue.append(e)
        self._start_engine_calls()
        self.counters["submitted"] += 1
        return SubmitAccepted(request_id=fid)

    def _key_quota(self, owner: str, body_bytes: int, arena_bytes: int) -> SubmitRefused | None:
        """The refusal when the key ``owner`` would pass its share (``auth.key_share``) of this
        shard's pending futures, pending request bytes or arena with one more request of
        ``body_bytes`` reserving ``arena_bytes``; None when shares are off or it fits."""
        u = self.owners.get(owner) if self.key_share else None
        if u is None:
            return None
        share, sc, shard = self.key_share, self.cfg.shards, self.shard
        max_pending = max(1, int(share * sc.max_pending))
        if u.pending >= max_pending:
            what = (f"this API key has {u.pending} futures waiting for the engine on shard {shard}, its share of "
                    f"shards.max_pending (auth.key_share={share:.4g} x {sc.max_pending} = {max_pending})")
        elif u.request_bytes and u.request_bytes + body_bytes > share * sc.max_pending_request_bytes:
            what = (f"this API key holds {u.request_bytes} bytes of engine requests on shard {shard}; {body_bytes} "
                    f"more would pass its share of shards.max_pending_request_bytes (auth.key_share={share:.4g} x "
                    f"{sc.max_pending_request_bytes} = {int(share * sc.max_pending_request_bytes)})")
        elif u.arena_bytes and u.arena_bytes + arena_bytes > share * self.arena.size and not self._evict_abandoned_until(
                lambda: u.arena_bytes + arena_bytes <= share * self.arena.size, owner):
            # (the key's own abandoned results, e.g. a crashed trainer's, were evicted first if any)
            what = (f"this API key holds {u.arena_bytes} bytes of shard {shard}'s arena (reservations and results "
                    f"not retrieved yet); {arena_bytes} more would pass its share of shards.arena_bytes "
                    f"(auth.key_share={share:.4g} x {self.arena.size} = {int(share * self.arena.size)})")
        else:
            return None
        self.counters["rejected_key_quota"] += 1
        return SubmitRefused(reason=RefusalReason.KEY_QUOTA,
                             message=f"API key quota: {what}; retrieve its results or retry later")

    def _pending_limit(self, body_bytes: int) -> SubmitRefused | None:
        """The refusal when one more pending future of ``body_bytes`` would pass
        ``shards.max_pending`` or ``shards.max_pending_request_bytes`` (a body larger than the
        whole bound is let through when no other body is held, so it is never refused forever)."""
        sc = self.cfg.shards
        pending = self.state_counts[FutureState.PENDING]
        if pending >= sc.max_pending:
            self.counters["rejected_pending_limit"] += 1
            return SubmitRefused(reason=RefusalReason.PENDING_LIMIT, message=(
                f"shard {self.shard} holds {pending} futures waiting for the engine (shards.max_pending="
                f"{sc.max_pending}); retry later"))
        if self.pending_request_bytes and self.pending_request_bytes + body_bytes > sc.max_pending_request_bytes:
            self.counters["rejected_pending_bytes"] += 1
            return SubmitRefused(reason=RefusalReason.PENDING_BYTES, message=(
                f"shard {self.shard} holds {self.pending_request_bytes} bytes of engine requests waiting for the "
                f"engine; this one ({body_bytes} bytes) would pass shards.max_pending_request_bytes="
                f"{sc.max_pending_request_bytes}; retry later"))
        return None

    def _call_finished(self) -> None:
        """An engine call ended (its answer decoded, or it failed): adjust the limit of calls
        in flight to ``engine.answer_budget_bytes`` (see ``engine_call_limit``), then start
        queued calls."""
        self.engine_calls -= 1
        if self.answer_budget:
            # (an http:// engine's answers wait unread for room in the budget: what they hold
            # meanwhile, at most one read each, never holds calls back)
            held = self.engine.answer_bytes - getattr(self.engine, "answers_waiting_bytes", 0)
            if held > self.answer_budget:
                if self.engine_call_limit > self.min_engine_calls:
                    self.engine_call_limit -= 1
                    self.counters["engine_calls_held_back"] += 1
                self._grow_credit = 0
            elif self.engine_call_limit < self.max_engine_calls:
                self._grow_credit += 1
                if self._grow_credit >= LIMIT_GROW_EVERY:
                    self._grow_credit = 0
                    self.engine_call_limit += 1
        self._start_engine_calls()

    def _start_engine_calls(self) -> None:
        """Start queued engine calls while fewer than ``engine_call_limit`` (at most
        ``engine.pool_size``, see :meth:`_call_finished`) run. A future that
        waited longer than ``engine.pool_wait_s`` for its turn is not sent: it answers 410 (never
        a failure: the engine never saw it) and the SDK resubmits it."""
        q = self.engine_queue
        pool_wait_s = self.cfg.engine.pool_wait_s
        while q and self.engine_calls < self.engine_call_limit and not self._closed:
            e = q.popleft()
            if e.body is None:  # left the pending state while queued (TTL, close)
                self._queue_stale -= 1
                continue
            waited = time.monotonic() - e.created
            if waited > pool_wait_s:
                self.counters["engine_pool_wait_exceeded"] += 1
                self._release_body(e, queued=False)
                self._gone(e, f"engine request not sent: no engine connection free within {pool_wait_s:g} s "
                              f"(all engine.pool_size = {self.max_engine_calls} in use; engine.pool_wait_s)")
                continue
            self.engine_calls += 1
            e.task = asyncio.get_running_loop().create_task(self._run(e), name=f"engine-call-{e.fid[:16]}")
        if self._queue_stale > 64 and self._queue_stale * 2 > len(q):
            q.compact()
            self._queue_stale = 0

    async def _run(self, e: FutureEntry) -> None:
        body, n, plp = e.body, e.n, e.plp
        assert body is not None and e.key is not None
        want_plp = plp is not None
        topk, prompt = plp if plp is not None else (0, None)
        headers = {"X-Session-ID": e.key[0]}
        ids = AttemptIds(e.fid)  # X-Request-Id <fid>-a1, -a2, ... over every attempt of this future
        aborts = 0
        bad_bodies = 0
        refit = e.fill  # at most once
        try:
            while True:
                t_engine = time.perf_counter()
                try:
                    # Re-forwards after refused/broken connections and 408/429/503 happen inside,
                    # within engine.unavailable_budget_s.
                    data = await self.engine.post(body, headers, ids=ids)
                except EngineError as exc:
                    self.timers.engine(time.perf_counter() - t_engine, False)
                    smaller = refit_to_window(body, exc) if refit else None
                    if smaller is not None:
                        refit, body = False, smaller
                        self.counters["engine_context_refits"] += 1
                        log.warning("encoder %d: the engine's context window is smaller than the gateway knew (%s); "
                                    "future %s sent again with max_tokens for it", self.shard, exc, e.fid)
                        continue
                    self._fail(e, str(exc), exc.category)
                    return
                t0 = time.perf_counter()
                self.timers.engine(t0 - t_engine, True)
                split0 = self.decoder.split_decodes
                try:
                    dc = self.decoder.decode(data, num_samples=n, prompt_token_ids=prompt,
                                             prompt_logprobs=want_plp, topk_prompt_logprobs=topk)
                    if self.decoder.split_decodes != split0:
                        self.counters["engine_bodies_split"] += 1  # shardserver.codec.split
                except EngineBodyError as exc:
                    bad_bodies += 1
                    if bad_bodies > self.cfg.engine.bad_body_resends:
                        self._fail(e, str(exc) if bad_bodies == 1 else
                                   f"{exc} (the engine's answer was unusable {bad_bodies} times; "
                                   f"engine.bad_body_resends = {self.cfg.engine.bad_body_resends})", "server")
                        return
                    self.counters["engine_bad_bodies_resent"] += 1
                    log.warning("encoder %d: future %s: unusable engine answer (%s): sending the request again",
                                self.shard, e.fid, exc)
                    continue
                finally:
                    self.engine.release(data)
                del data
                if dc.aborted:
                    aborts += 1
                    self.counters["engine_aborts"] += 1
                    now = time.monotonic()
                    # Only an abort right after an answer that was not aborted counts against the
                    # request's content: in a storm (a weight sync aborting all in flight), only
                    # the first abort does, so identical requests aborted together are not
                    # taken for one the engine singles out.
                    gap = min(ABORT_STREAK_GAP_S, self.cfg.engine.unavailable_budget_s / 2)
                    if self._aborting_since is None or now - self._answered_at > gap:
                        self._aborting_since = now
                        history = self._note_abort(e.digest, now)
                    else:
                        history = self._abort_history.get(e.digest) if e.digest else None
                    self._answered_at = now
                    ec = self.cfg.engine
                    if aborts > ec.max_abort_resubmits:
                        aborting_for = now - self._aborting_since
                        if aborting_for >= ec.unavailable_budget_s:
                            self.counters["engine_budget_exhausted"] += 1
                            self._fail(e, f"engine at {self.engine.display_url} aborted every request for "
                                          f"{aborting_for:.1f} s (engine.unavailable_budget_s = "
                                          f"{ec.unavailable_budget_s:g}); this one {aborts} times "
                                          f"(engine.max_abort_resubmits = {ec.max_abort_resubmits})", "server")
                            return
                        if history is not None and self._singled_out(history, now):
                            self.counters["engine_budget_exhausted"] += 1
                            self._abort_history.pop(e.digest, None)
                            self._fail(e, f"engine at {self.engine.display_url} aborted this request {history[1]} "
                                          f"times in {now - history[0]:.1f} s right after finishing others, its "
                                          f"resubmissions included ({self._finished - history[2]} others finished; "
                                          f"more than "
                                          f"{ABORT_ROUNDS} x (engine.max_abort_resubmits + 1) = "
                                          f"{ABORT_ROUNDS * (ec.max_abort_resubmits + 1)}, over more than "
                                          f"engine.unavailable_budget_s = {ec.unavailable_budget_s:g}); it is not "
                                          f"sent again", "server")
                            return
                        self._log_abort_gone(e, aborts)
                        self._gone(e, f"engine aborted the request {aborts} times "
                                      f"(engine.max_abort_resubmits={ec.max_abort_resubmits})")
                        return
                    continue
                self._aborting_since = None
                self._answered_at = time.monotonic()
                self._finished += 1
                if self._abort_history and e.digest:
                    self._abort_history.pop(e.digest, None)
                body = b""  # nothing more to send: keep no request body
                self._release_body(e)
                self._store(e, dc)
                dt = time.perf_counter() - t0
                self.decode_encode_s += dt
                self.timers.decode_encode(dt)
                return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must fail this future, not hang it
            log.exception("engine task for %s failed", e.fid)
            self._fail(e, f"internal error: {exc}", "server")
        finally:
            self._release_body(e)
            self._call_finished()

    def _note_abort(self, digest: bytes, now: float) -> list | None:
        """Count an abort of the request content ``digest`` (``SubmitRequest.digest``) that came
        right after an answer that was not aborted, in :attr:`_abort_history`; its entry
        ``[first abort, aborts, finished answers then]``, or None for a request without a digest."""
        if not digest:
            return None
        h = self._abort_history.get(digest)
        if h is None:
            h = self._abort_history[digest] = [now, 0, self._finished]
            if len(self._abort_history) > ABORT_HISTORY_MAX:
                self._abort_history.popitem(last=False)
        else:
            self._abort_history.move_to_end(digest)
        h[1] += 1
        return h

    def _singled_out(self, history: list, now: float) -> bool:
        """Whether the engine singles out a request content (see :data:`ABORT_ROUNDS`): aborted
        more than ``ABORT_ROUNDS x (engine.max_abort_resubmits + 1)`` times, each right after an
        answer that was not aborted, over at least ``engine.unavailable_budget_s``."""
        ec = self.cfg.engine
        return (history[1] > ABORT_ROUNDS * (ec.max_abort_resubmits + 1)
                and now - history[0] >= ec.unavailable_budget_s and self._finished > history[2])

    def _log_abort_gone(self, e: FutureEntry, aborts: int) -> None:
        """WARNING (at most every :data:`ABORT_LOG_EVERY_S`, folding the others, which are logged
        with their count that long after the last line even if none follows) that a future
        answers 410 because the engine aborted it ``aborts`` times."""
        self._abort_log.hit("encoder %d: the engine aborted future %s %d times (finish_reason abort; "
                            "engine.max_abort_resubmits = %d): it answers 410 and the SDK resubmits the sample",
                            self.shard, e.fid, aborts, self.cfg.engine.max_abort_resubmits)

    def _store(self, e: FutureEntry, dc) -> None:
        plan = plan_sample_response(dc)
        size = plan[1]
        slot = e.reserve
        if slot is not None and ArenaWriter.slot_bytes(size) <= slot.capacity:
            self.reserved_bytes -= slot.capacity
            e.reserve = None
            self.arena.shrink(slot, size)
        else:
            # Larger than its reservation (an engine that returned more than max_tokens, e.g. a
            # speculative-decoding step past the limit): find other room, else 410 (resubmit).
            self._release_reserve(e)
            slot = self.arena.alloc(size)
            if slot is None and self._evict_delivered_until(
                    lambda: self.arena.largest_free() >= ArenaWriter.slot_bytes(size), need=ArenaWriter.slot_bytes(size)):
                slot = self.arena.alloc(size)
            if slot is None:
                self.counters["arena_overflow"] += 1
                self._gone(e, f"its {size}-byte result exceeded the request's arena reservation and shard "
                              f"{self.shard} has no room for it")
                return
        try:
            n = encode_sample_response(dc, self.arena.payload(slot, size), 0, plan=plan)
        except ArenaSpaceError as exc:
            # /dev/shm filled up since the start (another program's files): a fault of the host,
            # not of the request. 410: the SDK resubmits, and SUBMITs are refused 429 while the
            # filesystem stays full (_shm_room).
            self.arena.free(slot)
            self._shm_full(exc)
            self._gone(e, f"could not be stored ({exc.strerror})")
            return
        except Exception:
            self.arena.free(slot)  # the caller fails the future; the slot must not leak
            raise
        if n != size:
            self.arena.free(slot)
            self._fail(e, f"internal error: encoder wrote {n} bytes, expected {size}", "server")
            return
        self.arena.commit(slot, size)
        e.slot = slot
        self._charge(e, slot.capacity)  # undelivered: evicted only once abandoned, so it stays on the key's share
        self._set_state(e, FutureState.DONE)
        self.counters["completed"] += 1
        self._set_deadline(e, self.cfg.futures.completed_ttl_s)
        self._wake(e)

    def _fail(self, e: FutureEntry, msg: str, category: str) -> None:
        if e.state != FutureState.PENDING:
            return
        self._release(e)
        self._set_state(e, FutureState.FAILED)
        e.error, e.category = msg, category
        self.counters[f"failed_{category}"] += 1
        self._set_deadline(e, self.cfg.futures.completed_ttl_s)
        self._wake(e)

    def _write_json(self, js: bytes) -> Slot | None:
        """A derived JSON form written to the arena; None when there is no room (in the arena, or
        in ``/dev/shm`` for its pages: then it is not cached and the front-end derives it)."""
        try:
            return self.arena.write(js)
        except ArenaSpaceError as exc:
            self._shm_full(exc)
            return None

    def _shm_full(self, exc: ArenaSpaceError) -> None:
        """``/dev/shm`` had no room for a result's pages: count it, log an ERROR (at most every
        :data:`SHM_FULL_LOG_EVERY_S`), and check the free space at each SUBMIT for the next
        :data:`SHM_FULL_CHECK_S`."""
        self._shm_full_at = time.monotonic()
        self.counters["arena_shm_full"] += 1
        self._shm_full_log.hit("encoder %d: %s: %s is full (another program's files? `df %s`): results that cannot "
                               "be stored answer 410 (the SDK resubmits) and new samples are refused 429 until there "
                               "is room (shardserver_encoder_events_total{event=\"arena_shm_full\"})",
                               self.shard, exc.strerror, SHM_DIR, SHM_DIR)

    def _shm_room(self, need: int) -> SubmitRefused | None:
        """While ``/dev/shm`` was full a moment ago: 429 when it has less than ``need`` bytes
        free (a reservation the engine would fill for nothing), else None."""
        try:
            free, _ = shm_free_bytes()
        except OSError:
            return None
        if free >= need:
            return None
        self.counters["rejected_429"] += 1
        return SubmitRefused(reason=RefusalReason.NO_ROOM, message=(
            f"{SHM_DIR} is full ({free} bytes free, this request's result may need {need}): shard "
            f"{self.shard} cannot store results; retry later"))

    def _gone(self, e: FutureEntry, reason: str) -> None:
        self._release(e)
        self._set_state(e, FutureState.GONE)
        e.gone_reason = reason
        self.counters["gone"] += 1
        self._set_deadline(e, self.cfg.futures.completed_ttl_s)
        self._wake(e)

    # -- POLL ----------------------------------------------------------------------------
    async def poll(self, req: PollRequest) -> PollReply:
        """Answer where a future's bytes are, waiting up to ``req.timeout`` s while it is pending."""
        e = self.table.get(req.fid)
        if e is None:
            return PollGone(reason="unknown or expired future (its result was not kept)")
        if e.state == FutureState.PENDING:
            timeout = min(req.timeout, self.cfg.futures.long_poll_s)
            if timeout > 0:
                loop = asyncio.get_running_loop()
                w: asyncio.Future[None] = loop.create_future()
                if e.waiters is None:
                    e.waiters = []
                e.waiters.append(w)
                # A timer on the waiter itself (asyncio.wait_for adds a second future and a callback hop).
                timer = loop.call_later(timeout, _resolve, w, None)
                try:
                    await w
                finally:
                    timer.cancel()
                    if e.waiters is not None and w in e.waiters:
                        e.waiters.remove(w)
        reply = self._answer(e, req.want)
        if e.journaled and isinstance(reply, PollGone):
            self._unjournal(e)  # a lost future answered 410: the client resubmits; nothing more is owed
        return reply

    def _answer(self, e: FutureEntry, want: ResultForm) -> PollReply:
        if e.state == FutureState.PENDING:
            return PollPending()
        if e.state == FutureState.FAILED:
            return PollFailed(error=e.error, category=e.category)  # type: ignore[arg-type]
        if e.state == FutureState.GONE or e.slot is None:
            return PollGone(reason=e.gone_reason or "result no longer held")
        slot = e.slot
        if want == ResultForm.JSON:
            if e.json_slot is None:
                room = self._json_room(e)
                js = sample_response_to_json(self.arena.read(e.slot)) if room is None or room > 0 else None
                if js is not None and (room is None or ArenaWriter.slot_bytes(len(js)) <= room):
                    e.json_slot = self._write_json(js)
                    if e.json_slot is None:
                        self._evict_delivered_until(
                            lambda: self.arena.largest_free() >= ArenaWriter.slot_bytes(len(js)), keep=e.fid)
                        e.json_slot = self._write_json(js)
                    if e.json_slot is not None and not e.delivered:
                        self._charge(e, e.charged + e.json_slot.capacity)  # held as long as the result
                if e.json_slot is None:
                    # No room to cache the JSON form (in the arena, or in its key's share): hand
                    # out the proto and let the front-end derive JSON from it for this one response.
                    self.counters["json_uncached"] += 1
                    e.readers += 1
                    return PollDone(arena=self.arena.name, offset=slot.offset, length=slot.length,
                                    generation=slot.generation, form=ResultForm.PROTO)
            slot = e.json_slot
        e.readers += 1  # a front-end will copy from it until its DELIVERED (or for good, if it fails)
        return PollDone(arena=self.arena.name, offset=slot.offset, length=slot.length,
                        generation=slot.generation, form=want)

    def delivered_ok(self, fid: str) -> None:
        """The front-end sent this future's result to a connected client: start the retrieved TTL."""
        e = self.table.get(fid)
        if e is None or e.state not in (FutureState.DONE, FutureState.FAILED):
            return
        if e.readers:
            e.readers -= 1  # that front-end is done copying: its slot may be freed without a hold
        if not e.delivered:
            e.delivered = True
            self.delivered_count += 1
            self.counters["delivered"] += 1
            self._charge(e, 0)  # delivered results can be evicted: off the key's share
        if e.state == FutureState.DONE:
            self.eviction_queue[fid] = None
            self.eviction_queue.move_to_end(fid)
        self._set_deadline(e, self.cfg.futures.retrieved_ttl_s)
        # The client has its answer: after a restart nothing is owed (a retry of its
        # retrieve_future finds the future unknown: 410, resubmit). Kept journaled, every
        # delivered result held for futures.retrieved_ttl_s came back as a lost future at each
        # encoder restart, and restarts closer together than futures.completed_ttl_s piled them up.
        self._unjournal(e)

    # -- SESSION_POLL and CANCEL ---------------------------------------------------------
    async def session_poll(self, req: SessionPollRequest) -> SessionPollReply:
        """The completions of one session in this shard, for ``retrieve_futures``.

        Frees the acknowledged futures of ``req.acks`` that belong to ``req.sid`` and are no
        longer pending, forgets the session's completions stamped at or before ``req.after``,
        and returns those stamped in ``(after, upto]`` (oldest first, at most ``limit``). With
        nothing to return and ``timeout`` > 0 it holds (at most ``futures.long_poll_s``) until a
        completion of the session arrives (``woke``), another SESSION_POLL for the session
        supersedes it (``woke``), or the time is up.
        """
        key = (req.sid, req.clone)
        old = self.session_waiters.pop(key, None)
        if old is not None and not old.done():
            old.set_result(True)  # superseded: its front-end has moved on
        for fid in req.acks:
            e = self.table.get(fid)
            if e is not None and e.key is not None and e.key[0] == req.sid and e.state != FutureState.PENDING:
                e.gone_reason = "retrieved and acknowledged by the client"
                self._drop(e)
                self.counters["acked"] += 1
        log_ = self.session_logs.get(key)
        events: list[CompletionEvent] = []
        more = False
        if log_:
            after, upto, table = req.after, req.upto, self.table
            seen = [fid for fid, stamp in itertools.takewhile(lambda kv: kv[1] <= after, log_.items())]
            for fid in seen:
                del log_[fid]
                e = table.get(fid)
                if e is not None and e.journaled:
                    self._unjournal(e)  # the poller got it: after a restart nothing is owed
            for fid, stamp in log_.items():
                if stamp > upto:
                    break
                if len(events) >= req.limit:
                    more = True
                    break
                e = table[fid]
                ok = e.state == FutureState.DONE and e.slot is not None
                events.append(CompletionEvent(fid=fid, stamp=stamp, ok=ok, size=e.slot.length if ok else 0))
            if not log_:
                del self.session_logs[key]
        if events:
            return SessionPollReply(events=events, more=more)
        timeout = min(req.timeout, self.cfg.futures.long_poll_s)
        if timeout <= 0:
            return SessionPollReply()
        log_ = self.session_logs.get(key)
        if log_ and next(reversed(log_.values())) > req.after:
            return SessionPollReply(woke=True)  # completions after upto exist already
        loop = asyncio.get_running_loop()
        w: asyncio.Future[bool] = loop.create_future()
        self.session_waiters[key] = w
        timer = loop.call_later(timeout, _resolve, w, False)  # time is up: not woken
        try:
            woke = await w
        finally:
            timer.cancel()
            if self.session_waiters.get(key) is w:
                del self.session_waiters[key]
        return SessionPollReply(woke=woke)

    def cancel(self, req: CancelRequest) -> CancelReply:
        """The client abandoned ``req.fid``: cancel its engine call (closing the engine connection
        makes vLLM abort the request) or take it out of the engine queue, free its reservation or
        result and forget it (polls then answer 410; the session's poller does not report it).
        ``was`` is the state it was in, ``"unknown"`` when the shard does not hold it."""
        e = self.table.get(req.fid)
        if e is None:
            return CancelReply(was="unknown")
        was = e.state.value
        e.gone_reason = "cancelled by the client"
        self._drop(e)
        self.counters[f"cancelled_{was}"] += 1
        return CancelReply(was=was)

    # -- TTL sweep -----------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> int:
        """Expire entries whose TTL passed: a pending one becomes GONE (kept for
        ``futures.completed_ttl_s``, its engine call cancelled or never started), any other is
        dropped. Returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        table = self.table

        def deadline_of(fid: str) -> float | None:
            x = table.get(fid)
            return None if x is None else x.deadline

        # (a pending future that expires gets futures.completed_ttl_s, which may be due at once)
        for _ in range(3):
            due = self._timers.pop_due(now, deadline_of)
            if not due:
                break
            n += self._expire(due, now)
        return n

    def _expire(self, due: list[str], now: float) -> int:
        """Expire the futures ``due`` whose deadline is still ``<= now`` (see :meth:`sweep`)."""
        n = 0
        for fid in due:
            e = self.table.get(fid)
            if e is None or e.deadline > now:
                continue
            n += 1
            if e.state == FutureState.PENDING:
                # Kept as GONE (polls answer 410) so the session's poller reports it; the engine
                # call stops.
                e.expired = True
                if e.task is not None and not e.task.done():
                    e.task.cancel()
                self._release(e)
                self._set_state(e, FutureState.GONE)
                e.gone_reason = "expired (the engine did not answer within futures.pending_ttl_s)"
                self._set_deadline(e, self.cfg.futures.completed_ttl_s, now)
                self._wake(e)
                self.counters["expired"] += 1
                continue
            if not e.expired:
                self.counters["expired"] += 1
            e.gone_reason = e.gone_reason or "expired"
            self._drop(e)
        return n

    def stages(self) -> dict[str, int]:
        """Futures by stage for the ``shardserver_futures`` gauge, from counts kept as states change
        (see :func:`shardserver.metrics.future_stages` for the definitions)."""
        sc = self.state_counts
        return {"pending": sc[FutureState.PENDING],
                "completed": sc[FutureState.DONE] + sc[FutureState.FAILED] - self.delivered_count,
                "retrieved": self.delivered_count, "gone": sc[FutureState.GONE]}

    def flush_metrics(self) -> None:
        """Write the counter increments and timings kept since the last flush to Prometheus
        (:class:`~shardserver.metrics.ShardCounters`, :class:`~shardserver.metrics.EncoderTimers`)."""
        flush = getattr(self.counters, "flush", None)
        if flush is not None:
            flush()
        self.timers.flush()

    def stats(self) -> StatsReply:
        """The STATS reply: counters and gauges of this shard. Flushes the Prometheus metrics
        first, so a ``/metrics`` scrape (which asks every encoder for STATS before it reads the
        metric files) sees every count made until then."""
        self.flush_metrics()
        states = {k.value: v for k, v in self.state_counts.items() if v}
        return StatsReply(
            shard=self.shard,
            pid=os.getpid(),
            futures=states,
            delivered_held=len(self.eviction_queue),
            arena_bytes=self.arena.size,
            arena_used_bytes=self.arena.used_bytes - self.reserved_bytes,  # results (proto + JSON)
            arena_reserved_bytes=self.reserved_bytes,
            decode_encode_s=self.decode_encode_s,
            counters=dict(self.counters),
            stages=self.stages(),
            engine=self.engine_probe.state() if self.engine_probe is not None else None,
            pending_request_bytes=self.pending_request_bytes,
            engine_calls=self.engine_calls,
            engine_call_limit=self.engine_call_limit,
            engine_queued=len(self.engine_queue) - self._queue_stale,
            engine_answer_bytes=getattr(self.engine, "answer_bytes", 0),
            engine_answers_waiting=getattr(self.engine, "answers_waiting", 0),
            # An ongoing outage seen by the engine calls themselves (None: the engine answers).
            engine_unavailable=getattr(self.engine, "unavailable", lambda: None)(),
        )

    async def handle(self, msg: object, blob: bytes) -> (SubmitReply | PollReply | StatsReply | SessionPollReply
                                                          | CancelReply | ErrorReply | None):
        """Dispatch one decoded control message (see :mod:`shardserver.control`); None for DELIVERED."""
        if isinstance(msg, PollRequest):
            return await self.poll(msg)
        if isinstance(msg, SubmitRequest):
            return self.submit(msg, blob)
        if isinstance(msg, Delivered):
            self.delivered_ok(msg.fid)
            return None
        if isinstance(msg, SessionFinished):
            self.session_finished(msg.session, msg.owner)
            return None
        if isinstance(msg, StatsRequest):
            return self.stats()
        if isinstance(msg, SessionPollRequest):
            return await self.session_poll(msg)
        if isinstance(msg, CancelRequest):
            return self.cancel(msg)
        return ErrorReply(message=f"unhandled control message {type(msg).__name__}")

    def close(self, why: str = "server shutting down") -> None:
        """Stop the shard's work: every pending future goes GONE with ``why`` (waiting polls answer
        410) and every engine call still running is cancelled. Results already in the arena stay."""
        self._closed = True
        for e in list(self.table.values()):
            if e.state == FutureState.PENDING:
                self._gone(e, why)
        for e in list(self.table.values()):
            if e.task is not None:
                e.task.cancel()


#: File descriptors an encoder keeps for everything but its engine connections: the health
#: probe's, the arena, the journal, metrics files, the logging pipe, imports (plus one control
#: connection per front-end, counted apart).
ENCODER_FD_RESERVE = 48


def effective_pool_size(configured: int, front_ends: int) -> tuple[int, int]:
    """``(engine connections, soft RLIMIT_NOFILE)``: ``engine.pool_size`` lowered to what the
    soft file-descriptor limit leaves after :data:`ENCODER_FD_RESERVE` and one control
    connection per front-end (at least 8); the limit is -1 when unlimited."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured, -1
    return max(8, min(configured, soft - ENCODER_FD_RESERVE - front_ends)), soft


class EncoderProc:
    """Process wrapper: ``EncoderProc.run`` is the only spawn target of an encoder."""

    @staticmethod
    def _open_journal(cfg: Config, shard: int, tag: str) -> tuple[FutureJournal | None, list[JournalRecord]]:
        """Take over this shard's journals and open its new one (see
        :mod:`shardserver.workers.journal`), whether or not the poller is announced (an SDK that
        learned it from an earlier run keeps polling); ``(None, [])`` with a warning when there is no
        ``server.state_dir`` or it cannot be written; ``(None, records)`` with a warning when the
        old journals were read but the new one cannot be written (disk full): those futures are
        still reported. A journal file that cannot be read is skipped with a warning."""
        if not tag:
            return None, []
        if not cfg.server.state_dir:
            log.warning("encoder %d: no server.state_dir: futures in flight when this encoder or the gateway restarts "
                        "will not be reported to pollers", shard)
            return None, []
        try:
            # A journal untouched for longer than a GONE future is kept is of no use to anyone.
            # A predecessor stopping after its supervisor died may take server.graceful_shutdown_s
            # and its event loop's last awaits: its journal is read only once it let go.
            journal, took = FutureJournal.open(os.path.join(cfg.server.state_dir, JOURNAL_DIR), tag, shard,
                                               cfg.shards.count, lock_wait_s=cfg.server.graceful_shutdown_s + 10.0,
                                               stale_s=cfg.futures.completed_ttl_s)
        except OSError as exc:
            log.warning("encoder %d: cannot keep a futures journal in %s (%s): futures in flight when this encoder "
                        "or the gateway restarts will not be reported to pollers", shard, cfg.server.state_dir, exc)
            # What was read is still reported (the files stay for the next run, which reads them again).
            return None, exc.takeover.records if isinstance(exc, JournalUnwritable) else []
        if took.bad_lines:
            log.warning("encoder %d: %d unreadable journal lines ignored", shard, took.bad_lines)
        if took.waited_s > 0.5:
            log.info("encoder %d: waited %.1f s for the journal of a stopping encoder", shard, took.waited_s)
        return journal, took.records

    @staticmethod
    def run(cfg: Config, shard: int, arena_name: str, sock_path: str, engine_url: str,
            secret: bytes, run_id: str, ready_conn, parent_pid: int, heartbeat=None, journal_tag: str = "") -> None:
        """The encoder process of shard ``shard``: serve its control socket ``sock_path`` until
        SIGTERM or the supervisor ``parent_pid`` dies. ``journal_tag``: the gateway's
        :func:`~shardserver.workers.journal.journal_tag` (its journal lives in
        ``<server.state_dir>/futures``); empty: no journal."""
        from ..process import die_with_parent
        from ._subprocess import child_setup

        die_with_parent(parent_pid, signal.SIGTERM)  # SIGTERM: the shutdown below unlinks the arena
        child_setup(f"encoder {shard}", cfg)
        try:
            import uvloop

            uvloop.run(EncoderProc._main(cfg, shard, arena_name, sock_path, engine_url, secret, run_id,
                                         ready_conn, parent_pid, heartbeat, journal_tag))
        except KeyboardInterrupt:
            pass

    @staticmethod
    async def _main(cfg: Config, shard: int, arena_name: str, sock_path: str, engine_url: str,
                    secret: bytes, run_id: str, ready_conn, parent_pid: int, heartbeat=None,
                    journal_tag: str = "") -> None:
        from .liveness import start_heartbeat

        loop = asyncio.get_running_loop()
        # The supervisor's liveness check (server.liveness_timeout_s) reads these beats.
        hb_task = start_heartbeat(heartbeat, cfg.server.liveness_timeout_s, f"encoder-{shard}-heartbeat")
        pool, soft = effective_pool_size(cfg.engine.pool_size, cfg.server.front_ends)
        if pool < cfg.engine.pool_size:
            # Past the limit each new engine connection would fail with EMFILE, which reads as
            # the engine being down: samples of a healthy engine failed, /readyz said 503.
            log.warning("encoder %d: engine.pool_size=%d lowered to %d: the soft RLIMIT_NOFILE is %d (raise it, "
                        "e.g. ulimit -n or LimitNOFILE=, or lower engine.pool_size)", shard, cfg.engine.pool_size,
                        pool, soft)
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, pool_size=pool))
        stop = asyncio.Event()
        # SIGINT (Ctrl-C reaches the whole process group) is the supervisor's to handle: it stops
        # the front-ends first, then sends SIGTERM here.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        arena = ArenaWriter(arena_name, hold_s=ARENA_READ_HOLD_S)
        # In a thread: waiting for a stopping predecessor's lock must not stop the heartbeat.
        journal, taken = await asyncio.to_thread(EncoderProc._open_journal, cfg, shard, journal_tag)
        engine = EngineClient(cfg.engine, engine_url)
        await engine.start()
        from ..health import EngineProbe

        probe = EngineProbe(engine_url, cfg.engine.health_interval_s, cfg.engine.connect_timeout_s, shard,
                            api_key=cfg.engine.api_key)
        probe.on_ok = engine.probe_ok  # a healthy engine nobody is retrying is no longer "unavailable"
        probe.outage = lambda: engine.unavailable() is not None  # probe every DOWN_PROBE_S meanwhile
        engine.on_answer = probe.kick  # an answered request re-runs a failed probe at once
        engine.check_life = probe.check_life  # an attempt past engine.timeout_s on a silent engine asks it
        core = EncoderCore(cfg, shard, arena, engine, IdSigner(secret, run_id, cfg.server.host_id),
                           engine_probe=probe, journal=journal, cursor_tag=cursor_tag(run_id))
        if taken:
            n = core.restore(taken)
            log.warning("encoder %d: %d futures were in flight when its predecessor stopped, or lost at an earlier "
                        "restart and not reported yet; their sessions' pollers will get them as failed "
                        "(retrieve_future answers 410: the SDK resubmits)", shard, n)
        engine.counters = core.counters  # retry counters reach /stats and /metrics
        probe.start()  # the first probe runs at once; /readyz waits for it
        try:
            os.unlink(sock_path)
        except FileNotFoundError:
            pass
        server = await serve_control(sock_path, core.handle)
        from ._subprocess import settle_gc

        settle_gc()
        ready_conn.send(("ready", shard, os.getpid()))
        ready_conn.close()
        log.info("encoder %d ready: arena %s (%d bytes), engine %s", shard, arena_name, arena.size,
                 mask_url(engine_url))

        from .heap import HeapTrimmer

        trimmer = HeapTrimmer()

        servers = [server]
        sock_checked = [time.monotonic()]

        def keep_socket() -> None:
            """A /tmp cleaner removed the run directory: bind the control socket's path again
            (the connections of the old listener stay), so that a restarted front-end finds it."""
            now = time.monotonic()
            if now < sock_checked[0] + SOCKET_CHECK_S:
                return
            sock_checked[0] = now
            from ..prometheus_dir import restore_removed_files

            try:
                restore_removed_files()
            except Exception:  # the metrics must never stop the encoder
                log.exception("encoder %d: cannot write its metrics files again", shard)
            if os.path.exists(sock_path):
                return
            os.makedirs(os.path.dirname(sock_path), mode=0o700, exist_ok=True)
            # The old listener stops listening (its path is gone; the front-ends' connections
            # stay): one listening socket, however often the directory is removed.
            for old in servers:
                old.close()
            servers.clear()
            fut = asyncio.ensure_future(serve_control(sock_path, core.handle))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or servers.append(f.result()))
            log.warning("encoder %d: its control socket %s was removed (a /tmp cleaner?): bound again", shard, sock_path)

        async def sweeper() -> None:
            while True:
                await asyncio.sleep(cfg.futures.sweep_interval_s)
                core.sweep()
                core.check_journal()
                try:
                    keep_socket()
                except OSError as exc:
                    log.error("encoder %d: cannot bind its control socket %s again: %s", shard, sock_path, exc)
                arena.release_held()  # (alloc releases them too; this gives the pages back in a quiet arena)
                try:
                    core.flush_metrics()
                except Exception:  # never let the metrics stop the TTL sweep
                    log.exception("encoder %d: writing the Prometheus metrics failed", shard)
                # Receive buffers no answer used for a while, then engine answers freed after a
                # burst that stay in glibc's heap: give them back.
                engine.sweep(BUFFER_IDLE_S)
                if trimmer.maybe_trim():
                    core.counters["heap_trims"] += 1

        from ..process import watch_parent

        sweep_task = loop.create_task(sweeper(), name=f"encoder-{shard}-sweeper")
        # The supervisor died (SIGKILL): leave.
        watch_task = loop.create_task(watch_parent(parent_pid, stop.set, who=f"encoder {shard}", logger=log,
                                                   interval_s=cfg.futures.sweep_interval_s),
                                      name=f"encoder-{shard}-parent-watch")
        try:
            await stop.wait()
        finally:
            sweep_task.cancel()
            watch_task.cancel()
            if hb_task is not None:
                hb_task.cancel()
            for srv in servers:
                srv.close()
            core.close("server shutting down")
            await probe.close()
            await engine.close()
            core.flush_metrics()
            try:
                arena.close()
            except BufferError:  # a view is still exported; the mapping goes with the process
                pass
            if os.getppid() != parent_pid:
                from ..shm.arena import unlink_segment

                unlink_segment(arena_name)
            try:
                os.unlink(sock_path)
            except FileNotFoundError:
                pass
            # Last, after every await: a SESSION_POLL answered meanwhile still ends its journal records
            # (SUBMITs are refused once core.close() ran: RefusalReason.STOPPING).
            j, core.journal = core.journal, None
            if j is not None:
                j.close()
            log.info("encoder %d stopped", shard)
