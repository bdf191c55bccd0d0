"""Run under tinker 0.26.2 (its own virtualenv): sample through the gateway's session-wide poller.

Usage: python poller_sdk_sample.py BASE_URL
Prints one JSON object: the SDK version, the flags this SDK read from /client/config and
/client/dynamic_config, whether its samples waited on the session poller, and the results of
three concurrent sample calls (prompt [11, 12, k], num_samples 2, max_tokens 7 + k, seed 5 + k).
"""

import asyncio
import json
import os
import sys

os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402


def seqs(resp):
    return [{"tokens": list(s.tokens), "logprobs": list(s.logprobs) if s.logprobs is not None else None,
             "stop_reason": s.stop_reason} for s in resp.sequences]


def main() -> None:
    url = sys.argv[1]
    service = tinker.ServiceClient(base_url=url, api_key="tml-sdk026")
    sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B")
    holder = service.holder
    out = {"version": tinker.__version__,
           "use_retrieve_futures": holder.get_client_config().sample_use_retrieve_futures,
           "cancel_enabled": holder._client_dynamic_config.sample_cancel_enabled}

    async def go():
        return await asyncio.gather(*(
            sampler.sample_async(prompt=types.ModelInput.from_ints([11, 12, k]), num_samples=2,
                                 sampling_params=types.SamplingParams(max_tokens=7 + k, seed=5 + k, temperature=1.0))
            for k in range(3)))

    out["results"] = [seqs(r) for r in asyncio.run(go())]
    out["poller"] = sampler._futures_poller is not None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
