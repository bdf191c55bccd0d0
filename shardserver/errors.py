"""Exception hierarchy of shardserver.

Every error that crosses a process boundary is sent as a typed reply (a reason or
category plus a message, see :mod:`shardserver.messages`), never as a pickled exception; the
classes here are what each process raises locally.
"""

from __future__ import annotations

__all__ = [
    "ShardServerError",
    "ConfigError",
    "EngineBodyError",
    "EngineError",
    "SlotInvalidError",
    "EncoderDeadError",
    "ControlError",
]


class ShardServerError(Exception):
    """Base class of every error raised by shardserver."""


class ConfigError(ShardServerError):
    """An invalid configuration value.

    Attributes:
        key: the dotted config key (``"shards.arena_bytes"``) that is wrong.
        reason: why the value was rejected.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason


class EngineBodyError(ShardServerError, ValueError):
    """The engine answered 2xx with a body that is not a usable vLLM completion.

    Raised by the decoder for truncated or non-JSON bodies, error envelopes
    (``{"error": {...}}``, ``{"detail": ...}``), missing or mistyped fields,
    length mismatches between ``token_ids`` and ``token_logprobs``, NaN, and
    unknown ``finish_reason`` values.

    Attributes:
        where: JSON path of the offending value, e.g. ``"choices[1].logprobs.token_logprobs"``
            (``"$"`` for the whole body).
        reason: a short human-readable statement of what was wrong.
        category: always ``"server"``: the request itself was fine, the engine's answer was not.
    """

    category = "server"

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"bad engine body at {where}: {reason}")
        self.where = where
        self.reason = reason


class EngineError(ShardServerError):
    """The engine request failed (HTTP status >= 400, timeout, connection error).

    Attributes:
        status: HTTP status from the engine, or ``None`` for timeouts and connection errors.
        category: ``"user"`` for engine 4xx (the request was bad), ``"server"`` otherwise.
    """

    def __init__(self, message: str, *, status: int | None, category: str) -> None:
        super().__init__(message)
        self.status = status
        self.category = category


class SlotInvalidError(ShardServerError):
    """A reader found that an arena slot was freed or reused while it read it."""


class EncoderDeadError(ShardServerError):
    """The encoder process that owns a shard died; its futures are lost."""


class ControlError(ShardServerError):
    """An encoder answered a control request with an error (an ``ErrorReply``: it could not
    decode the request, or its handler failed)."""
