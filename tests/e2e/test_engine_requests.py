"""What the gateway asks the engine for (issue 10, inputs 5 and 6), checked against fake engines
that behave as vLLM does: stop strings that are special tokens, and the engine's context window.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import BASE_MODEL, Api
from fake_engine import FakeEngine
from shardserver.testing import RunningServer, http_json

pytestmark = [pytest.mark.sdk, pytest.mark.slow, pytest.mark.timeout(150)]

IM_END = 151645
SCRIPT = [1001, 1002, IM_END] + list(range(1003, 1020))


def gateway(engine_url: str, **env: str) -> RunningServer:
    return RunningServer(env={"SHARDSERVER_ENGINE__URL": engine_url, "SHARDSERVER_SHARDS__COUNT": "1",
                              "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_ENGINE__HEALTH_INTERVAL_S": "0.3",
                              **env})


def sampler_for(url: str):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    return tinker.ServiceClient(base_url=url, api_key="tml-t").create_sampling_client(base_model=BASE_MODEL).result(60)


# -- input 5: stop strings that are special tokens ----------------------------------------------------
def test_every_stop_form_lands_in_the_right_vllm_field():
    """The engine generates [1001, 1002, <|im_end|>, ...]. vLLM matches the stop string
    "<|im_end|>" only when the request has skip_special_tokens false. Before: both string forms
    ran to 16 tokens ("length") while stop=[151645] stopped at 3."""
    from tinker import types

    cases = [  # SDK stop -> (tokens, stop_reason), the vLLM fields sent
        ("<|im_end|>", (SCRIPT[:3], "stop"), {"stop": ["<|im_end|>"], "skip_special_tokens": False}),
        (["<|im_end|>"], (SCRIPT[:3], "stop"), {"stop": ["<|im_end|>"], "skip_special_tokens": False}),
        ([IM_END], (SCRIPT[:3], "stop"), {"stop_token_ids": [IM_END]}),
        ([], (SCRIPT[:16], "length"), {"ignore_eos": True}),
        (None, (SCRIPT[:16], "length"), {}),
    ]
    fields = ("stop", "stop_token_ids", "skip_special_tokens", "ignore_eos")
    with FakeEngine(script=SCRIPT) as eng, gateway(eng.url) as s:
        sampler = sampler_for(s.url)
        for stop, (tokens, reason), sent in cases:
            resp = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                                  sampling_params=types.SamplingParams(max_tokens=16, seed=1, stop=stop)).result(60)
            seq = resp.sequences[0]
            assert (list(seq.tokens), seq.stop_reason) == (tokens, reason), stop
            req = eng.log()[-1]["request"]
            assert {k: req[k] for k in fields if k in req} == sent, stop


# -- input 6: the engine's context window ---------------------------------------------------------------
def _asample(api: Api, ssid: str, prompt: list[int], seq: int, **params: int):
    return api.post("/api/v1/asample", {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
                                        "prompt": {"chunks": [{"tokens": prompt}]}, "sampling_params": params})


def test_a_sample_without_max_tokens_survives_an_engine_that_came_back_with_a_smaller_window():
    """The engine restarts with a smaller --max-model-len (4096 -> 2048) and the gateway has not
    probed it yet: a sample that left max_tokens unset got the old window's max_tokens (3996),
    vLLM refused it ("This model's maximum context length is 2048 tokens ..."), and the sample
    failed as the user's fault though the user asked for nothing wrong (tester's stale_window.py:
    10 of 10 in flight failed). Now it is sent again once, with max_tokens for the window the
    engine names (1948) and the exact result for that. A max_tokens the user chose still fails."""
    from conftest import engine_body, expected_sequences

    with FakeEngine(max_model_len=4096) as eng, gateway(eng.url, SHARDSERVER_ENGINE__HEALTH_INTERVAL_S="60") as s:
        api = Api(s.url)
        ssid = api.sampling_session()
        eng.configure(max_model_len=2048)  # as after a restart the gateway has not probed yet
        prompt = list(range(1, 101))
        st, _, b = _asample(api, ssid, prompt, 1, seed=1)
        assert st == 200, b
        rid = json.loads(b)["request_id"]
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert st == 200 and json.loads(b)["type"] == "sample", b
        want = expected_sequences(engine_body(prompt, 1, 1948, 1, sim={"model_name": BASE_MODEL, "max_model_len": 2048}))
        assert json.loads(b)["sequences"][0]["tokens"] == want[0]["tokens"]
        sent = [(e["request_id"], e["request"]["max_tokens"]) for e in eng.log() if e["request_id"].startswith(rid)]
        assert sent == [(f"{rid}-a1", 3996), (f"{rid}-a2", 1948)]
        st, _, b = _asample(api, ssid, prompt, 2, seed=1, max_tokens=3000)
        rid = json.loads(b)["request_id"]
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid})
        assert json.loads(b)["category"] == "user" and "maximum context length is 2048" in json.loads(b)["error"]
        assert s.stats()["shards"][0]["counters"]["engine_context_refits"] == 1


def test_context_window_is_learned_from_the_engine_and_relearned_after_a_restart():
    """Engine with a 4096-token window (GET /v1/models), gateway default 65536, 3-token prompt, no
    max_tokens. Before: /readyz said ready, the gateway sent max_tokens 65533 and every such sample
    failed (category user). Now the window is learned, shown by /readyz, caps an unset max_tokens,
    refuses at asample what cannot fit, and is learned again when the engine comes back with another."""
    from tinker import types

    from conftest import engine_body, expected_sequences

    with FakeEngine(max_model_len=4096) as eng, gateway(eng.url) as s:
        st, _, b = http_json(s.url + "/readyz")
        assert (st, json.loads(b)) == (200, {"status": "ready", "encoders": 1, "max_model_len": {BASE_MODEL: 4096}})
        sampler = sampler_for(s.url)
        prompt = [81, 82, 83]
        resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                              sampling_params=types.SamplingParams(seed=3)).result(60)
        want = expected_sequences(engine_body(prompt, 1, 4093, 3, sim={"model_name": BASE_MODEL, "max_model_len": 4096}))
        assert list(resp.sequences[0].tokens) == want[0]["tokens"] and len(want[0]["tokens"]) == 4093
        assert eng.log()[-1]["request"]["max_tokens"] == 4093
        # What cannot fit is refused at asample, naming both numbers.
        api = Api(s.url)
        ssid = api.sampling_session()
        st, _, b = _asample(api, ssid, list(range(4096)), 1)
        assert (st, json.loads(b)["error"]) == (400, "prompt of 4096 tokens does not fit the engine's context window "
                                                     f"of 4096 tokens (max_model_len of {BASE_MODEL} in GET /v1/models)")
        st, _, b = _asample(api, ssid, list(range(4000)), 2, max_tokens=200)
        assert (st, json.loads(b)["error"]) == (400, "prompt of 4000 tokens + max_tokens 200 = 4200 tokens exceeds "
                                                     "the engine's context window of 4096 tokens (max_model_len of "
                                                     f"{BASE_MODEL} in GET /v1/models)")
        # The engine comes back with another window: learned again.
        eng.kill()
        eng.config["max_model_len"] = 8192
        eng.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            st, _, b = http_json(s.url + "/readyz")
            if st == 200 and json.loads(b).get("max_model_len") == {BASE_MODEL: 8192}:
                break
            time.sleep(0.2)
        assert json.loads(b)["max_model_len"] == {BASE_MODEL: 8192}
        st, _, b = _asample(api, ssid, prompt, 3, seed=3)
        assert st == 200, b
        rid = json.loads(b)["request_id"]
        st, _, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
        assert st == 200
        assert eng.log()[-1]["request"]["max_tokens"] == 8189
