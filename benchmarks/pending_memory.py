"""Memory one encoder holds per pending future, beyond the engine request body (issue 11, item 4).

An ``EncoderCore`` with a real :class:`~shardserver.engine_client.EngineClient` posts to an
engine that accepts, reads and never answers, so every future stays pending. The script counts
the Python heap (``tracemalloc``) held after SUBMITs, with the request bodies allocated before
counting starts (the bodies themselves are what ``shards.max_pending_request_bytes`` bounds):

* ``running``: per future whose engine call is in flight (at most ``engine.pool_size`` of them:
  aiohttp's request, connection and task);
* ``queued``: per further future, waiting for an engine connection (entry and queue slot only).

Run: ``.venv/bin/python benchmarks/pending_memory.py [--pool 64] [--queued 2000] [--prompt 2500]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tracemalloc

from shardserver.config import config_from_mapping
from shardserver.engine_client import EngineClient
from shardserver.ids import IdSigner
from shardserver.messages import Kind, SubmitAccepted, SubmitRequest, decode_request, encode_meta
from shardserver.shm.arena import ArenaWriter, create_segment, segment_name, unlink_segment
from shardserver.workers.encoder import EncoderCore


# An engine that reads each request and never answers; prints its port, then (on stderr) how
# many request heads it read so far, one line per request. Ends with its parent's kill.
_ENGINE_CHILD = """
import asyncio, sys
n = 0
async def serve(reader, writer):
    global n
    try:
        await reader.readuntil(b"\\r\\n\\r\\n")
        n += 1
        print(n, file=sys.stderr, flush=True)
        while await reader.read(1 << 20):
            pass
    except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
        pass
async def main():
    srv = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=4096)
    print(srv.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def measure(pool: int, queued: int, prompt_tokens: int) -> dict[str, float]:
    """Bytes held per running and per queued pending future (see the module docstring)."""
    # The hung engine runs in a process of its own: only the encoder's side is counted.
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ENGINE_CHILD, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    port = int(await asyncio.wait_for(child.stdout.readline(), 30))
    name = segment_name(os.getpid(), "be0c0000", random.randrange(10**6), 0)
    create_segment(name, 64 << 20)
    arena = ArenaWriter(name)
    cfg = config_from_mapping({"shards": {"count": 1}, "engine": {"url": f"http://127.0.0.1:{port}",
                                                                  "pool_size": pool, "timeout_s": 600}}, env={})
    engine = EngineClient(cfg.engine, cfg.engine.url)
    await engine.start()
    core = EncoderCore(cfg, 0, arena, engine, IdSigner(os.urandom(16), "be0c0000"))
    prompt = [random.randrange(150_000) for _ in range(prompt_tokens)]
    total = pool + queued
    bodies = [json.dumps({"model": "m", "prompt": prompt, "n": 1, "max_tokens": 1, "seed": i}).encode()
              for i in range(total)]
    # SUBMIT messages as a front-end sends them (decoded below, while counting, as the encoder
    # does: each decode makes its own sid str and digest bytes), 8 sampling sessions.
    sids = [f"ss-{os.urandom(40).hex()}.{os.urandom(12).hex()}" for _ in range(8)]
    metas = [encode_meta(SubmitRequest(sid=sids[i % 8], seq=i, n=1, reserve_bytes=64, digest=os.urandom(16)))
             for i in range(total)]
    marks = []
    try:
        gc.collect()
        tracemalloc.start()
        marks.append(tracemalloc.get_traced_memory()[0])
        for i, body in enumerate(bodies):
            reply = core.submit(decode_request(Kind.SUBMIT, metas[i]), body)
            assert isinstance(reply, SubmitAccepted), reply
            if i + 1 == pool:
                for _ in range(pool):  # until every running call connected and sent its request
                    if int((await asyncio.wait_for(child.stderr.readline(), 30)) or 0) >= pool:
                        break
                await asyncio.sleep(0.5)
                gc.collect()
                marks.append(tracemalloc.get_traced_memory()[0])
        await asyncio.sleep(0.5)
        gc.collect()
        marks.append(tracemalloc.get_traced_memory()[0])
        assert core.engine_calls == pool and len(core.engine_queue) == queued
    finally:
        tracemalloc.stop()
        core.close()
        await asyncio.sleep(0.1)
        await engine.close()
        arena.close()
        unlink_segment(name)
        child.kill()
        await child.wait()
    return {"body_bytes": sum(map(len, bodies)) / total, "running": (marks[1] - marks[0]) / pool,
            "queued": (marks[2] - marks[1]) / queued}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool", type=int, default=64, help="engine.pool_size (running engine calls)")
    ap.add_argument("--queued", type=int, default=2000, help="pending futures beyond the pool")
    ap.add_argument("--prompt", type=int, default=2500, help="prompt tokens (the body is ~7 bytes per token)")
    args = ap.parse_args()
    import uvloop

    r = uvloop.run(measure(args.pool, args.queued, args.prompt))
    print(f"request body {r['body_bytes']:.0f} B (not counted); held beyond it: "
          f"{r['running']:.0f} B per running engine call (engine.pool_size={args.pool}), "
          f"{r['queued']:.0f} B per queued pending future ({args.queued} queued)")


if __name__ == "__main__":
    main()
