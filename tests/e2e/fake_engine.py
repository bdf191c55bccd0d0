"""Engines that misbehave on purpose, as real processes on 127.0.0.1, for the engine fault tests.

Run as a script this module is a small HTTP/1.1 server written on raw asyncio streams, so that
every connection-level behaviour is exact (which request on which connection, RST or FIN, how
many body bytes before the close). Its 200 bodies are the engine simulator's
(:func:`shardserver.engine_sim.render_completion`), so results can be checked token for token
against ``conftest.engine_body``. Behaviour (JSON, changeable while it runs with
``POST /_fake/config``):

* ``delay_s``: wait this long before answering each completion.
* ``max_running``: like vLLM's scheduler (``max_num_seqs``), at most this many completions
  generate (``delay_s`` each) at once; the others wait in a first-come queue (0: no bound).
  The log entry's ``started`` is when its generation began.
* ``gather``: hold 200 completions (rendered) until this many are waiting, then send them all
  at once (a batch of samples that finish together); 0: off.
* ``reset_reused``: answer one completion per connection (keep-alive); when the next request
  arrives on that connection, read it and reset the connection (RST, no response byte).
* ``idle_close_s``: close (FIN) a keep-alive connection idle this long (uvicorn: 5 s).
* ``drop_before_response``: the next N completions are read, then the connection is closed
  without a response byte; ``drop_how`` = ``"close"`` (FIN) or ``"reset"`` (RST).
* ``garble``: the next N completions are answered 200 with the first half of the body and a
  Content-Length of that half: a complete answer whose JSON is broken (a proxy's or a
  transport's corruption; vLLM itself never sends one).
* ``truncate``: the next N completions get the headers (full Content-Length) and half the body,
  then a FIN.
* ``status`` (+ ``status_body`` = ``vllm`` | ``router`` | ``empty`` | ``proxy`` | ``engine_dead`` | ``router_send`` |
  ``router_read`` | ``auth``): answer completions with this HTTP status, for ``status_for_s`` seconds from
  the first request it answers so (0: until changed). ``proxy`` is nginx's HTML error page;
  ``auth`` is vLLM's ``{"error":"Unauthorized"}`` (``vllm serve --api-key``, a request without the key);
  ``router_send`` and ``router_read`` are vllm-router's plain-text bodies for a worker it could not
  reach (``Request failed: ...``) or whose body broke (``Failed to get response body: ...``).
* ``pad_bytes``: the next completion's body is followed by this many spaces (still valid JSON),
  sent ``how`` = ``"chunked"`` (``Transfer-Encoding: chunked``, 1 MiB chunks, no Content-Length) or
  ``"gzip"`` (``Content-Encoding: gzip``, Content-Length of the compressed bytes) in
  ``pad_how``.
* ``crash_resets``: every connection is set to ``SO_LINGER`` 0, so that when the process is
  SIGKILLed its kernel sends each peer a single RST (a FIN would be retransmitted until it is
  acknowledged): with that RST lost, the peer hears nothing more, as from a crashed host.
* ``api_key``: like ``vllm serve --api-key``: every ``/v1/*`` request without
  ``Authorization: Bearer <api_key>`` gets 401 ``{"error":"Unauthorized"}`` (``/health`` is open).
* ``abort``: the next N completions end with ``finish_reason: "abort"`` (a partial sample).
* ``abort_prompt``: every completion whose prompt holds this token id ends with
  ``finish_reason: "abort"``, whatever else is answered (an engine that singles a request out).
* ``metrics``: ``GET /metrics`` answers vLLM's token counters (``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total``) and ``vllm:num_requests_running`` (the completions being
  handled): ``"live"`` counters grow by 100 tokens a second while a completion is being handled
  (a working engine core), ``"frozen"`` ones never move and at least one request is always
  running (an engine core hung with requests in it, whose API server still answers
  ``/health``), ``"idle"`` ones never move and no request runs (what a probe sees when a load
  balancer sends it to an idle replica while another one runs the gateway's requests); None
  (the default): 404, like an engine that exports none.
* ``model``, ``max_model_len``: what ``GET /v1/models`` reports and what the bodies are
  rendered with (prompt + max_tokens over the window: vLLM's 400).
* ``script``: generate these token ids (repeated as needed) instead of the simulator's, with
  vLLM's stop rules (:func:`scripted_body`): EOS 151643 unless ``ignore_eos``, then
  ``stop_token_ids``, then ``stop`` strings matched against the detokenized text, in which the
  special tokens of ``SPECIAL`` appear only when the request has ``skip_special_tokens: false``.

With ``tls=True`` the engine serves HTTPS (TLS 1.2+) with ``tls/cert.pem`` (self-signed for
IP 127.0.0.1, valid to 2126, made for these tests with ``openssl req -x509 -newkey rsa:2048
-nodes -days 36500 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1``); a client trusts
it through ``SSL_CERT_FILE`` (:data:`TLS_CERT`), as OpenSSL's default verify paths do.

``GET /_fake/log`` returns one entry per completion request: ``conn`` (connection number),
``nth`` (request number on that connection), ``request_id`` (``X-Request-Id``), ``action``
(``ok``, ``reset``, ``drop``, ``truncate``, ``garble``, ``status``, ``abort``, ``error``), ``t`` (monotonic
seconds) and ``request`` (the parsed JSON body). ``GET /health`` answers 200.

:class:`FakeEngine` runs this script; :class:`SimEngineProcess` runs ``shardserver engine-sim``
standalone. Both can be SIGKILLed and started again on the same port.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

DEFAULTS: dict[str, Any] = {
    "delay_s": 0.0, "gather": 0, "reset_reused": False, "idle_close_s": 0.0, "drop_before_response": 0,
    "drop_how": "close",
    "truncate": 0, "status": None, "status_body": "vllm", "status_for_s": 0.0, "abort": 0,
    "model": "Qwen/Qwen3-8B", "max_model_len": 65536, "api_key": None, "script": None, "pad_bytes": 0, "pad_how": "chunked",
    "crash_resets": False, "max_running": 0, "garble": 0, "metrics": None, "abort_prompt": None,
}
PHRASES = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 408: "Request Timeout", 413: "Request Entity Too Large",
           429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}
EOS = 151643
# Qwen's special tokens: their text appears in the output only with skip_special_tokens false.
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def scripted_body(req: dict[str, Any], script: list[int], model: str, request_id: str) -> dict[str, Any]:
    """A vLLM 0.30 completion (parsed JSON) whose every choice generates ``script``, stopped the
    way vLLM stops (``check_stop`` for EOS and ``stop_token_ids``; the detokenizer's stop-string
    check, on text without special tokens unless ``skip_special_tokens`` is false).

    The matched stop token stays in ``token_ids`` (vLLM keeps it); a matched stop string is cut
    from ``text`` and reported as ``stop_reason``. Logprobs are ``-0.5 - 0.01 * i``.
    """
    max_tokens = req.get("max_tokens") or 16
    stop_ids = set(req.get("stop_token_ids") or [])
    stops = req.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    skip = req.get("skip_special_tokens", True)
    ignore_eos = bool(req.get("ignore_eos", False))
    ids: list[int] = []
    pieces: list[str] = []
    text = ""
    finish, reason = "length", None
    for i in range(max_tokens):
        t = script[i % len(script)]
        ids.append(t)
        piece = ("" if skip else SPECIAL[t]) if t in SPECIAL else f" w{t}"
        pieces.append(SPECIAL.get(t, piece))
        if not ignore_eos and t == EOS:
            finish = "stop"
            break
        if t in stop_ids:
            finish, reason = "stop", t
            break
        text += piece
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            at, s = min(hits)
            text, finish, reason = text[:at], "stop", s
            break
    lps = [-0.5 - 0.01 * i for i in range(len(ids))]
    offsets, off = [], 0
    for p in pieces:
        offsets.append(off)
        off += len(p)
    choice = lambda k: {  # noqa: E731
        "index": k, "text": text,
        "logprobs": {"text_offset": offsets, "token_logprobs": lps, "tokens": pieces,
                     "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps)]},
        "finish_reason": finish, "stop_reason": reason, "token_ids": ids, "prompt_logprobs": None,
        "prompt_token_ids": req.get("prompt"), "routed_experts": None}
    n = int(req.get("n") or 1)
    return {"id": request_id, "object": "text_completion", "created": 1700000000, "model": model,
            "choices": [choice(k) for k in range(n)], "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(req.get("prompt") or []),
                      "total_tokens": len(req.get("prompt") or []) + len(ids) * n,
                      "completion_tokens": len(ids) * n, "prompt_tokens_details": None}}


# ---------------------------------------------------------------------------------------------
# The server (runs in its own process: python tests/e2e/fake_engine.py --port P --config JSON)
# ---------------------------------------------------------------------------------------------
class _Server:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = dict(DEFAULTS)
        self.set_config(config)
        self.log: list[dict[str, Any]] = []
        self.conns = 0
        self.gathered: list[asyncio.Event] = []  # completions held by ``gather``
        self.running: asyncio.Semaphore | None = None  # ``max_running``
        self.handling = 0  # completions being handled now (``metrics``)
        self.tokens, self.tokens_at = 1000.0, time.monotonic()  # ``metrics``: the counters' sum, when

    def set_config(self, patch: dict[str, Any]) -> None:
        unknown = set(patch) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown fake-engine settings: {sorted(unknown)}")
        self.cfg.update(patch)
        self.status_since: float | None = None
        held = getattr(self, "gathered", [])
        if held and len(held) >= max(1, self.cfg["gather"]):  # gathering lifted or lowered: answer those held
            for ev in held:
                ev.set()
            self.gathered = []

    def _status_now(self) -> int | None:
        st = self.cfg["status"]
        if st is None:
            return None
        now = time.monotonic()
        if self.status_since is None:
            self.status_since = now  # the window starts at the first request it answers
        if self.cfg["status_for_s"] and now - self.status_since > self.cfg["status_for_s"]:
            return None
        return int(st)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        conn = self.conns
        nth = 0
        if self.cfg["crash_resets"]:
            sock = writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: when this process dies, one RST, never retransmitted
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            while True:
                idle = self.cfg["idle_close_s"] or None
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                except asyncio.TimeoutError:
                    return  # idle keep-alive connection: close it (FIN)
                nth += 1
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                hdrs = {}
                for ln in lines[1:]:
                    if ":" in ln:
                        k, v = ln.split(":", 1)
                        hdrs[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(hdrs.get("content-length", "0") or 0))
                key = self.cfg["api_key"]
                if key and path.startswith("/v1/") and hdrs.get("authorization") != f"Bearer {key}":
                    # vllm serve --api-key: /v1/* needs the key (/health does not)
                    self.log.append({"path": path, "status": 401})
                    await self.send(writer, 401, b'{"error":"Unauthorized"}')
                    continue
                if path == "/v1/completions" and method == "POST":
                    self._advance()
                    self.handling += 1
                    try:
                        keep = await self.completion(conn, nth, hdrs, body, writer)
                    finally:
                        self._advance()
                        self.handling -= 1
                else:
                    keep = await self.other(method, path, body, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def send(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json") -> None:
        phrase = PHRASES.get(status, "Status")
        head = f"HTTP/1.1 {status} {phrase}\r\ncontent-length: {len(body)}\r\n"
        if body:
            head += f"content-type: {ctype}\r\n"
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()

    @staticmethod
    def reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def completion(self, conn: int, nth: int, hdrs: dict[str, str], raw: bytes,
                         writer: asyncio.StreamWriter) -> bool:
        from shardserver.engine_sim import FaultRule, SimConfig, SimRequestError, render_completion

        cfg = self.cfg
        try:
            req = json.loads(raw)
        except ValueError:
            req = None
        entry = {"conn": conn, "nth": nth, "request_id": hdrs.get("x-request-id"), "t": time.monotonic(),
                 "request": req, "action": "ok"}
        self.log.append(entry)
        if cfg["reset_reused"] and nth > 1:
            entry["action"] = "reset"
            self.reset(writer)
            return False
        if cfg["drop_before_response"] > 0:
            cfg["drop_before_response"] -= 1
            entry["action"] = "drop"
            if cfg["drop_how"] == "reset":
                self.reset(writer)
            else:
                writer.close()
            return False
        status = self._status_now()
        if status is not None:
            entry["action"] = "status"
            kind = cfg["status_body"]
            if kind == "empty":
                await self.send(writer, status, b"")
            elif kind == "router":
                await self.send(writer, status, b"No available workers (all circuits open or unhealthy)",
                                "text/plain; charset=utf-8")
            elif kind == "proxy":
                title = f"{status} {PHRASES.get(status, 'Error')}"
                await self.send(writer, status, f"<html>\r\n<head><title>{title}</title></head>\r\n"
                                f"<body>\r\n<center><h1>{title}</h1></center>\r\n"
                                "<hr><center>nginx/1.22.1</center>\r\n</body>\r\n</html>\r\n".encode(), "text/html")
            elif kind == "auth":  # vLLM's --api-key middleware (AuthenticationMiddleware)
                await self.send(writer, status, b'{"error":"Unauthorized"}')
            elif kind == "engine_dead":  # vLLM's EngineDeadError handler: the engine core process died
                msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
                await self.send(writer, status, json.dumps(
                    {"error": {"message": msg, "type": "InternalServerError", "param": None, "code": status}},
                    separators=(",", ":")).encode())
            elif kind in ("router_send", "router_read"):
                what = ("Request failed: error sending request for url (http://10.0.0.7:8000/v1/completions)"
                        if kind == "router_send" else "Failed to get response body: error decoding response body")
                await self.send(writer, status, what.encode(), "text/plain; charset=utf-8")
            else:
                msg = "The engine is currently busy and cannot accept new requests."
                await self.send(writer, status, json.dumps(
                    {"error": {"message": msg, "type": "Service Unavailable", "param": None, "code": status}},
                    separators=(",", ":")).encode())
            return True
        if cfg["max_running"]:
            # vLLM's scheduler: at most max_running requests generate at once (max_num_seqs, the
            # KV cache); the others wait in its queue, first come first served.
            if self.running is None:
                self.running = asyncio.Semaphore(cfg["max_running"])
            async with self.running:
                entry["started"] = time.monotonic()
                await asyncio.sleep(cfg["delay_s"])
        elif cfg["delay_s"]:
            await asyncio.sleep(cfg["delay_s"])
        sim = SimConfig.from_mapping({"model_name": cfg["model"], "max_model_len": cfg["max_model_len"]})
        override = None
        singled = cfg["abort_prompt"] is not None and cfg["abort_prompt"] in ((req or {}).get("prompt") or [])
        if cfg["abort"] > 0 or singled:
            if not singled:
                cfg["abort"] -= 1
            entry["action"] = "abort"
            override = FaultRule(kind="finish_reason", finish_reason="abort")
        rid = hdrs.get("x-request-id")
        if cfg["script"]:
            out = scripted_body(req or {}, cfg["script"], cfg["model"], "cmpl-" + (rid or "x"))
            await self.send(writer, 200, json.dumps(out, separators=(",", ":")).encode())
            return True
        try:
            body = render_completion(req or {}, sim, request_id=("cmpl-" + rid) if rid else None,
                                     finish_override=override)
        except SimRequestError as err:
            entry["action"] = "error"
            await self.send(writer, err.status, err.body)
            return True
        if cfg["truncate"] > 0:
            cfg["truncate"] -= 1
            entry["action"] = "truncate"
            head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body[: len(body) // 2])
            await writer.drain()
            writer.close()
            return False
        if cfg["garble"] > 0:
            cfg["garble"] -= 1
            entry["action"] = "garble"
            await self.send(writer, 200, body[: len(body) // 2])  # whole by its Content-Length, broken JSON
            return True
        if cfg["pad_bytes"] > 0:
            pad, cfg["pad_bytes"] = cfg["pad_bytes"], 0
            entry["action"] = "pad"
            return await self.send_padded(writer, body, pad, cfg["pad_how"])
        await self.gather()
        await self.send(writer, 200, body)
        return True

    async def gather(self) -> None:
        """With ``gather``: wait (body rendered) until that many completions wait, then all go."""
        if self.cfg["gather"] <= 0:
            return
        go = asyncio.Event()
        self.gathered.append(go)
        if len(self.gathered) >= self.cfg["gather"]:
            for ev in self.gathered:
                ev.set()
            self.gathered = []
        await go.wait()

    @staticmethod
    async def send_padded(writer: asyncio.StreamWriter, body: bytes, pad: int, how: str) -> bool:
        """``body`` + ``pad`` spaces, chunked (1 MiB chunks, streamed) or gzip-compressed."""
        if how == "gzip":
            import zlib

            z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip container
            step = b" " * (1 << 20)
            parts = [z.compress(body)]
            for i in range(0, pad, len(step)):
                parts.append(z.compress(step[: min(len(step), pad - i)]))
            data = b"".join(parts) + z.flush()
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                         f"content-length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b" " * (1 << 20)
        for piece in [body] + [chunk[: min(len(chunk), pad - i)] for i in range(0, pad, len(chunk))]:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()  # the reader may give up (close) at any point
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def _advance(self) -> None:
        """``metrics = "live"``: the token counters grow 100 a second while completions run."""
        now = time.monotonic()
        if self.cfg["metrics"] == "live" and self.handling:
            self.tokens += 100.0 * (now - self.tokens_at)
        self.tokens_at = now

    async def other(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            await self.send(writer, 200, b"")
        elif path == "/metrics" and self.cfg["metrics"]:
            self._advance()
            m = self.cfg["model"]
            running = {"frozen": max(1, self.handling), "idle": 0}.get(self.cfg["metrics"], self.handling)
            text = (f'# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
                    f'# TYPE vllm:num_requests_running gauge\n'
                    f'vllm:num_requests_running{{engine="0",model_name="{m}"}} {float(running)}\n'
                    f'# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n'
                    f'# TYPE vllm:prompt_tokens_total counter\n'
                    f'vllm:prompt_tokens_total{{engine="0",model_name="{m}"}} 300.0\n'
                    f'vllm:prompt_tokens_created{{engine="0",model_name="{m}"}} 1.7e+09\n'
                    f'# HELP vllm:generation_tokens_total Number of generation tokens processed.\n'
                    f'# TYPE vllm:generation_tokens_total counter\n'
                    f'vllm:generation_tokens_total{{engine="0",model_name="{m}"}} {float(int(self.tokens))}\n')
            await self.send(writer, 200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            m = self.cfg["model"]
            await self.send(writer, 200, json.dumps({"object": "list", "data": [{
                "id": m, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": m, "parent": None,
                "max_model_len": self.cfg["max_model_len"], "permission": []}]}, separators=(",", ":")).encode())
        elif path == "/_fake/config" and method == "POST":
            try:
                self.set_config(json.loads(raw or b"{}"))
            except ValueError as exc:
                await self.send(writer, 400, json.dumps({"error": str(exc)}).encode())
                return True
            await self.send(writer, 200, json.dumps(self.cfg).encode())
        elif path == "/_fake/log":
            await self.send(writer, 200, json.dumps(self.log).encode())
        else:
            await self.send(writer, 404, b'{"detail":"Not Found"}')
        return True


TLS_CERT = Path(__file__).resolve().parent / "tls" / "cert.pem"
TLS_KEY = TLS_CERT.with_name("key.pem")


async def _serve(port: int, config: dict[str, Any], tls: bool = False, host: str = "127.0.0.1") -> None:
    from shardserver.engine_sim import SimConfig, render_completion

    srv = _Server(config)
    # Build the simulator's token pool now (seconds on a loaded machine), not in the first request.
    render_completion({"prompt": [1], "max_tokens": 1}, SimConfig.from_mapping(
        {"model_name": srv.cfg["model"], "max_model_len": srv.cfg["max_model_len"]}))
    ctx = None
    if tls:
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(TLS_CERT, TLS_KEY)
    server = await asyncio.start_server(srv.handle, host, port, reuse_address=True, backlog=1024, ssl=ctx)
    actual = server.sockets[0].getsockname()[1]
    print(f"fake-engine listening on {'https' if tls else 'http'}://{host}:{actual}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


# ---------------------------------------------------------------------------------------------
# Test-side handles
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _EngineProcess:
    """A child process that prints ``... listening on http://HOST:PORT`` once it serves
    (``host`` 127.0.0.1 unless a subclass says otherwise)."""

    scheme = "http"
    host = "127.0.0.1"

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "_EngineProcess":
        """Start (again) on ``self.port`` (0 the first time: pick one); wait until it serves."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=str(REPO), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if "listening on" in line and f"://{self.host}:" in line and not ready.is_set():
                    self.port = int(line.rsplit(":", 1)[1].strip().rstrip("/"))
                    ready.set()

        threading.Thread(target=pump, daemon=True, name="engine-log-pump").start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("engine did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    def kill(self) -> None:
        """SIGKILL (no goodbye on its connections beyond what the kernel does) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> "_EngineProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _http(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET",
                                     headers={"Content-Type": "application/json"})
        ctx = None
        if self.scheme == "https":
            import ssl

            ctx = ssl.create_default_context(cafile=str(TLS_CERT))
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read())


class FakeEngine(_EngineProcess):
    """This module run as a script; ``config`` keys are listed in the module docstring."""

    def __init__(self, port: int = 0, tls: bool = False, host: str = "127.0.0.1", **config: Any) -> None:
        super().__init__(port)
        self.host = host
        unknown = set(config) - set(DEFAULTS)
        assert not unknown, f"unknown fake-engine settings: {sorted(unknown)}"
        self.config = config
        self.scheme = "https" if tls else "http"

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port), "--host", self.host,
                "--config", json.dumps(self.config)] + (["--tls"] if self.scheme == "https" else [])

    def configure(self, **changes: Any) -> dict[str, Any]:
        """Change the behaviour of the running engine (and of later restarts)."""
        self.config.update(changes)
        return self._http("/_fake/config", changes)

    def log(self) -> list[dict[str, Any]]:
        """One entry per completion request received (see the module docstring)."""
        return self._http("/_fake/log")


class SimEngineProcess(_EngineProcess):
    """``shardserver engine-sim`` standalone, with ``[simulator]`` settings ``sim``."""

    def __init__(self, port: int = 0, sim: dict[str, Any] | None = None) -> None:
        super().__init__(port)
        self.sim = {"model_name": "Qwen/Qwen3-8B", **(sim or {})}
        fd, self.config_path = tempfile.mkstemp(prefix="engine-sim-", suffix=".toml")
        with os.fdopen(fd, "w") as f:
            f.write("[simulator]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.sim.items()))

    def command(self) -> list[str]:
        return [sys.executable, "-m", "shardserver.cli", "engine-sim", "--host", "127.0.0.1",
                "--port", str(self.port), "--config", self.config_path]

    def stop(self) -> None:
        super().stop()
        try:
            os.unlink(self.config_path)
        except FileNotFoundError:
            pass

    def stats(self) -> dict[str, Any]:
        return self._http("/_sim/stats")


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(REPO))
    ap = argparse.ArgumentParser(description="a misbehaving vLLM /v1/completions for fault tests")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--tls", action="store_true", help="serve HTTPS with tls/cert.pem")
    a = ap.parse_args()
    try:
        asyncio.run(_serve(a.port, json.loads(a.config), a.tls, a.host))
    except KeyboardInterrupt:
        pass
