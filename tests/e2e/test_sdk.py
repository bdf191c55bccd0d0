"""The real tinker SDK samples through the gateway: 0.38.0 (proto) in-process, 0.24.1 in its own venv."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import BASE_MODEL, engine_body, expected_prompt_logprobs, expected_sequences, old_sdk_python

pytestmark = [pytest.mark.sdk, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def sampler(server):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    service = tinker.ServiceClient(base_url=server.url, api_key="tml-test")
    return service.create_sampling_client(base_model=BASE_MODEL).result(60)


def _check(resp, body):
    want = expected_sequences(body)
    assert len(resp.sequences) == len(want)
    for seq, w in zip(resp.sequences, want):
        assert list(seq.tokens) == w["tokens"]
        assert np.array_equal(np.asarray(seq.logprobs, dtype=np.float32), w["logprobs"])
        assert seq.stop_reason == w["stop_reason"]


def test_sample_result(sampler):
    from tinker import types

    prompt = [400, 401, 402]
    resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=64, seed=11, temperature=1.0)).result(60)
    _check(resp, engine_body(prompt, 1, 64, 11))
    assert len(resp.sequences[0].tokens) == 64
    assert resp.prompt_logprobs is None


@pytest.mark.filterwarnings("ignore:.*sample_async.*:FutureWarning")  # deprecated in 0.38, still supported
def test_sample_async_many_in_flight(sampler):
    from tinker import types

    async def go():
        async def one(i):
            return await sampler.sample_async(
                prompt=types.ModelInput.from_ints([7, i]), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=300, seed=i, temperature=0.8))
        return await asyncio.gather(*(one(i) for i in range(24)))

    results = asyncio.run(go())
    for i, resp in enumerate(results):
        _check(resp, engine_body([7, i], 1, 300, i, temperature=0.8))


def test_await_sample(sampler):
    from tinker import types

    async def go():
        return await sampler.sample(prompt=types.ModelInput.from_ints([70, 71]), num_samples=2,
                                    sampling_params=types.SamplingParams(max_tokens=33, seed=8))

    _check(asyncio.run(go()), engine_body([70, 71], 2, 33, 8))


def test_num_samples_greater_than_one(sampler):
    from tinker import types

    prompt = [9, 8, 7, 6]
    resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                          sampling_params=types.SamplingParams(max_tokens=40, seed=5, temperature=1.0)).result(60)
    _check(resp, engine_body(prompt, 3, 40, 5))
    # vLLM child seeds are seed+i: the three sequences differ.
    assert len({tuple(s.tokens) for s in resp.sequences}) == 3


def test_prompt_logprobs_and_topk(sampler):
    from tinker import types

    prompt = [31, 32, 33, 34, 35, 36, 37]
    resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                          sampling_params=types.SamplingParams(max_tokens=5, seed=2, temperature=1.0),
                          include_prompt_logprobs=True, topk_prompt_logprobs=4).result(60)
    body = engine_body(prompt, 2, 5, 2, prompt_logprobs=4)
    _check(resp, body)
    lps, topk = expected_prompt_logprobs(body, prompt, 4)
    assert resp.prompt_logprobs == lps
    got = [None if row is None else [(int(t), float(np.float32(v))) for t, v in row]
           for row in resp.topk_prompt_logprobs]
    assert got == topk


def test_compute_logprobs(sampler):
    prompt = [51, 52, 53, 54]
    got = sampler.compute_logprobs(__import__("tinker").types.ModelInput.from_ints(prompt)).result(60)
    body = engine_body(prompt, 1, 1, None, prompt_logprobs=0)
    lps, _ = expected_prompt_logprobs(body, prompt, 0)
    assert got == lps


def test_stop_token_ids_map_to_stop(sampler, server):
    from tinker import types

    prompt = [61, 62]
    # Find a token the engine will emit, then ask to stop on it: the sequence must end there with "stop".
    free = engine_body(prompt, 1, 30, 4)
    stop_tok = free["choices"][0]["token_ids"][10]
    resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=30, seed=4, stop=[stop_tok])).result(60)
    body = engine_body(prompt, 1, 30, 4, stop=[stop_tok])
    _check(resp, body)
    assert resp.sequences[0].stop_reason == "stop"
    assert resp.sequences[0].tokens[-1] == stop_tok


@pytest.mark.parametrize("version,venv", [("0.24.1", ".venv-sdk024"), ("0.15.0", ".venv-sdk015")])
def test_old_sdk(server, version, venv):
    """0.24.1 asks for proto first (Accept: application/x-protobuf, application/json); 0.15.0 asks for JSON."""
    py = old_sdk_python(venv)
    if py is None:
        pytest.skip(f"no tinker {version} environment (make test builds {venv})")
    proc = subprocess.run([py, os.path.join(os.path.dirname(os.path.dirname(__file__)), "sdk_scripts", "old_sdk_sample.py"),
                           server.url], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    want = expected_sequences(engine_body([11, 12, 13], 2, 7, 5))
    for seq, w in zip(out["plain"], want):
        assert seq["tokens"] == w["tokens"]
        assert seq["logprobs"] == [float(x) for x in w["logprobs"]]
        assert seq["stop_reason"] == w["stop_reason"]
    prompt = [21, 22, 23, 24]
    body = engine_body(prompt, 1, 4, 9, prompt_logprobs=2)
    lps, topk = expected_prompt_logprobs(body, prompt, 2)
    for form in ("prompt_logprobs", "json_form"):
        got = out[form]
        assert got["seqs"][0]["tokens"] == expected_sequences(body)[0]["tokens"]
        assert got["prompt_logprobs"] == lps
        assert [None if r is None else [tuple(x) for x in r] for r in got["topk_prompt_logprobs"]] == \
            [None if r is None else [tuple(x) for x in r] for r in topk]
    assert out["json_form"]["content_type"].startswith("application/json")


def test_max_tokens_unset_generates_until_eos_not_16(tmp_path):
    """The SDK leaves max_tokens unset for "until EOS": the gateway sends max_model_len - prompt
    length (vLLM alone would stop after 16 tokens); stop=[] also ignores EOS."""
    from tinker import types

    import tinker
    from shardserver.testing import RunningServer

    env = {"SHARDSERVER_SIMULATOR__EOS_PROBABILITY": "0.01", "SHARDSERVER_ENGINE__MAX_MODEL_LEN": "4096",
           "SHARDSERVER_SERVER__FRONT_ENDS": "1", "SHARDSERVER_SHARDS__COUNT": "1"}
    with RunningServer(env=env) as s:
        sampler = tinker.ServiceClient(base_url=s.url, api_key="tml-t").create_sampling_client(
            base_model=BASE_MODEL).result(60)
        prompt = [81, 82, 83]
        resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=4,
                              sampling_params=types.SamplingParams(seed=3)).result(60)
        sim = {"model_name": BASE_MODEL, "eos_probability": 0.01, "max_model_len": 4096}
        body = engine_body(prompt, 4, 4096 - 3, 3, sim=sim)
        _check(resp, body)
        assert all(s.stop_reason == "stop" and s.tokens[-1] == 151643 for s in resp.sequences)
        assert max(len(s.tokens) for s in resp.sequences) > 16
        # stop=[]: no stop at all, EOS included: every sequence runs to max_tokens.
        resp = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                              sampling_params=types.SamplingParams(seed=3, max_tokens=300, stop=[])).result(60)
        assert [(len(s.tokens), s.stop_reason) for s in resp.sequences] == [(300, "length")] * 2
