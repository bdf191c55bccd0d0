"""A minimal HTTP/1.1 keep-alive client on raw asyncio streams, for the front-end robustness tests.

It exists so that a test can tell apart what ``http.client`` and the SDK blur together: a
connection refused at connect time (the server stopped listening: clean), a connection reset or
closed after a request was sent and before its response was complete (a *reset*: the failure the
tests count), and a clean ``Connection: close`` after a complete response.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConnectionBroken", "RawResponse", "RawConnection", "open_result_poll"]


class ConnectionBroken(Exception):
    """The connection was reset or closed after the request was (partly) sent and before the
    whole response arrived. ``got`` is how many response bytes had arrived (0: none)."""

    def __init__(self, why: str, got: int) -> None:
        super().__init__(f"{why} after {got} response bytes")
        self.why, self.got = why, got


@dataclass
class RawResponse:
    """One complete response: status code, headers (lower-cased names), body bytes."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def closes(self) -> bool:
        """True when the server said it closes the connection after this response."""
        return "close" in self.headers.get("connection", "").lower()

    def json(self) -> Any:
        return json.loads(self.body)


class RawConnection:
    """One keep-alive TCP connection to ``host:port`` speaking HTTP/1.1 by hand.

    ``connect`` raises ``ConnectionRefusedError`` (or another ``OSError``) when nobody listens;
    ``request`` raises :class:`ConnectionBroken` when the exchange is cut, and marks the
    connection unusable after a ``Connection: close`` answer (``usable`` is False then).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.usable = False

    async def connect(self, timeout: float = 5.0) -> None:
        self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout)
        self.usable = True

    def close(self) -> None:
        self.usable = False
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float = 60.0) -> RawResponse:
        """Send one request and read its whole response (Content-Length bodies only)."""
        assert self.reader is not None and self.writer is not None and self.usable
        hdrs = {"Host": f"{self.host}:{self.port}", "Content-Type": "application/json", **(headers or {})}
        if body is not None:
            hdrs["Content-Length"] = str(len(body))
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
        got = 0
        try:
            self.writer.write(head.encode() + (body or b""))
            await self.writer.drain()
            raw_head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            got = len(raw_head)
            lines = raw_head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            rh: dict[str, str] = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    rh[k.strip().lower()] = v.strip()
            n = int(rh.get("content-length", "0"))
            data = await asyncio.wait_for(self.reader.readexactly(n), timeout) if n else b""
        except asyncio.IncompleteReadError as exc:
            self.close()
            raise ConnectionBroken("closed", got + len(exc.partial)) from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            self.close()
            raise ConnectionBroken(type(exc).__name__, got) from None
        resp = RawResponse(status, rh, data)
        if resp.closes:
            self.close()
        return resp

    async def closed_by_peer(self) -> bool:
        """True if the server has already closed this idle connection (what an HTTP client checks
        before reusing a pooled connection)."""
        await asyncio.sleep(0)
        return self.reader is None or self.reader.at_eof() or self.writer is None or self.writer.is_closing()


def open_result_poll(port: int, rid: str, rcvbuf: int = 16 * 1024) -> tuple[socket.socket, int, bytes]:
    """Send ``retrieve_future`` for ``rid`` (proto) on a fresh blocking socket to 127.0.0.1:``port``
    whose receive buffer is ``rcvbuf`` bytes, and read up to the end of the 200 response's headers.

    Returns ``(socket, announced Content-Length in bytes, body bytes that came with the headers)``;
    the caller reads the rest (or not) and closes the socket. Raises AssertionError when the
    status is not 200 or the headers do not arrive within 1000 reads.
    """
    body = json.dumps({"request_id": rid}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Accept: application/x-protobuf\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    for _ in range(1000):
        if b"\r\n\r\n" in data:
            break
        data += s.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), head
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    return s, length, rest
