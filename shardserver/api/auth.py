"""API-key authentication and key-bound ownership of IDs.

The SDK sends ``X-API-Key: <key>`` on every request (keys start with ``tml-``;
see ``tinker_sdk_protocol.md`` §2). Two modes (``[auth] mode``):

* ``"open"`` (demo): every request is accepted, with or without a key, and the
  owner of every ID is ``""``. Keys are not checked, so binding IDs to them
  would add no security (anyone may send any key) and would only make a
  future unreadable from a tool that uses another key; the 128 random bits of
  a future ID already make it unguessable.
* ``"keys"`` (production): a request must carry one of the configured keys,
  else 401 ``{"error": ...}`` (the SDK raises ``AuthenticationError`` when
  this happens on its setup calls). The request's *owner* is a 16-hex-digit
  BLAKE2b fingerprint of its key; it is mixed into the MAC of every session,
  sampling-session and future ID minted for that request
  (:class:`shardserver.ids.IdSigner`), so another key presenting the ID is
  answered exactly like an unknown ID (404). The fingerprint depends only on
  the key, so with the ID secret kept across restarts (``server.id_secret`` or the
  ``id_secret`` file in ``server.state_dir``), IDs stay valid across restarts.

Keys are read once, in the supervisor (:func:`load_key_table`), from the file
``auth.keys_file`` (one key per line, ``#`` comments, blank lines ignored)
and from the environment variable named by ``auth.keys_env``
(comma-separated). The children receive a :class:`KeyTable`, which holds only
salted digests of the keys, never the keys themselves. No key is ever logged.

:class:`AuthMiddleware` is a plain ASGI middleware (no Starlette
``BaseHTTPMiddleware``, so no extra task per request). ``/healthz``,
``/readyz`` and ``/metrics`` need no key. Per request it costs one header
scan and, in ``keys`` mode, one BLAKE2b of the key and one dict lookup
(about 1-2 µs).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from ..config import AuthConfig
from ..errors import ConfigError

__all__ = [
    "KEY_PREFIX",
    "MIN_KEY_CHARS",
    "OWNER_SCOPE_KEY",
    "PUBLIC_PATHS",
    "KeyTable",
    "load_key_table",
    "read_keys_file",
    "owner_fingerprint",
    "owner_of",
    "AuthMiddleware",
]

log = logging.getLogger("shardserver.auth")

KEY_PREFIX = "tml-"
# Characters required after the prefix: keys should carry >= 96 random bits (e.g. token_urlsafe(32)).
MIN_KEY_CHARS = 16
# The ASGI scope key under which the middleware leaves the request's owner string.
OWNER_SCOPE_KEY = "shardserver.owner"
# Paths served without a key (probes and scrapes).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
API_KEY_HEADER = b"x-api-key"


def owner_fingerprint(key: str) -> str:
    """The owner string of an API key: 16 hex digits (64 bits) of an unkeyed, personalized BLAKE2b.

    Deterministic (the same key gives the same owner in every process and run), and useless
    for recovering the key. Also printed as ``key=<first 8 digits>`` in access-log lines.
    """
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"shardsrv-owner").hexdigest()


@dataclass(frozen=True)
class KeyTable:
    """The accepted keys as salted digests, picklable for the spawn of a front-end.

    Attributes:
        mode: ``"open"`` or ``"keys"`` (``auth.mode``).
        salt: 16 random bytes per run; the digests are BLAKE2b-256 keyed with it.
        digests: digest of each accepted key -> that key's owner fingerprint.
        sources: where the keys came from (file path, ``$VAR``), for messages; never the keys.
    """

    mode: str = "open"
    salt: bytes = b""
    digests: Mapping[bytes, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    @classmethod
    def open(cls) -> "KeyTable":
        """A table that accepts every request (``auth.mode = "open"``)."""
        return cls()

    @classmethod
    def from_keys(cls, keys: list[str], sources: tuple[str, ...] = ()) -> "KeyTable":
        """A ``keys``-mode table accepting exactly ``keys``."""
        salt = os.urandom(16)
        return cls(mode="keys", salt=salt,
                   digests={_digest(salt, k): owner_fingerprint(k) for k in keys}, sources=sources)

    def __len__(self) -> int:
        return len(self.digests)

    def __repr__(self) -> str:  # never show digests in logs or tracebacks
        return f"KeyTable(mode={self.mode!r}, keys={len(self.digests)}, sources={self.sources!r})"

    def owner(self, key: str | None) -> str | None:
        """The owner string for a request carrying ``key`` (None: no ``X-API-Key`` header).

        Returns ``""`` in open mode, the key's fingerprint when it is accepted, and None
        when it is not (the caller answers 401).

        Timing: the presented key is never compared with a stored key. It is hashed with
        BLAKE2b keyed by this run's secret salt, and that digest is looked up in a dict of the
        stored keys' digests. What the lookup's timing depends on (the digest's hash and
        bytes) is unknown to a client that does not hold the salt, so the check is as safe as
        a constant-time comparison, at O(1) cost (about 1 µs) for any number of keys.
        """
        if self.mode != "keys":
            return ""
        if not key:
            return None
        return self.digests.get(_digest(self.salt, key))


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.blake2b(key.encode(), key=salt, digest_size=32).digest()


def _check_key(key: str, where: str, cfg_key: str) -> None:
    if not key.startswith(KEY_PREFIX):
        raise ConfigError(cfg_key, f"{where}: an API key must start with {KEY_PREFIX!r} "
                                   "(the tinker SDK refuses any other key)")
    if len(key) - len(KEY_PREFIX) < MIN_KEY_CHARS:
        raise ConfigError(cfg_key, f"{where}: an API key needs at least {MIN_KEY_CHARS} characters after "
                                   f"{KEY_PREFIX!r} (generate one with: python -c \"import secrets; "
                                   f"print('tml-' + secrets.token_urlsafe(32))\")")
    if any(c.isspace() or c == "," for c in key):
        raise ConfigError(cfg_key, f"{where}: an API key must not contain whitespace or commas")
    if not (key.isascii() and key.isprintable()):
        raise ConfigError(cfg_key, f"{where}: an API key must be printable ASCII (it travels in the X-API-Key "
                                   "header, which the SDK sends as ASCII)")


def read_keys_file(path: str) -> list[str]:
    """The keys of a keys file: one per line; blank lines and lines starting with ``#`` are skipped,
    and so is anything after `` #`` on a line.

    Raises:
        ConfigError: (key ``auth.keys_file``) the file cannot be read, or a line is not a valid key
            (must start with ``tml-``, then >= 16 characters, printable ASCII, no whitespace or
            commas). A UTF-8 byte-order mark at the start is ignored. The
            message names the line number, never the key.
    """
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is not a key
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError("auth.keys_file", f"file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("auth.keys_file", f"cannot read {path!r}: {exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("API keys file %s is readable by group or others (mode %o); chmod 600 it",
                    path, stat.S_IMODE(st.st_mode))
    keys = []
    for i, line in enumerate(lines, 1):
        s = line.split(" #", 1)[0].strip()
        if not s or s.startswith("#"):
            continue
        _check_key(s, f"{path} line {i}", "auth.keys_file")
        keys.append(s)
    return keys


def load_key_table(cfg: AuthConfig, env: Mapping[str, str] | None = None) -> KeyTable:
    """Read the API keys named by ``cfg`` once (in the supervisor) and return the children's table.

    ``open`` mode reads nothing. ``keys`` mode reads ``cfg.keys_file`` (when not empty) and the
    environment variable ``cfg.keys_env`` (when set; comma-separated keys) and accepts the union.

    Raises:
        ConfigError: ``auth.keys_file``: the file is missing or unreadable or holds an invalid key,
            or mode is ``keys`` and neither source gives a key; ``auth.keys_env``: the variable
            holds an invalid key.
    """
    if cfg.mode != "keys":
        return KeyTable.open()
    env = os.environ if env is None else env
    keys: list[str] = []
    sources: list[str] = []
    if cfg.keys_file:
        file_keys = read_keys_file(cfg.keys_file)
        keys += file_keys
        sources.append(cfg.keys_file)
    raw = env.get(cfg.keys_env, "") if cfg.keys_env else ""
    env_keys = [k.strip() for k in raw.split(",") if k.strip()]
    for i, k in enumerate(env_keys, 1):
        _check_key(k, f"${cfg.keys_env} entry {i}", "auth.keys_env")
    if env_keys:
        keys += env_keys
        sources.append(f"${cfg.keys_env}")
    if not keys:
        where = []
        where.append(f"file {cfg.keys_file!r} has no keys" if cfg.keys_file else "no file is set")
        where.append(f"${cfg.keys_env} is unset or empty" if cfg.keys_env else "auth.keys_env is empty")
        raise ConfigError("auth.keys_file", 'auth.mode = "keys" but no API key is configured ('
                          + "; ".join(where) + ")")
    table = KeyTable.from_keys(sorted(set(keys)), tuple(sources))
    log.info("auth: %d API keys loaded from %s", len(table), ", ".join(sources))
    return table


def owner_of(request: Any) -> str:
    """The owner string :class:`AuthMiddleware` found for this request (``""`` in open mode).

    ``request`` is a Starlette ``Request`` (anything with a ``scope`` mapping).
    """
    return request.scope.get(OWNER_SCOPE_KEY, "")


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def _unauthorized(message: str, extra_headers: list[tuple[bytes, bytes]]) -> tuple[dict, dict]:
    body = json.dumps({"error": message}).encode()
    start = {"type": "http.response.start", "status": 401,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"www-authenticate", b'ApiKey header="X-API-Key"'), *extra_headers]}
    return start, {"type": "http.response.body", "body": body}


MISSING_KEY_MESSAGE = ("missing API key: send it in the X-API-Key header "
                       "(tinker.ServiceClient(api_key=...) or $TINKER_API_KEY)")
#: api.common.CONNECTION_SCOPE_KEY (not imported from there: the supervisor loads this module,
#: and that one imports FastAPI); tests/unit/test_imports.py checks that they agree.
CONNECTION_SCOPE_KEY = "shardserver.connection"
#: A retrieve_future refused for the key's connection share is answered 408 try_again after this
#: many seconds (its connection is closed after).
TOO_MANY_POLL_WAIT_S = 1.0
RETRIEVE_FUTURE_PATH = "/api/v1/retrieve_future"
TOO_MANY_CONNECTIONS_MESSAGE = ("this API key holds its share of this server's connections (auth.key_share of "
                                "server.max_connections): close idle connections or retry")
INVALID_KEY_MESSAGE = "invalid API key: it is not one of this server's keys (auth.keys_file / auth.keys_env)"


class AuthMiddleware:
    """ASGI middleware: checks ``X-API-Key`` and leaves the owner in ``scope[OWNER_SCOPE_KEY]``.

    Args:
        app: the wrapped ASGI app.
        table: the accepted keys (:meth:`KeyTable.open` accepts everything).
        headers: extra response headers for the 401 answers, as ``(bytes, bytes)`` pairs.
        on_reject: called with ``"missing"`` or ``"invalid"`` for every 401 (metrics).
    """

    def __init__(self, app: ASGIApp, table: KeyTable | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.table = table or KeyTable.open()
        self._extra = list(headers or [])
        self._on_reject = on_reject
        self._missing = _unauthorized(MISSING_KEY_MESSAGE, self._extra)
        self._invalid = _unauthorized(INVALID_KEY_MESSAGE, self._extra)
        body = json.dumps({"error": TOO_MANY_CONNECTIONS_MESSAGE}).encode()
        self._too_many = ({"type": "http.response.start", "status": 429,
                           "headers": [(b"content-type", b"application/json"),
                                       (b"content-length", str(len(body)).encode()), (b"retry-after", b"1"),
                                       (b"connection", b"close"), *self._extra]},
                          {"type": "http.response.body", "body": body})
        # The same refusal for a retrieve_future: the SDK's "not ready yet, poll again" (SDK 0.15
        # raises on a 429 there and the sample fails; it polls again after a 408), given after
        # TOO_MANY_POLL_WAIT_S so that its next poll does not follow at once.
        body = json.dumps({"type": "try_again", "queue_state": "paused_capacity",
                           "queue_state_reason": TOO_MANY_CONNECTIONS_MESSAGE}).encode()
        self._too_many_poll = ({"type": "http.response.start", "status": 408,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                                            *self._extra]},
                               {"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http" or self.table.mode != "keys" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        key = None
        for name, value in scope["headers"]:
            if name == API_KEY_HEADER:
                key = value.decode("latin-1").strip()
                break
        owner = self.table.owner(key)
        if owner is None:
            reason = "missing" if not key else "invalid"
            if self._on_reject is not None:
                self._on_reject(reason)
            start, body = self._missing if reason == "missing" else self._invalid
            await send(start)
            await send(body)
            return
        scope[OWNER_SCOPE_KEY] = owner
        conn = scope.get(CONNECTION_SCOPE_KEY)
        if conn is not None and conn.owner != owner and not conn.claim(owner):
            if self._on_reject is not None:
                self._on_reject("connections")
            conn.cycle.keep_alive = False  # answered, then closed: the key's count goes down
            answer = self._too_many
            if scope["path"] == RETRIEVE_FUTURE_PATH:
                answer = self._too_many_poll
                conn.doom()  # closed at once if the front-end needs the slot meanwhile
                await asyncio.sleep(TOO_MANY_POLL_WAIT_S)
            await send(answer[0])
            await send(answer[1])
            return
        await self.app(scope, receive, send)
