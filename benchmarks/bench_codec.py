"""Benchmark the vLLM-body -> SampleResponse codec (a plain script, not a test).

    .venv/bin/python benchmarks/bench_codec.py [--runs 9] [--quick]

For each realistic vLLM 0.30 body (shared/spec/vllm_completions.md §9: logprobs=1 with
return_token_ids, ~25% positions with a second top entry, 17-digit float32 reprs;
optionally prompt_logprobs=5 on a 4096-token prompt, copied onto every choice) it
times, median of ``--runs``:

* ours: ``CompletionDecoder.decode`` + ``encode_sample_response`` into a preallocated buffer;
* (a): a bare ``simdjson.Parser().parse(body)`` of the same body (the floor: no field access);
* (b): a conventional reference: ``orjson.loads`` -> Python lists -> the generated protobuf
  message -> ``SerializeToString()``.

and checks that ours and (b) produce the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import simdjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "codec"))

from codec_fixtures import realistic_case  # noqa: E402

from shardserver.codec import CompletionDecoder, encode_sample_response, sample_response_size  # noqa: E402
from shardserver.proto import sample_response_pb2 as pb  # noqa: E402

_STOP = {"stop": 0, "repetition": 0, "length": 1}


def reference(body: bytes, n: int, k: int, with_plp: bool) -> bytes:
    """orjson -> Python lists -> generated message -> SerializeToString (the conventional way)."""
    doc = orjson.loads(body)
    choices = sorted(doc["choices"], key=lambda c: c["index"])
    assert len(choices) == n
    msg = pb.SampleResponse()
    for c in choices:
        seq = msg.sequences.add()
        seq.stop_reason = _STOP[c["finish_reason"]]
        seq.tokens = np.array(c["token_ids"], dtype=np.int32).tobytes()
        if c["logprobs"] is not None:
            seq.logprobs = np.array(c["logprobs"]["token_logprobs"], dtype=np.float32).tobytes()
    if with_plp:
        pids = choices[0]["prompt_token_ids"]
        rows = choices[0]["prompt_logprobs"]
        plp = []
        tids, tlps = [], []
        for i, row in enumerate(rows):
            if row is None:
                plp.append(float("nan"))
                tids.extend([0] * k)
                tlps.extend([-99999.0] * k)
                continue
            plp.append(row[str(pids[i])]["logprob"])
            top = sorted(((int(t), e["logprob"]) for t, e in row.items()), key=lambda x: -x[1])[:k]
            top += [(0, -99999.0)] * (k - len(top))
            tids.extend(t for t, _ in top)
            tlps.extend(lp for _, lp in top)
        msg.prompt_logprobs = np.array(plp, dtype=np.float32).tobytes()
        if k:
            msg.topk_prompt_logprobs.token_ids = np.array(tids, dtype=np.int32).tobytes()
            msg.topk_prompt_logprobs.logprobs = np.array(tlps, dtype=np.float32).tobytes()
            msg.topk_prompt_logprobs.k = k
            msg.topk_prompt_logprobs.length = len(rows)
    usage = doc.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    msg.prompt_cache_hit_tokens = details.get("cached_tokens") or 0
    return msg.SerializeToString()


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def machine_info() -> str:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"nproc={os.cpu_count()}  cpu={model}  python={platform.python_version()}  "
        f"numpy={np.__version__}  simdjson={getattr(simdjson, 'VERSION', '?')}  orjson={orjson.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="8192-token bodies only")
    args = ap.parse_args()

    print(machine_info())
    rng = np.random.default_rng(1234)
    dec = CompletionDecoder()
    parser = simdjson.Parser()
    gen_sizes = (8192,) if args.quick else (8192, 32768)
    header = (
        "| gen tokens | n | prompt_logprobs | body MB | proto KB | ours ms | (a) parse ms | (b) ref ms "
        "| (b)/ours | ours/(a) |"
    )
    rows = [header, "|" + "---|" * 10]
    for gen in gen_sizes:
        for n in (1, 4):
            for k in (None, 5):
                case = realistic_case(rng, n=n, gen_tokens=gen, prompt_len=4096, k=-1 if k is None else k)
                body = case.body
                with_plp = k is not None
                kk = k or 0
                out = dec.decode(body, num_samples=n, prompt_logprobs=with_plp, topk_prompt_logprobs=kk)
                size = sample_response_size(out)
                buf = bytearray(size)
                del out

                def ours() -> None:
                    d = dec.decode(body, num_samples=n, prompt_logprobs=with_plp, topk_prompt_logprobs=kk)
                    encode_sample_response(d, buf, 0)

                def bare() -> None:
                    doc = parser.parse(body)
                    del doc

                def ref() -> bytes:
                    return reference(body, n, kk, with_plp)

                ours()
                assert bytes(buf) == ref(), "ours and the reference disagree"
                gc.collect()
                t_ours = median_ms(ours, args.runs)
                t_bare = median_ms(bare, args.runs)
                t_ref = median_ms(ref, max(3, args.runs // 2))
                rows.append(
                    f"| {gen} | {n} | {'k=5, P=4096' if with_plp else 'no'} | {len(body) / 1e6:.2f} | "
                    f"{size / 1e3:.0f} | {t_ours:.2f} | {t_bare:.2f} | {t_ref:.2f} | "
                    f"{t_ref / t_ours:.1f}x | {t_ours / t_bare:.2f}x |"
                )
                print(rows[-1], flush=True)
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
