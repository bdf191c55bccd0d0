"""shardserver.engine_http.EnginePool with a host name: resolved once per ``dns_ttl_s`` (not once
per new connection), one lookup shared by concurrent connects, addresses tried in order, a failed
lookup not cached. Lookups are counted by an event loop whose ``getaddrinfo`` is wrapped; the
engine is a server on 127.0.0.1 answering every request with the same bytes."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import pytest
import uvloop

from shardserver.engine_http import ConnectFailed, EnginePool

BODY = b'{"choices":[{"index":0,"token_ids":[1,2,3]}]}'
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


def _is_ip(host: Any) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class _Counting:
    """Mixin: records every ``getaddrinfo`` host name (not IP literals); answers hosts in ``fake`` with the list given
    there (or raises the exception given there), after ``delay`` seconds; other hosts resolve
    for real after the same delay."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[str] = []
        self.fake: dict[str, Any] = {}
        self.delay = 0.05  # long enough that the connects started together overlap the lookup

    async def getaddrinfo(self, host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if _is_ip(host):  # uvloop's sock_connect asks about the address; answered without a lookup
            return await super().getaddrinfo(host, port, *args, **kw)
        self.lookups.append(host)
        await asyncio.sleep(self.delay)
        answer = self.fake.get(host)
        if isinstance(answer, BaseException):
            raise answer
        if answer is not None:
            return answer
        return await super().getaddrinfo(host, port, *args, **kw)


class CountingAsyncioLoop(_Counting, asyncio.SelectorEventLoop):
    pass


class CountingUvloop(_Counting, uvloop.Loop):
    pass


@pytest.fixture(params=[CountingAsyncioLoop, CountingUvloop], ids=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Any:
    """Run a coroutine function (called with its loop, bounded at 20 s) on a counting loop of
    the test's parameter: the encoders run uvloop."""
    def runner(fn: Any) -> Any:
        with asyncio.Runner(loop_factory=request.param) as r:
            return r.run(asyncio.wait_for(fn(r.get_loop()), 20))
    return runner


class Engine:
    """Answers every request with ``ANSWER``; counts connections."""

    def __init__(self) -> None:
        self.connections = 0

    async def __aenter__(self) -> "Engine":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for _ in range(1000):
                head = await r.readuntil(b"\r\n\r\n")
                n = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                await r.readexactly(n)
                w.write(ANSWER)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released): connects are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _addr(port: int) -> tuple:
    return (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))


def test_a_host_name_is_resolved_once_per_ttl_for_many_connections(run: Any) -> None:
    async def main(loop: Any) -> None:
        async with Engine() as e:
            pool = EnginePool(f"http://localhost:{e.port}/v1/completions", connect_timeout_s=5.0,
                              idle_s=30.0, dns_ttl_s=1.0)
            # 40 connections opened together (fresh: each request on a new one): one lookup.
            got = await asyncio.gather(*(pool.post(b"{}", {}, limit=1 << 20, fresh=True) for _ in range(40)))
            assert [(status, bytes(body)) for status, body, _ in got] == [(200, BODY)] * 40
            assert e.connections == 40 and loop.lookups == ["localhost"]
            for _ in range(5):  # one after the other, within the TTL: the cached addresses
                status, body, reused = await pool.post(b"{}", {}, limit=1 << 20, fresh=True)
                assert (status, bytes(body), reused) == (200, BODY, False)
            assert e.connections == 45 and loop.lookups == ["localhost"]
            await asyncio.sleep(1.1)  # past the TTL: resolved again, once
            await asyncio.gather(*(pool.post(b"{}", {}, limit=1 << 20, fresh=True) for _ in range(3)))
            assert e.connections == 48 and loop.lookups == ["localhost"] * 2
            await pool.close()
    run(main)


def test_addresses_are_tried_in_order_and_all_refused_names_the_last(run: Any) -> None:
    async def main(loop: Any) -> None:
        async with Engine() as e:
            refused1, refused2 = _closed_port(), _closed_port()
            loop.fake["engine.test"] = [_addr(refused1), _addr(e.port)]
            pool = EnginePool("http://engine.test:8000/v1/completions", connect_timeout_s=5.0, idle_s=30.0)
            status, body, _ = await pool.post(b"{}", {}, limit=1 << 20)
            assert (status, bytes(body), e.connections) == (200, BODY, 1)  # the second address
            await pool.close()
            loop.fake["engine.test"] = [_addr(e.port), _addr(refused1)]
            pool = EnginePool("http://engine.test:8000/v1/completions", connect_timeout_s=5.0, idle_s=30.0)
            await pool.post(b"{}", {}, limit=1 << 20)
            assert e.connections == 2
            await pool.close()
            loop.fake["dead.test"] = [_addr(refused1), _addr(refused2)]
            pool = EnginePool("http://dead.test:8000/v1/completions", connect_timeout_s=5.0, idle_s=30.0)
            with pytest.raises(ConnectFailed) as exc:
                await pool.post(b"{}", {}, limit=1 << 20)
            assert str(exc.value) == f"dead.test (127.0.0.1 port {refused2}): Connection refused"
            assert e.connections == 2
            await pool.close()
    run(main)


def test_a_failed_lookup_is_connect_failed_and_not_cached(run: Any) -> None:
    async def main(loop: Any) -> None:
        loop.fake["engine.invalid"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        pool = EnginePool("http://engine.invalid:8000/v1/completions", connect_timeout_s=5.0, idle_s=30.0)
        for attempt in (1, 2):
            with pytest.raises(ConnectFailed) as exc:
                await pool.post(b"{}", {}, limit=1 << 20)
            assert str(exc.value) == "cannot resolve 'engine.invalid': [Errno -2] Name or service not known"
            assert loop.lookups == ["engine.invalid"] * attempt  # asked again: failures are not cached
        # Concurrent connects share the one lookup in flight, and its failure.
        got = await asyncio.gather(*(pool.post(b"{}", {}, limit=1 << 20) for _ in range(5)),
                                   return_exceptions=True)
        assert [type(g) for g in got] == [ConnectFailed] * 5 and loop.lookups == ["engine.invalid"] * 3
        await pool.close()
    run(main)


def test_a_lookup_slower_than_the_connect_timeout_keeps_the_timeout_message(run: Any) -> None:
    async def main(loop: Any) -> None:
        async with Engine() as e:
            loop.fake["slow.test"] = [_addr(e.port)]
            loop.delay = 0.5
            pool = EnginePool("http://slow.test:8000/v1/completions", connect_timeout_s=0.2, idle_s=30.0)
            with pytest.raises(ConnectFailed, match=r"^connect timeout after 0.2 s \(engine.connect_timeout_s\)$"):
                await pool.post(b"{}", {}, limit=1 << 20)
            await asyncio.sleep(0.4)  # the lookup went on for the next connect, which uses its answer
            loop.delay = 5.0
            status, _, _ = await pool.post(b"{}", {}, limit=1 << 20)
            assert status == 200 and loop.lookups == ["slow.test"] and e.connections == 1
            await pool.close()
    run(main)


def test_an_ip_literal_is_never_resolved(run: Any) -> None:
    async def main(loop: Any) -> None:
        async with Engine() as e:
            pool = EnginePool(f"http://127.0.0.1:{e.port}/v1/completions", connect_timeout_s=5.0, idle_s=30.0)
            await asyncio.gather(*(pool.post(b"{}", {}, limit=1 << 20, fresh=True) for _ in range(3)))
            assert e.connections == 3 and loop.lookups == []
            await pool.close()
    run(main)
