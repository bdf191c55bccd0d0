"""Front-end CPU per HTTP request, side by side with a bare uvicorn app on the same machine
(issue 12, goal "front-end <= 0.6 ms per 32k result").

What a front-end spends on one ``retrieve_future`` of a finished result, against the floor of
the same server stack with nothing in it: a bare ASGI app on uvicorn (uvloop + httptools, the
front-ends' own loop and parser) that answers every request with 200 and a fixed body. Both
take the same request bytes, pipelined ``--depth`` deep on one keep-alive connection from this
process, so neither waits on the client; CPU is read from ``/proc/<pid>/stat`` of the one server
process (the front-end; the encoder it asks is not counted).

Runs, in one invocation (``--rounds`` times each, alternating):

* ``bare``: the bare app, 137-byte body;
* ``retrieve 16``: the gateway (S=1, F=1, bundled simulator) answering ``retrieve_future`` for a
  16-token result (137 bytes of proto): HTTP, auth, metrics, the control round trip to the
  encoder (POLL, then DELIVERED), the send from the arena;
* ``retrieve 32768``: the same for a 32768-token result (262 KB), so the difference is what
  sending the bytes costs.

Prints microseconds of server CPU per request and the ratio to ``bare``.

Run: ``.venv/bin/python benchmarks/frontend_request_cost.py [--requests 6000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

from shardserver.testing import RunningServer, http_json

BARE_BODY = b"x" * 137


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve_bare(port: int) -> None:
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(BARE_BODY)), (b"content-type", b"application/x-protobuf")]})
        await send({"type": "http.response.body", "body": BARE_BODY})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, lifespan="off")


def _request(rid: str) -> bytes:
    body = json.dumps({"request_id": rid}).encode()
    return (b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Accept: application/x-protobuf\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def pipelined(port: int, req: bytes, count: int, depth: int, pid: int, timeout_s: float = 120.0) -> float:
    """Send ``req`` ``count`` times on one connection, at most ``depth`` unanswered; every
    answer must be a 200 with a Content-Length. Returns server CPU microseconds per request."""
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    c.settimeout(timeout_s)
    try:
        cpu0, deadline = _cpu_s(pid), time.monotonic() + timeout_s
        sent = got = 0
        buf = b""
        for _ in range(min(depth, count)):
            c.sendall(req)
            sent += 1
        while got < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {count} answers within {timeout_s} s")
            chunk = c.recv(1 << 22)
            if not chunk:
                raise ConnectionError(f"closed after {got} answers")
            buf += chunk
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buf[:end]
                length = int(next(ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                                  if ln.lower().startswith(b"content-length:")))
                if len(buf) < end + 4 + length:
                    break
                if not head.startswith(b"HTTP/1.1 200 "):
                    raise AssertionError(head[:200])
                buf = buf[end + 4 + length:]
                got += 1
                if sent < count:
                    c.sendall(req)
                    sent += 1
        return (_cpu_s(pid) - cpu0) * 1e6 / count
    finally:
        c.close()


def _done_result(url: str, tokens: int, seq: int, ssid: str) -> str:
    """Submit one sample of ``tokens`` tokens and wait until it is retrievable; its request id."""
    st, _, b = http_json(url + "/api/v1/asample", {
        "sampling_session_id": ssid, "seq_id": seq, "num_samples": 1, "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": tokens, "seed": seq}})
    assert st == 200, b
    rid = json.loads(b)["request_id"]
    for _ in range(100):
        st, _, b = http_json(url + "/api/v1/retrieve_future", {"request_id": rid},
                             headers={"Accept": "application/x-protobuf"})
        if st == 200:
            return rid
        assert st == 408, b[:200]
    raise TimeoutError(f"{rid} not done")


def _front_end_pid(server: RunningServer) -> int:
    """The pid of the server's front-end (a child of its supervisor titled ``shardserver: front-end 0``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if ppid == server.proc.pid and b"front-end 0" in title:
            return int(entry)
    raise RuntimeError("front-end 0 not found among the server's children")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6000, help="requests per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternating")
    ap.add_argument("--depth", type=int, default=8, help="requests in flight on the connection")
    args = ap.parse_args()
    results: dict[str, list[float]] = {"bare": [], "retrieve 16": [], "retrieve 32768": []}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bare_port = s.getsockname()[1]
    bare = mp.get_context("spawn").Process(target=_serve_bare, args=(bare_port,), daemon=True)
    bare.start()
    env = {"SHARDSERVER_SHARDS__COUNT": "1", "SHARDSERVER_SERVER__FRONT_ENDS": "1"}
    try:
        with RunningServer(env=env) as server:
            st, _, b = http_json(server.url + "/api/v1/create_session",
                                 {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
            sid = json.loads(b)["session_id"]
            st, _, b = http_json(server.url + "/api/v1/create_sampling_session",
                                 {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "Qwen/Qwen3-8B"})
            ssid = json.loads(b)["sampling_session_id"]
            small, large = _done_result(server.url, 16, 1, ssid), _done_result(server.url, 32768, 2, ssid)
            fe = _front_end_pid(server)
            for _ in range(100):  # the bare server is up once it answers
                try:
                    pipelined(bare_port, _request("x"), 1, 1, bare.pid)
                    break
                except OSError:
                    time.sleep(0.1)
            for _ in range(args.rounds):
                results["bare"].append(pipelined(bare_port, _request("x"), args.requests, args.depth, bare.pid))
                results["retrieve 16"].append(pipelined(server.port, _request(small), args.requests, args.depth, fe))
                results["retrieve 32768"].append(pipelined(server.port, _request(large), args.requests // 2,
                                                           args.depth, fe))
    finally:
        bare.terminate()
        bare.join(10)
    floor = statistics.median(results["bare"])
    print(f"front-end CPU per request, pipelined {args.depth} deep on one connection, {os.cpu_count()} CPUs "
          f"(median of {args.rounds}; each run {args.requests} requests, 32768-token runs half as many):")
    print("| run | us CPU per request (each run) | median | x bare uvicorn |")
    print("|---|---|---|---|")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | {med:.0f} | {med / floor:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
