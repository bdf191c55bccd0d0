"""Protocol-faithful load driver for shardserver: the tinker SDK's sampling wire protocol, by hand.

This is *not* the tinker SDK. It is an asyncio + aiohttp client that sends the same requests
with the same headers and follows the same retry rules as SDK 0.38's ``SamplingClient.sample``
(see ``/work/shared/spec/tinker_sdk_protocol.md`` §4.5–4.6), because the SDK's own per-request
CPU (pydantic models, httpx/pyqwest, telemetry, its retry machinery) would dominate a 2-core
machine and the load would measure the client instead of the gateway.

Rules followed (spec §4.5 ``asample``, §4.6 ``retrieve_future``):

* ``asample``: at most ``sdk_dispatch_limit`` (400) in flight per driver process, each holding
  its place through its retries (SDK 0.38 ``InternalClientHolder._sample_dispatch_semaphore``,
  taken in ``SamplingClient._sample_async_impl``); the other samples wait for a place, not for a
  connection, so that wait is not charged to the 60 s client timeout;
  header ``X-Tinker-Sampling-Backpressure: 1``; 429 -> sleep 1 s and re-send the
  **same** ``seq_id`` (no time limit); 408/409/5xx/connection error/timeout -> re-send the same
  ``seq_id`` after ``min(2**n, 30)`` s, for up to 300 s, then the whole sample restarts with a
  new ``seq_id``; any other status is fatal for that sample.
* ``retrieve_future``: body ``{"request_id", "allow_metadata_only"}``, ``Accept:
  application/x-protobuf``, ``X-Tinker-Request-Iteration`` (0, 1, ...), ``X-Tinker-Request-Type:
  Sample``, ``X-Tinker-Create-Promise-Roundtrip-Time`` (iteration 0), ``x-stainless-raw-response:
  raw``, ``x-stainless-read-timeout: 45``; client timeout ``poll_timeout_s`` (45 s, plain-httpx
  semantics: pool wait + connect <= 45 s, each read <= 45 s).
  200 proto -> result; 200 JSON ``try_again`` / 408 / 5xx -> re-poll immediately; 200 JSON
  ``complete_metadata`` -> re-poll with ``allow_metadata_only: false``; 200 JSON ``error`` ->
  terminal ``RequestFailedError``; 429 -> sleep ``min(2**n, 30)`` s (``n`` shared with
  connection errors/timeouts, reset by any other HTTP response); 400 with a body -> re-poll,
  at most 3 times; 410 -> the whole sample is re-run with a **new** ``seq_id`` after
  ``0.5 * 2**attempt`` s (+-25 %, <= 10 s); 402 -> sleep 5 s; anything else fatal;
  timeout / connection error -> sleep ``min(2**n, 30)`` s and poll again.

Poller mode (scenario key ``mode = "poller"``; spec §4.7, SDK 0.38 ``SessionFuturesPoller``):
each driver process runs one session-wide poller, ``retrieve_futures`` on its own connection
(the SDK's dedicated ``RETRIEVE_FUTURES`` pool): body ``{"target": {"type": "sampling_session",
"sampling_session_id", "cloned_sampler_id": 0}, "prev_cursor", "retrieved_request_ids"}`` plus
``"timeout": 0`` when no sample waits (an ack-only poll, 5 s client timeout; else 45 s); it
idles while nothing waits and nothing is left to acknowledge. A sample submits, waits for its
request id in the poller's completions, then fetches the result with ``retrieve_future``
(``allow_metadata_only: false`` when the completion gave a size) and is acknowledged in the
next poll. Poller errors: timeouts, connection errors, 408/409/429/5xx -> sleep 1 s and poll
again; 400 with a body -> the same, at most 3 times in a row; anything else fails every waiting
sample.

Every result is verified: the body is parsed with the SDK's own generated proto module
(``tinker.proto.tinker_public_pb2.SampleResponse``), and each sequence's ``tokens`` (int32 LE)
and ``logprobs`` (float32 LE) bytes and ``stop_reason`` are compared byte-for-byte with what
the simulator sends for that (prompt, seed) (:func:`expected_for`, from
``shardserver.engine_sim.render_completion``). A scenario uses a small number of distinct
(prompt, seed) pairs so the expected arrays are precomputed once and the simulator's body
cache keeps the engine cheap.

Loops are bounded in count (``max_polls`` per future, ``max_resubmits`` per sample) and in
time (the run's ``deadline``); a sample that hits a bound is counted as a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

BASE_MODEL = "Qwen/Qwen3-8B"
PROTO = "application/x-protobuf"
SDK_VERSION = "0.38.0"

# Counter slots in the shared progress array (one row of N_SLOTS per driver process): five totals,
# then one cumulative count per retry kind of RETRY_KINDS (the orchestrator samples them every
# second for the time series of retries by kind).
P_DONE, P_FAILED, P_RETRIES, P_BYTES, P_SUBMITTED = range(5)
RETRY_KINDS = (
    "asample_429", "asample_timeout", "asample_conn_error", "asample_other",   # asample: 408/409/5xx
    "poll_408", "poll_200_try_again", "poll_complete_metadata", "poll_5xx", "poll_429", "poll_400",
    "poll_timeout", "poll_conn_error", "poll_410", "poll_402",
    "resubmit_410", "resubmit_asample_timeout",
    "futures_timeout", "futures_conn_error", "futures_status",   # the poller's retried polls (poller mode)
    "heartbeat_error", "other",
)
_KIND_INDEX = {k: i for i, k in enumerate(RETRY_KINDS)}
P_KIND0 = 5
N_SLOTS = P_KIND0 + len(RETRY_KINDS)


def retry_slot(kind: str) -> int:
    """Index (within a driver's row) of the progress slot that counts retry ``kind`` (a counter name)."""
    if kind in _KIND_INDEX:
        return P_KIND0 + _KIND_INDEX[kind]
    if kind.startswith("asample_"):
        return P_KIND0 + _KIND_INDEX["asample_other"]
    if kind.startswith("poll_5") and kind[5:].isdigit():
        return P_KIND0 + _KIND_INDEX["poll_5xx"]
    if kind == "poll_400_empty":
        return P_KIND0 + _KIND_INDEX["poll_400"]
    if kind.startswith("futures_") and kind[8:].isdigit():
        return P_KIND0 + _KIND_INDEX["futures_status"]
    return P_KIND0 + _KIND_INDEX["other"]


def sdk_headers(api_key: str) -> dict[str, str]:
    """Headers the SDK 0.38 puts on every request (spec §1)."""
    return {
        "X-API-Key": api_key,
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": f"AsyncTinker/Python {SDK_VERSION}",
        "X-Stainless-Lang": "python",
        "X-Stainless-Package-Version": SDK_VERSION,
        "X-Stainless-OS": "Linux",
        "X-Stainless-Arch": "x64",
        "X-Stainless-Runtime": "CPython",
        "X-Stainless-Runtime-Version": platform.python_version(),
        "X-Stainless-Async": "async:asyncio",
        "x-stainless-retry-count": "0",
    }


def engine_request(prompt: list[int], max_tokens: int, seed: int, n: int) -> dict[str, Any]:
    """The ``/v1/completions`` request the gateway builds for our ``asample`` (see shardserver.engine_request)."""
    return {"model": BASE_MODEL, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "logprobs": 1, "return_token_ids": True, "seed": seed}


def prompt_for(key: int, prompt_tokens: int) -> list[int]:
    """Deterministic prompt (token ids) of distinct key ``key``."""
    return [(1000 + 7919 * key + 31 * j) % 150000 for j in range(prompt_tokens)]


def expected_for(key: int, spec: dict[str, Any]) -> list[tuple[bytes, bytes, int]]:
    """Per choice: (tokens int32 LE bytes, logprobs float32 LE bytes, proto stop_reason) the gateway must serve."""
    import numpy as np

    from shardserver.engine_sim import SimConfig, render_completion

    req = engine_request(prompt_for(key, spec["prompt_tokens"]), spec["tokens"], seed_for(key), spec["num_samples"])
    body = json.loads(render_completion(req, SimConfig.from_mapping({"model_name": BASE_MODEL})))
    out = []
    for ch in sorted(body["choices"], key=lambda c: c["index"]):
        toks = np.asarray(ch["token_ids"], dtype="<i4").tobytes()
        lps = np.asarray(ch["logprobs"]["token_logprobs"], dtype="<f4").tobytes()
        out.append((toks, lps, 1 if ch["finish_reason"] == "length" else 0))
    return out


def seed_for(key: int) -> int:
    return 12345 + key


@dataclass
class DriverResult:
    """What one driver process sends back (times in seconds, sizes in bytes)."""

    index: int
    latencies_s: list[float] = field(default_factory=list)   # time to result, per verified result
    done_at_s: list[float] = field(default_factory=list)     # completion time since go, per result
    counters: dict[str, int] = field(default_factory=dict)   # retries and failures by kind
    failures: int = 0
    done: int = 0
    bytes_delivered: int = 0
    first_errors: list[str] = field(default_factory=list)
    t_go: float = 0.0       # time.time() at go
    t_end: float = 0.0      # time.time() when the last sample finished
    cpu_s: float = 0.0      # this driver process's CPU seconds during the run
    poller_polls: int = 0   # retrieve_futures calls after go (poller mode)


class _Fatal(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


class _Gone(Exception):
    pass


class _Resubmit(Exception):
    pass


class SessionPoller:
    """The driver's session-wide poller (poller mode), after SDK 0.38 ``SessionFuturesPoller``.

    :meth:`wait_for` blocks a sample until the poller has seen its request complete and returns
    the completion (``{"state", "request_id", "response_payload_uncompressed_size"?}``);
    :meth:`mark_retrieved` queues an acknowledgement for the next poll.
    """

    def __init__(self, driver: "Driver", session: Any) -> None:
        self.d = driver
        self.session = session
        self.cursor = 0
        self.acked_cursor = 0
        self.events: dict[str, asyncio.Event] = {}
        self.completions: dict[str, dict[str, Any]] = {}
        self.retrieved: set[str] = set()
        self.failure: str | None = None
        self.has_work = asyncio.Event()
        self.polls = 0
        self.task = asyncio.create_task(self.loop())

    async def wait_for(self, rid: str) -> dict[str, Any]:
        """The completion of ``rid``. Raises _Fatal when the poller failed or the run's deadline passed."""
        c = self.completions.pop(rid, None)
        if c is not None:
            return c
        if self.failure is not None:
            raise _Fatal("poller", self.failure)
        ev = self.events[rid] = asyncio.Event()
        self.has_work.set()
        try:
            await asyncio.wait_for(ev.wait(), max(0.0, self.d.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise _Fatal("deadline", f"waiting on the poller for {rid}") from None
        finally:
            self.events.pop(rid, None)
        c = self.completions.pop(rid, None)
        if c is None:
            raise _Fatal("poller", self.failure or "woken without a completion")
        return c

    def mark_retrieved(self, rid: str) -> None:
        self.retrieved.add(rid)
        self.has_work.set()

    def _fail(self, why: str) -> None:
        self.failure = why
        for ev in self.events.values():
            ev.set()

    async def loop(self) -> None:
        import aiohttp

        d = self.d
        target = {"type": "sampling_session", "sampling_session_id": d.sid, "cloned_sampler_id": 0}
        extra = {"x-stainless-raw-response": "raw"}
        n400 = 0
        while True:  # until run() cancels it
            if not self.events and not self.retrieved and self.cursor <= self.acked_cursor:
                self.has_work.clear()
                try:
                    await asyncio.wait_for(self.has_work.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            retrieved = set(self.retrieved)
            ack_only = not self.events
            body: dict[str, Any] = {"target": target, "prev_cursor": self.cursor,
                                    "retrieved_request_ids": sorted(retrieved)}
            if ack_only:
                body["timeout"] = 0
            t = aiohttp.ClientTimeout(total=5.0 if ack_only else 45.0)
            self.polls += 1
            try:
                st, _, b = await d._post(self.session, "/api/v1/retrieve_futures", body,
                                         {**extra, "x-stainless-read-timeout": "5" if ack_only else "45"}, t)
            except asyncio.TimeoutError:
                d.count("futures_timeout")
                await asyncio.sleep(1)
                continue
            except (aiohttp.ClientError, OSError):
                d.count("futures_conn_error")
                await asyncio.sleep(1)
                continue
            if st != 200:
                d.count(f"futures_{st}")
                if st in (408, 409, 429) or st >= 500 or (st == 400 and (not b or n400 < 3)):
                    n400 += st == 400 and bool(b)
                    await asyncio.sleep(1)
                    continue
                self._fail(f"retrieve_futures answered {st}: {b[:300].decode(errors='replace')}")
                return
            n400 = 0
            js = json.loads(b)
            self.retrieved -= retrieved
            self.acked_cursor = max(self.acked_cursor, body["prev_cursor"])
            self.cursor = js["cursor"]
            for c in js["completions"]:
                self.completions[c["request_id"]] = c
                ev = self.events.pop(c["request_id"], None)
                if ev is not None:
                    ev.set()


class Driver:
    """Drives ``requests`` samples through the gateway at ``url`` (see module docstring)."""

    def __init__(self, url: str, spec: dict[str, Any], my_ids: list[int], concurrency: int, connections: int,
                 progress: Any, row: int, deadline_mono: float) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.my_ids = my_ids
        self.concurrency = max(1, concurrency)
        self.connections = max(1, connections)
        self.progress = progress
        self.base = row * N_SLOTS
        self.deadline = deadline_mono
        self.poll_timeout = float(spec["poll_timeout_s"])
        self.dispatch: asyncio.Semaphore | None = None  # the SDK's asample dispatch limit (made in run())
        self.headers = sdk_headers("tml-load")
        self.counters: dict[str, int] = {}
        self.res = DriverResult(index=row)
        self.expected: dict[int, list[tuple[bytes, bytes, int]]] = {}
        self.seq = 0
        self.sid = ""
        self.session_id = ""
        self.poller: SessionPoller | None = None   # poller mode: started in run()

    # -- bookkeeping ------------------------------------------------------------------------------
    def count(self, kind: str, retry: bool = True) -> None:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        if retry:
            self.progress[self.base + P_RETRIES] += 1
            self.progress[self.base + retry_slot(kind)] += 1

    def fail(self, kind: str, detail: str) -> None:
        self.counters["fail_" + kind] = self.counters.get("fail_" + kind, 0) + 1
        self.res.failures += 1
        self.progress[self.base + P_FAILED] += 1
        if len(self.res.first_errors) < 10:
            self.res.first_errors.append(f"{kind}: {detail[:300]}")

    def prepare(self) -> None:
        """Precompute the expected arrays of every distinct key this driver will see (CPU, once)."""
        for key in sorted({i % self.spec["distinct"] for i in self.my_ids}):
            self.expected[key] = expected_for(key, self.spec)

    # -- HTTP -------------------------------------------------------------------------------------
    async def _post(self, session: Any, path: str, body: dict[str, Any], extra: dict[str, str],
                    timeout: Any) -> tuple[int, str, bytes]:
        h = dict(self.headers)
        h["X-Idempotency-Key"] = f"stainless-python-retry-{uuid.uuid4()}"
        h.update(extra)
        async with session.post(self.url + path, data=json.dumps(body).encode(), headers=h, timeout=timeout) as r:
            data = await r.read()
            return r.status, r.headers.get("Content-Type", ""), data

    async def setup(self, session: Any) -> None:
        """create_session + create_sampling_session, as ``ServiceClient.create_sampling_client`` does."""
        import aiohttp

        t = aiohttp.ClientTimeout(total=60)
        st, _, b = await self._post(session, "/api/v1/client/config", {}, {}, t)
        st, _, b = await self._post(session, "/api/v1/create_session",
                                    {"tags": [], "user_metadata": {}, "sdk_version": SDK_VERSION, "type": "create_session"},
                                    {}, t)
        if st != 200:
            raise RuntimeError(f"create_session: {st} {b[:200]!r}")
        self.session_id = json.loads(b)["session_id"]
        st, _, b = await self._post(session, "/api/v1/create_sampling_session",
                                    {"session_id": self.session_id, "sampling_session_seq_id": 0,
                                     "base_model": BASE_MODEL, "type": "create_sampling_session"}, {}, t)
        if st != 200:
            raise RuntimeError(f"create_sampling_session: {st} {b[:200]!r}")
        self.sid = json.loads(b)["sampling_session_id"]

    async def heartbeat(self, session: Any) -> None:
        """``session_heartbeat`` every 10 s, like the SDK's background loop (bounded by the deadline)."""
        import aiohttp

        t = aiohttp.ClientTimeout(total=10)
        # Own connection (the SDK's heartbeat does not queue behind the sample long-polls either).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as hb_session:
            while time.monotonic() < self.deadline:
                await asyncio.sleep(10)
                try:
                    await self._post(hb_session, "/api/v1/session_heartbeat",
                                     {"session_id": self.session_id, "type": "session_heartbeat"}, {}, t)
                except Exception:  # noqa: BLE001 - heartbeats are best effort
                    self.count("heartbeat_error")

    # -- one sample -------------------------------------------------------------------------------
    def _asample_body(self, i: int, seq: int) -> dict[str, Any]:
        key = i % self.spec["distinct"]
        return {"num_samples": self.spec["num_samples"],
                "prompt": {"chunks": [{"tokens": prompt_for(key, self.spec["prompt_tokens"]), "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": self.spec["tokens"], "seed": seed_for(key), "temperature": 1.0,
                                    "top_k": -1, "top_p": 1.0},
                "sampling_session_id": self.sid, "seq_id": seq, "prompt_logprobs": False,
                "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0,
                "record_stability_info": False, "type": "sample"}

    async def _asample(self, session: Any, i: int, seq: int) -> tuple[str, float]:
        """Submit; returns (request_id, round-trip s). Raises _Resubmit after 300 s of retryable errors."""
        import aiohttp

        t = aiohttp.ClientTimeout(total=60)
        body = self._asample_body(i, seq)
        n = 0
        t_first = time.monotonic()
        extra = {"X-Tinker-Sampling-Backpressure": "1", "x-sdk-version": SDK_VERSION,
                 "x-sdk-method": "SamplingClient.sample_async"}
        for _ in range(10_000):
            if time.monotonic() > self.deadline:
                raise _Fatal("deadline", "asample")
            t0 = time.monotonic()
            try:
                st, _, b = await self._post(session, "/api/v1/asample", body, extra, t)
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
                self.count("asample_" + ("timeout" if isinstance(exc, asyncio.TimeoutError) else "conn_error"))
                st, b = -1, str(exc).encode()
            if st == 200:
                return json.loads(b)["request_id"], time.monotonic() - t0
            if st == 429:
                self.count("asample_429")
                await asyncio.sleep(1.0)
                continue
            if st in (408, 409) or st >= 500 or st == -1:
                if st != -1:
                    self.count(f"asample_{st}")
                if time.monotonic() - t_first > 300:
                    raise _Resubmit()
                await asyncio.sleep(min(2 ** n, 30))
                n += 1
                continue
            raise _Fatal(f"asample_{st}", b[:300].decode(errors="replace"))
        raise _Fatal("asample_bound", "too many asample attempts")

    async def _poll(self, session: Any, rid: str, rtt: float, allow_meta: bool = True) -> bytes:
        """retrieve_future until a result; returns the proto body. Raises _Gone on 410, _Fatal otherwise.

        ``allow_meta``: the first poll's ``allow_metadata_only`` (False after the poller gave a size)."""
        import aiohttp

        t = aiohttp.ClientTimeout(total=None, connect=self.poll_timeout, sock_read=self.poll_timeout)
        n = 0
        n400 = 0
        base = {"Accept": PROTO, "X-Tinker-Request-Type": "Sample", "x-stainless-raw-response": "raw",
                "x-stainless-read-timeout": str(int(self.poll_timeout)), "x-sdk-version": SDK_VERSION,
                "x-sdk-method": "SamplingClient.sample_async"}
        for it in range(int(self.spec["max_polls"])):
            if time.monotonic() > self.deadline:
                raise _Fatal("deadline", f"polling {rid}")
            extra = dict(base)
            extra["X-Tinker-Request-Iteration"] = str(it)
            if it == 0:
                extra["X-Tinker-Create-Promise-Roundtrip-Time"] = f"{rtt:.6f}"
            try:
                st, ctype, b = await self._post(session, "/api/v1/retrieve_future",
                                                {"request_id": rid, "allow_metadata_only": allow_meta}, extra, t)
            except asyncio.TimeoutError:
                self.count("poll_timeout")
                await asyncio.sleep(min(2 ** n, 30))
                n += 1
                continue
            except (aiohttp.ClientError, OSError):
                self.count("poll_conn_error")
                await asyncio.sleep(min(2 ** n, 30))
                n += 1
                continue
            if st == 200:
                n = 0
                if PROTO in ctype:
                    return b
                js = json.loads(b)
                if js.get("type") == "try_again":
                    self.count("poll_200_try_again")
                    continue
                if js.get("status") == "complete_metadata":
                    self.count("poll_complete_metadata")
                    allow_meta = False
                    continue
                if "error" in js:
                    raise _Fatal("request_failed_" + str(js.get("category", "unknown")), str(js["error"]))
                raise _Fatal("json_result", "JSON result to a proto-only client")
            if st == 408:
                n = 0
                n400 = 0
                self.count("poll_408")
                continue
            if st >= 500:
                n = 0
                self.count(f"poll_{st}")
                continue
            if st == 429:
                self.count("poll_429")
                await asyncio.sleep(min(2 ** n, 30))
                n += 1
                continue
            if st == 400:
                if not b:
                    self.count("poll_400_empty")
                    await asyncio.sleep(min(2 ** n, 30))
                    n += 1
                    continue
                n = 0
                n400 += 1
                self.count("poll_400")
                if n400 > 3:
                    raise _Fatal("poll_400", b[:300].decode(errors="replace"))
                continue
            if st == 410:
                self.count("poll_410")
                raise _Gone()
            if st == 402:
                n = 0
                self.count("poll_402")
                await asyncio.sleep(5)
                continue
            raise _Fatal(f"poll_{st}", b[:300].decode(errors="replace"))
        raise _Fatal("max_polls", rid)

    def _verify(self, i: int, body: bytes) -> str | None:
        """None when the proto matches the engine's body for request i, else a description."""
        from tinker.proto import tinker_public_pb2

        msg = tinker_public_pb2.SampleResponse()
        try:
            msg.ParseFromString(body)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a verification failure
            return f"proto parse: {exc}"
        exp = self.expected[i % self.spec["distinct"]]
        if len(msg.sequences) != len(exp):
            return f"{len(msg.sequences)} sequences, expected {len(exp)}"
        for k, (seq, (toks, lps, stop)) in enumerate(zip(msg.sequences, exp)):
            if seq.tokens != toks:
                return f"seq {k}: tokens differ ({len(seq.tokens) // 4} vs {len(toks) // 4} tokens)"
            if seq.logprobs != lps:
                return f"seq {k}: logprobs differ"
            if seq.stop_reason != stop:
                return f"seq {k}: stop_reason {seq.stop_reason} != {stop}"
        return None

    async def one(self, session: Any, i: int, t_go: float) -> None:
        """One ``sample_async`` call: submit, poll, resubmit on 410 with a new seq_id, verify."""
        t0 = time.monotonic()
        self.progress[self.base + P_SUBMITTED] += 1
        try:
            for attempt in range(int(self.spec["max_resubmits"]) + 1):
                self.seq += 1
                seq = self.seq
                try:
                    if self.dispatch is None:
                        rid, rtt = await self._asample(session, i, seq)
                    else:
                        async with self.dispatch:
                            rid, rtt = await self._asample(session, i, seq)
                    allow_meta = True
                    if self.poller is not None:
                        c = await self.poller.wait_for(rid)
                        allow_meta = not c.get("response_payload_uncompressed_size")
                    try:
                        body = await self._poll(session, rid, rtt, allow_meta)
                    finally:
                        if self.poller is not None:
                            self.poller.mark_retrieved(rid)
                except _Resubmit:
                    self.count("resubmit_asample_timeout")
                    continue
                except _Gone:
                    self.count("resubmit_410")
                    delay = min(0.5 * 2 ** attempt, 10.0) * random.uniform(0.75, 1.25)
                    await asyncio.sleep(delay)
                    continue
                err = self._verify(i, body)
                now = time.monotonic()
                if err is not None:
                    self.fail("verify", f"request {i}: {err}")
                    return
                self.res.latencies_s.append(now - t0)
                self.res.done_at_s.append(now - t_go)
                self.res.done += 1
                self.res.bytes_delivered += len(body)
                self.progress[self.base + P_DONE] += 1
                self.progress[self.base + P_BYTES] += len(body)
                return
            self.fail("max_resubmits", f"request {i}")
        except _Fatal as exc:
            self.fail(exc.kind, exc.detail)
        except Exception as exc:  # noqa: BLE001 - count, never crash the run
            self.fail("exception_" + type(exc).__name__, repr(exc))

    async def warmup(self, session: Any) -> None:
        """Run ``warmup`` samples (distinct keys, concurrently) before go, then forget their tallies.

        They fill the simulator's body cache and touch the gateway's code paths once, so the
        measured run starts warm. Their results stay in the server (retained like any other).
        """
        n = int(self.spec.get("warmup", 0))
        if n <= 0:
            return
        ids = [self.my_ids[k] for k in range(min(n, len(self.my_ids)))]
        t = time.monotonic()
        self.deadline = t + 300
        await asyncio.gather(*(self.one(session, i, t) for i in ids))
        if self.res.failures:
            raise RuntimeError(f"warmup failed: {self.res.first_errors[:3]}")
        self.res = DriverResult(index=self.res.index)
        self.counters = {}
        for k in range(N_SLOTS):
            self.progress[self.base + k] = 0

    async def run(self, go: Any, ready: Any) -> DriverResult:
        """Set up, tell the orchestrator we are ready, wait for go, drive every request, return the tally."""
        import aiohttp

        self.prepare()
        conn = aiohttp.TCPConnector(limit=self.connections, limit_per_host=self.connections,
                                    keepalive_timeout=60, force_close=False)
        poll_session = None
        async with aiohttp.ClientSession(connector=conn, auto_decompress=True) as session:
            await self.setup(session)
            if self.spec.get("mode", "per_request") == "poller":
                # Its own connection, like the SDK's dedicated RETRIEVE_FUTURES pool.
                poll_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), auto_decompress=True)
                self.poller = SessionPoller(self, poll_session)
            await self.warmup(session)
            ready.put(self.res.index)
            loop = asyncio.get_running_loop()
            for _ in range(1200):                       # wait for go, at most 600 s
                if await loop.run_in_executor(None, go.wait, 0.5):
                    break
            else:
                raise RuntimeError("no go signal within 600 s")
            self.deadline = time.monotonic() + float(self.spec["time_limit_s"])
            if self.poller is not None:
                self.poller.polls = 0
            hb = asyncio.create_task(self.heartbeat(session))
            self.res.t_go = time.time()
            t_go = time.monotonic()
            c0 = time.process_time()
            sem = asyncio.Semaphore(self.concurrency)
            limit = int(self.spec.get("sdk_dispatch_limit") or 0)
            self.dispatch = asyncio.Semaphore(limit) if limit > 0 else None
            tasks: set[asyncio.Task[None]] = set()

            async def gated(i: int) -> None:
                try:
                    await self.one(session, i, t_go)
                finally:
                    sem.release()

            for i in self.my_ids:
                await sem.acquire()
                task = asyncio.create_task(gated(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(set(tasks))
            self.res.t_end = time.time()
            self.res.cpu_s = time.process_time() - c0
            if self.poller is not None:
                self.res.poller_polls = self.poller.polls
                self.poller.task.cancel()
                try:
                    await self.poller.task
                except asyncio.CancelledError:
                    pass
                assert poll_session is not None
                await poll_session.close()
            hb.cancel()
            try:
                await hb
            except asyncio.CancelledError:
                pass
        self.res.counters = dict(self.counters)
        return self.res


def driver_process(row: int, nprocs: int, url: str, spec: dict[str, Any], progress: Any, go: Any, ready: Any,
                   results: Any) -> None:
    """Entry point of one driver process: requests ``i`` with ``i % nprocs == row``."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"load-driver {row}")
    except ImportError:
        pass
    my_ids = list(range(row, int(spec["requests"]), nprocs))
    per = lambda total: -(-int(total) // nprocs)  # noqa: E731 - ceil division
    drv = Driver(url, spec, my_ids, per(spec["concurrency"]), per(spec["connections"]), progress, row,
                 time.monotonic() + float(spec["time_limit_s"]) + 700)
    try:
        try:
            import uvloop

            res = uvloop.run(drv.run(go, ready))
        except ImportError:
            res = asyncio.run(drv.run(go, ready))
        results.put(("ok", res))
    except BaseException as exc:  # noqa: BLE001 - report to the orchestrator, which decides
        results.put(("error", f"driver {row}: {exc!r}"))
        ready.put(-1 - row)
        raise
    finally:
        os.sys.stdout.flush()
