"""Readiness: every encoder connected and the engine reachable from every encoder.

Each encoder runs an :class:`EngineProbe`: every ``engine.health_interval_s``
seconds one ``GET {engine.url}/health`` on a connection of its own (so a busy
request pool never delays it), bounded by ``engine.connect_timeout_s``. The
last result is part of the encoder's STATS reply (``"engine": {"ok",
"reason", "age_s"}``). A front-end answering ``/readyz`` asks every encoder
for STATS (:func:`readiness`) and answers 200 only when all of them answer and
report the engine reachable; otherwise 503 with the reason. The encoder's
engine calls also count: while they are being re-forwarded because the
engine does not answer (an outage, see :mod:`shardserver.engine_client`),
STATS carries ``"engine_unavailable"`` and ``/readyz`` says since when, the
last status seen and when samples start failing, even if ``/health`` answers.

An answer below 500 counts as reachable (vLLM answers 200; a router or proxy
without ``/health`` answers 404, which still proves the engine host is
serving HTTP). A 5xx, a timeout or a connection error counts as unreachable.
State changes are logged once (warning when the engine goes down, info when
it comes back), never per probe.

Recovery is seen at once, not one ``engine.health_interval_s`` later: while the
last probe failed (or the encoder's engine requests are failing), the probe
runs every :data:`DOWN_PROBE_S` seconds instead, and any answer from the
engine to a request of this encoder (:meth:`EngineProbe.kick`) runs the next
probe immediately. Each encoder decides for itself, and ``/readyz`` asks every
encoder at each call (nothing is cached in the front-ends), so ``/readyz``
turns 200 within about :data:`DOWN_PROBE_S` of the engine answering again.

Each successful probe also reads ``GET {engine.url}/v1/models``: the context
window (``max_model_len``) of every model the engine serves, reported in
STATS as ``"models"`` and in ``/readyz`` as ``"max_model_len"``. The
front-ends use it for ``asample`` (see :mod:`shardserver.api.sampling`).

**Progress.** ``/health`` answers as long as vLLM's API server runs, even while its engine
core is hung (a stuck collective or kernel: the core is alive, so vLLM does not take it for
dead). So each successful probe also reads ``GET {engine.url}/metrics``: vLLM's token counters
(:data:`PROGRESS_COUNTERS`, which move at every engine step that prefills or decodes anything)
and the requests it runs or holds waiting (:data:`BUSY_GAUGES`). For the engine calls waiting
past ``engine.timeout_s`` (:meth:`shardserver.engine_client.EngineClient.probe_ok`) a probe
then counts as a sign of life unless the engine has held requests with counters that did not
move for ``engine.unavailable_budget_s`` (at least the life window): only an engine *stuck* on
requests loses the benefit of its ``/health``, and a pause (a weight load with requests queued)
shorter than that does not. An idle engine still counts (behind a load balancer the probe may reach an idle replica while another one runs this
encoder's requests), and so does one without the counters (a router, a proxy, vLLM with
``--disable-log-stats``, the bundled simulator), as before. An engine that holds requests with
counters that have not moved for :data:`STALL_LOG_S` is logged once as stalled (WARNING; INFO
when it moves again).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

from .aio import cancel_and_wait
from .config import engine_base_url, mask_url, mask_urls_in
from .engine_request import parse_model_windows
from .messages import EngineReachability

if TYPE_CHECKING:
    import aiohttp

    from .engine_http import EnginePool

# The probe of an http:// engine goes through engine_http (the encoders' engine client); aiohttp
# is imported only to probe an https:// engine. It is ~16 MiB of each process's private memory,
# and the front-ends import this module for readiness() only.

#: The most body bytes a probe reads from ``/health`` or ``/v1/models`` (bytes); a longer answer
#: counts as a failed probe.
PROBE_BODY_LIMIT = 4 << 20
_TOO_LARGE = f"the answer's body is over {PROBE_BODY_LIMIT} bytes, the most a probe reads (health.PROBE_BODY_LIMIT)"

__all__ = ["EngineProbe", "readiness", "engine_models_of", "parse_engine_progress"]

log = logging.getLogger("shardserver.health")

#: Seconds between probes while the engine is down (the last probe failed, or requests to it are
#: being re-forwarded), when that is shorter than ``engine.health_interval_s``.
DOWN_PROBE_S = 0.5
#: vLLM's counters of tokens it prefilled and generated (``/metrics``; Prometheus counters, so
#: with ``_total``; vllm/v1/metrics/loggers.py): summed over their series, they move whenever the
#: engine core finishes a step.
PROGRESS_COUNTERS = (b"vllm:generation_tokens_total", b"vllm:prompt_tokens_total")
#: vLLM's gauges of the requests its scheduler runs and holds waiting (summed over series).
BUSY_GAUGES = (b"vllm:num_requests_running", b"vllm:num_requests_waiting")
#: Seconds with requests running and the token counters unmoved after which the engine is logged
#: as stalled (once per stall).
STALL_LOG_S = 60.0


def parse_engine_progress(body: bytes) -> tuple[float, float] | None:
    """``(tokens, requests)`` from a vLLM ``/metrics`` answer (Prometheus text format 0.0.4):
    the sum of :data:`PROGRESS_COUNTERS` over all their series (tokens) and of
    :data:`BUSY_GAUGES` (requests it runs or holds waiting; 0 when absent). None when neither
    counter is there (not vLLM, or vLLM with ``--disable-log-stats``). Series whose value is not
    a finite number are skipped; label values may hold spaces and braces (they are quoted)."""
    tokens = requests = 0.0
    seen = False
    for line in body.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        brace = line.find(b"{")
        space = line.find(b" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            end = line.rfind(b"}")
            if end < brace:
                continue
            rest = line[end + 1:]
        else:
            if space == -1:
                continue
            name, rest = line[:space], line[space:]
        is_counter = name in PROGRESS_COUNTERS
        if not is_counter and name not in BUSY_GAUGES:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if is_counter:
            tokens += value
            seen = True
        else:
            requests += value
    return (tokens, requests) if seen else None


class EngineProbe:
    """Periodic engine reachability check of one encoder.

    Args:
        url: the engine base URL (``http://host:port``).
        interval_s: seconds between probes; 0 disables probing (the engine always counts as reachable).
        timeout_s: seconds one probe may take (connect and answer).
        shard: the encoder's shard index, for log lines.
        api_key: ``engine.api_key``; when set, every probe carries ``Authorization: Bearer <key>``.
    """

    def __init__(self, url: str, interval_s: float, timeout_s: float, shard: int = 0, api_key: str = "") -> None:
        self.url = engine_base_url(url) + "/health"
        self.display_url = mask_url(self.url)
        self.models_url = engine_base_url(url) + "/v1/models"
        self.metrics_url = engine_base_url(url) + "/metrics"
        self.display_base = mask_url(engine_base_url(url))
        # {model id: context window in tokens}, from the last GET /v1/models that answered one.
        self.models: dict[str, int] = {}
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.shard = shard
        # vLLM's --api-key guards /v1/* (GET /v1/models) but not /health; sent to both.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.ok: bool | None = True if interval_s <= 0 else None
        self.reason = "engine probing disabled (engine.health_interval_s = 0)" if interval_s <= 0 else \
            "engine not probed yet"
        self.checked_at = 0.0
        # Called after each successful probe with progress_at (see below; None: the engine
        # exports no token counters): the encoder ends an engine outage no request is
        # re-forwarding any more, and takes it as a sign of life (EngineClient.probe_ok).
        self.on_ok: Callable[[float | None], None] | None = None
        # The engine's token counters (parse_engine_progress) at the last probe that read them
        # (None: unknown), the monotonic time they were last seen moving (-inf: not yet; the
        # first reading is no evidence), since when they are known, and whether a stall is logged.
        self.tokens: float | None = None
        self.progress_at = -math.inf
        self._tokens_since = 0.0
        self._stall_logged = False
        # True while the encoder's engine requests are failing (EngineClient.unavailable): probe
        # every DOWN_PROBE_S then, too.
        self.outage: Callable[[], bool] | None = None
        self._session: aiohttp.ClientSession | None = None  # https:// engines
        self._pool: EnginePool | None = None  # http:// engines
        self._models_target = ""  # GET target of /v1/models on self._pool
        self._metrics_target = ""  # GET target of /metrics on self._pool
        # What a probe that cannot reach the engine raises: OSError (engine_http's failures are
        # turned into one), and aiohttp.ClientError for https:// engines.
        self._errors: tuple[type[BaseException], ...] = (OSError,)
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        """Start probing in the running event loop (the first probe runs at once)."""
        if self.interval_s <= 0:
            return
        self.open()
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-probe-{self.shard}")

    def open(self) -> None:
        """Open the probe's connection pool (``http://``) or aiohttp session (``https://``) in the
        running event loop, without probing: :meth:`start` does this, and then probes every
        ``interval_s``; alone, it lets :meth:`check_once` be called at will (closed by :meth:`close`)."""
        if self.url.startswith("http://"):
            from .engine_http import EnginePool, request_target

            # A connection per probe (closed after it), like the https:// session below; small
            # bodies, one receive buffer kept.
            self._pool = EnginePool(self.url, connect_timeout_s=self.timeout_s, idle_s=0.0,
                                    keep_buffer_bytes=1 << 20)
            self._models_target = request_target(self.models_url)
            self._metrics_target = request_target(self.metrics_url)
        else:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, force_close=True),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self._headers)
            self._errors = (OSError, aiohttp.ClientError)

    def kick(self) -> None:
        """The engine answered a request: if the last probe failed, probe now (not at the next
        interval), so readiness and the context windows are back at once. Cheap otherwise (called
        at every engine answer)."""
        if self.ok is not True and self._wake is not None:
            self._wake.set()

    def _pause_s(self) -> float:
        """Seconds until the next probe: ``interval_s``, or :data:`DOWN_PROBE_S` while the engine is down."""
        down = self.ok is not True or (self.outage is not None and self.outage())
        return min(self.interval_s, DOWN_PROBE_S) if down else self.interval_s

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            await self.check_once()
            try:
                await asyncio.wait_for(self._wake.wait(), self._pause_s())
            except asyncio.TimeoutError:
                pass

    async def _get(self, what: str = "health") -> tuple[int, bytes]:
        """``GET /health`` (``what``: ``"models"`` for ``/v1/models``, ``"metrics"`` for
        ``/metrics``) on a connection of its own, within ``timeout_s``: (status, body).

        Raises:
            asyncio.TimeoutError: no complete answer within ``timeout_s`` seconds.
            OSError: the engine could not be reached, or the connection broke, or the answer is
                not HTTP (for an ``http://`` engine, the :mod:`shardserver.engine_http` failure
                as an ``OSError`` with its message); ``aiohttp.ClientError`` for ``https://``.
        """
        if self._pool is not None:
            from .engine_http import BadResponse, BodyTooLarge, Broken, ConnectFailed

            pool = self._pool
            try:
                async with asyncio.timeout(self.timeout_s):
                    status, body, _ = await pool.post(
                        b"", self._headers or {}, limit=PROBE_BODY_LIMIT, fresh=True, method="GET",
                        target={"models": self._models_target, "metrics": self._metrics_target}.get(what))
            except BodyTooLarge:
                raise OSError(_TOO_LARGE) from None
            except (ConnectFailed, Broken, BadResponse) as exc:
                raise OSError(str(exc) or type(exc).__name__) from None
            out = bytes(body)
            pool.recycle(body)
            return status, out
        assert self._session is not None, "EngineProbe.start() was not called"
        # As for http://: a redirect is an answer (not followed), the body is bounded, and an
        # answer aiohttp's parser refuses is "not an HTTP/1.1 answer" (not its code 400).
        import aiohttp

        try:
            return await self._get_aiohttp({"models": self.models_url, "metrics": self.metrics_url}.get(what, self.url))
        except aiohttp.ClientResponseError as exc:
            raise OSError(f"not an HTTP/1.1 answer: {exc.message}") from None

    async def _get_aiohttp(self, url: str) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.get(url, allow_redirects=False) as resp:
            if resp.content_length is not None and resp.content_length > PROBE_BODY_LIMIT:
                raise OSError(_TOO_LARGE)
            parts: list[bytes] = []
            got = 0
            while chunk := await resp.content.readany():
                got += len(chunk)
                if got > PROBE_BODY_LIMIT:
                    raise OSError(_TOO_LARGE)
                parts.append(chunk)
            return resp.status, b"".join(parts)

    async def check_life(self) -> bool:
        """One ``GET /health`` now, for :meth:`EngineClient._timed
        <shardserver.engine_client.EngineClient._timed>` (an attempt past ``engine.timeout_s`` on an
        engine this encoder has heard nothing from: another encoder may have had its answers).
        With periodic probing on it is recorded like any probe (:meth:`check_once`); with it off
        (``engine.health_interval_s = 0``) only ``on_ok`` is called, and readiness is left as it is.
        Returns whether the engine answered (any status below 500)."""
        if self._pool is None and self._session is None:
            self.open()
        if self.interval_s > 0:
            return await self.check_once()
        try:
            status, _ = await self._get()
            ok = status < 500
        except (asyncio.TimeoutError, *self._errors):
            ok = False
        if ok and self.on_ok is not None:
            self.on_ok(None)
        return ok

    async def check_once(self) -> bool:
        """Probe once and record the result; returns whether the engine is reachable."""
        assert self._session is not None or self._pool is not None, "EngineProbe.start() was not called"
        try:
            status, _ = await self._get()
            if status >= 500:
                ok, reason = False, f"engine answered GET {self.display_url} with HTTP {status}"
            else:
                ok, reason = True, ""
        except asyncio.TimeoutError:
            ok, reason = False, f"engine did not answer GET {self.display_url} within {self.timeout_s} s"
        except self._errors as exc:
            ok, reason = False, f"cannot reach engine at {self.display_url}: {mask_urls_in(str(exc))}"
        if ok != self.ok:
            if ok:
                log.info("encoder %d: engine reachable (%s)", self.shard, self.display_url)
            else:
                log.warning("encoder %d: engine unreachable: %s", self.shard, reason)
        # The context windows are read before the verdict is recorded only while none is known
        # (so the first /readyz 200 carries them); afterwards, after it, so that a /v1/models
        # that is slow to answer does not hold back the recovery /readyz reports.
        known = bool(self.models)
        if ok and not known:
            await self._learn_models()
        if ok:
            await self._read_progress()
        self.ok, self.reason, self.checked_at = ok, reason, time.monotonic()
        if ok and self.on_ok is not None:
            self.on_ok(None if self.tokens is None else self.progress_at)
        if ok and known:
            await self._learn_models()
        return ok

    async def _read_progress(self) -> None:
        """``GET /metrics``: update :attr:`tokens` and :attr:`progress_at` (see the module's
        "Progress"), and log a stall. A failed read, or an answer without vLLM's counters, makes
        progress unknown (:attr:`tokens` None: the probe alone counts again), so a counter that
        could not be read is never taken for one that stopped."""
        try:
            status, body = await self._get("metrics")
        except (asyncio.TimeoutError, *self._errors):
            status, body = 0, b""
        parsed = parse_engine_progress(body) if status == 200 else None
        now = time.monotonic()
        if parsed is None:
            self.tokens, self.progress_at, self._stall_logged = None, -math.inf, False
            return
        tokens, requests = parsed
        first, moved = self.tokens is None, tokens != self.tokens
        self.tokens = tokens
        if first:
            self._tokens_since = now
        if requests == 0 or (moved and not first):
            # Generating, or holding no request at all: nothing stuck in it (behind a load
            # balancer the probe may reach an idle replica while another runs this encoder's
            # requests), so the answer counts as a probe's always did.
            self.progress_at = now
            if self._stall_logged:
                log.info("encoder %d: engine at %s generates again (its token counters moved)", self.shard,
                         self.display_base)
                self._stall_logged = False
            return
        if first:
            return
        still = now - max(self.progress_at, self._tokens_since)
        if still >= STALL_LOG_S and not self._stall_logged:
            self._stall_logged = True
            log.warning("encoder %d: engine at %s reports %g requests running or waiting but its token counters (%s in "
                        "/metrics) have not moved for %.0f s: its engine core looks hung, though GET /health "
                        "answers; once this lasts engine.unavailable_budget_s, engine calls waiting past "
                        "engine.timeout_s fail", self.shard,
                        self.display_base, requests, ", ".join(c.decode() for c in PROGRESS_COUNTERS), still)

    async def _learn_models(self) -> None:
        """``GET /v1/models``: learn each served model's context window (``max_model_len``), again
        at every probe, so a restart with another model or ``--max-model-len`` is noticed. An
        engine without the endpoint (some routers) or without the field keeps what was learned."""
        try:
            status, body = await self._get("models")
            if status != 200:
                return
            models = parse_model_windows(body)
        except (asyncio.TimeoutError, ValueError, *self._errors):
            return
        if models and models != self.models:
            log.info("encoder %d: engine context window%s (GET /v1/models): %s", self.shard,
                     "" if len(models) == 1 else "s", ", ".join(f"{m} {n} tokens" for m, n in models.items()))
            self.models = models

    def state(self) -> EngineReachability:
        """The last probe's result (``ok`` None: not probed yet; ``age_s`` in seconds, None before the
        first; ``models``: context windows learned from ``GET /v1/models``)."""
        return EngineReachability(ok=self.ok, reason=self.reason,
                                  age_s=round(time.monotonic() - self.checked_at, 3) if self.checked_at else None,
                                  models=self.models)


def engine_models_of(replies: list[dict[str, Any]]) -> dict[str, int]:
    """The context windows the encoders learned (``{model id: tokens}``), from STATS replies."""
    out: dict[str, int] = {}
    for r in replies:
        eng = r.get("engine") or {}
        out.update(eng.get("models") or {})
    return out


async def readiness(clients: list[Any], timeout: float = 2.0, model: str = "") -> tuple[int, dict[str, Any]]:
    """The ``/readyz`` answer of a front-end: (HTTP status, JSON body).

    200 ``{"status": "ready", "encoders": S, "max_model_len": {model: tokens}}`` when every
    encoder is connected, answers STATS within ``timeout`` seconds and reports its last engine
    probe successful (an encoder whose STATS has no ``engine`` entry does not probe and does not
    block readiness), and no encoder's engine requests are failing (STATS ``engine_unavailable``,
    from :meth:`shardserver.engine_client.EngineClient.unavailable`). ``max_model_len`` is there
    once the engine reported its context windows in ``GET /v1/models`` (in the 503 answer too).
    Otherwise 503 ``{"status": "not ready", "reason": "...", "encoders_down": [...],
    "engine_down": [...], "engine_unknown": [...], "engine_unavailable": [...]}`` (the last key
    only when not empty): shards whose encoder did not answer, whose last probe failed, whose
    first probe has not finished yet, and whose engine requests are being re-forwarded (the
    reason says for how long, the last status seen and the budget). With ``model`` (a pinned
    ``engine.model``), also 503 while the engine's ``GET /v1/models`` lists other models only
    (``"engine_model_missing": model``): every sample would fail with the engine's 404.
    """
    from .metrics import gather_stats

    replies = await gather_stats(clients, timeout)
    reasons: list[str] = []
    down: list[int] = []
    engine_down: list[int] = []
    engine_unknown: list[int] = []
    unavailable: list[int] = []
    for r in replies:
        shard = r.get("shard")
        if "error" in r:
            down.append(shard)
            reasons.append(str(r["error"]))
            continue
        eng = r.get("engine")
        if eng is not None and eng.get("ok") is not True:
            (engine_down if eng.get("ok") is False else engine_unknown).append(shard)
            reasons.append(f"encoder {shard}: {eng.get('reason') or 'engine not reachable'}")
        out = r.get("engine_unavailable")
        if out:
            unavailable.append(shard)
            reasons.append(f"encoder {shard}: engine requests to {out['url']} failing for {out['for_s']:.1f} s, "
                           f"last: {out['reason']}; each is re-forwarded for up to engine.unavailable_budget_s = "
                           f"{out['budget_s']:g} s, then fails")
    models = engine_models_of(replies)
    missing = bool(model and models and model not in models)
    if missing:
        reasons.append(f"the engine serves {', '.join(sorted(models))}, not engine.model = {model!r} "
                       f"(GET /v1/models): every sample would fail with its 404")
    if down or engine_down or engine_unknown or unavailable or missing:
        body = {"status": "not ready", "reason": "; ".join(reasons), "encoders_down": down,
                "engine_down": engine_down, "engine_unknown": engine_unknown}
        if unavailable:
            body["engine_unavailable"] = unavailable
        if missing:
            body["engine_model_missing"] = model
        if models:
            body["max_model_len"] = models
        return 503, body
    body = {"status": "ready", "encoders": len(clients)}
    if models:
        body["max_model_len"] = models
    return 200, body
