"""The access log: one plain line per HTTP request, only when ``server.access_log = true``.

Lines go to the logger ``shardserver.access`` at INFO, through the process's
plain stderr handler (``time level name[pid]: message``; no Rich, no colours),
whatever ``server.log_level`` is. The line is::

    <client ip:port> "<METHOD> <path>" <status> <body bytes>B <milliseconds>ms key=<fingerprint> fe=<front-end>

``key`` is the first 8 hex digits of the API key's owner fingerprint
(:func:`shardserver.api.auth.owner_fingerprint`; ``-`` in open mode): it tells keys
apart without revealing them. Query strings are not logged. uvicorn's own
access logger is left off (:class:`shardserver.metrics.HttpMetricsMiddleware`
already times every request, so the line carries the latency uvicorn's lacks).

With the access log off (the default) nothing is formatted or logged per request.
"""

from __future__ import annotations

import logging
from typing import Callable

from .auth import OWNER_SCOPE_KEY

__all__ = ["ACCESS_LOGGER", "make_access_log"]

ACCESS_LOGGER = "shardserver.access"


def make_access_log(enabled: bool, front_end: int) -> Callable[[dict, int, int, float], None] | None:
    """The ``access_log`` callback for :class:`shardserver.metrics.HttpMetricsMiddleware`, or None when off.

    Args:
        enabled: ``server.access_log``.
        front_end: this front-end's index (printed as ``fe=``).
    """
    logger = logging.getLogger(ACCESS_LOGGER)
    if not enabled:
        return None
    logger.setLevel(logging.INFO)
    info = logger.info

    def access_log(scope: dict, status: int, nbytes: int, seconds: float) -> None:
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        owner = scope.get(OWNER_SCOPE_KEY) or ""
        info('%s "%s %s" %d %dB %.1fms key=%s fe=%d', peer, scope.get("method", "-"), scope.get("path", "-"),
             status, nbytes, seconds * 1000.0, owner[:8] or "-", front_end)

    return access_log
