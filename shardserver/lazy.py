"""Module attributes that load their submodule on first use (PEP 562).

Used by packages whose submodules pull in heavy libraries (numpy, simdjson, aiohttp) that some
processes never need: the supervisor validates a simulator config, a front-end sizes arena
reservations, and neither should carry the imports of the code they do not run.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps an attribute name to the relative
    submodule that defines it (``".render"``). The first access imports that submodule and keeps
    the value on the package, so later accesses are plain attribute reads.

    Raises (from the returned function):
        AttributeError: ``name`` is not in ``table``.
    """

    def __getattr__(name: str) -> Any:
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
