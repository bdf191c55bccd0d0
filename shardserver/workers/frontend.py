"""Front-end workers: FastAPI on uvicorn (uvloop + httptools), stateless.

Any front-end serves any request. Sessions are signed IDs (:mod:`shardserver.ids`),
futures live in the encoders, and result bytes are copied straight out of
the owning shard's arena into the response: no re-encoding, no pickling, one
memcpy. :func:`create_app` builds the ASGI app; :class:`FrontendProc` runs
it in a process on the supervisor's listening socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..api_models import (
    UNSUPPORTED_SAMPLE_FIELDS,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    EncodedTextChunk,
    RetrieveFutureRequest,
    SampleRequest,
)
from ..codec import sample_response_to_json
from ..config import Config
from ..control import ControlClient, Kind
from ..errors import EncoderDeadError, SlotInvalidError
from ..ids import FutureIdStatus, IdSigner, SamplingSession, shard_of
from ..shm.arena import ArenaReader
from ..access_log import make_access_log
from ..auth import AuthMiddleware, KeyTable, owner_of
from ..health import readiness
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import FrontendCounters, HttpMetricsMiddleware, count_auth_rejected, metrics_body

__all__ = ["FrontendContext", "create_app", "FrontendProc", "PROTO_MEDIA_TYPE", "TRAINING_ENDPOINTS"]

log = logging.getLogger("shardserver.frontend")

PROTO_MEDIA_TYPE = "application/x-protobuf"
# Longest base_model / model_path accepted (they travel inside the signed sampling-session ID).
MAX_MODEL_NAME = 512
# Endpoints of the Tinker API that train; this gateway only samples.
TRAINING_ENDPOINTS = (
    "create_model", "forward", "forward_backward", "optim_step", "load_weights", "save_weights",
    "save_weights_for_sampler", "get_info", "unload_model", "load_state", "save_state",
)


@dataclass
class FrontendContext:
    """What one front-end process holds: no futures, no sessions, only connections and mappings."""

    cfg: Config
    index: int
    signer: IdSigner
    socket_paths: list[str]
    clients: list[ControlClient] = field(default_factory=list)
    readers: dict[str, ArenaReader] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=FrontendCounters)  # bytes_delivered also feeds Prometheus
    ready_conn: Any = None
    draining: bool = False
    auth: KeyTable = field(default_factory=KeyTable.open)  # the accepted API keys (digests only)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def reader(self, name: str) -> ArenaReader:
        r = self.readers.get(name)
        if r is None:
            shard_prefix = name.rsplit(".", 1)[0]
            for old in [k for k in self.readers if k.rsplit(".", 1)[0] == shard_prefix]:
                self.readers.pop(old).close()  # that shard's encoder was restarted with a fresh arena
            r = self.readers[name] = ArenaReader(name)
        return r

    async def start(self) -> None:
        self.clients = [ControlClient(p, i) for i, p in enumerate(self.socket_paths)]
        for c in self.clients:
            c.start()
        for c in self.clients:
            await c.wait_connected(self.cfg.shards.ready_timeout_s)

    def drain(self) -> None:
        """Shutdown has begun: release held polls (they answer 408 try_again) and refuse new holds."""
        self.draining = True
        for c in self.clients:
            c.release_polls({"state": "pending", "draining": True})

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request body: " + "; ".join(parts) + more


class ResultResponse(Response):
    """A finished result's bytes; reports delivery only if the client was still connected after the write."""

    def __init__(self, content: bytes, media_type: str, on_delivered, headers: dict[str, str]) -> None:
        super().__init__(content=content, media_type=media_type, headers=headers)
        self._on_delivered = on_delivered

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        # The request body was read already, so a pending receive() completes only on disconnect
        # (or, in uvicorn, once the response is complete): look before writing.
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.sleep(0)
            lost = watch.done()
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            watch.cancel()
        if not lost:
            self._on_delivered()


