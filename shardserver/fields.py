"""One field checker for structured input: a mapping of named values against a dataclass.

Both the gateway's configuration (:mod:`shardserver.config`: TOML sections plus
``SHARDSERVER_<SECTION>__<KEY>`` environment variables) and the engine simulator's knobs
(:class:`shardserver.engine_sim.SimConfig` and its fault rules, from TOML or JSON) are
frozen dataclasses built from such mappings. :func:`check_fields` does the shared part:
every key must name a field, and every value must have the field's declared type
(``bool``, ``int``, ``float``, ``str``, each optionally ``| None``; other types are passed
through for the caller to check). Each caller turns a :class:`FieldError` into its own
message (the config names the dotted key in a ``ConfigError``; the simulator answers a
``ValueError``), and checks value ranges itself.

Type rules: ``bool`` is not an ``int`` or ``float``; an ``int`` is accepted for a
``float`` field and converted, and a ``float`` field takes finite numbers only (TOML's
``inf`` and ``nan`` are refused: every bound here says "none" with 0, and an infinite one
overflowed later, e.g. a TTL of ``inf`` made every ``asample`` answer 500); ``None`` only where
the type says ``| None``. A
:class:`EnvText` value (text from an environment variable) is parsed leniently:
``"1"/"true"/"yes"/"on"`` and ``"0"/"false"/"no"/"off"`` for bools, ``"4_096"`` for
ints, surrounding spaces for numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

__all__ = ["FieldKind", "FieldError", "EnvText", "field_kinds", "check_fields"]

_SCALARS = ("bool", "int", "float", "str")


@dataclasses.dataclass(frozen=True)
class FieldKind:
    """The checked type of one field: ``name`` is ``"bool"``, ``"int"``, ``"float"``,
    ``"str"`` or ``"any"`` (not checked); ``nullable`` when the type includes ``None``."""

    name: str
    nullable: bool = False


class FieldError(ValueError):
    """A mapping that does not fit the dataclass.

    Attributes:
        key: the offending key, as given (no section prefix).
        problem: ``"unknown"`` (no such field) or ``"type"`` (a value of the wrong type).
        kind: the field's :class:`FieldKind` (``None`` for an unknown key).
        value: the value given.
        known: every field name of the dataclass, in declaration order.
    """

    def __init__(self, key: str, problem: str, kind: FieldKind | None, value: Any, known: tuple[str, ...]) -> None:
        super().__init__(f"{problem} field {key!r}")
        self.key = key
        self.problem = problem
        self.kind = kind
        self.value = value
        self.known = known


class EnvText(str):
    """A value that came from an environment variable: parsed leniently ("1", "yes", "4_096")."""


def _kind_of(annotation: Any) -> FieldKind:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|")]
    nullable = "None" in parts
    rest = [p for p in parts if p != "None"]
    name = rest[0] if len(rest) == 1 and rest[0] in _SCALARS else "any"
    return FieldKind(name, nullable)


@functools.cache
def field_kinds(cls: type) -> dict[str, FieldKind]:
    """Field name -> :class:`FieldKind` of dataclass ``cls``, from its annotations."""
    return {f.name: _kind_of(f.type) for f in dataclasses.fields(cls)}


def _coerce(kind: FieldKind, value: Any) -> Any:
    """``value`` as a ``kind.name`` value; ValueError if it is not one."""
    from_env = isinstance(value, EnvText)
    if kind.name == "bool":
        if isinstance(value, bool):
            return value
        if from_env and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if from_env and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError
    if kind.name == "int":
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if from_env:
            return int(value.strip().replace("_", ""))
        raise ValueError
    if kind.name == "float":
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, (int, float)):
            number = float(value)
        elif from_env:
            number = float(value.strip())
        else:
            raise ValueError
        if not math.isfinite(number):  # TOML's inf and nan: no knob means "unbounded" by inf
            raise ValueError
        return number
    if kind.name == "str":
        if isinstance(value, str):
            return str(value)
        raise ValueError
    return value


def check_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for ``cls(**...)`` from ``data``, keys in ``data``'s order.

    Values are converted as the module docstring says (``int`` -> ``float``,
    :class:`EnvText` parsed, :class:`EnvText` strings become plain ``str``).

    Raises:
        FieldError: at the first key (in ``data``'s order) that names no field of ``cls``
            or whose value has the wrong type.
    """
    kinds = field_kinds(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        kind = kinds.get(key)
        if kind is None:
            raise FieldError(key, "unknown", None, value, tuple(kinds))
        if value is None and kind.nullable:
            out[key] = None
            continue
        try:
            out[key] = _coerce(kind, value)
        except ValueError:
            raise FieldError(key, "type", kind, value, tuple(kinds)) from None
    return out
