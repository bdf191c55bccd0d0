"""The encoder's pooled client to the engine's ``/v1/completions`` (:mod:`shardserver.engine_http`
for ``http://`` engines; :mod:`shardserver.engine_https`, aiohttp, for ``https://``).

Sampling has no side effects, so a request the engine did not finish can always be sent again.
Every transport outcome is decided here, in one place:

=============================================== ============================================ ==========
what the engine did                              what the client does                         category
=============================================== ============================================ ==========
2xx                                              returns the body                             --
closed or reset a *reused* keep-alive connection sends it again at once on a fresh connection --
before any response byte (idle keep-alive race)  (``engine_keepalive_retries``)
refused the connection, closed or reset it       re-forwards with backoff (0.1 s doubling to  --
(before or during the response), truncated the   2 s, jittered) while the engine has been
body, connect timeout                            unavailable for less than
                                                 ``engine.unavailable_budget_s``
                                                 (``engine_reforwards``)
HTTP 408, 429, 503 (router queue, admission      same: re-forwarded within the budget         --
control: the request never ran); HTTP 502 (a
proxy got no answer from the engine: vLLM never
sends 502); vllm-router's 500 ``Request failed:
...`` / ``Failed to get response body: ...``
(it could not reach the worker, or the worker's
body broke); any 5xx when ``engine.retry_5xx``
still unavailable after the budget               fails (``engine_budget_exhausted``)          server
HTTP 3xx (a redirect: never followed)            fails, naming the status and ``Location``    server
TLS certificate not trusted (``https://``)       fails at once, saying how to trust it        server
HTTP 4xx (other: vLLM's JSON error envelope)     fails                                        user
HTTP 400 "Out of range float values" (NaN),      fails (the engine ran it, the path is ours,  server
404/405 ``{"detail": ...}`` (wrong engine path), or a proxy refused the gateway's request,
401/403/407 (the gateway's credentials: vLLM's   or the deployment serves another model:
``--api-key``, an auth proxy), a 4xx that is     not the user's fault)
not JSON (a proxy's HTML page, a router's plain
text, empty), 404 while ``engine.model`` pins
the model
HTTP 5xx (other)                                 fails                                        server
no answer within ``engine.timeout_s`` of being   fails (the engine may be running it)         server
sent while the engine answers nothing else (a
``/health`` answer counts only while vLLM's token
counters in ``/metrics`` move: a hung engine core
answers ``/health``, :mod:`shardserver.health`);
no answer within ``engine.max_request_s``;
body over ``engine.max_body_bytes``
=============================================== ============================================ ==========

Retry-After: a re-forwarded answer (429 or 503 from a router or vLLM's admission control, 408,
502) that carries ``Retry-After`` (seconds or an HTTP-date) waits that long before the next
attempt when it is longer than the backoff, never past the budget
(``engine_retry_after_waits``).

Budget: the client keeps the engine's outage: the time of the first failure since the last
answer (any HTTP answer that is not a re-forwardable one ends it, and so does a successful
health probe while no request is being re-forwarded and none failed in the last second). A
request gives up once it has kept failing for ``engine.unavailable_budget_s`` seconds since its
own first failure, so every sample gets the whole budget to ride out an engine restart and none is re-sent forever (e.g. a body
that is always cut); or, during an outage already older than the budget, after its second
failed attempt (so the futures queued behind the first ``engine.pool_size`` do not each wait a
budget more; one transient failure alone never fails a request). :meth:`EngineClient.unavailable`
reports the outage for ``/readyz`` and the ``shardserver_engine_unavailable_seconds`` gauge.
Recovery needs nothing: the next answer ends it.

Timeouts: ``engine.timeout_s`` bounds one attempt (connecting, sending, waiting for and reading
the answer) while the engine shows no sign of life; an engine that answers other requests or
health probes has this one queued or generating (vLLM runs ``max_num_seqs`` at once and queues
the rest), so the attempt waits on, up to ``engine.max_request_s`` (:meth:`EngineClient._timed`).
The encoder starts at most ``engine.pool_size`` engine calls at once, so an attempt
never waits for a pooled connection: that wait happens in the encoder's queue, before the call,
bounded by ``engine.pool_wait_s``. Idle pooled connections are dropped after
``engine.pool_idle_s`` (default 4 s, below the 5 s after which vLLM's uvicorn closes an idle
keep-alive connection).

Every attempt carries its own ``X-Request-Id`` (``<future_id>-a<N>``, see :class:`AttemptIds`):
vLLM versions and prefill/decode routers that tear down the previous attempt reject a reused
id, and the common prefix keeps the gateway's and the engine's logs joinable.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import logging
import math
import random
import re
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, MutableMapping
from urllib.parse import urlsplit

from .config import EngineConfig, engine_base_url, mask_url, mask_urls_in
from .engine_http import BadResponse, BodyTooLarge, Broken, ConnectFailed, EnginePool
from .errors import EngineError
from .messages import EngineOutage

if TYPE_CHECKING:
    from .engine_https import HttpsTransport

__all__ = ["EngineClient", "AttemptIds", "engine_error_message", "engine_did_not_answer", "NEVER_RAN_STATUSES"]

log = logging.getLogger("shardserver.engine")

_NAN_MARK = "Out of range float values are not JSON compliant"
# Statuses that mean the engine did not run the request: a router's full queue (429), its queue
# timeout (408), vLLM admission control or a router without workers (503) (spec §8.2, §11.12).
NEVER_RAN_STATUSES = (408, 429, 503)
# What a proxy or router between the gateway and vLLM answers when the engine did not: 502 from
# nginx/an ingress/HAProxy, 504 when its connection to the engine timed out (an AWS ALB or
# ingress-nginx while the engine's pod restarts; also when a generation outlasts the proxy's read
# timeout: keep that above engine.timeout_s, or such samples are re-sent until
# engine.unavailable_budget_s) -- vLLM itself never answers either --, and vllm-router's 500 wrapping a
# failure to reach its worker or to read the worker's body (spec §8.2) -- the transport failures
# the gateway re-forwards when it meets them itself. vLLM's own 500 (its JSON error envelope,
# e.g. a GenerationError) stays final, except its EngineDeadError (below).
_PROXY_STATUSES = (502, 504)
# Statuses about the gateway's own credentials, never about a sample: vLLM's ``--api-key``
# middleware answers 401 ``{"error":"Unauthorized"}`` (JSON, like its errors for a bad parameter),
# an ingress or auth proxy 401, 403 or 407. The deployment is at fault: category server.
_CREDENTIAL_STATUSES = (401, 403, 407)
_ROUTER_TRANSPORT_500 = (b"Request failed: ", b"Failed to get response body")
# vLLM's 500 when its engine core process died (EngineDeadError, spec §8: "EngineCore encountered an
# issue. See stack trace (above) for the root cause."): the requests in flight were not finished and
# the API server shuts down, to be restarted by whatever runs it. The same outage as the engine
# being killed and restarted, which is re-forwarded; so is this answer.
_ENGINE_DEAD_500 = b"EngineCore encountered an issue"


def engine_did_not_answer(status: int, body: bytes) -> bool:
    """Whether an HTTP error status means the engine itself never answered the request (so it
    is re-forwarded within ``engine.unavailable_budget_s``): :data:`NEVER_RAN_STATUSES`, a 502 or 504, or
    vllm-router's plain-text 500 for a worker it could not reach or read (``body`` starts with
    ``Request failed: `` or ``Failed to get response body``), or vLLM's 500 for an engine core that
    died (``EngineDeadError``: its message within the body's first 1 KiB)."""
    return (status in NEVER_RAN_STATUSES or status in _PROXY_STATUSES
            or (status == 500 and (body.startswith(_ROUTER_TRANSPORT_500) or _ENGINE_DEAD_500 in body[:1024])))
# Re-forward backoff (seconds): first wait, factor 2 per re-forward, cap; each wait is jittered to
# 50-100 % so that the requests of one outage do not come back in lockstep.
#: A successful health probe ends an outage only once no engine request failed for this long
#: (seconds; :meth:`EngineClient.probe_ok`).
PROBE_QUIET_S = 1.0
#: An engine that answered anything (another request, a health probe) within this long, or
#: 3 x engine.health_interval_s if longer, is alive: an attempt past engine.timeout_s keeps
#: waiting (queued or generating in it), re-judged every LIFE_RECHECK_S, up to engine.max_request_s.
LIFE_WINDOW_S = 60.0
LIFE_RECHECK_S = 10.0
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 2.0


def retry_after_s(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait that an HTTP ``Retry-After`` field asks for (RFC 9110 10.2.3): a
    non-negative integer of seconds, or an HTTP-date (then its distance from ``now``, unix
    seconds, default the current time, and never negative). None for a missing or unreadable field.
    """
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def redirect_message(status: int, location: bytes | str | None) -> str:
    """The message for an engine answer of HTTP 3xx (``location``: its ``Location`` field). The
    gateway follows no redirect: a POST redirected is no longer the same request (301/302/303
    turn it into a GET), and an engine URL that redirects (``http://`` to ``https://``, a
    missing or extra path prefix, a login page) is a deployment fault."""
    if isinstance(location, bytes):
        location = location.decode("latin-1")
    to = f" to {mask_urls_in(location[:200])}" if location else ""
    return (f"engine answered HTTP {status} (a redirect{to}); the gateway follows no redirects: set "
            f"engine.url to the address that serves /v1/completions itself")


def engine_error_message(status: int, body: bytes) -> str:
    """A one-line message for an engine error response (vLLM JSON envelope, router text, or empty)."""
    text = body[:2000].decode("utf-8", "replace").strip()
    msg = text
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                msg = err["message"]
            elif isinstance(err, str):
                msg = err
            elif "detail" in obj:
                msg = str(obj["detail"])
            elif isinstance(obj.get("message"), str):
                msg = obj["message"]
    except ValueError:
        pass
    if not msg:
        msg = "(empty body)"
    return f"engine returned HTTP {status}: {msg}"


class AttemptIds:
    """The ``X-Request-Id`` of each engine attempt of one future: ``<future_id>-a1``, ``-a2``, ...

    One instance per future, shared by every attempt (transport retries in :class:`EngineClient`
    and ``finish_reason: abort`` re-forwards in the encoder), so no id is ever sent twice.
    """

    __slots__ = ("future_id", "count")

    def __init__(self, future_id: str) -> None:
        self.future_id = future_id
        self.count = 0

    def next(self) -> str:
        """The id for the next attempt (``str``; counts attempts from 1)."""
        self.count += 1
        return f"{self.future_id}-a{self.count}"


# The top-level "id" of an engine answer, when the body starts with it (vLLM's and the simulator's
# do: CompletionResponse's first field), read from its first bytes only.
_ANSWER_ID_RE = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([!#-\[\]-~]{1,256})"')
# An id vLLM made from one of our X-Request-Ids ("cmpl-" + <future id>-a<N>, spec §2).
_OUR_ANSWER_ID_RE = re.compile(rb"cmpl-f[0-9a-f]{8}-(?:[a-z0-9]{1,16}-)?[0-9a-f]{32}-[0-9a-f]{16}-a[0-9]{1,9}")


def answer_of_another_request(data: bytes | memoryview, request_id: str) -> bytes | None:
    """The id of a 2xx engine answer when it names another of this gateway's requests than
    ``request_id`` (the ``X-Request-Id`` it was sent with), else None.

    vLLM answers ``"id": "cmpl-" + X-Request-Id``. Answers are matched to requests by their
    order on a keep-alive connection, so an answer sent twice (by the engine or a proxy in
    between) would be taken as the next request's, and that sample would carry another prompt's
    tokens. An engine that does not echo the header (any id not of our form) is not judged.
    """
    m = _ANSWER_ID_RE.match(bytes(data[:512]))
    if m is None or not _OUR_ANSWER_ID_RE.fullmatch(m.group(1)):
        return None
    got = m.group(1)
    return None if got == b"cmpl-" + request_id.encode() else got


class _Broken(Exception):
    """One attempt ended without a complete answer: the request can be sent again.

    ``no_response``: failed before any response header arrived; ``reused``: on a pooled
    connection that had already carried a request.
    """

    def __init__(self, message: str, *, no_response: bool, reused: bool) -> None:
        super().__init__(message)
        self.no_response = no_response
        self.reused = reused


class EngineClient:
    """Posts completion request bodies; one instance (one connection pool) per encoder.

    Args:
        cfg: the ``[engine]`` config (timeouts in seconds, pool size in connections).
        url: base URL of the engine (``http://host:port``), without ``/v1/completions``.
        counters: where the retry counters go (``engine_keepalive_retries``, ``engine_reforwards``,
            ``engine_budget_exhausted``); the encoder passes its
            :class:`shardserver.metrics.ShardCounters`, so they reach ``/stats`` and ``/metrics``.
    """

    def __init__(self, cfg: EngineConfig, url: str, counters: MutableMapping[str, int] | None = None) -> None:
        self.cfg = cfg
        self.url = engine_base_url(url) + "/v1/completions"
        self.display_url = mask_url(self.url)  # for messages: no credentials
        self._counters: MutableMapping[str, int] = counters if counters is not None else collections.Counter()
        # http:// engines: the answer is read into one buffer of its size (engine_http.EnginePool);
        # https:// engines: aiohttp, through two pools (engine_https, imported only then).
        self._pool: EnginePool | None = None
        self._https: HttpsTransport | None = None
        # The engine's outage: monotonic time of the first failure since the last answer, and why.
        self._down_since: float | None = None
        self._down_reason = ""
        self._last_failure = 0.0  # monotonic time of the last failed attempt (see probe_ok)
        self._retrying = 0  # requests between their first failure and their final outcome
        # Engine answers in this process (see answer_bytes): bytes the connections received that
        # no reader claimed yet, and 2xx bodies post() returned that nobody release()d yet.
        self._unclaimed = 0
        self._returned = 0
        self.answer_bytes_peak = 0  # the most answer_bytes ever held (bytes)
        self._life_at = -math.inf  # monotonic time of the engine's last answer to anything (see _timed)
        self._probe_at = -math.inf  # monotonic time of the last health probe that answered
        self._progress_known = False  # that probe read the engine's token counters (probe_ok)
        # How long the engine may hold requests without its token counters moving before its
        # /health answers stop counting as life (seconds): engine.unavailable_budget_s, the
        # outage every sample rides out, and at least the life window.
        self.life_window_s = max(LIFE_WINDOW_S, 3 * cfg.health_interval_s)
        self.stall_window_s = max(cfg.unavailable_budget_s, self.life_window_s)
        self._stalled_for = 0.0  # seconds its counters had not moved at the last probe that did not count
        self._stall_verdict_log_at = -math.inf  # monotonic time of the last WARNING about a hung verdict
        # Called at every engine answer (the encoder's EngineProbe.kick: a failed probe is re-run at once).
        self.on_answer: Callable[[], None] | None = None
        # A probe to run now (the encoder's EngineProbe.check_life) when an attempt passes
        # engine.timeout_s on an engine this client heard nothing from (see _timed); its task.
        self.check_life: Callable[[], Awaitable[bool]] | None = None
        self._life_check: asyncio.Task[bool] | None = None

    @property
    def counters(self) -> MutableMapping[str, int]:
        """Where the client counts its retries and receive-buffer reuse (settable: the encoder
        hands over its ``ShardCounters`` once its core exists)."""
        return self._counters

    @counters.setter
    def counters(self, value: MutableMapping[str, int]) -> None:
        self._counters = value
        if self._pool is not None:
            self._pool.buffers.counters = value

    async def start(self) -> None:
        """Open the connection pools (call in the event loop that will use them)."""
        if urlsplit(self.url).scheme == "http":
            # Receive buffers, in use and kept for reuse together: the answer budget (the bodies it
            # admits are the buffers in use) plus a quarter for their size classes' rounding
            # (at most 1/8), 64 MiB without a budget.
            budget = self.cfg.answer_budget(self.url)
            keep = budget * 5 // 4 or 64 << 20
            self._pool = EnginePool(self.url, connect_timeout_s=self.cfg.connect_timeout_s,
                                    idle_s=self.cfg.pool_idle_s, on_bytes=self._add_unclaimed,
                                    keep_buffer_bytes=keep, counters=self.counters,
                                    read_idle_s=self.cfg.read_idle_timeout_s,
                                    budget_bytes=budget, held=lambda: self.answer_bytes,
                                    receive_buffer_bytes=self.cfg.receive_buffer(),
                                    dead_connection_s=self.cfg.dead_connection_s)
            return
        from .engine_https import HttpsTransport

        self._https = HttpsTransport(self)

    async def close(self) -> None:
        """Close the pools (idempotent)."""
        if self._life_check is not None:
            self._life_check.cancel()
            self._life_check = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._https is not None:
            await self._https.close()
            self._https = None

    def unavailable(self) -> EngineOutage | None:
        """The ongoing outage (seconds since the first failure with no answer since, the last
        failure, ``engine.unavailable_budget_s``, the engine), or None while the engine answers."""
        if self._down_since is None:
            return None
        return EngineOutage(for_s=round(time.monotonic() - self._down_since, 3), reason=self._down_reason,
                            budget_s=self.cfg.unavailable_budget_s, url=self.display_url)

    def probe_ok(self, progress_at: float | None = None) -> None:
        """The engine answered a health probe: end the outage if no request is being re-forwarded
        and none failed in the last :data:`PROBE_QUIET_S` seconds (so ``/readyz`` does not stay
        503 after an outage that no sample has tried since, while a ``GET /health`` that answers
        does not outweigh completions refused a moment ago: an engine whose admission control
        answers 503 still serves ``/health``).

        As a sign of life for attempts past ``engine.timeout_s`` (:meth:`_timed`): with
        ``progress_at`` None (the engine exports no token counters) the answer itself counts;
        otherwise ``progress_at`` is the last time its token counters moved, or it held no
        request (``time.monotonic()`` seconds; see :mod:`shardserver.health`, "Progress"), and
        the answer counts while that is less than :attr:`stall_window_s` ago: an engine core that
        is hung still answers ``/health``, and one paused for a while (a weight load with
        requests queued) is not taken for hung.
        """
        self._probe_at = now = time.monotonic()
        self._progress_known = progress_at is not None
        if progress_at is None or now - progress_at < self.stall_window_s:
            self._life_at = now
        else:
            self._stalled_for = now - progress_at
        if self._retrying == 0 and time.monotonic() - self._last_failure >= PROBE_QUIET_S:
            self._end_outage()

    def _answered(self) -> None:
        """The engine answered a request: a sign of life, and the outage (if any) is over."""
        self._life_at = time.monotonic()
        if self.on_answer is not None:
            self.on_answer()
        self._end_outage()

    def _end_outage(self) -> None:
        if self._down_since is not None:
            log.info("engine at %s answers again after %.1f s", self.display_url,
                     time.monotonic() - self._down_since)
            self._down_since, self._down_reason = None, ""

    async def post(self, body: bytes, headers: dict[str, str], ids: AttemptIds | None = None) -> bytes | memoryview:
        """POST ``body`` (JSON bytes) until the engine answers it; return the 2xx response body
        (for ``http://`` engines a ``memoryview`` of exactly its size over a receive buffer that
        is reused after :meth:`release`; ``bytes`` for ``https://``). It stays counted in
        :attr:`answer_bytes` until the caller hands it to :meth:`release`.

        ``ids`` gives each attempt its ``X-Request-Id``; without it none is added to ``headers``.

        Raises:
            EngineError: a final answer or failure (see the module table).
        """
        assert self._pool is not None or self._https is not None, "EngineClient.start() was not called"
        hdrs = {"Content-Type": "application/json", **headers}
        if self.cfg.api_key:
            hdrs["Authorization"] = f"Bearer {self.cfg.api_key}"
        retrying = [False]
        try:
            return await self._post(body, hdrs, ids, retrying)
        finally:
            if retrying[0]:
                self._retrying -= 1

    async def _post(self, body: bytes, hdrs: dict[str, str], ids: AttemptIds | None,
                    retrying: list[bool]) -> bytes:
        """The attempt loop of :meth:`post`; sets ``retrying[0]`` (and counts the request in
        ``self._retrying``) at its first failure."""
        cfg = self.cfg
        fresh = False  # the next attempt opens a connection of its own (after a keep-alive race)
        first_failure: float | None = None
        failed = 0
        backoff = _BACKOFF_FIRST_S
        while True:
            if ids is not None:
                hdrs["X-Request-Id"] = ids.next()
            meta: dict[str, Any] = {}  # the answer's Retry-After, if any
            try:
                status, data = await self._timed(
                    self._attempt_pool(body, hdrs, fresh, meta) if self._pool is not None
                    else self._https.attempt(fresh, body, hdrs, meta))  # type: ignore[union-attr]
            except _Broken as exc:
                if exc.reused and exc.no_response and not fresh:
                    # The engine closed an idle keep-alive connection as we reused it: nothing ran.
                    self.counters["engine_keepalive_retries"] += 1
                    fresh = True
                    continue
                reason = str(exc)
                status = None
            else:
                if status < 300:
                    self._answered()
                    sent = hdrs.get("X-Request-Id")
                    other = answer_of_another_request(data, sent) if sent else None
                    if other is None:
                        return data
                    self.release(data)
                    del data
                    self.counters["engine_answers_of_another_request"] += 1
                    log.warning("engine at %s answered request %s with the answer of %s (sent twice by the engine "
                                "or a proxy, on a %s connection); sending the request again on a new connection",
                                self.display_url, sent, other.decode(), "fresh" if fresh else "reused")
                    if not fresh:
                        fresh = True
                        continue
                    reason = f"the engine's answer is that of another request ({other.decode()})"
                    status = None
                elif status < 400:
                    self._answered()  # the engine (or a proxy) is up: this answer is final
                    raise EngineError(redirect_message(status, meta.get("location")), status=status,
                                      category="server")
                else:
                    reason = engine_error_message(status, data)
                    if not (engine_did_not_answer(status, data) or (status >= 500 and cfg.retry_5xx)):
                        self._answered()  # the engine is up: this answer is final
                        # vLLM reports its own NaN-serialization failure as a 400 although the request
                        # was fine (spec §4, §8.1); a 404 in FastAPI's own shape ({"detail": "Not Found"})
                        # is a wrong engine path, ours.
                        wrong_path = status in (404, 405) and data[:11] == b'{"detail":"'
                        # vLLM's 4xx carry its JSON error envelope; an HTML, plain-text or empty 4xx
                        # comes from a proxy or router in between (nginx's 413 for a large body, a
                        # router refusing the gateway's JSON): the deployment's fault, not the user's.
                        from_vllm = data.lstrip()[:1] == b"{"
                        # A 404 for the model when engine.model pins it: the deployment serves another
                        # model (renamed, or restarted with another), not the user's choice.
                        pinned_404 = status == 404 and bool(cfg.model)
                        user = (400 <= status < 500 and _NAN_MARK not in reason and not wrong_path and from_vllm
                                and status not in _CREDENTIAL_STATUSES and not pinned_404)
                        raise EngineError(reason, status=status, category="user" if user else "server")
            # Not answered: re-forward with backoff while the budget lasts.
            now = time.monotonic()
            if first_failure is None:
                first_failure = now
                retrying[0] = True
                self._retrying += 1
            if self._down_since is None:
                self._down_since = now
                log.warning("engine at %s unavailable: %s", self.display_url, reason)
            self._down_reason = reason
            self._last_failure = now
            failed += 1
            down_for = now - first_failure
            if failed >= 2 and now - self._down_since >= cfg.unavailable_budget_s:
                down_for = now - self._down_since  # the outage outlasted the budget before this request
            left = cfg.unavailable_budget_s - down_for
            if left <= 0:
                self.counters["engine_budget_exhausted"] += 1
                raise EngineError(f"engine at {self.display_url} unavailable for {down_for:.1f} s "
                                  f"(engine.unavailable_budget_s = {cfg.unavailable_budget_s:g}); last: {reason}",
                                  status=status, category="server")
            self.counters["engine_reforwards"] += 1
            wait = backoff * random.uniform(0.5, 1.0)
            asked = retry_after_s(meta.get("retry_after")) if status is not None else None
            if asked is not None and asked > wait:
                # A router or admission control said when to come back (429/503 + Retry-After):
                # wait that long, within what is left of the budget.
                self.counters["engine_retry_after_waits"] += 1
                wait = asked
            await asyncio.sleep(min(wait, left))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            fresh = False

    async def _attempt_pool(self, body: bytes, hdrs: dict[str, str], fresh: bool,
                            meta: dict[str, Any]) -> tuple[int, bytes | memoryview]:
        """One attempt through :class:`EnginePool` (``http://`` engines): (status, body), or
        raises _Broken / EngineError. A 2xx body is a ``memoryview`` of exactly its size over a
        receive buffer; it stays counted in :attr:`answer_bytes` until :meth:`release`."""
        limit = self.cfg.max_body_bytes
        try:
            status, data, _ = await self._pool.post(body, hdrs, limit=limit, fresh=fresh, meta=meta)  # type: ignore[union-attr]
        except ConnectFailed as exc:
            raise _Broken(f"cannot connect to engine at {self.display_url}: {mask_urls_in(str(exc))}",
                          no_response=True, reused=False) from None
        except Broken as exc:
            if exc.answered:
                raise _Broken(f"engine connection broke while reading the response: {mask_urls_in(str(exc))}",
                              no_response=False, reused=exc.reused) from None
            raise _Broken(f"engine connection broke before the response: {mask_urls_in(str(exc))}",
                          no_response=True, reused=exc.reused) from None
        except BodyTooLarge as exc:
            if exc.declared is not None:
                raise EngineError(f"engine body of {exc.declared} bytes exceeds engine.max_body_bytes={limit}",
                                  status=exc.status, category="server") from None
            raise EngineError(f"engine body exceeds engine.max_body_bytes={limit} (stopped reading after "
                              f"{exc.got} bytes)", status=exc.status, category="server") from None
        except BadResponse as exc:
            raise EngineError(f"engine request failed: {mask_urls_in(str(exc))}", status=None,
                              category="server") from None
        if status < 300:
            self._returned += len(data)
            return status, data
        out = bytes(data)
        self._pool.recycle(data)  # type: ignore[union-attr]
        self._pool.wake()  # type: ignore[union-attr]
        return status, out

    async def _timed(self, attempt: Awaitable[tuple[int, Any]]) -> tuple[int, Any]:
        """Await one attempt (connecting, sending, waiting for and reading the answer).

        At ``engine.timeout_s`` after the start it is judged: if the engine answered anything
        (another request, a health probe) within the last :attr:`life_window_s`, it is alive and
        this request is queued or generating in it, so the attempt keeps waiting, judged again
        every :data:`LIFE_RECHECK_S`; up to ``engine.max_request_s`` in all. When this client heard
        nothing for that long (each encoder has its own client: with probing off, one whose calls
        are all still running has no answer of its own), :attr:`check_life` probes the engine
        first, and the verdict waits for it. Given up, the attempt is
        cancelled (its connection closed, so vLLM aborts the request) and EngineError (category
        server) is raised, saying which bound ended it.
        """
        clock = _AttemptClock(self)
        try:
            async with asyncio.timeout(None) as clock.scope:
                return await attempt
        except TimeoutError:
            if not clock.scope.expired() or clock.verdict is None:
                raise
            raise EngineError(clock.verdict, status=None, category="server") from None
        finally:
            # Cancelling the timer empties its callback (the bound judge), so neither the clock
            # nor its handle is left in a reference cycle for the encoder's rare cyclic GC.
            clock.stop()

    @property
    def answer_bytes(self) -> int:
        """Bytes of engine answers this process holds: received by the engine connections and
        not claimed by a finished read yet (in aiohttp's buffers or a body being read), plus the
        2xx bodies :meth:`post` returned that the caller has not :meth:`release`d."""
        return self._unclaimed + self._returned

    def _add_unclaimed(self, n: int) -> None:
        self._unclaimed += n
        if n > 0 and self._unclaimed + self._returned > self.answer_bytes_peak:
            self.answer_bytes_peak = self._unclaimed + self._returned

    def release(self, data: bytes | memoryview) -> None:
        """The caller is done with a 2xx body that :meth:`post` returned: it no longer counts in
        :attr:`answer_bytes`, and its receive buffer may be reused (``data`` must not be read
        afterwards)."""
        self._returned -= len(data)
        if self._pool is not None:
            self._pool.recycle(data)
            self._pool.wake()  # room in engine.answer_budget_bytes: answers waiting unread may come in

    @property
    def answers_waiting_bytes(self) -> int:
        """Bytes of :attr:`answer_bytes` held by answers waiting for room (what came with their
        header sections): the rest is what ``engine.answer_budget_bytes`` bounds."""
        return self._pool.waiting_bytes if self._pool is not None else 0

    @property
    def answers_waiting(self) -> int:
        """Engine answers whose bodies wait unread (left in the socket) for room in
        ``engine.answer_budget_bytes`` (``http://`` engines; 0 for ``https://``)."""
        return self._pool.waiting if self._pool is not None else 0

    def sweep(self, buffer_idle_s: float) -> None:
        """Periodic upkeep (``http://`` engines; aiohttp keeps its own for ``https://``): free the
        receive buffers kept for reuse that no answer used for ``buffer_idle_s`` seconds, and
        close the idle connections older than ``engine.pool_idle_s``."""
        if self._pool is not None:
            self._pool.buffers.trim(buffer_idle_s)
            self._pool.close_idle()
            if self._pool.waiting:
                self._pool.wake()  # (under TCP memory pressure it lets waiting answers in)


class _AttemptClock:
    """The timing of one engine attempt (:meth:`EngineClient._timed`): when it started, whether
    its silence has been asked about (a ``check_life`` probe), whether it has waited past
    ``engine.timeout_s``, and the verdict that ends it (``None`` while it may go on).

    :meth:`judge` runs on the event loop's timer at ``engine.timeout_s`` after the start, then
    every :data:`LIFE_RECHECK_S` while the engine answers anything else; a verdict expires
    :attr:`scope` (an ``asyncio.timeout``), which cancels the attempt.
    """

    __slots__ = ("client", "loop", "start", "cap", "asked", "waited", "verdict", "scope", "timer")

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.cap = client.cfg.request_cap()  # seconds: engine.max_request_s, resolved
        self.asked = False  # a probe was run for this silence (check_life)
        self.waited = False  # judged alive once past engine.timeout_s (counted once)
        self.verdict: str | None = None  # why the attempt was given up
        self.scope: asyncio.Timeout | None = None
        self.timer: asyncio.TimerHandle | None = self.loop.call_at(self.start + client.cfg.timeout_s, self.judge)

    def _again(self, at: float) -> None:
        self.timer = self.loop.call_at(min(at, self.start + self.cap), self.judge)

    def judge(self) -> None:
        """Decide at a deadline: wait on (re-arm), ask the engine first, or give up (verdict)."""
        c = self.client
        cfg = c.cfg
        now = self.loop.time()
        silent_s = time.monotonic() - c._life_at
        if silent_s >= c.life_window_s and c.check_life is not None and not self.asked:
            # This encoder heard nothing (probing off, and its own calls all still running):
            # ask the engine now; the verdict waits for the probe (engine.connect_timeout_s).
            self.asked = True
            if c._life_check is None or c._life_check.done():
                c._life_check = self.loop.create_task(c.check_life())
                c._life_check.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._again(now + cfg.connect_timeout_s + 0.5)
            return
        if silent_s < c.life_window_s:
            self.asked = False
            if now - self.start < self.cap:
                if now - self.start >= cfg.timeout_s and not self.waited:
                    self.waited = True
                    c.counters["engine_waits_past_timeout"] += 1
                self._again(now + LIFE_RECHECK_S)
                return
            self.verdict = (f"engine timed out after {now - self.start:.1f} s (engine.max_request_s = "
                            f"{self.cap:g}): no answer to this request, though the engine answers others")
        elif c._progress_known and time.monotonic() - c._probe_at < c.life_window_s:
            stalled = c._stalled_for
            since = f"for {stalled:.1f} s" if stalled < math.inf else "since the gateway started"
            self.verdict = (f"engine timed out after {now - self.start:.1f} s (engine.timeout_s = "
                            f"{cfg.timeout_s:g}): no answer to this request or any other, and though "
                            f"the engine answers GET /health, it holds requests and its token counters "
                            f"(vllm:generation_tokens_total, vllm:prompt_tokens_total in /metrics) have not "
                            f"moved {since}: its engine core runs nothing (hung?)")
            if time.monotonic() - c._stall_verdict_log_at >= LIFE_WINDOW_S:
                c._stall_verdict_log_at = time.monotonic()
                log.warning("engine at %s: giving up engine calls waiting past engine.timeout_s = %g s: it answers "
                            "GET /health but holds requests with token counters unmoved %s (its engine core "
                            "looks hung; engine calls fail until it generates again)", c.display_url,
                            cfg.timeout_s, since)
        else:
            since = f"for {silent_s:.1f} s" if silent_s < math.inf else "since the gateway started"
            self.verdict = (f"engine timed out after {now - self.start:.1f} s (engine.timeout_s = "
                            f"{cfg.timeout_s:g}): no answer to this request, and none to any other "
                            f"request or health probe {since}")
        assert self.scope is not None
        self.scope.reschedule(now)  # expires at once: the attempt is cancelled

    def stop(self) -> None:
        """The attempt ended: cancel the pending judgement."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
