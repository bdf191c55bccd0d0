"""One frozen, typed configuration, built once in the supervisor.

The configuration comes from a TOML file (``configs/*.toml``) and is then
overridden from the environment. Every environment variable is read here and
nowhere else: ``SHARDSERVER_<SECTION>__<KEY>`` overrides ``[section] key``
(for example ``SHARDSERVER_SHARDS__COUNT=4``), and ``SHARDSERVER_CONFIG``
names the file when ``--config`` is not given. The built :class:`Config` is a
tree of frozen dataclasses handed to every child process at spawn.

Units are part of the key names: ``_s`` seconds, ``_bytes`` bytes.
Invalid values raise :class:`shardserver.errors.ConfigError`, whose message
names the dotted key (``shards.arena_bytes``) and the reason. Keys and types are
checked by :func:`shardserver.fields.check_fields` (shared with the simulator's
knobs); each section's ``validate`` checks the ranges.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from urllib.parse import urlsplit
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .fields import EnvText, FieldError, check_fields

__all__ = [
    "ServerConfig",
    "ShardsConfig",
    "EngineConfig",
    "FuturesConfig",
    "AuthConfig",
    "Config",
    "load_config",
    "config_from_mapping",
    "ENV_PREFIX",
    "mask_url",
    "mask_urls_in",
    "engine_base_url",
    "default_state_dir",
]

ENV_PREFIX = "SHARDSERVER_"
# engine.receive_buffer_bytes = -1: SO_RCVBUF of each http:// engine connection is this share of
# engine.pool_size (so an encoder's engine sockets hold at most 2 x 128 MiB of kernel memory),
# within RECEIVE_BUFFER_RANGE (bytes).
RECEIVE_BUFFERS_PER_ENCODER = 128 << 20
RECEIVE_BUFFER_RANGE = (64 << 10, 1 << 20)
#: engine.max_request_s when it is 0 (seconds), unless engine.timeout_s is longer.
MAX_REQUEST_DEFAULT_S = 14400.0
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP side: the listening socket and the uvicorn front-end workers."""

    host: str = "127.0.0.1"
    port: int = 8000
    front_ends: int = 2
    backlog: int = 4096
    keep_alive_s: float = 75.0
    max_request_bytes: int = 16 * MiB
    graceful_shutdown_s: float = 5.0
    # A request's headers must be complete this long after the connection opened or the
    # request's first byte arrived; its body this long after the headers (else 408 and close).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # A request's headers (request line included) may take at most this many bytes; beyond it the
    # front-end answers 431 and closes (httptools itself has no bound).
    max_header_bytes: int = 64 * 1024
    # Open client connections per front-end at which it stops accepting (lowered to the soft
    # RLIMIT_NOFILE minus a reserve); idle keep-alive connections are closed first to make room.
    max_connections: int = 4096
    access_log: bool = False
    # POST /api/v1/asample and /api/v1/retrieve_future skip FastAPI's routing (same responses,
    # less CPU; shardserver.api.app.GatewayApp). False: every request goes through FastAPI.
    fast_path: bool = True
    log_level: str = "info"
    # Secret that signs session and future IDs. Empty: the secret kept in
    # ``<state_dir>/id_secret`` (created once, 0600), so sessions survive restarts.
    # Several hosts behind one balancer must share it (docs/MULTI_HOST.md).
    id_secret: str = ""
    # This host's name in future IDs (1-16 of [a-z0-9]); with several hosts, unique per host and
    # equal to the host's server name in the HAProxy config (docs/MULTI_HOST.md).
    host_id: str = "h0"
    # Directory for state kept across restarts (the ``id_secret`` file). Empty in a file or the
    # environment means ``$XDG_STATE_HOME/shardserver`` or ``~/.local/state/shardserver``
    # (filled in by :func:`config_from_mapping`).
    state_dir: str = ""
    # True: a secret that cannot be read or created is a startup error (exit 2) instead of a
    # warning and a random per-run secret (under which sessions do not survive a restart).
    require_persistent_secret: bool = False
    # An encoder or front-end whose event loop has not beaten its heartbeat for this many seconds
    # (stopped, or its event loop blocked) is SIGKILLed and restarted by the supervisor
    # (shardserver.workers.liveness). 0: no liveness check.
    liveness_timeout_s: float = 30.0

    def validate(self) -> None:
        _check(self.port, "server.port", 0 <= self.port <= 65535, "must be 0..65535")
        _check(self.liveness_timeout_s, "server.liveness_timeout_s",
               self.liveness_timeout_s == 0 or self.liveness_timeout_s >= 1, "must be 0 (off) or >= 1")
        _check(self.front_ends, "server.front_ends", 1 <= self.front_ends <= 256, "must be 1..256")
        _check(self.backlog, "server.backlog", 1 <= self.backlog <= 65535, "must be in 1..65535 (the kernel caps it at "
               "net.core.somaxconn)")
        _check(self.keep_alive_s, "server.keep_alive_s", self.keep_alive_s > 0, "must be > 0")
        _check(self.max_request_bytes, "server.max_request_bytes", self.max_request_bytes >= 1024, "must be >= 1024")
        _check(self.graceful_shutdown_s, "server.graceful_shutdown_s", self.graceful_shutdown_s >= 0, "must be >= 0")
        _check(self.header_timeout_s, "server.header_timeout_s", self.header_timeout_s > 0, "must be > 0")
        _check(self.max_header_bytes, "server.max_header_bytes", self.max_header_bytes >= 1024, "must be >= 1024")
        _check(self.body_timeout_s, "server.body_timeout_s", self.body_timeout_s > 0, "must be > 0")
        _check(self.max_connections, "server.max_connections", self.max_connections >= 16, "must be >= 16")
        _check(self.log_level, "server.log_level", self.log_level in ("debug", "info", "warning", "error"),
               "must be one of debug, info, warning, error")
        _check(self.host_id, "server.host_id", re.fullmatch(r"[a-z0-9]{1,16}", self.host_id) is not None,
               "must be 1-16 characters of [a-z0-9]")
        _check(self.state_dir, "server.state_dir", self.state_dir == "" or os.path.isabs(self.state_dir),
               "must be an absolute path (or ~/...)")


