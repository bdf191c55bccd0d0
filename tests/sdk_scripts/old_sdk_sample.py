"""Run under an old tinker SDK (its own virtualenv): sample through the gateway, print JSON results.

Usage: python old_sdk_sample.py BASE_URL
Prints one JSON object: the SDK version, the results of three sample calls, and the
gateway's JSON result form (Accept: application/json) parsed by this SDK's own pydantic
SampleResponse type.
"""

import json
import os
import sys
import urllib.error
import urllib.request

os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402


def seqs(resp):
    return [{"tokens": list(s.tokens), "logprobs": list(s.logprobs) if s.logprobs is not None else None,
             "stop_reason": s.stop_reason} for s in resp.sequences]


def main() -> None:
    url = sys.argv[1]
    service = tinker.ServiceClient(base_url=url, api_key="tml-old-sdk")
    sampler = service.create_sampling_client(base_model="Qwen/Qwen3-8B")
    out = {"version": tinker.__version__}
    r1 = sampler.sample(prompt=types.ModelInput.from_ints([11, 12, 13]), num_samples=2,
                        sampling_params=types.SamplingParams(max_tokens=7, seed=5, temperature=1.0)).result(60)
    out["plain"] = seqs(r1)
    r2 = sampler.sample(prompt=types.ModelInput.from_ints([21, 22, 23, 24]), num_samples=1,
                        sampling_params=types.SamplingParams(max_tokens=4, seed=9, temperature=1.0),
                        include_prompt_logprobs=True, topk_prompt_logprobs=2).result(60)
    out["prompt_logprobs"] = {"seqs": seqs(r2), "prompt_logprobs": r2.prompt_logprobs,
                              "topk_prompt_logprobs": r2.topk_prompt_logprobs}

    # The JSON form, fetched as a pre-0.18.1 SDK would (Accept: application/json), parsed by this SDK's type.
    def post(path, body, accept="application/json"):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": accept,
                                              "X-API-Key": "tml-old-sdk"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.headers.get("content-type"), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("content-type"), exc.read()

    _, _, b = post("/api/v1/create_session", {"tags": [], "user_metadata": {}})
    sid = json.loads(b)["session_id"]
    _, _, b = post("/api/v1/create_sampling_session", {"session_id": sid, "base_model": "Qwen/Qwen3-8B"})
    ssid = json.loads(b)["sampling_session_id"]
    _, _, b = post("/api/v1/asample", {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 1,
                                       "prompt": {"chunks": [{"tokens": [21, 22, 23, 24]}]},
                                       "sampling_params": {"max_tokens": 4, "seed": 9, "temperature": 1.0},
                                       "prompt_logprobs": True, "topk_prompt_logprobs": 2})
    rid = json.loads(b)["request_id"]
    for _ in range(20):
        status, ctype, body = post("/api/v1/retrieve_future", {"request_id": rid})
        if status == 200:
            break
    try:  # the SDK's own JSON read path (0.24), or its pydantic model (0.15-0.23)
        from tinker.lib._pydantic_conv import deserialize_json_response

        parsed = deserialize_json_response(json.loads(body), types.SampleResponse)
    except ImportError:
        parsed = types.SampleResponse.model_validate_json(body)
    out["json_form"] = {"content_type": ctype, "seqs": seqs(parsed), "prompt_logprobs": parsed.prompt_logprobs,
                        "topk_prompt_logprobs": parsed.topk_prompt_logprobs}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
