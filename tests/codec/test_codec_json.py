"""sample_response_to_json: the pre-0.25 SDK JSON form, derived from the proto bytes."""

from __future__ import annotations

import json
from typing import List, Literal, Optional, Tuple

import numpy as np
import pydantic
import pytest

from codec_fixtures import SPEC_EXAMPLE_BODY
from shardserver.codec import (
    CompletionDecoder,
    DecodedChoice,
    DecodedCompletion,
    encode_sample_response,
    sample_response_to_json,
)
from tinker.proto.response_conv import deserialize_sample_response


class OldSampledSequence(pydantic.BaseModel):
    """Shape of tinker 0.15-0.24 ``types/sampled_sequence.py`` (spec §5.2)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    stop_reason: Literal["stop", "length"]
    tokens: List[int]
    logprobs: Optional[List[float]] = None


class OldSampleResponse(pydantic.BaseModel):
    """Shape of tinker 0.15-0.24 ``types/sample_response.py`` (spec §5.2)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    type: Literal["sample"] = "sample"
    sequences: List[OldSampledSequence]
    prompt_logprobs: Optional[List[Optional[float]]] = None
    topk_prompt_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]] = None
    prompt_cache_hit_tokens: int = 0


def _ch(tokens, lps, finish, i=0):
    return DecodedChoice(i, np.array(tokens, np.int32), None if lps is None else np.array(lps, np.float32), finish, None)


def test_exact_json_small_case():
    dc = DecodedCompletion(
        [_ch([100, 101], [-0.25, -0.1], "length", 0), _ch([7], None, "stop", 1), _ch([], [], "stop", 2)],
        prompt_logprobs=np.array([np.nan, -1.5, -9999.0], np.float32),
        topk_token_ids=np.array([[0, 0], [2, 0], [3, 4]], np.int32),
        topk_logprobs=np.array([[-99999.0, -99999.0], [-0.5, -99999.0], [-0.5, -1.5]], np.float32),
        prompt_cache_hit_tokens=3,
    )
    got = sample_response_to_json(encode_sample_response(dc))
    assert got == (
        b'{"type":"sample","sequences":['
        b'{"stop_reason":"length","tokens":[100,101],"logprobs":[-0.25,-0.10000000149011612]},'
        b'{"stop_reason":"stop","tokens":[7],"logprobs":null},'
        b'{"stop_reason":"stop","tokens":[],"logprobs":null}],'
        b'"prompt_logprobs":[null,-1.5,-9999.0],'
        b'"topk_prompt_logprobs":[null,[[2,-0.5]],[[3,-0.5],[4,-1.5]]],'
        b'"prompt_cache_hit_tokens":3}'
    )
    m = OldSampleResponse.model_validate(json.loads(got))
    assert m.sequences[0].logprobs == [-0.25, float(np.float32(-0.1))]
    assert m.topk_prompt_logprobs == [None, [(2, -0.5)], [(3, -0.5), (4, -1.5)]]


def test_no_prompt_fields():
    dc = DecodedCompletion([_ch([1], [-1.0], "stop")])
    got = sample_response_to_json(memoryview(encode_sample_response(dc)))
    assert got == (
        b'{"type":"sample","sequences":[{"stop_reason":"stop","tokens":[1],"logprobs":[-1.0]}],'
        b'"prompt_logprobs":null,"topk_prompt_logprobs":null,"prompt_cache_hit_tokens":0}'
    )
    OldSampleResponse.model_validate_json(got)


def test_spec_example_matches_sdk_proto_view():
    dc = CompletionDecoder().decode(SPEC_EXAMPLE_BODY, num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=2)
    proto = encode_sample_response(dc)
    js = json.loads(sample_response_to_json(proto))
    sr = deserialize_sample_response(proto)  # what a proto client sees
    assert js["sequences"][0]["tokens"] == sr.sequences[0].tokens
    assert js["sequences"][0]["logprobs"] == sr.sequences[0].logprobs
    assert js["prompt_logprobs"] == sr.prompt_logprobs == [None, -6.091300010681152, -0.36329999566078186]
    assert js["topk_prompt_logprobs"] == [[list(t) for t in row] if row is not None else None for row in sr.topk_prompt_logprobs]
    assert js["topk_prompt_logprobs"] == [None, [[1156, -2.4475998878479004], [4226, -6.091300010681152]], [[374, -0.36329999566078186]]]
    OldSampleResponse.model_validate(js)


def test_random_matches_sdk_proto_view():
    rng = np.random.default_rng(3)
    for _ in range(20):
        P, k = int(rng.integers(0, 50)), int(rng.integers(1, 4))
        ids = rng.integers(1, 1000, size=(P, k)).astype(np.int32)
        lps = (-rng.exponential(1.0, size=(P, k))).astype(np.float32)
        mask = rng.random((P, k)) < 0.3
        ids[mask], lps[mask] = 0, -99999.0
        plp = (-rng.exponential(1.0, size=P)).astype(np.float32)
        plp[rng.random(P) < 0.2] = np.nan
        dc = DecodedCompletion(
            [_ch(rng.integers(0, 5000, size=int(rng.integers(0, 30))), None, "length")],
            prompt_logprobs=plp,
            topk_token_ids=ids,
            topk_logprobs=lps,
        )
        dc.choices[0].logprobs = (-rng.exponential(1.0, size=dc.choices[0].token_ids.size)).astype(np.float32)
        proto = encode_sample_response(dc)
        js = json.loads(sample_response_to_json(proto))
        sr = deserialize_sample_response(proto)
        assert js["sequences"][0]["logprobs"] == sr.sequences[0].logprobs
        assert js["prompt_logprobs"] == sr.prompt_logprobs
        want_topk = None if sr.topk_prompt_logprobs is None else [None if r is None else [list(t) for t in r] for r in sr.topk_prompt_logprobs]
        assert js["topk_prompt_logprobs"] == want_topk
        OldSampleResponse.model_validate(js)


def test_bad_proto_bytes():
    with pytest.raises(ValueError):
        sample_response_to_json(b"\x0a\x05\x08\x07")  # truncated sequence
    with pytest.raises(ValueError, match="stop_reason"):
        sample_response_to_json(b"\x0a\x02\x08\x05")  # stop_reason 5
