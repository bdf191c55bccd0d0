"""Prometheus metrics of every process of a run, served by any front-end at ``GET /metrics``.

Uses ``prometheus_client`` in multiprocess mode: the supervisor creates
``<run_dir>/metrics`` and sets ``PROMETHEUS_MULTIPROC_DIR`` to it *before* it
spawns any child (:func:`shardserver.prometheus_dir.prepare_prometheus_dir`); every child process then
keeps its counters and histograms in small mmap files there, and the
front-end answering a scrape merges all of them
(``MultiProcessCollector``). The counts of a dead child are kept, folded into
the run's ``*_dead.db`` files, so totals never go backwards when a worker is
restarted and the directory does not grow with restarts; the directory goes with
the run directory at shutdown, and run directories of dead supervisors are
removed at the next start. :func:`shardserver.prometheus_dir.mark_process_dead`
is called for every child that exits (it drops the files of live-mode gauges:
``shardserver_connections_open``, and folds the rest).

Gauges that describe a shard's *current* state (futures by stage, arena
bytes, engine reachability) are not kept in files: the front-end asks every
encoder for its STATS when it is scraped and emits them
(:class:`ShardGaugeCollector`), so they are exact at scrape time and cost
nothing per request.

Hot-path cost: a counter increment or a histogram observation in
multiprocess mode is a dict lookup plus an mmap write (about 1-3 µs);
label children are cached, so no per-request ``labels()`` call. No metric is
updated in a loop over futures. The encoders, which count several things per
result, keep their increments and observations in the process and write them
in one go before every STATS reply and at every sweep (:class:`ShardCounters`,
:class:`EncoderTimers`): a scrape asks every encoder for STATS before it reads
the files, so it sees them all; an encoder killed with SIGKILL loses what it
counted since its last sweep (at most ``futures.sweep_interval_s``).

Every metric, its type and labels are listed in ``docs/OPERATIONS.md``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

from .prometheus_dir import MULTIPROC_ENV, files_lock, prometheus_dir, use_cached_pid

use_cached_pid()  # before the first metric below is created

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client.core import GaugeMetricFamily  # noqa: E402

from .messages import FutureState  # noqa: E402

__all__ = [
    "MULTIPROC_ENV",
    "CONTENT_TYPE",
    "ShardCounters",
    "FrontendCounters",
    "EncoderTimers",
    "future_stages",
    "endpoint_of",
    "HttpMetricsMiddleware",
    "ShardGaugeCollector",
    "render",
    "count_worker_restart",
    "count_auth_rejected",
    "count_asample_refused",
    "gather_stats",
    "metrics_body",
]

log = logging.getLogger("shardserver.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# This process's metrics (exported directly only when not in multiprocess mode, e.g. in unit tests).
REGISTRY = CollectorRegistry(auto_describe=True)

# -- encoders ---------------------------------------------------------------------------------------
RESULTS_COMPLETED = Counter("shardserver_results_completed", "Results decoded, encoded and stored in the arena.",
                            ["shard"], registry=REGISTRY)
RESULTS_FAILED = Counter("shardserver_results_failed",
                         "Futures that failed: category user = engine 4xx, server = engine 5xx/timeout/bad body.",
                         ["shard", "category"], registry=REGISTRY)
RESULTS_EVICTED = Counter("shardserver_results_evicted",
                          "Delivered results evicted from a full arena before their retrieved TTL ran out.",
                          ["shard"], registry=REGISTRY)
RESULTS_DELIVERED = Counter("shardserver_results_delivered",
                            "Results and failures delivered to a connected client (first delivery only).",
                            ["shard"], registry=REGISTRY)
FUTURES_EXPIRED = Counter("shardserver_futures_expired", "Futures dropped by a TTL (futures.*_ttl_s).",
                          ["shard"], registry=REGISTRY)
FUTURES_GONE = Counter("shardserver_futures_gone",
                       "Futures lost before completion (engine aborted too often, shutdown); polls answer 410.",
                       ["shard"], registry=REGISTRY)
SUBMITS = Counter("shardserver_submits", "Sample requests registered by an encoder (new futures).",
                  ["shard"], registry=REGISTRY)
SUBMITS_DEDUPLICATED = Counter("shardserver_submits_deduplicated",
                               "asample resubmissions answered with the existing future.",
                               ["shard"], registry=REGISTRY)
SUBMITS_REJECTED = Counter("shardserver_submits_rejected",
                           "asample refused because the arena could not take the reservation (HTTP 429).",
                           ["shard"], registry=REGISTRY)
ENGINE_ABORTS = Counter("shardserver_engine_aborts", "Engine answers with finish_reason abort (re-forwarded).",
                        ["shard"], registry=REGISTRY)
ENGINE_RETRIES = Counter(
    "shardserver_engine_retries",
    "Engine requests sent again: kind keepalive = at once on a fresh connection (a reused keep-alive "
    "connection closed before any response byte), reforward = with backoff after a refused or broken "
    "connection, a truncated body or HTTP 408/429/503.",
    ["shard", "kind"], registry=REGISTRY)
ENGINE_BUDGET_EXHAUSTED = Counter(
    "shardserver_engine_budget_exhausted",
    "Futures failed (category server) because the engine stayed unavailable for engine.unavailable_budget_s.",
    ["shard"], registry=REGISTRY)
ARENA_OVERFLOW = Counter("shardserver_arena_overflow",
                         "Results larger than their request's arena reservation with no other room (410).",
                         ["shard"], registry=REGISTRY)
ENCODER_EVENTS = Counter("shardserver_encoder_events", "Other encoder counters, by name.",
                         ["shard", "event"], registry=REGISTRY)
ENGINE_LATENCY = Histogram(
    "shardserver_engine_request_duration_seconds",
    "One engine request (POST /v1/completions, re-forwards and the wait for a connection included), in seconds.",
    ["outcome"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
DECODE_ENCODE = Histogram(
    "shardserver_decode_encode_duration_seconds",
    "Decoding one engine body and encoding its SampleResponse into the arena, in seconds.",
    registry=REGISTRY,
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))

# -- front-ends -------------------------------------------------------------------------------------
HTTP_REQUESTS = Counter("shardserver_http_requests", "HTTP requests answered, by endpoint and status code.",
                        ["endpoint", "code"], registry=REGISTRY)
HTTP_LATENCY = Histogram(
    "shardserver_http_request_duration_seconds",
    "Time to answer one HTTP request (every endpoint but retrieve_future), in seconds.",
    ["endpoint"], registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
RETRIEVE_LATENCY = Histogram(
    "shardserver_retrieve_duration_seconds",
    "Time to answer one retrieve_future poll (long polls included), in seconds, by status code.",
    ["code"], registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45))
BYTES_DELIVERED = Counter("shardserver_bytes_delivered",
                          "Result bytes (proto or JSON) copied from the arenas into responses.",
                          registry=REGISTRY)
CONNECTIONS_OPEN = Gauge("shardserver_connections_open", "Client connections open, summed over live front-ends.",
                         registry=REGISTRY, multiprocess_mode="livesum")
CONNECTION_TIMEOUTS = Counter(
    "shardserver_connection_timeouts",
    "Connections closed because a request's headers (server.header_timeout_s) or body (server.body_timeout_s) "
    "did not arrive in time.", ["phase"], registry=REGISTRY)
CONNECTION_CAP_REACHED = Counter(
    "shardserver_connection_cap_reached",
    "Times a front-end reached server.max_connections and stopped accepting (new clients wait in the backlog).",
    registry=REGISTRY)
CONNECTIONS_EVICTED = Counter("shardserver_connections_evicted",
                              "Idle keep-alive connections closed to make room at server.max_connections.",
                              registry=REGISTRY)
ACCEPT_ERRORS = Counter("shardserver_accept_errors",
                        "accept() failures of the front-ends by errno name (EMFILE: out of file descriptors).",
                        ["reason"], registry=REGISTRY)
ASAMPLE_REFUSED = Counter("shardserver_asample_refused",
                          "asample refused by the owning shard, by reason (no_room, pending_limit, pending_bytes, key_quota: "
                          "HTTP 429; too_large, invalid: 400; conflict: 409; internal: 500).", ["reason"], registry=REGISTRY)
AUTH_REJECTED = Counter("shardserver_auth_rejected", "Requests refused by the key check (reason: missing or invalid key: 401; connections: 429, the key holds its share of the connections).",
                        ["reason"], registry=REGISTRY)

# -- supervisor -------------------------------------------------------------------------------------
WORKER_RESTARTS = Counter("shardserver_worker_restarts", "Child processes restarted by the supervisor.",
                          ["role"], registry=REGISTRY)


def count_worker_restart(role: str) -> None:
    WORKER_RESTARTS.labels(role=role).inc()


WORKER_HUNG_KILLS = Counter("shardserver_worker_hung_kills",
                            "Children SIGKILLed by the supervisor because their heartbeat was older than "
                            "server.liveness_timeout_s (stopped, or their event loop blocked); each is restarted.",
                            ["role"], registry=REGISTRY)


def count_worker_hung_kill(role: str) -> None:
    WORKER_HUNG_KILLS.labels(role=role).inc()


def count_asample_refused(reason: str) -> None:
    ASAMPLE_REFUSED.labels(reason=reason).inc()


def count_auth_rejected(reason: str) -> None:
    AUTH_REJECTED.labels(reason=reason).inc()


# -- counters mirrored from the existing in-process dicts --------------------------------------------
_SHARD_COUNTER_MAP: dict[str, tuple[Counter, dict[str, str]]] = {
    "completed": (RESULTS_COMPLETED, {}),
    "failed_user": (RESULTS_FAILED, {"category": "user"}),
    "failed_server": (RESULTS_FAILED, {"category": "server"}),
    "evicted": (RESULTS_EVICTED, {}),
    "delivered": (RESULTS_DELIVERED, {}),
    "expired": (FUTURES_EXPIRED, {}),
    "gone": (FUTURES_GONE, {}),
    "submitted": (SUBMITS, {}),
    "deduplicated": (SUBMITS_DEDUPLICATED, {}),
    "rejected_429": (SUBMITS_REJECTED, {}),
    "engine_aborts": (ENGINE_ABORTS, {}),
    "arena_overflow": (ARENA_OVERFLOW, {}),
    "engine_keepalive_retries": (ENGINE_RETRIES, {"kind": "keepalive"}),
    "engine_reforwards": (ENGINE_RETRIES, {"kind": "reforward"}),
    "engine_budget_exhausted": (ENGINE_BUDGET_EXHAUSTED, {}),
}


class ShardCounters(collections.Counter):
    """An encoder's ``counters``: a :class:`collections.Counter` whose increments also go to Prometheus.

    ``counters["completed"] += 1`` updates the dict (``/stats`` shows it) at once and
    ``shardserver_results_completed_total{shard}`` at the next :meth:`flush`; names without a
    dedicated metric go to ``shardserver_encoder_events_total{shard,event}``. Decrements and
    ``clear()`` touch only the dict. The encoder flushes before every STATS reply (so each
    ``/metrics`` scrape, which asks every encoder for STATS first, sees every increment made
    until then) and at every sweep (``futures.sweep_interval_s``): a Prometheus write per
    increment was an mmap write of ~2 µs, several per result.

    Args:
        shard: the encoder's shard index (the ``shard`` label).
    """

    def __init__(self, shard: int) -> None:
        self._shard = str(shard)
        self._children: dict[str, Any] = {}
        self._unflushed: dict[str, int] = {}  # name -> increments not yet added to Prometheus
        super().__init__()

    def _child(self, name: str) -> Any:
        metric, labels = _SHARD_COUNTER_MAP.get(name, (None, {}))
        if metric is None:
            c = ENCODER_EVENTS.labels(shard=self._shard, event=name)
        else:
            c = metric.labels(shard=self._shard, **labels)
        self._children[name] = c
        return c

    def __setitem__(self, name: str, value: int) -> None:
        delta = value - dict.get(self, name, 0)
        dict.__setitem__(self, name, value)
        if delta > 0:
            u = self._unflushed
            u[name] = u.get(name, 0) + delta

    def flush(self) -> None:
        """Add the increments made since the last flush to the Prometheus counters."""
        if not self._unflushed:
            return
        pending, self._unflushed = self._unflushed, {}
        for name, delta in pending.items():
            c = self._children.get(name)
            (c if c is not None else self._child(name)).inc(delta)

    def __reduce__(self):  # a plain Counter when pickled: the label children stay in this process
        return (collections.Counter, (dict(self),))


class FrontendCounters(dict):
    """A front-end's ``counters`` dict; ``bytes_delivered`` also feeds ``shardserver_bytes_delivered_total``.

    The front-end's other counters are HTTP status counts, which
    :class:`HttpMetricsMiddleware` already exports as ``shardserver_http_requests_total``.
    """

    def __setitem__(self, name: str, value: int) -> None:
        if name == "bytes_delivered":
            delta = value - dict.get(self, name, 0)
            if delta > 0:
                BYTES_DELIVERED.inc(delta)
        dict.__setitem__(self, name, value)


#: Observations an :class:`EncoderTimers` keeps before it flushes by itself (a bound on its memory
#: between sweeps: 4096 floats, ~100 KB per histogram).
MAX_UNFLUSHED_OBSERVATIONS = 4096


def _observe_all(child: Any, values: list[float]) -> None:
    """``child.observe(v)`` for every ``v`` of ``values`` (seconds), in order, with one write of
    the sum and one per bucket touched: the sum is added up in the same order as the
    observations would have (the same float), each value counts in the first bucket whose
    upper bound is at least it (a NaN in none), as ``prometheus_client.Histogram.observe`` does."""
    bounds = child._upper_bounds
    counts = [0] * len(bounds)
    total = child._sum.get()
    nb = len(bounds)
    for v in values:
        total += v
        if v == v:
            i = bisect.bisect_left(bounds, v)
            if i < nb:
                counts[i] += 1
    child._sum.set(total)
    buckets = child._buckets
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


class EncoderTimers:
    """Histogram observations of one encoder (pre-bound label children).

    Observations are kept in the process and reach Prometheus at :meth:`flush` (the encoder
    flushes with its :class:`ShardCounters`: before every STATS reply and at every sweep).
    """

    def __init__(self) -> None:
        self._engine_ok = ENGINE_LATENCY.labels(outcome="ok")
        self._engine_error = ENGINE_LATENCY.labels(outcome="error")
        self._decode_encode = DECODE_ENCODE
        self._pending_ok: list[float] = []
        self._pending_error: list[float] = []
        self._pending_de: list[float] = []

    def engine(self, seconds: float, ok: bool) -> None:
        """One engine request took ``seconds``; ``ok`` is False when it raised EngineError."""
        pending = self._pending_ok if ok else self._pending_error
        pending.append(seconds)
        if len(pending) >= MAX_UNFLUSHED_OBSERVATIONS:
            self.flush()

    def decode_encode(self, seconds: float) -> None:
        """Decode + encode of one result took ``seconds``."""
        self._pending_de.append(seconds)
        if len(self._pending_de) >= MAX_UNFLUSHED_OBSERVATIONS:
            self.flush()

    def flush(self) -> None:
        """Observe everything timed since the last flush (see :func:`_observe_all`)."""
        for child, name in ((self._engine_ok, "_pending_ok"), (self._engine_error, "_pending_error"),
                            (self._decode_encode, "_pending_de")):
            values = getattr(self, name)
            if values:
                setattr(self, name, [])
                _observe_all(child, values)


def future_stages(entries: Iterable[Any]) -> dict[str, int]:
    """Count futures by stage for the ``shardserver_futures`` gauge (one pass; call on STATS only).

    Stages: ``pending`` (the engine has not answered), ``completed`` (result or failure held,
    not yet delivered), ``retrieved`` (delivered, kept for ``futures.retrieved_ttl_s`` for
    SDK retries), ``gone`` (lost, kept to answer 410).
    """
    pending = completed = retrieved = gone = 0
    for e in entries:
        st = e.state
        if st == FutureState.PENDING:
            pending += 1
        elif st == FutureState.GONE:
            gone += 1
        elif e.delivered:
            retrieved += 1
        else:
            completed += 1
    return {"pending": pending, "completed": completed, "retrieved": retrieved, "gone": gone}


# -- HTTP ------------------------------------------------------------------------------------------
_FIXED_ENDPOINTS = {
    "/api/v1/client/config": "client_config",
    "/api/v1/client/dynamic_config": "client_dynamic_config",
    "/api/v1/create_session": "create_session",
    "/api/v1/session_heartbeat": "session_heartbeat",
    "/api/v1/create_sampling_session": "create_sampling_session",
    "/api/v1/asample": "asample",
    "/api/v1/retrieve_future": "retrieve_future",
    "/api/v1/retrieve_futures": "retrieve_futures",
    "/api/v1/cancel_future": "cancel_future",
    "/api/v1/telemetry": "telemetry",
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/stats": "stats",
}


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request path (bounded: IDs in paths are never labels)."""
    e = _FIXED_ENDPOINTS.get(path)
    if e is not None:
        return e
    if path.startswith("/api/v1/samplers/"):
        return "samplers"
    if path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
        return "session_finish"
    return "other"