@dataclass(frozen=True, slots=True)
class ShardsConfig:
    """Encoder workers: how many shards and how much shared memory each owns."""

    count: int = 2
    arena_bytes: int = 256 * MiB
    # Seconds the supervisor waits for a worker's READY before giving up.
    ready_timeout_s: float = 30.0
    # Per shard: futures waiting for the engine, and the engine request bytes they hold, beyond
    # which asample answers 429 (the SDK backs off and retries).
    max_pending: int = 16384
    max_pending_request_bytes: int = 512 * MiB

    def validate(self) -> None:
        _check(self.count, "shards.count", 1 <= self.count <= 256, "must be 1..256")
        _check(self.arena_bytes, "shards.arena_bytes", self.arena_bytes >= 1 * MiB, "must be >= 1 MiB (1048576)")
        _check(self.ready_timeout_s, "shards.ready_timeout_s", self.ready_timeout_s > 0, "must be > 0")
        _check(self.max_pending, "shards.max_pending", self.max_pending >= 1, "must be >= 1")
        _check(self.max_pending_request_bytes, "shards.max_pending_request_bytes",
               self.max_pending_request_bytes >= 1 * MiB, "must be >= 1 MiB (1048576)")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The inference engine (vLLM ``/v1/completions``) or the embedded simulator."""

    # Empty: start the bundled simulator inside encoder 0's supervisor (see ``[simulator]``).
    url: str = ""
    # Model name sent to the engine; empty means the sampling session's base_model.
    model: str = ""
    # The engine's API key (``vllm serve --api-key``): sent as ``Authorization: Bearer <key>`` with
    # every completion request and probe. Empty: none. A secret: masked in logs and config dumps.
    api_key: str = ""
    # One engine request, from the moment it has a connection slot (waiting for one not included):
    # past this it is given up (fails, category server) unless the engine shows it is alive: an
    # answer to another request or to a health probe (engine.health_interval_s) within the last
    # max(60 s, 3 x health_interval_s); a probe stops counting once the engine has held requests
    # with vLLM's token counters in its /metrics unmoved for unavailable_budget_s (a hung engine
    # core still answers /health). A live engine is running it or has it queued (vLLM's scheduler
    # runs max_num_seqs at once; a 32k-token generation alone can take longer than this): it
    # keeps waiting, up to max_request_s.
    timeout_s: float = 900.0
    # Longest wait for one engine request however alive the engine is (a request stuck in an engine
    # that answers everything else); >= timeout_s. 0 (the default): max(4 h, timeout_s), see
    # request_cap().
    max_request_s: float = 0.0
    connect_timeout_s: float = 5.0
    # Once an answer's first byte has arrived, silence on its connection for this long means
    # the connection is dead (a partition, a hung proxy): the request is re-forwarded like any
    # broken connection instead of waiting out timeout_s. 0: no bound (timeout_s only).
    read_idle_timeout_s: float = 60.0
    # A connection to the engine whose peer stops acknowledging (its host crashed or lost power,
    # a network partition, a pod gone behind a Service: no FIN or RST ever comes) is found dead
    # after about this long, by TCP keepalive probes while the engine generates (a request still
    # unacknowledged then is left to the kernel's retransmission limit); it is then re-forwarded
    # (engine.unavailable_budget_s) instead of waiting out timeout_s. An engine that is only slow
    # or busy is never taken for dead: its kernel acknowledges the probes. 0: off (timeout_s only).
    dead_connection_s: float = 60.0
    # Connections to the engine per encoder.
    pool_size: int = 512
    # Engine answer bodies an encoder may hold received but not yet decoded (bytes; 0 = no bound
    # besides pool_size). http:// engines: a Content-Length body that would pass it waits unread
    # in its socket (no buffer taken) until decoded ones make room; the engine calls keep
    # running. https:// engines (aiohttp) and a body larger than the budget: beyond it a
    # finished engine call is not replaced, so fewer calls run (never fewer than min(8,
    # pool_size)); below it each finished call is replaced and one more may start, up to
    # pool_size again. Bounds the answers that pile up when the engine answers faster than the
    # encoder decodes (many answers finishing at once). -1 (the default): 16 MiB for http://
    # engines (a body past it waits in the kernel at no cost; a smaller read-ahead means fewer
    # fresh receive buffers: ~100 MiB less peak PSS at S=2 in burst-32k and queue-8k, ~150 MiB
    # in soak-131k mid-size, CPU per result unchanged; benchmarks/README_load.md), 64 MiB for https://
    # (where it holds engine calls back instead). See answer_budget().
    answer_budget_bytes: int = -1
    # SO_RCVBUF of each http:// engine connection (bytes; the kernel accounts twice that); 0
    # (the default): the kernel's autotuning; -1: 128 MiB / pool_size within 64 KiB .. 1 MiB (see
    # receive_buffer()). An answer waiting unread for room in answer_budget_bytes sits in its
    # socket, with autotuning up to the whole answer (~0.65 MB at 8k tokens). Bounded, it holds
    # at most 2 x this of this host's kernel memory and a remote engine keeps the rest; an
    # admitted answer's connection is widened to 1 MiB (at most 64 per encoder) to read it at
    # speed. It costs CPU all the same (soak-131k mid-size at 64 KiB: encoder 1.33 -> 1.76 ms
    # per result), and with the engine on this host its send buffers are in the same kernel: see
    # docs/OPERATIONS.md, "Engine answers in memory", for when TCP memory runs out.
    receive_buffer_bytes: int = 0
    # Longest wait for one of the pool_size connections; then the future answers 410 (the request
    # never reached the engine) and the SDK resubmits it.
    pool_wait_s: float = 1800.0
    # Idle pooled connections are dropped after this; keep it below the engine's keep-alive
    # (vLLM/uvicorn close idle connections after 5 s), so an idle connection is never reused as
    # the engine closes it.
    pool_idle_s: float = 4.0
    # Requests the engine did not finish (refused, reset or closed connection, truncated body,
    # HTTP 408/429/503) are re-forwarded with backoff while the engine has been unavailable for
    # less than this; then they fail (category server). Long enough for vLLM to reload a model.
    unavailable_budget_s: float = 300.0
    # A 5xx may come from a request that already ran; re-forwarding it (within
    # unavailable_budget_s) is opt-in.
    retry_5xx: bool = False
    # ``finish_reason: abort`` (weights being synced) is re-forwarded at most this often.
    max_abort_resubmits: int = 2
    # A 200 whose body is not a usable completion (broken JSON, wrong lengths: a proxy's or the
    # network's corruption; vLLM never sends one) is sent again this many times before the
    # sample fails (category server): an engine whose every answer is unusable still fails.
    bad_body_resends: int = 1
    # The engine's --max-model-len (tokens): a request without max_tokens generates up to
    # max_model_len - prompt length (the SDK's "until EOS"), and its arena reservation is sized so.
    max_model_len: int = 65536
    # Largest engine response body accepted (bytes); vLLM repeats prompt logprobs in every choice.
    max_body_bytes: int = 512 * 1024 * 1024
    max_num_samples: int = 64
    # Seconds between the encoders' engine probes (GET {url}/health) for /readyz; 0 = no probing.
    health_interval_s: float = 5.0

    def validate(self) -> None:
        if self.url:
            try:
                parts = urlsplit(self.url)
                port_ok = parts.port is None or parts.port > 0
            except ValueError:
                parts, port_ok = None, False
            _check(mask_url(self.url), "engine.url",
                   parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok
                   and not parts.query and not parts.fragment,
                   "must be empty (embedded simulator) or an http(s)://host[:port][/path] URL")
        if self.url and self.api_key:
            _check("***", "engine.api_key", "@" not in urlsplit(self.url).netloc,
                   "cannot be combined with credentials in engine.url (one Authorization header per request)")
        _check("***", "engine.api_key", self.api_key.isascii() and self.api_key.isprintable()
               and self.api_key.strip() == self.api_key, "must be printable ASCII without surrounding spaces")
        _check(self.timeout_s, "engine.timeout_s", self.timeout_s > 0, "must be > 0")
        _check(self.bad_body_resends, "engine.bad_body_resends", 0 <= self.bad_body_resends <= 10, "must be 0 .. 10")
        _check(self.max_request_s, "engine.max_request_s", self.max_request_s == 0 or self.max_request_s >= self.timeout_s,
               f"must be 0 (max(14400, engine.timeout_s)) or >= engine.timeout_s ({self.timeout_s:g})")
        _check(self.connect_timeout_s, "engine.connect_timeout_s", self.connect_timeout_s > 0, "must be > 0")
        _check(self.read_idle_timeout_s, "engine.read_idle_timeout_s", self.read_idle_timeout_s >= 0, "must be >= 0")
        _check(self.dead_connection_s, "engine.dead_connection_s",
               self.dead_connection_s == 0 or 2 <= self.dead_connection_s <= 86400, "must be 0 (off) or 2 .. 86400")
        _check(self.pool_size, "engine.pool_size", self.pool_size >= 1, "must be >= 1")
        _check(self.receive_buffer_bytes, "engine.receive_buffer_bytes",
               self.receive_buffer_bytes in (-1, 0) or 4096 <= self.receive_buffer_bytes <= 1 << 30,
               "must be -1 (128 MiB / engine.pool_size), 0 (the kernel's autotuning) or 4096 .. 1073741824")
        _check(self.answer_budget_bytes, "engine.answer_budget_bytes", self.answer_budget_bytes >= -1,
               "must be >= 0, or -1 (16 MiB for http://, 64 MiB for https:// engines)")
        _check(self.pool_wait_s, "engine.pool_wait_s", self.pool_wait_s > 0, "must be > 0")
        _check(self.pool_idle_s, "engine.pool_idle_s", self.pool_idle_s > 0, "must be > 0")
        _check(self.unavailable_budget_s, "engine.unavailable_budget_s", self.unavailable_budget_s > 0,
               "must be > 0")
        _check(self.max_abort_resubmits, "engine.max_abort_resubmits", self.max_abort_resubmits >= 0, "must be >= 0")
        _check(self.max_model_len, "engine.max_model_len", self.max_model_len >= 1, "must be >= 1")
        _check(self.max_num_samples, "engine.max_num_samples", self.max_num_samples >= 1, "must be >= 1")
        _check(self.max_body_bytes, "engine.max_body_bytes", self.max_body_bytes >= 1024 * 1024, "must be >= 1 MiB")
        _check(self.health_interval_s, "engine.health_interval_s", self.health_interval_s >= 0, "must be >= 0")

    def answer_budget(self, url: str) -> int:
        """``answer_budget_bytes`` in effect for an engine at ``url`` (bytes; 0: no bound): the
        configured value, or for -1 16 MiB when ``url`` is ``http://`` and 64 MiB otherwise."""
        if self.answer_budget_bytes >= 0:
            return self.answer_budget_bytes
        return (16 if urlsplit(url).scheme == "http" else 64) * 1024 * 1024  # as EngineClient.start

    def request_cap(self) -> float:
        """``max_request_s`` in effect (seconds): the configured value, or for 0
        max(:data:`MAX_REQUEST_DEFAULT_S`, ``timeout_s``), so a ``timeout_s`` set above 4 h
        before this key existed still starts."""
        return self.max_request_s or max(MAX_REQUEST_DEFAULT_S, self.timeout_s)

    def receive_buffer(self) -> int:
        """``receive_buffer_bytes`` in effect (bytes; 0: the kernel's autotuning): the configured
        value, or for -1 ``RECEIVE_BUFFERS_PER_ENCODER / pool_size`` (a multiple of 4 KiB) within
        ``RECEIVE_BUFFER_RANGE``: 256 KiB for 512 connections, 64 KiB for 2048."""
        if self.receive_buffer_bytes >= 0:
            return self.receive_buffer_bytes
        lo, hi = RECEIVE_BUFFER_RANGE
        return max(lo, min(hi, RECEIVE_BUFFERS_PER_ENCODER // self.pool_size // 4096 * 4096))


@dataclass(frozen=True, slots=True)
class FuturesConfig:
    """Future lifetimes (TTLs) and long-poll pacing, all in seconds."""

    # The engine never answered: the future answers 410 after this (the SDK resubmits), even while
    # its engine call runs; above engine.max_request_s (the longest a call on a live engine is
    # awaited), or samples queued that long in a busy engine are resubmitted forever.
    pending_ttl_s: float = 18000.0
    # Completed but never delivered.
    completed_ttl_s: float = 1800.0
    # When a SUBMIT finds no room in the arena even after evicting delivered results, results
    # completed this long ago and still not delivered (their client crashed or left: a live SDK
    # fetches a result within seconds of its completion) are evicted, oldest first, to make room;
    # they answer 410 and an SDK still waiting resubmits. 0: never (such results hold the arena
    # until completed_ttl_s, and new samples get 429 meanwhile).
    abandoned_after_s: float = 300.0
    # Grace after delivery, so a retry after a lost response still finds the result.
    retrieved_ttl_s: float = 120.0
    # How long one retrieve_future poll is held before a 408 try_again (well under the SDK's 45 s).
    long_poll_s: float = 25.0
    # TTL sweep period.
    sweep_interval_s: float = 1.0
    # Announce POST /api/v1/retrieve_futures (the SDK's session-wide poller, tinker >= 0.26.2) in
    # /client/config (``sample_use_retrieve_futures``). The endpoint is served and the futures
    # journals are kept either way: an SDK reads /client/config once, so one that learned the
    # poller from an earlier run keeps polling. A poller-mode SDK learns of a future only from the
    # server: futures in flight when the gateway restarts or an encoder dies are kept in a
    # journal in ``server.state_dir`` and reported as failed by the next encoder of their shard
    # (the SDK then gets 410 and resubmits). Without a writable ``server.state_dir`` the gateway
    # does not announce it for the run (a WARNING): per-request polling gets 410 for lost futures.
    retrieve_futures: bool = True
    # Most completions one retrieve_futures answer lists (the rest come with the next poll).
    retrieve_futures_max_ids: int = 1024
    # Serve POST /api/v1/cancel_future and announce it in /client/dynamic_config
    # (``sample_cancel_enabled``, tinker >= 0.26): an abandoned sample stops its engine request.
    cancel_enabled: bool = True

    def validate(self) -> None:
        for f in ("pending_ttl_s", "completed_ttl_s", "retrieved_ttl_s", "sweep_interval_s"):
            v = getattr(self, f)
            _check(v, f"futures.{f}", v > 0, "must be > 0")
        _check(self.abandoned_after_s, "futures.abandoned_after_s", self.abandoned_after_s >= 0, "must be >= 0")
        _check(self.long_poll_s, "futures.long_poll_s", 0 < self.long_poll_s < 45,
               "must be > 0 and < 45 (the SDK abandons a poll after 45 s)")
        _check(self.retrieve_futures_max_ids, "futures.retrieve_futures_max_ids",
               1 <= self.retrieve_futures_max_ids <= 100_000, "must be 1..100000")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """API keys (see :mod:`shardserver.api.auth`).

    ``mode = "open"`` accepts every request (the SDK still sends a ``tml-`` key); ``mode = "keys"``
    requires one of the keys read at start from ``keys_file`` (one per line, ``#`` comments)
    and from the environment variable named by ``keys_env`` (comma-separated). The keys
    themselves never appear in the config.
    """

    mode: str = "open"
    keys_file: str = ""
    keys_env: str = "SHARDSERVER_API_KEYS"
    # With mode = "keys": the fraction of every shard's arena, pending futures and pending request
    # bytes that one key may hold; 0 = an equal share, 1 / (number of keys), set at start.
    key_share: float = 0.0

    def validate(self) -> None:
        _check(self.mode, "auth.mode", self.mode in ("open", "keys"), 'must be "open" or "keys"')
        _check(self.key_share, "auth.key_share", 0 <= self.key_share <= 1,
               "must be 0 (an equal share per key) or a fraction in (0, 1]")
        if self.keys_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.keys_env):
            # Never echo the value: it may be a key put here by mistake.
            raise ConfigError("auth.keys_env", "must be the name of an environment variable that holds the keys "
                                               "(letters, digits, _), not a key")


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration. ``simulator`` is passed to :class:`shardserver.engine_sim.SimConfig`."""

    server: ServerConfig = field(default_factory=ServerConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    futures: FuturesConfig = field(default_factory=FuturesConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    simulator: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<defaults>"

    def validate(self) -> "Config":
        for sec in (self.server, self.shards, self.engine, self.futures, self.auth):
            sec.validate()
        if self.simulator:
            from .engine_sim import SimConfig

            try:
                SimConfig.from_mapping(dict(self.simulator))
            except (ValueError, TypeError) as exc:
                raise ConfigError("simulator", str(exc)) from None
        return self

    @property
    def uses_simulator(self) -> bool:
        return self.engine.url == ""

    def replace(self, section: str, **changes: Any) -> "Config":
        """Return a copy with ``[section]`` keys changed (validated)."""
        sec = getattr(self, section)
        return dataclasses.replace(self, **{section: dataclasses.replace(sec, **changes)}).validate()

    def as_dict(self, mask_secrets: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            sec = getattr(self, name)
            d = {f.name: getattr(sec, f.name) for f in fields(sec)}
            out[name] = _mask(d) if mask_secrets else d
        out["simulator"] = _mask(dict(self.simulator)) if mask_secrets else dict(self.simulator)
        return out


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "shards": ShardsConfig,
    "engine": EngineConfig,
    "futures": FuturesConfig,
    "auth": AuthConfig,
}


# Field names whose values are secrets; ``auth.keys_file`` and ``auth.keys_env`` only name where keys are.
_SECRET_NAME_PARTS = ("secret", "password", "passwd", "token", "api_key", "apikey", "credential")


def mask_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``, for logs and error messages."""
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def mask_urls_in(text: str) -> str:
    """``text`` (e.g. an aiohttp error message) with credentials of any URL in it masked."""
    return re.sub(r"://[^/@\s]+@", "://***@", text)


def engine_base_url(url: str) -> str:
    """The engine's base URL as the gateway uses it: no trailing ``/`` and no trailing ``/v1``
    (OpenAI-style base URLs end in ``/v1``; the gateway appends ``/v1/completions`` itself)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _mask(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with secret-looking values replaced by ``"***"``: values of secret-named fields
    (``id_secret``, ``*token*``, ``*password*``, ...) and any string that looks like an API key
    (starts with ``tml-`` or is a JWT, ``eyJ...``); ``user:password@`` in URLs becomes ``***@``."""
    out = {}
    for k, v in d.items():
        kl = k.lower()
        if v not in ("", None) and not isinstance(v, bool) and any(p in kl for p in _SECRET_NAME_PARTS):
            v = "***"
        elif isinstance(v, str) and v.startswith(("tml-", "eyJ")):
            v = "***"
        elif isinstance(v, str) and "://" in v:
            v = mask_url(v)  # credentials in a URL
        elif isinstance(v, dict):
            v = _mask(v)
        out[k] = v
    return out


def _check(value: Any, key: str, ok: bool, reason: str) -> None:
    if not ok:
        raise ConfigError(key, f"{reason} (got {value!r})")


# Keys of earlier versions: naming one stops the server with what replaced it.
_REMOVED_KEYS = {
    "engine.connect_retries": "removed: requests the engine did not run are now re-forwarded with backoff "
                              "for up to engine.unavailable_budget_s seconds",
}


#: The longest duration any ``*_s`` key takes (seconds, ~31 years): past it the event loop's and
#: the kernel's timers overflow ("timestamp too large"), and no bound here needs more.
MAX_SECONDS = 1e9


def _build_section(name: str, data: Mapping[str, Any]) -> Any:
    """``[name]`` as its dataclass, or ConfigError naming ``name.key`` (unknown key, wrong type,
    a duration over :data:`MAX_SECONDS`)."""
    cls = _SECTIONS[name]
    for k in data:
        if f"{name}.{k}" in _REMOVED_KEYS:
            raise ConfigError(f"{name}.{k}", _REMOVED_KEYS[f"{name}.{k}"])
    try:
        values = check_fields(cls, data)
    except FieldError as exc:
        key = f"{name}.{exc.key}"
        if exc.problem == "unknown":
            raise ConfigError(key, f"unknown key (known: {', '.join(sorted(exc.known))})") from None
        expected = "a finite number" if exc.kind.name == "float" else exc.kind.name
        raise ConfigError(key, f"expected {expected}, got {exc.value!r}") from None
    for k, v in values.items():
        if k.endswith("_s") and isinstance(v, float) and v > MAX_SECONDS:
            raise ConfigError(f"{name}.{k}", f"must be at most {MAX_SECONDS:g} s (got {v!r})")
    return cls(**values)


def config_from_mapping(data: Mapping[str, Any], env: Mapping[str, str] | None = None,
                        source: str = "<mapping>") -> Config:
    """Build and validate a :class:`Config` from a parsed TOML mapping plus environment overrides.

    Raises:
        ConfigError: an unknown section or key, a value of the wrong type, or an invalid value.
    """
    merged: dict[str, dict[str, Any]] = {}
    for sec, body in data.items():
        if sec not in _SECTIONS and sec != "simulator":
            raise ConfigError(sec, f"unknown section (known: {', '.join(sorted([*_SECTIONS, 'simulator']))})")
        if not isinstance(body, Mapping):
            raise ConfigError(sec, "must be a table")
        merged[sec] = dict(body)
    env = os.environ if env is None else env
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        sec, _, key = var[len(ENV_PREFIX):].partition("__")
        sec, key = sec.lower(), key.lower()
        if sec not in _SECTIONS and sec != "simulator":
            raise ConfigError(f"{sec}.{key}", f"unknown section in environment variable {var}")
        merged.setdefault(sec, {})[key] = EnvText(raw)
    sim = merged.pop("simulator", {})
    # Env values for the simulator arrive as strings; numbers are parsed here, strings kept.
    sim = {k: _parse_env_scalar(v) if isinstance(v, EnvText) else v for k, v in sim.items()}
    cfg = Config(**{name: _build_section(name, merged.get(name, {})) for name in _SECTIONS},
                 simulator=sim, source=source)
    state_dir = cfg.server.state_dir or default_state_dir(env)
    if state_dir == "~" or state_dir.startswith("~/"):
        state_dir = env.get("HOME", "") + state_dir[1:]
    if state_dir != cfg.server.state_dir:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, state_dir=state_dir))
    return cfg.validate()


def default_state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where ``server.state_dir`` points when unset: ``$XDG_STATE_HOME/shardserver``, else
    ``$HOME/.local/state/shardserver`` (the XDG base-directory default), else ``""`` (no home:
    nowhere to keep state)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec ignores relative paths
        return os.path.join(xdg, "shardserver")
    home = env.get("HOME", "")
    if home and os.path.isabs(home):
        return os.path.join(home, ".local", "state", "shardserver")
    return ""


def _parse_env_scalar(v: str) -> Any:
    """An environment value for ``[simulator]``: int, float, true/false, else the plain string
    (which :class:`SimConfig` checks strictly)."""
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return str(v)


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Load ``path`` (or ``$SHARDSERVER_CONFIG``, or the built-in defaults) and apply env overrides.

    Raises:
        ConfigError: the file is missing or not valid TOML (key ``"<file>"``), or any value is invalid.
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get(ENV_PREFIX + "CONFIG") or None
    if path is None:
        return config_from_mapping({}, env, source="<defaults>")
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{p}: invalid TOML: {exc}") from None
    return config_from_mapping(data, env, source=str(p))
