"""Run under a tinker SDK (0.38 in .venv, 0.24.1 in .venv-sdk024): a burst of samples, results as JSON.

Usage: python sdk_burst.py BASE_URL N MAX_TOKENS
Submits N samples at once (sample i: prompt [7, i], seed i, temperature 1.0, MAX_TOKENS tokens),
then waits for every one. Prints one JSON object: the SDK version, per sample its tokens,
logprobs and stop_reason (or the error the SDK raised to the caller), and the wall seconds.
"""

import json
import os
import sys
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402


def main() -> None:
    url, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    service = tinker.ServiceClient(base_url=url, api_key="tml-multihost")
    sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B")
    if not hasattr(type(sampler), "sample"):  # 0.38 returns a future of the client, 0.24 the client
        sampler = sampler.result(60)
    t0 = time.monotonic()
    futures = [sampler.sample(prompt=types.ModelInput.from_ints([7, i]), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=max_tokens, seed=i, temperature=1.0))
               for i in range(n)]
    results = []
    for f in futures:
        try:
            r = f.result(240)
            s = r.sequences[0]
            results.append({"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason})
        except Exception as exc:  # what reaches the user: counted by the test, must be none
            results.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
    print(json.dumps({"version": tinker.__version__, "seconds": time.monotonic() - t0, "results": results}))
    sys.stdout.flush()
    os._exit(0)  # the SDK's background threads may hold the interpreter at exit


if __name__ == "__main__":
    main()