def create_app(ctx: FrontendContext) -> FastAPI:
    """The FastAPI app of one front-end. Routes are listed in README's API section."""
    cfg = ctx.cfg
    shards = cfg.shards.count
    max_body = cfg.server.max_request_bytes
    fe_header = {"X-Shardserver-Front-End": str(ctx.index)}

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ctx.start()
        if ctx.ready_conn is not None:
            ctx.ready_conn.send(("ready", ctx.index, os.getpid()))
            ctx.ready_conn.close()
            ctx.ready_conn = None
        log.info("front-end %d ready (pid %d)", ctx.index, os.getpid())
        yield
        await ctx.stop()
        log.info("front-end %d stopped", ctx.index)

    app = FastAPI(title="shardserver", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # The last added runs first: count and time every response (401s included), then check the key.
    app.add_middleware(AuthMiddleware, table=ctx.auth, on_reject=count_auth_rejected,
                       headers=[(b"x-shardserver-front-end", str(ctx.index).encode())])
    app.add_middleware(HttpMetricsMiddleware, access_log=make_access_log(cfg.server.access_log, ctx.index))

    async def read_json(request: Request) -> Any:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > max_body:
            raise _BodyError(413, f"request body of {cl} bytes exceeds server.max_request_bytes={max_body}")
        # Count while receiving: a chunked upload without Content-Length is cut off at the limit.
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise _BodyError(413, f"request body exceeds server.max_request_bytes={max_body} bytes")
            parts.append(chunk)
        body = b"".join(parts)
        try:
            return json.loads(body) if body else {}
        except ValueError as exc:
            raise _BodyError(400, f"request body is not valid JSON: {exc}") from None

    class _BodyError(Exception):
        def __init__(self, status: int, message: str) -> None:
            self.status, self.message = status, message

    @app.exception_handler(_BodyError)
    async def _body_error(_: Request, exc: _BodyError) -> JSONResponse:
        ctx.count(f"http_{exc.status}")
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=fe_header)

    @app.exception_handler(ValidationError)
    async def _val_error(_: Request, exc: ValidationError) -> JSONResponse:
        ctx.count("http_400")
        return JSONResponse({"error": _validation_message(exc)}, status_code=400, headers=fe_header)

    # -- health ---------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok", "front_end": ctx.index, "pid": os.getpid()}, headers=fe_header)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status, body = await readiness(ctx.clients)  # encoders connected and the engine reachable
        return JSONResponse(body, status_code=status, headers=fe_header)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await metrics_body(ctx.clients), media_type=METRICS_CONTENT_TYPE, headers=fe_header)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        shards_out: list[Any] = []
        for c in ctx.clients:
            try:
                shards_out.append(await c.request(Kind.STATS, {}, timeout=5))
            except (EncoderDeadError, asyncio.TimeoutError) as exc:
                shards_out.append({"shard": c.shard, "error": str(exc)})
        return JSONResponse({"front_end": ctx.index, "pid": os.getpid(), "counters": ctx.counters,
                             "shards": shards_out}, headers=fe_header)

    # -- client setup ---------------------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> JSONResponse:
        await read_json(request)
        return JSONResponse({"pjwt_auth_enabled": False}, headers=fe_header)

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> JSONResponse:
        await read_json(request)
        return JSONResponse({}, headers=fe_header)

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> JSONResponse:
        CreateSessionRequest.model_validate(await read_json(request))
        return JSONResponse({"session_id": ctx.signer.mint_session_id(owner_of(request)), "type": "create_session"},
                            headers=fe_header)

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> JSONResponse:
        body = await read_json(request)
        if not isinstance(body, dict) or not ctx.signer.check_session_id(body.get("session_id"), owner_of(request)):
            return _error(404, "unknown session_id")
        return JSONResponse({"type": "session_heartbeat"}, headers=fe_header)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> JSONResponse:
        await read_json(request)
        return JSONResponse({}, headers=fe_header)

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> JSONResponse:
        await read_json(request)
        return JSONResponse({"status": "accepted"}, headers=fe_header)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> JSONResponse:
        req = CreateSamplingSessionRequest.model_validate(await read_json(request))
        if not ctx.signer.check_session_id(req.session_id, owner_of(request)):
            return _error(404, f"unknown session_id {req.session_id[:64]!r} (create_session first)")
        if not req.base_model and not req.model_path:
            return _error(400, "create_sampling_session needs base_model or model_path")
        for name in ("base_model", "model_path"):
            v = getattr(req, name)
            if v is not None and len(v) > MAX_MODEL_NAME:
                return _error(400, f"{name} is {len(v)} characters long; at most {MAX_MODEL_NAME} are accepted")
        sid = ctx.signer.mint_sampling_session_id(
            SamplingSession(req.session_id, req.base_model, req.model_path, req.sampling_session_seq_id),
            owner_of(request))
        return JSONResponse({"sampling_session_id": sid, "type": "create_sampling_session"}, headers=fe_header)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> JSONResponse:
        sess = ctx.signer.open_sampling_session_id(sampler_id, owner_of(request))
        if sess is None:
            return _error(404, "unknown sampler id")
        # base_model picks the client's tokenizer: a model_path-only session reports the engine's model.
        base = sess.base_model or cfg.engine.model or sess.model_path or ""
        return JSONResponse({"sampler_id": sampler_id, "base_model": base, "model_path": sess.model_path},
                            headers=fe_header)

    # -- sampling -------------------------------------------------------------------------------
    @app.post("/api/v1/asample")
    async def asample(request: Request) -> JSONResponse:
        raw = await read_json(request)
        req = SampleRequest.model_validate(raw)
        for name in UNSUPPORTED_SAMPLE_FIELDS:
            v = getattr(req, name)
            if v not in (None, 0):
                return _error(400, f"{name} is not supported by this gateway")
        tokens: list[int] = []
        for i, chunk in enumerate(req.prompt.chunks):
            ctype = chunk.get("type", "encoded_text")
            if ctype != "encoded_text":
                return _error(400, f"prompt.chunks[{i}]: chunk type {ctype!r} is not supported by this gateway "
                                   "(token prompts only)")
            tokens.extend(EncodedTextChunk.model_validate(chunk).tokens)
        if tokens and not (0 <= min(tokens) and max(tokens) < 2**31):
            bad = next(t for t in tokens if not 0 <= t < 2**31)
            return _error(400, f"prompt token id {bad} is outside [0, 2^31)")
        if not tokens:
            return _error(400, "prompt has no tokens")
        sess = ctx.signer.open_sampling_session_id(req.sampling_session_id, owner_of(request))
        if sess is None:
            return _error(404, "unknown sampling_session_id (create_sampling_session first; "
                               "sessions of an earlier server run are not kept unless server.id_secret is set)")
        n = req.num_samples
        if n > cfg.engine.max_num_samples:
            return _error(400, f"num_samples={n} exceeds engine.max_num_samples={cfg.engine.max_num_samples}")
        sp = req.sampling_params
        plen = len(tokens)
        max_tokens = sp.max_tokens
        if plen >= cfg.engine.max_model_len:
            return _error(400, f"prompt of {plen} tokens does not fit engine.max_model_len={cfg.engine.max_model_len}")
        if max_tokens is None:
            # Unset means "until EOS or the context is full" for the SDK; vLLM would use 16.
            max_tokens = cfg.engine.max_model_len - plen
        gen_bound = max_tokens
        # topk_prompt_logprobs > 0 implies prompt logprobs (the top-k rows come with them).
        topk = req.topk_prompt_logprobs
        want_plp = bool(req.prompt_logprobs) or topk > 0
        # Largest SampleResponse this request can produce (bytes): per sequence tokens + logprobs,
        # plus prompt logprobs and the top-k matrices, plus framing.
        reserve = n * (8 * gen_bound + 32) + 32
        if want_plp:
            reserve += 4 * plen + 16 + (8 * plen * topk + 48 if topk else 0)
        engine_req: dict[str, Any] = {
            "model": cfg.engine.model or sess.base_model or sess.model_path or "default",
            "prompt": tokens, "n": n, "max_tokens": max_tokens,
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "logprobs": 1, "return_token_ids": True,
        }
        if sp.seed is not None:
            engine_req["seed"] = sp.seed
        if want_plp:
            engine_req["prompt_logprobs"] = topk
        if isinstance(sp.stop, str):
            engine_req["stop"] = [sp.stop]
        elif sp.stop is not None and len(sp.stop) == 0:
            engine_req["ignore_eos"] = True  # the SDK's stop=[]: no stop at all, EOS included
        elif sp.stop:
            if all(isinstance(s, int) for s in sp.stop):
                engine_req["stop_token_ids"] = sp.stop
            else:
                engine_req["stop"] = sp.stop
        seq = req.seq_id if req.seq_id is not None else int.from_bytes(os.urandom(6), "little") + 10**15
        key = f"{req.sampling_session_id}#{seq}"
        shard = shard_of(key, shards)
        meta = {"sid": req.sampling_session_id, "seq": seq, "owner": owner_of(request), "n": n,
                "prompt_logprobs": want_plp, "topk": topk, "reserve_bytes": reserve}
        if want_plp:
            meta["prompt"] = tokens
        body = json.dumps(engine_req, separators=(",", ":")).encode()
        try:
            reply = await ctx.clients[shard].request(Kind.SUBMIT, meta, body, timeout=30)
        except (EncoderDeadError, asyncio.TimeoutError) as exc:
            ctx.count("asample_503")
            return JSONResponse({"error": f"shard {shard} unavailable: {exc}; retry"}, status_code=503,
                                headers=fe_header)
        if "request_id" not in reply:
            status = int(reply.get("status", 500))
            ctx.count(f"asample_{status}")
            hdrs = dict(fe_header)
            if status == 429:
                hdrs["Retry-After"] = "1"
            return JSONResponse({"error": reply.get("message", "rejected")}, status_code=status, headers=hdrs)
        ctx.count("asample_ok")
        rid = reply["request_id"]
        return JSONResponse({"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]},
                            headers={**fe_header, "X-Shardserver-Shard": str(shard)})

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = RetrieveFutureRequest.model_validate(await read_json(request))
        fid = req.request_id
        status = ctx.signer.check_future_id(fid, owner_of(request))
        if status == FutureIdStatus.INVALID:
            ctx.count("retrieve_404")
            return _error(404, f"unknown future {fid[:80]!r}: this server never issued it")
        if status == FutureIdStatus.FOREIGN_RUN:
            ctx.count("retrieve_410")
            return JSONResponse({"error": "future was issued by an earlier run of the server; resubmit"},
                                status_code=410, headers=fe_header)
        shard = shard_of(fid, shards)
        want = "proto" if PROTO_MEDIA_TYPE in request.headers.get("accept", "") else "json"
        client = ctx.clients[shard]
        t0 = time.monotonic()
        for _attempt in range(3):
            try:
                reply = await client.request(
                    Kind.POLL, {"fid": fid, "timeout": 0 if ctx.draining else cfg.futures.long_poll_s, "want": want},
                    timeout=cfg.futures.long_poll_s + 15)
            except EncoderDeadError as exc:
                ctx.count("retrieve_410")
                return JSONResponse({"error": f"shard {shard} lost its state ({exc}); resubmit"},
                                    status_code=410, headers=fe_header)
            except asyncio.TimeoutError:
                reply = {"state": "pending"}
            state = reply.get("state")
            if state == "done":
                try:
                    data = ctx.reader(reply["arena"]).read(reply["off"], reply["len"], reply["gen"])
                except (SlotInvalidError, FileNotFoundError) as exc:
                    log.debug("re-polling %s after a stale read: %s", fid, exc)
                    continue
                if want == "json" and reply.get("form") == "proto":
                    data = sample_response_to_json(data)
                ctx.count("retrieve_done")
                ctx.count("bytes_delivered", len(data))
                return ResultResponse(
                    data, PROTO_MEDIA_TYPE if want == "proto" else "application/json",
                    lambda: client.send(Kind.DELIVERED, {"fid": fid}),
                    headers={**fe_header, "X-Shardserver-Shard": str(shard)})
            if state == "pending":
                ctx.count("retrieve_408")
                return JSONResponse({"type": "try_again", "request_id": fid, "queue_state": "active"},
                                    status_code=408, headers=fe_header)
            if state == "failed":
                ctx.count("retrieve_failed")
                client.send(Kind.DELIVERED, {"fid": fid})
                return JSONResponse({"error": reply.get("error", "failed"), "category": reply.get("category", "unknown")},
                                    headers=fe_header)
            ctx.count("retrieve_410")
            return JSONResponse({"error": f"future {reply.get('reason', 'is gone')}; resubmit"},
                                status_code=410, headers=fe_header)
        ctx.count("retrieve_410")
        log.warning("future %s: arena slot kept changing during reads (%.3f s)", fid, time.monotonic() - t0)
        return JSONResponse({"error": "result was evicted while being read; resubmit"}, status_code=410,
                            headers=fe_header)

    # -- everything else ------------------------------------------------------------------------
    @app.api_route("/api/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def other(path: str) -> JSONResponse:
        if path.split("/")[0] in TRAINING_ENDPOINTS:
            ctx.count("http_501")
            return _error(501, f"/api/v1/{path} is a training endpoint: not supported by this gateway "
                               "(it only samples)")
        ctx.count("http_404")
        return _error(404, f"no such endpoint: /api/v1/{path}")

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, plus: when shutdown starts, held retrieve_future polls are answered at
    once (408 try_again, which the SDK re-polls) instead of being cut off as 500s at the end of
    the graceful period."""

    def __init__(self, config: uvicorn.Config, ctx: FrontendContext) -> None:
        super().__init__(config)
        self._ctx = ctx

    def handle_exit(self, sig, frame) -> None:  # runs in the signal handler: only schedule work
        if sig == signal.SIGINT:
            return  # Ctrl-C reaches the whole process group: the supervisor decides (it sends SIGTERM)
        super().handle_exit(sig, frame)
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self._ctx.drain)
        except RuntimeError:
            pass


class FrontendProc:
    """Process wrapper: ``FrontendProc.run`` is the only spawn target of a front-end."""

    @staticmethod
    def run(cfg: Config, index: int, sock, socket_paths: list[str], secret: bytes, run_id: str,
            parent_pid: int, ready_conn=None, auth: KeyTable | None = None) -> None:
        from ._subprocess import child_setup

        child_setup(f"front-end {index}", cfg)
        ctx = FrontendContext(cfg=cfg, index=index, signer=IdSigner(secret, run_id), socket_paths=socket_paths,
                              ready_conn=ready_conn, auth=auth or KeyTable.open())
        app = create_app(ctx)
        ucfg = uvicorn.Config(
            app, loop="uvloop", http="httptools", lifespan="on", access_log=False,  # see shardserver.access_log
            log_config=None, log_level=cfg.server.log_level, timeout_keep_alive=max(1, math.ceil(cfg.server.keep_alive_s)),
            timeout_graceful_shutdown=max(1, math.ceil(cfg.server.graceful_shutdown_s)), backlog=cfg.server.backlog,
            server_header=False)
        server = DrainingServer(ucfg, ctx)

        async def watch_parent() -> None:
            while not server.should_exit:
                await asyncio.sleep(0.5)
                if os.getppid() != parent_pid:
                    log.warning("front-end %d: supervisor %d is gone, exiting", index, parent_pid)
                    server.should_exit = True

        async def main() -> None:
            t = asyncio.get_running_loop().create_task(watch_parent(), name=f"front-end-{index}-parent-watch")
            try:
                await server.serve(sockets=[sock])
            finally:
                t.cancel()

        import uvloop

        uvloop.run(main())
