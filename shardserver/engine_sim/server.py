"""The simulator's aiohttp application and how to serve it: :func:`make_app`,
:func:`start_sim`, :func:`stop_sim`, and the simulator's process, :func:`run_process`
(standalone or under the supervisor) with :func:`run_standalone`."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import signal
import socket
import time
from typing import Any, Mapping

from aiohttp import web

from ..aio import cancel_and_wait
from ..process import configure_logging, set_process_title, watch_parent
from .config import FaultRule, SimConfig
from .generate import _generate, _pool_for
from .render import _cache_key, _head, _ids_for, _render_tail
from .request import SimRequestError, _error_body, _parse_request, _Req
from .wire import _dumps

__all__ = ["make_app", "start_sim", "stop_sim", "run_process", "run_standalone", "RUNNER_KWARGS"]

logger = logging.getLogger("shardserver.engine_sim")

class _BodyCache:
    """LRU of rendered body tails, bounded by total bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: collections.OrderedDict[bytes, tuple[bytes, int]] = collections.OrderedDict()

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: bytes, value: tuple[bytes, int]) -> None:
        size = len(value[0]) + 128
        if size > self.max_bytes or key in self._d:
            return
        self._d[key] = value
        self.bytes += size
        self.shrink()

    def shrink(self) -> None:
        while self.bytes > self.max_bytes and self._d:
            _, (tail, _) = self._d.popitem(last=False)
            self.bytes -= len(tail) + 128

    def clear(self) -> None:
        self._d.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)


class _SimState:
    def __init__(self, config: SimConfig) -> None:
        self.initial = config
        self.config = config
        self.cache = _BodyCache(config.cache_max_bytes)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counter = 0
        self.rule_fired = [0] * len(self.config.faults)
        self.rule_rng = [random.Random(self.config.fault_seed * 1000003 + i) for i in range(len(self.config.faults))]
        self.stats: dict[str, Any] = {
            "requests": 0,
            "by_status": {},
            "body_bytes": 0,
            "cache_hits": 0,
            "cache_misses": 0,
            "faults": {},
            "completion_tokens": 0,
            "build_seconds": 0.0,
            "in_flight": 0,
            "aborted": 0,
        }

    def set_config(self, config: SimConfig) -> None:
        faults_changed = config.faults != self.config.faults or config.fault_seed != self.config.fault_seed
        self.config = config
        self.cache.max_bytes = config.cache_max_bytes
        self.cache.shrink()
        if faults_changed:
            self.rule_fired = [0] * len(config.faults)
            self.rule_rng = [random.Random(config.fault_seed * 1000003 + i) for i in range(len(config.faults))]

    def match(self, req: _Req, count: int) -> list[FaultRule]:
        out = []
        for i, rule in enumerate(self.config.faults):
            if rule.times is not None and self.rule_fired[i] >= rule.times:
                continue
            if rule.every_nth is not None and count % rule.every_nth != 0:
                continue
            if rule.first_token_id is not None and req.prompt_list[0] != rule.first_token_id:
                continue
            if rule.probability is not None and self.rule_rng[i].random() >= rule.probability:
                continue
            self.rule_fired[i] += 1
            out.append(rule)
        return out

    def snapshot(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["by_status"] = dict(s["by_status"])
        s["faults"] = dict(s["faults"])
        s["cache_entries"] = len(self.cache)
        s["cache_bytes"] = self.cache.bytes
        s["counter"] = self.counter
        return s


_STATE = web.AppKey("engine_sim_state", _SimState)

_STATUS_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                 501: "NotImplementedError", 503: "Service Unavailable"}
_VLLM_MESSAGES = {
    500: "Internal server error",
    503: "The engine is currently busy and cannot accept new requests. Please try again later or on a different "
         "instance.",
    501: "The model does not support Completions API",
    400: "Injected fault",
}
_ROUTER_MESSAGES = {
    422: "Failed to deserialize the JSON body into the target type: logprobs: invalid type: boolean `true`, "
         "expected u32 at line 1 column 1",
    503: "No available workers (all circuits open or unhealthy)",
    500: "Request failed: error sending request for url (http://127.0.0.1:8000/v1/completions)",
    400: "Failed to parse the request body as JSON",
}
_HTML = (b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n<body><center><h1>502 Bad Gateway"
         b"</h1></center><hr><center>nginx</center></body></html>\n")


def _json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


