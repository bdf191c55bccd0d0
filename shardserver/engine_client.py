"""The encoder's pooled aiohttp client to the engine's ``/v1/completions``.

Maps every transport outcome onto :class:`shardserver.errors.EngineError` in
this one place:

============================================== ========= =============================================
outcome                                         category  what happens
============================================== ========= =============================================
connection refused / reset before sending       --        retried ``connect_retries`` times, then 410
HTTP 408, 429, 503 (queue full or timed out,    --        retried ``connect_retries`` times (backoff
admission control: the request never ran)                 0.5, 1, 2 ... 8 s), then 410
HTTP 4xx (other)                                user      failed future
HTTP 400 "Out of range float values" (NaN)      server    failed future (the request did run)
HTTP 5xx (other)                                server    failed future; retried first if ``retry_5xx``
timeout, connection broken while reading        server    failed future (the engine may have run it)
============================================== ========= =============================================

"retryable" errors (``EngineError.retryable``) never reached the engine's model: the encoder
answers the future with 410, and the SDK resubmits the sample with its own backoff, so an RL
loop rides out an engine restart or a brief overload instead of failing a training step.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from .config import EngineConfig, engine_base_url, mask_url, mask_urls_in
from .errors import EngineError

__all__ = ["EngineClient", "engine_error_message", "NEVER_RAN_STATUSES"]

_NAN_MARK = "Out of range float values are not JSON compliant"
# Statuses that mean the engine did not run the request: a router's full queue (429), its queue
# timeout (408), vLLM admission control or a router without workers (503) (spec §8.2, §11.12).
NEVER_RAN_STATUSES = (408, 429, 503)


def engine_error_message(status: int, body: bytes) -> str:
    """A one-line message for an engine error response (vLLM JSON envelope, router text, or empty)."""
    text = body[:2000].decode("utf-8", "replace").strip()
    msg = text
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                msg = err["message"]
            elif isinstance(err, str):
                msg = err
            elif "detail" in obj:
                msg = str(obj["detail"])
            elif isinstance(obj.get("message"), str):
                msg = obj["message"]
    except ValueError:
        pass
    if not msg:
        msg = "(empty body)"
    return f"engine returned HTTP {status}: {msg}"


class EngineClient:
    """Posts completion request bodies; one instance (one connection pool) per encoder.

    Args:
        cfg: the ``[engine]`` config (timeouts in seconds, pool size in connections).
        url: base URL of the engine (``http://host:port``), without ``/v1/completions``.
    """

    def __init__(self, cfg: EngineConfig, url: str) -> None:
        self.cfg = cfg
        self.url = engine_base_url(url) + "/v1/completions"
        self.display_url = mask_url(self.url)  # for messages: no credentials
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=self.cfg.pool_size, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s, sock_connect=self.cfg.connect_timeout_s)
        # aiohttp's default read buffer (64 KiB): a larger one cost more memory when many engine
        # answers arrive at once (measured with benchmarks/run_load.py --scenario queue-8k) and
        # saved no measurable CPU.
        self._session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, body: bytes, headers: dict[str, str]) -> bytes:
        """POST ``body`` (JSON bytes) and return the 2xx response body bytes.

        Raises:
            EngineError: any non-2xx status, timeout or connection failure (see module table).
        """
        assert self._session is not None, "EngineClient.start() was not called"
        hdrs = {"Content-Type": "application/json", **headers}
        attempt = 0
        while True:
            try:
                async with self._session.post(self.url, data=body, headers=hdrs) as resp:
                    limit = self.cfg.max_body_bytes
                    if resp.content_length is not None and resp.content_length > limit:
                        raise EngineError(f"engine body of {resp.content_length} bytes exceeds "
                                          f"engine.max_body_bytes={limit}", status=resp.status, category="server")
                    data = await resp.read()
                    status = resp.status
                    if len(data) > limit:
                        raise EngineError(f"engine body of {len(data)} bytes exceeds engine.max_body_bytes={limit}",
                                          status=status, category="server")
            except aiohttp.ClientConnectorError as exc:
                if attempt < self.cfg.connect_retries:
                    attempt += 1
                    await asyncio.sleep(0.05 * 2 ** attempt)
                    continue
                raise EngineError(f"cannot connect to engine at {self.display_url}: {mask_urls_in(str(exc))}", status=None,
                                  category="server", retryable=True) from None
            except asyncio.TimeoutError:
                raise EngineError(f"engine timed out after {self.cfg.timeout_s} s (engine.timeout_s)",
                                  status=None, category="server") from None
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                raise EngineError(f"engine connection broke while reading the response: {mask_urls_in(str(exc))}",
                                  status=None, category="server") from None
            except aiohttp.ClientError as exc:
                raise EngineError(f"engine request failed: {mask_urls_in(str(exc))}", status=None, category="server") from None
            if status < 400:
                return data
            never_ran = status in NEVER_RAN_STATUSES
            if (never_ran or (status >= 500 and self.cfg.retry_5xx)) and attempt < self.cfg.connect_retries:
                attempt += 1
                await asyncio.sleep(min(0.25 * 2 ** attempt, 8.0))
                continue
            msg = engine_error_message(status, data)
            # 408/429 come from a router's queue, not from a bad request; vLLM reports its own
            # NaN-serialization failure as a 400 although the request was fine (spec §4, §8.1).
            # A 404 in FastAPI's own shape ({"detail": "Not Found"}) is a wrong engine path, ours.
            wrong_path = status in (404, 405) and data[:11] == b'{"detail":"'
            user = 400 <= status < 500 and not never_ran and _NAN_MARK not in msg and not wrong_path
            raise EngineError(msg, status=status, category="user" if user else "server", retryable=never_ran)