AccessLog = Callable[[dict, int, int, float], None]


class HttpMetricsMiddleware:
    """ASGI middleware: counts every response by (endpoint, status), times it, and writes the access log.

    Placed outside :class:`shardserver.api.auth.AuthMiddleware`, so 401s are counted and logged too.

    Args:
        app: the wrapped ASGI app.
        access_log: when not None, called as ``access_log(scope, status, body_bytes, seconds)``
            once per finished request (see :mod:`shardserver.api.access_log`).
    """

    def __init__(self, app: Any, access_log: AccessLog | None = None) -> None:
        self.app = app
        self.access_log = access_log
        self._counts: dict[tuple[str, int], Any] = {}
        self._latency: dict[str, Any] = {}
        self._retrieve: dict[int, Any] = {}

    def _record(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = HTTP_REQUESTS.labels(endpoint=endpoint, code=str(status))
        c.inc()
        if endpoint == "retrieve_future":
            h = self._retrieve.get(status)
            if h is None:
                h = self._retrieve[status] = RETRIEVE_LATENCY.labels(code=str(status))
        else:
            h = self._latency.get(endpoint)
            if h is None:
                h = self._latency[endpoint] = HTTP_LATENCY.labels(endpoint=endpoint)
        h.observe(seconds)

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # what the server sends if the app raises before starting a response
        nbytes = 0
        logging_on = self.access_log is not None

        async def send_wrapper(message: dict) -> None:
            nonlocal status, nbytes
            if message["type"] == "http.response.start":
                status = message["status"]
            elif logging_on and message["type"] == "http.response.body":
                nbytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            dt = time.perf_counter() - t0
            self._record(endpoint_of(scope["path"]), status, dt)
            if logging_on:
                self.access_log(scope, status, nbytes, dt)  # type: ignore[misc]


# -- scrape ----------------------------------------------------------------------------------------
class ShardGaugeCollector:
    """Per-shard gauges built from the encoders' STATS replies of one scrape.

    Args:
        replies: one STATS reply per shard, or ``{"shard": s, "error": ...}`` for an encoder that
            did not answer.
    """

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies

    def collect(self) -> Iterable[Any]:
        up = GaugeMetricFamily("shardserver_encoder_up", "1 if the encoder answered this scrape's STATS.",
                               labels=["shard"])
        engine = GaugeMetricFamily("shardserver_engine_up",
                                   "1 if the encoder's last engine probe (GET /health) succeeded.", labels=["shard"])
        outage = GaugeMetricFamily("shardserver_engine_unavailable_seconds",
                                   "Seconds the encoder's engine requests have been failing and re-forwarded "
                                   "(0 while the engine answers).", labels=["shard"])
        futures = GaugeMetricFamily("shardserver_futures", "Futures held by the shard, by stage.",
                                    labels=["shard", "stage"])
        size = GaugeMetricFamily("shardserver_arena_size_bytes", "Size of the shard's arena.", labels=["shard"])
        used = GaugeMetricFamily("shardserver_arena_used_bytes", "Arena bytes holding results (slot headers included).",
                                 labels=["shard"])
        reserved = GaugeMetricFamily("shardserver_arena_reserved_bytes",
                                     "Arena bytes reserved for results of requests in flight.", labels=["shard"])
        free = GaugeMetricFamily("shardserver_arena_free_bytes",
                                 "Arena bytes neither used nor reserved (size - used - reserved).", labels=["shard"])
        req_bytes = GaugeMetricFamily("shardserver_pending_request_bytes",
                                      "Engine request bodies held by the shard's pending futures.", labels=["shard"])
        calls = GaugeMetricFamily("shardserver_engine_calls",
                                  "The shard's pending futures: running (an engine request in flight) or queued "
                                  "(waiting for one of engine.pool_size connections).", labels=["shard", "state"])
        answers = GaugeMetricFamily("shardserver_engine_answer_bytes",
                                    "Engine answers the encoder holds: received and not yet decoded (bytes).",
                                    labels=["shard"])
        limit = GaugeMetricFamily("shardserver_engine_call_limit",
                                  "Engine calls the encoder may run now: engine.pool_size, less while its held "
                                  "engine answers pass engine.answer_budget_bytes.", labels=["shard"])
        waiting = GaugeMetricFamily("shardserver_engine_answers_waiting",
                                    "Engine answers whose bodies wait unread in their sockets for room in "
                                    "engine.answer_budget_bytes.", labels=["shard"])
        for r in self.replies:
            s = str(r.get("shard", "?"))
            ok = "error" not in r
            up.add_metric([s], 1.0 if ok else 0.0)
            if not ok:
                continue
            eng = r.get("engine")
            engine.add_metric([s], 1.0 if (eng is None or eng.get("ok") is True) else 0.0)
            out = r.get("engine_unavailable")
            outage.add_metric([s], float(out["for_s"]) if out else 0.0)
            for stage, n in (r.get("stages") or {}).items():
                futures.add_metric([s, stage], float(n))
            a_size = float(r.get("arena_bytes", 0))
            a_used = float(r.get("arena_used_bytes", 0))
            a_res = float(r.get("arena_reserved_bytes", 0))
            size.add_metric([s], a_size)
            used.add_metric([s], a_used)
            reserved.add_metric([s], a_res)
            free.add_metric([s], max(0.0, a_size - a_used - a_res))
            req_bytes.add_metric([s], float(r.get("pending_request_bytes", 0)))
            calls.add_metric([s, "running"], float(r.get("engine_calls", 0)))
            calls.add_metric([s, "queued"], float(r.get("engine_queued", 0)))
            answers.add_metric([s], float(r.get("engine_answer_bytes", 0)))
            limit.add_metric([s], float(r.get("engine_call_limit", 0)))
            waiting.add_metric([s], float(r.get("engine_answers_waiting", 0)))
        return [up, engine, outage, futures, size, used, reserved, free, req_bytes, calls, answers, limit, waiting]


def render(shard_replies: list[dict[str, Any]]) -> bytes:
    """The Prometheus text exposition of the whole run plus the per-shard gauges.

    Blocking (reads the multiprocess files): call it in a thread from an event loop.
    """
    gauges = CollectorRegistry(auto_describe=False)
    gauges.register(ShardGaugeCollector(shard_replies))  # type: ignore[arg-type]
    d = prometheus_dir()
    if d is None:
        return generate_latest(REGISTRY) + generate_latest(gauges)
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(registry, path=d)
    with files_lock(d, shared=True):  # no dead process's files folded meanwhile
        text = generate_latest(registry)
    return text + generate_latest(gauges)


RECONNECT_GRACE_S = 0.6
"""Seconds :func:`gather_stats` waits for a front-end's connection to an encoder that is not
connected (one reconnect attempt of :class:`shardserver.control.ControlClient`, whose retry
delay is at most 0.5 s) before it reports the encoder down."""


async def gather_stats(clients: list[Any], timeout: float = 2.0) -> list[dict[str, Any]]:
    """STATS of every shard as plain dicts (the fields of :class:`shardserver.messages.StatsReply`),
    or ``{"shard": s, "error": ...}`` for one that is down, slow or failing.

    Args:
        clients: the front-end's :class:`shardserver.control.ControlClient` list.
        timeout: seconds to wait for each reply (and, for an encoder not connected, up to
            :data:`RECONNECT_GRACE_S` of it for the connection).
    """
    import msgspec

    from .errors import ControlError, EncoderDeadError

    async def one(c: Any) -> dict[str, Any]:
        # A restarted encoder listens before every front-end has reconnected (their retry delay
        # is up to 0.5 s): give the connection that long rather than report a live encoder down.
        if not c.connected and not await c.wait_connected(min(timeout, RECONNECT_GRACE_S)):
            return {"shard": c.shard, "error": f"encoder {c.shard} is not connected"}
        try:
            return msgspec.to_builtins(await c.stats(timeout=timeout))
        except (EncoderDeadError, ControlError) as exc:
            return {"shard": c.shard, "error": str(exc)}
        except asyncio.TimeoutError:
            return {"shard": c.shard, "error": f"encoder {c.shard} did not answer STATS within {timeout} s"}

    return list(await asyncio.gather(*(one(c) for c in clients)))


async def metrics_body(clients: list[Any]) -> bytes:
    """What ``GET /metrics`` answers (asks every encoder for STATS, then renders in a thread)."""
    replies = await gather_stats(clients)
    return await asyncio.to_thread(render, replies)