def _fault_response(rule: FaultRule, cfg: SimConfig) -> web.Response:
    st = rule.status
    if rule.body == "empty":
        return web.Response(status=st)
    if rule.body == "detail":
        msg = rule.message or {404: "Not Found", 405: "Method Not Allowed"}.get(st, "Not Found")
        return _json_response(st, _dumps({"detail": msg}))
    if rule.body == "router":
        msg = rule.message or _ROUTER_MESSAGES.get(st, f"injected router error {st}")
        return web.Response(status=st, text=msg, content_type="text/plain", charset="utf-8")
    err_type = _STATUS_TYPES.get(st, "InternalServerError" if st >= 500 else "BadRequestError")
    param = None
    if st == 404:
        msg = rule.message or f"The model `{cfg.model_name}-missing` does not exist."
        param = "model"
    else:
        msg = rule.message or _VLLM_MESSAGES.get(st, f"Injected fault {st}")
    return _json_response(st, _error_body(st, msg, err_type, param))


@web.middleware
async def _errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json_response(404, b'{"detail":"Not Found"}')
    except web.HTTPMethodNotAllowed:
        return _json_response(405, b'{"detail":"Method Not Allowed"}')


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[_STATE].config
    created = cfg.fixed_created
    body = {
        "object": "list",
        "data": [
            {
                "id": cfg.model_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": cfg.model_name,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }
        ],
    }
    return _json_response(200, _dumps(body))


def _count(st: _SimState, status: int, nbytes: int) -> None:
    key = str(status)
    st.stats["by_status"][key] = st.stats["by_status"].get(key, 0) + 1
    st.stats["body_bytes"] += nbytes


async def _completions(request: web.Request) -> web.StreamResponse:
    st = request.app[_STATE]
    st.stats["requests"] += 1
    st.stats["in_flight"] += 1
    try:
        return await _completions_inner(request, st)
    finally:
        st.stats["in_flight"] -= 1


async def _completions_inner(request: web.Request, st: _SimState) -> web.StreamResponse:
    """Parse, apply the matching fault rules, build (or find) the body tail, wait out the
    configured latency, then answer: a fault's response, or the body (possibly cut short)."""
    cfg = st.config
    parsed = await _read_request(request, st, cfg)
    if isinstance(parsed, web.Response):
        return parsed
    req = parsed
    st.counter += 1
    override, terminal = await _apply_fault_rules(st, req)
    key, tail, ntok = _body_tail(st, cfg, req, override)

    delay = cfg.queue_delay_s + cfg.latency_s + cfg.per_token_latency_s * ntok
    if delay > 0:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            # The client closed the connection before the answer (the runner cancels the
            # handler, see RUNNER_KWARGS): vLLM aborts such a request; so does the simulator.
            st.stats["aborted"] += 1
            raise

    if terminal is not None and terminal.kind != "truncate":
        return _terminal_response(st, terminal, cfg)
    xrid = request.headers.get("X-Request-Id")
    rid, created = _ids_for(cfg, key, ("cmpl-" + xrid) if xrid else None, None)
    return await _send_body(request, st, _head(rid, created), tail, terminal)


async def _read_request(request: web.Request, st: _SimState, cfg: SimConfig) -> _Req | web.Response:
    """The parsed request, or the 400/404 response vLLM gives for it (already counted)."""
    raw = await request.read()
    ctype = request.headers.get("Content-Type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        err = SimRequestError(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request", None)
        _count(st, 400, len(err.body))
        return _json_response(400, err.body)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        msg = getattr(exc, "msg", "JSON decode error")
        err = SimRequestError(
            400,
            "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', %d), 'msg': 'JSON decode error', "
            "'input': {}, 'ctx': {'error': %r}}" % (getattr(exc, "pos", 0) or 0, msg),
            "Bad Request",
            "body",
        )
        _count(st, 400, len(err.body))
        return _json_response(400, err.body)
    try:
        return _parse_request(obj, cfg)
    except SimRequestError as err:
        _count(st, err.status, len(err.body))
        return _json_response(err.status, err.body)


async def _apply_fault_rules(st: _SimState, req: _Req) -> tuple[FaultRule | None, FaultRule | None]:
    """Fire the rules matching this request: sleep for every ``stall``; return the first
    ``finish_reason`` rule (the override) and the first rule that decides the response."""
    override = None
    terminal = None
    for rule in st.match(req, st.counter):
        st.stats["faults"][rule.kind] = st.stats["faults"].get(rule.kind, 0) + 1
        if rule.kind == "stall":
            await asyncio.sleep(rule.stall_s)
        elif rule.kind == "finish_reason":
            override = override or rule
        elif terminal is None:
            terminal = rule
    return override, terminal


def _body_tail(st: _SimState, cfg: SimConfig, req: _Req, override: FaultRule | None) -> tuple[bytes, bytes, int]:
    """(cache key, body tail bytes, completion tokens), from the LRU or built now."""
    key = _cache_key(req, cfg, override)
    hit = st.cache.get(key) if cfg.cache_max_bytes > 0 else None
    if hit is not None:
        st.stats["cache_hits"] += 1
        tail, ntok = hit
    else:
        st.stats["cache_misses"] += 1
        t0 = time.perf_counter()
        gen = _generate(req, cfg, override)
        tail = _render_tail(gen, cfg)
        ntok = sum(c.T for c in gen.choices)
        st.stats["build_seconds"] += time.perf_counter() - t0
        if cfg.cache_max_bytes > 0:
            st.cache.put(key, (tail, ntok))
    st.stats["completion_tokens"] += ntok
    return key, tail, ntok


def _terminal_response(st: _SimState, terminal: FaultRule, cfg: SimConfig) -> web.Response:
    """The response of a ``status``, ``nan`` or ``non_json`` rule (counted)."""
    if terminal.kind == "status":
        resp = _fault_response(terminal, cfg)
        _count(st, resp.status, len(resp.body or b""))
        return resp
    if terminal.kind == "nan":
        body = _error_body(400, "Out of range float values are not JSON compliant: nan", "BadRequestError", None)
        _count(st, 400, len(body))
        return _json_response(400, body)
    _count(st, 200, len(_HTML))  # non_json
    return web.Response(status=200, body=_HTML, content_type=terminal.content_type)


async def _send_body(request: web.Request, st: _SimState, head: bytes, tail: bytes,
                     terminal: FaultRule | None) -> web.StreamResponse:
    """Send the 200 body, or, for a ``truncate`` rule, a prefix of it and close the connection."""
    total = len(head) + len(tail)
    # Head and (cached) tail go out as two writes: no copy of a multi-MB body per request.
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.content_length = total
    await resp.prepare(request)

    if terminal is not None and terminal.kind == "truncate":
        cut = terminal.truncate_bytes
        if cut is None:
            cut = int(total * terminal.truncate_fraction)
        cut = max(0, min(cut, total - 1))
        if cut:
            await resp.write(head[:cut])
            if cut > len(head):
                await resp.write(tail[: cut - len(head)])
        _count(st, 200, cut)
        transport = request.transport
        if transport is not None:
            transport.close()  # flushes what was written, then closes: the client sees a short body
        raise asyncio.CancelledError()  # keep aiohttp from finishing the response

    await resp.write(head)
    await resp.write(tail)
    await resp.write_eof()
    _count(st, 200, total)
    return resp


async def _sim_config_get(request: web.Request) -> web.Response:
    return _json_response(200, _dumps(request.app[_STATE].config.to_mapping()))


async def _sim_config_post(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    try:
        patch = json.loads(await request.read() or b"{}")
        cfg = SimConfig.from_mapping(patch, base=st.config)
    except (ValueError, TypeError) as exc:
        return _json_response(400, _error_body(400, str(exc), "BadRequestError", None))
    _pool_for(cfg)  # build the fake vocabulary and the token pool now
    st.set_config(cfg)
    return _json_response(200, _dumps(cfg.to_mapping()))


async def _sim_stats(request: web.Request) -> web.Response:
    return _json_response(200, _dumps(request.app[_STATE].snapshot()))


async def _sim_reset(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    raw = await request.read()
    try:
        opts = json.loads(raw) if raw else {}
    except ValueError:
        opts = {}
    if isinstance(opts, dict) and opts.get("restore_config"):
        st.set_config(st.initial)
    st.cache.clear()
    st.reset_counters()
    return _json_response(200, b'{"ok":true}')


# aiohttp cancels a request's handler when its client disconnects (as vLLM aborts the request).
RUNNER_KWARGS: dict[str, Any] = {"handler_cancellation": True}


def make_app(config: SimConfig | None = None) -> web.Application:
    """The simulator as an aiohttp application.

    Routes:
        ``POST /v1/completions``: vLLM 0.30 non-streaming completions (see module doc).
        ``GET /health``: 200, empty body. ``GET /v1/models``: vLLM's model list.
        ``GET|POST /_sim/config``: read / JSON-patch the :class:`SimConfig` (returns it).
        ``GET /_sim/stats``: counters: ``requests``, ``by_status`` (status string ->
            count), ``body_bytes``, ``cache_hits``, ``cache_misses``, ``cache_entries``,
            ``cache_bytes``, ``faults`` (kind -> fired), ``completion_tokens``,
            ``build_seconds``, ``in_flight``, ``aborted`` (requests whose client closed the
            connection during the latency wait: vLLM aborts those), ``counter``.
        ``POST /_sim/reset``: zero the stats and the request counter, re-seed fault
            rules, clear the cache; ``{"restore_config": true}`` also restores the
            startup config.
    Unknown paths answer FastAPI's ``{"detail":"Not Found"}``.
    """
    config = config or SimConfig()
    _pool_for(config)  # build the fake vocabulary and the token pool now, not on the first request
    app = web.Application(middlewares=[_errors_middleware], client_max_size=256 * 1024 * 1024)
    app[_STATE] = _SimState(config)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/_sim/config", _sim_config_get)
    app.router.add_post("/_sim/config", _sim_config_post)
    app.router.add_get("/_sim/stats", _sim_stats)
    app.router.add_post("/_sim/reset", _sim_reset)
    return app


async def start_sim(
    config: SimConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    sock: socket.socket | None = None,
    backlog: int = 2048,
    shutdown_timeout: float = 1.0,
) -> tuple[web.AppRunner, int]:
    """Serve the simulator on the running loop. ``port=0`` picks a free port.

    Returns ``(runner, actual_port)``; pass the runner to :func:`stop_sim`.
    ``sock``: serve on this already-bound TCP socket instead of binding ``host:port``.
    ``backlog``: the listen queue length (connections). ``shutdown_timeout`` (seconds)
    bounds how long :func:`stop_sim` waits for in-flight requests (e.g. stalled ones)
    before closing their connections.
    """
    runner = web.AppRunner(make_app(config), access_log=None, handle_signals=False,
                           shutdown_timeout=shutdown_timeout, **RUNNER_KWARGS)
    await runner.setup()
    if sock is None:
        site: web.BaseSite = web.TCPSite(runner, host, port, backlog=backlog)
    else:
        site = web.SockSite(runner, sock, backlog=backlog)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    actual = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            actual = addr[1]
            break
    return runner, actual


async def stop_sim(runner: web.AppRunner) -> None:
    """Stop serving and close every connection of a runner from :func:`start_sim`."""
    await runner.cleanup()


def run_process(config: SimConfig | Mapping[str, Any] | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                sock: socket.socket | None = None, log_level: str | None = None,
                parent_pid: int | None = None) -> None:
    """The simulator's process, ``shardserver: engine-sim``: serve on uvloop until SIGTERM, then return.

    The one entry point of both ways to run it as a process:

    * standalone (``shardserver engine-sim``, :func:`run_standalone`): binds ``host:port``
      (``port=0`` picks a free port), prints ``engine-sim listening on http://HOST:PORT``
      to stdout once it serves, and stops on SIGINT too;
    * embedded (the supervisor's spawn target when ``engine.url`` is empty): serves on
      ``sock``, the listening socket the supervisor bound; exits when ``parent_pid`` (the
      supervisor) is gone; ignores SIGINT, since Ctrl-C reaches the whole process group
      and the supervisor answers it with SIGTERM.

    Args:
        config: the knobs, or a ``[simulator]`` mapping for :meth:`SimConfig.from_mapping`
            (ValueError naming a bad key); None: the defaults.
        log_level: set up logging at this level (``server.log_level``); None leaves it alone.
    """
    set_process_title("engine-sim")
    if log_level is not None:
        configure_logging(log_level)
    if not isinstance(config, SimConfig):
        config = SimConfig.from_mapping(config or {})
    import uvloop

    try:
        uvloop.run(_serve_until_stopped(config, host, port, sock, parent_pid))
    except KeyboardInterrupt:
        pass


async def _serve_until_stopped(config: SimConfig, host: str, port: int, sock: socket.socket | None,
                               parent_pid: int | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
    if parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's; it sends SIGTERM
        stop_signals = (signal.SIGTERM,)
    for sig in stop_signals:
        loop.add_signal_handler(sig, stop.set)
    if sock is None:
        runner, actual = await start_sim(config, host, port)
        logger.info("engine-sim listening on http://%s:%d", host, actual)
        print(f"engine-sim listening on http://{host}:{actual}", flush=True)
    else:
        # The settings the embedded simulator has always had: the supervisor's listen backlog
        # and aiohttp's default 60 s drain (the supervisor kills it after 3 s anyway).
        runner, _ = await start_sim(config, sock=sock, backlog=4096, shutdown_timeout=60.0)
    watcher = None
    if parent_pid is not None:
        watcher = loop.create_task(watch_parent(parent_pid, stop.set, who="engine-sim", logger=logger),
                                   name="engine-sim-parent-watch")
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(watcher)
        for sig in stop_signals:
            loop.remove_signal_handler(sig)
        await stop_sim(runner)


def run_standalone(host: str = "127.0.0.1", port: int = 8000, config: SimConfig | None = None) -> None:
    """Run the simulator forever on uvloop (blocking) until SIGTERM or SIGINT, then exit
    cleanly. Sets the process title ``shardserver: engine-sim``. Same as
    ``run_process(config, host=host, port=port)``."""
    run_process(config, host=host, port=port)
