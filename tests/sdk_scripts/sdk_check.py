"""Run under any tinker SDK version: sample, prompt logprobs, compute_logprobs; print one JSON line.

Usage: python sdk_check.py BASE_URL   (used by scripts/sdk_matrix.py)
"""

import json, os, sys
os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker
from tinker import types
url = sys.argv[1]
service = tinker.ServiceClient(base_url=url, api_key="tml-check")
sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B")
if hasattr(sampler, "result") and not hasattr(sampler, "sample"):
    sampler = sampler.result()
r1 = sampler.sample(prompt=types.ModelInput.from_ints([11, 12, 13]), num_samples=2,
                    sampling_params=types.SamplingParams(max_tokens=7, seed=5, temperature=1.0)).result(60)
r2 = sampler.sample(prompt=types.ModelInput.from_ints([21, 22, 23, 24]), num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=4, seed=9, temperature=1.0),
                    include_prompt_logprobs=True, topk_prompt_logprobs=2).result(60)
lp = sampler.compute_logprobs(types.ModelInput.from_ints([21, 22, 23, 24])).result(60)
print(json.dumps({"v": tinker.__version__, "t": [list(s.tokens) for s in r1.sequences],
                  "plp": r2.prompt_logprobs, "cl": lp, "seqids": [getattr(s, "sequence_id", None) for s in r1.sequences]}))
