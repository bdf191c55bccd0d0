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
