"""JSON value types as the decoder names them in :class:`~shardserver.errors.EngineBodyError` reasons.

Shared by :mod:`shardserver.codec.decode` (simdjson proxies) and
:mod:`shardserver.codec.prompt_logprobs` (the Python objects of ``Array.as_list()``), so
both say ``"expected an object, got array"`` the same way.
"""

from __future__ import annotations

import simdjson

__all__ = ["INT32_MAX", "NUMBER", "is_int", "type_name"]

#: Largest token id (and ``cached_tokens``) the wire's int32 fields hold.
INT32_MAX = 2**31 - 1

#: Python types of a JSON number after ``as_list()`` (``bool`` is excluded by exact type checks).
NUMBER = (int, float)

_Array = simdjson.Array
_Object = simdjson.Object


def type_name(v: object) -> str:
    """The JSON type of ``v`` (a simdjson proxy or a plain Python value): ``"null"``, ``"boolean"``,
    ``"number"``, ``"string"``, ``"array"`` or ``"object"``; for anything else its Python type name."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (_Array, list)):
        return "array"
    if isinstance(v, (_Object, dict)):
        return "object"
    return type(v).__name__


def is_int(v: object) -> bool:
    """Whether ``v`` is a JSON integer (exact ``int``: ``True``/``False`` are booleans, not ints)."""
    return type(v) is int
