"""How vLLM writes JSON: Starlette's ``JSONResponse`` settings and the wire form of -inf.

Shared by the request errors, the renderers and the server of the simulator.
"""

from __future__ import annotations

import json
from typing import Any

_CLAMP = -9999.0  # vLLM's wire form of -inf (spec §4)


def _dumps(obj: Any) -> bytes:
    """Serialize like Starlette's ``JSONResponse.render`` (spec §2.1)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode(
        "utf-8"
    )


def _jstr(s: str) -> str:
    """JSON string literal (with quotes) exactly as ``json.dumps(ensure_ascii=False)`` writes it."""
    return json.dumps(s, ensure_ascii=False)
