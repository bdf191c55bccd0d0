"""``make demo``: start the gateway on the demo config and drive it with the real tinker SDK.

Starts ``shardserver serve --config configs/demo.toml`` on a free port, creates
a sampling client with the real SDK, samples ``samples`` results of ``tokens``
tokens each with ``concurrency`` in flight, checks one result token-for-token
against what the simulator sent, prints results/s and where the work went,
then stops the server with SIGTERM and checks nothing of ours is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import statistics
import time

import numpy as np

from .testing import RunningServer, leftovers_of_started_servers

__all__ = ["run_demo", "expected_completion"]

BASE_MODEL = "Qwen/Qwen3-8B"


def expected_completion(prompt: list[int], n: int, max_tokens: int, seed: int, temperature: float = 1.0,
                        sim_cfg: dict | None = None) -> dict:
    """The simulator's body for the engine request the gateway builds from this sample call (parsed JSON)."""
    from .engine_sim import SimConfig, render_completion

    req = {"model": BASE_MODEL, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature,
           "top_p": 1.0, "top_k": -1, "logprobs": 1, "return_token_ids": True, "seed": seed}
    return json.loads(render_completion(req, SimConfig.from_mapping(sim_cfg or {})))


def run_demo(config_path: str = "configs/demo.toml", samples: int = 256, tokens: int = 4096,
             concurrency: int = 64) -> int:
    """Run the demo; returns 0 when every result arrived, matched, and nothing was left behind."""
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    print(f"shardserver demo: {samples} samples x {tokens} tokens, {concurrency} in flight, "
          f"tinker SDK {tinker.__version__}, {os.cpu_count()} cores, Python {platform.python_version()}")
    failures = 0
    with RunningServer(config_path) as server:
        print(f"gateway up at {server.url}")
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-demo")
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result()

        async def drive() -> tuple[list[float], list[object], float]:
            sem = asyncio.Semaphore(concurrency)
            latencies: list[float] = []
            results: list[object] = [None] * samples

            async def one(i: int) -> None:
                async with sem:
                    t0 = time.perf_counter()
                    prompt = types.ModelInput.from_ints([1000 + i, 17, 42, 7 + i % 5])
                    params = types.SamplingParams(max_tokens=tokens, seed=i, temperature=1.0)
                    results[i] = await sampler.sample(prompt=prompt, num_samples=1, sampling_params=params)
                    latencies.append(time.perf_counter() - t0)

            t_start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(samples)))
            return latencies, results, time.perf_counter() - t_start

        latencies, results, wall = asyncio.run(drive())
        total_tokens = sum(len(r.sequences[0].tokens) for r in results)  # type: ignore[attr-defined]
        print(f"sampled {samples} results ({total_tokens} tokens) in {wall:.2f} s: "
              f"{samples / wall:.1f} results/s, {total_tokens / wall / 1e6:.2f} M tokens/s; "
              f"latency p50 {statistics.median(latencies) * 1000:.0f} ms, "
              f"p99 {np.percentile(latencies, 99) * 1000:.0f} ms")

        # Check one result exactly against what the engine sent.
        i = samples // 2
        body = expected_completion([1000 + i, 17, 42, 7 + i % 5], 1, tokens, i)
        ch = body["choices"][0]
        seq = results[i].sequences[0]  # type: ignore[attr-defined]
        want_tokens = ch["token_ids"]
        want_lp = np.asarray(ch["logprobs"]["token_logprobs"], dtype=np.float32)
        got_lp = np.asarray(seq.logprobs, dtype=np.float32)
        ok = list(seq.tokens) == want_tokens and np.array_equal(got_lp, want_lp)
        want_stop = "length" if ch["finish_reason"] == "length" else "stop"
        ok = ok and seq.stop_reason == want_stop
        print(f"checked sample {i}: {len(seq.tokens)} tokens, first {list(seq.tokens[:5])}, "
              f"logprobs {[round(x, 4) for x in seq.logprobs[:3]]}..., stop_reason {seq.stop_reason!r}: "
              f"{'matches the engine body exactly' if ok else 'MISMATCH'}")
        failures += 0 if ok else 1

        stats = [server.stats() for _ in range(4)]
        shards = {s["shard"]: s for s in stats[-1]["shards"] if "shard" in s}
        for s in sorted(shards):
            c = shards[s].get("counters", {})
            print(f"  encoder {s} (pid {shards[s].get('pid')}): {c.get('completed', 0)} completed, "
                  f"{shards[s].get('decode_encode_s', 0.0) * 1000 / max(c.get('completed', 1), 1):.2f} ms "
                  f"decode+encode per result (wall time, includes waits for the CPU), arena {shards[s].get('arena_used_bytes', 0)} bytes in use")
        close = getattr(service, "close", None)  # SDK >= 0.28: sends sessions/{id}/finish
        if close is not None:
            close("success").result(30)
    leftover_procs, leftover_shm = leftovers_of_started_servers()
    clean = not leftover_shm and not leftover_procs and not server.leftover_processes
    print(f"server stopped (exit code {server.proc.returncode if server.proc else None}); "
          f"left behind: {len(leftover_shm)} shm segments, {len(leftover_procs)} processes"
          f"{'' if clean else ' -- NOT CLEAN'}")
    if not clean:
        failures += 1
    print("demo OK" if failures == 0 else f"demo FAILED ({failures} problems)")
    return 0 if failures == 0 else 1
