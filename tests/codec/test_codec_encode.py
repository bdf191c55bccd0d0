"""encode_sample_response: byte-identical to the generated module, and what the real SDK decodes."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec_fixtures import SPEC_EXAMPLE_BODY, choice_dict, f32, logprobs_object, prompt_row, render
from shardserver.codec import (
    STOP_REASON_LENGTH,
    STOP_REASON_STOP,
    CompletionDecoder,
    DecodedChoice,
    DecodedCompletion,
    encode_sample_response,
    max_sample_response_size,
    plan_sample_response,
    sample_response_size,
    stop_reason_code,
)
from shardserver.errors import EngineBodyError
from shardserver.proto import sample_response_pb2 as pb
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.response_conv import deserialize_sample_response

_CODES = {"stop": pb.STOP_REASON_STOP, "repetition": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def reference_message(dc: DecodedCompletion) -> pb.SampleResponse:
    """The same result built with the generated module (independent of the hand-written encoder)."""
    msg = pb.SampleResponse()
    for c in dc.choices:
        seq = msg.sequences.add()
        seq.stop_reason = _CODES[c.finish_reason]
        seq.tokens = c.token_ids.astype("<i4").tobytes()
        if c.logprobs is not None:
            seq.logprobs = c.logprobs.astype("<f4").tobytes()
    if dc.prompt_logprobs is not None:
        msg.prompt_logprobs = dc.prompt_logprobs.astype("<f4").tobytes()
    if dc.topk_token_ids is not None:
        length, k = dc.topk_token_ids.shape
        msg.topk_prompt_logprobs.SetInParent()
        msg.topk_prompt_logprobs.token_ids = dc.topk_token_ids.astype("<i4").tobytes()
        msg.topk_prompt_logprobs.logprobs = dc.topk_logprobs.astype("<f4").tobytes()
        msg.topk_prompt_logprobs.k = k
        msg.topk_prompt_logprobs.length = length
    msg.prompt_cache_hit_tokens = dc.prompt_cache_hit_tokens
    return msg


def assert_identical(dc: DecodedCompletion) -> bytes:
    want = reference_message(dc).SerializeToString()
    got = encode_sample_response(dc)
    assert isinstance(got, bytes)
    assert got == want
    assert sample_response_size(dc) == len(want)
    # The SDK's own module (package tinker_public) writes the same bytes.
    sdk = sdk_pb.SampleResponse()
    sdk.ParseFromString(got)
    assert sdk.SerializeToString() == want
    # Into a buffer at an offset: same bytes, nothing outside touched.
    buf = bytearray(b"\xee" * (len(want) + 13))
    assert encode_sample_response(dc, buf, 5) == len(want)
    assert bytes(buf[5 : 5 + len(want)]) == want
    assert buf[:5] == b"\xee" * 5 and buf[5 + len(want) :] == b"\xee" * 8
    return got


def ch(tokens, logprobs=None, finish="length", index=0) -> DecodedChoice:
    t = np.asarray(tokens, dtype=np.int32)
    lp = None if logprobs is None else np.asarray(logprobs, dtype=np.float32)
    return DecodedChoice(index, t, lp, finish, None)


# --------------------------------------------------------------------------------------------
# Examples


def test_spec_example_bytes():
    dc = CompletionDecoder().decode(SPEC_EXAMPLE_BODY, num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=1)
    got = assert_identical(dc)
    sr = deserialize_sample_response(got)
    (seq,) = sr.sequences
    assert seq.stop_reason == "stop"
    assert seq.tokens == [220, 19, 13, 151643]
    assert seq.logprobs == [-0.04190000146627426, -1.2999999523162842, -0.6930999755859375, 0.0]
    assert sr.prompt_logprobs == [None, -6.091300010681152, -0.36329999566078186]
    assert sr.topk_prompt_logprobs == [None, [(1156, -2.4475998878479004)], [(374, -0.36329999566078186)]]
    assert sr.prompt_cache_hit_tokens == 0


def test_n1_minimal_exact_wire():
    dc = DecodedCompletion([ch([1, 2], [-0.5, -1.0], "length")])
    got = assert_identical(dc)
    assert got == bytes.fromhex("0a16" "0801" "1208" "01000000" "02000000" "1a08" "000000bf" "000080bf")


def test_n4_mixed():
    dc = DecodedCompletion(
        [
            ch([5, 6, 7], [-0.1, -9999.0, 0.0], "stop", 0),
            ch([], [], "length", 1),
            ch([8], None, "repetition", 2),
            ch([9, 10], [-1.5, 2.5], "length", 3),
        ],
        prompt_cache_hit_tokens=4096,
    )
    got = assert_identical(dc)
    sr = deserialize_sample_response(got)
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length", "stop", "length"]
    assert [s.tokens for s in sr.sequences] == [[5, 6, 7], [], [8], [9, 10]]
    # the SDK maps empty logprobs bytes to None
    assert [s.logprobs for s in sr.sequences] == [[f32(-0.1), -9999.0, 0.0], None, None, [-1.5, 2.5]]
    assert sr.prompt_cache_hit_tokens == 4096


def test_empty_stop_sequence_is_an_empty_message():
    dc = DecodedCompletion([ch([], None, "stop")])
    assert assert_identical(dc) == b"\x0a\x00"


def test_empty_logprobs_field_is_present():
    dc = DecodedCompletion([ch([], [], "stop")])
    assert assert_identical(dc) == b"\x0a\x02\x1a\x00"


def test_nan_prompt_logprobs_and_empty_prompt():
    dc = DecodedCompletion([ch([1], [-1.0])], prompt_logprobs=np.array([np.nan, -2.0, np.nan], np.float32))
    sr = deserialize_sample_response(assert_identical(dc))
    assert sr.prompt_logprobs == [None, -2.0, None]
    dc = DecodedCompletion([ch([1], [-1.0])], prompt_logprobs=np.zeros(0, np.float32))
    assert assert_identical(dc).endswith(b"\x12\x00")


def test_topk_k_and_k_plus_one_rows_via_decode():
    rows = [
        None,
        prompt_row(9, f32(-7.0), [(1, f32(-0.1)), (2, f32(-0.2))], 2),  # k+1 entries
        prompt_row(4, f32(-0.3), [(4, f32(-0.3)), (6, f32(-1.7))], 2),  # k entries (merged)
        prompt_row(5, f32(-0.2), [], 0),  # 1 entry: masked tail
    ]
    c = choice_dict(0, [3], logprobs_object([f32(-0.7)]), prompt_logprobs=rows, prompt_token_ids=[8, 9, 4, 5])
    dc = CompletionDecoder().decode(render([c]), num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=2)
    sr = deserialize_sample_response(assert_identical(dc))
    assert sr.topk_prompt_logprobs == [None, [(1, f32(-0.1)), (2, f32(-0.2))], [(4, f32(-0.3)), (6, f32(-1.7))], [(5, f32(-0.2))]]
    assert sr.prompt_logprobs == [None, f32(-7.0), f32(-0.3), f32(-0.2)]


def test_topk_empty_prompt_and_negative_cache_hits():
    dc = DecodedCompletion(
        [ch([1], [-1.0])],
        prompt_logprobs=np.zeros(0, np.float32),
        topk_token_ids=np.zeros((0, 3), np.int32),
        topk_logprobs=np.zeros((0, 3), np.float32),
        prompt_cache_hit_tokens=-1,  # never from the decoder; int32 negatives are 10-byte varints
    )
    got = assert_identical(dc)
    assert deserialize_sample_response(got).topk_prompt_logprobs is None


def test_large_varints():
    toks = np.arange(20000, dtype=np.int32)  # 80000-byte field: 3-byte length varint
    dc = DecodedCompletion([ch(toks, np.linspace(-5, 0, 20000), "length")], prompt_cache_hit_tokens=2**31 - 1)
    assert_identical(dc)


def test_into_mmap_and_memoryview_slice():
    dc = DecodedCompletion([ch([1, 2, 3], [-1.0, -2.0, -3.0], "stop")], prompt_logprobs=np.array([np.nan, -1.0], np.float32))
    want = reference_message(dc).SerializeToString()
    with mmap.mmap(-1, 4096) as mm:
        view = memoryview(mm)[100:200]
        assert encode_sample_response(dc, view, 7) == len(want)
        assert mm[107 : 107 + len(want)] == want
        view.release()


def test_a_plan_made_first_encodes_the_same_bytes():
    """plan_sample_response (the encoder sizes its arena slot with it, then writes with it):
    its size is sample_response_size and encoding with it gives the reference bytes."""
    dc = DecodedCompletion([ch([1, 2, 3], [-1.0, -2.0, -3.0], "stop", 0), ch([4], None, "length", 1)],
                           prompt_logprobs=np.array([np.nan, -1.0], np.float32), prompt_cache_hit_tokens=3)
    want = reference_message(dc).SerializeToString()
    plan = plan_sample_response(dc)
    assert plan[1] == sample_response_size(dc) == len(want)
    out = bytearray(len(want) + 9)
    assert encode_sample_response(dc, out, 9, plan=plan) == len(want)
    assert bytes(out[9:]) == want
    assert encode_sample_response(dc, plan=plan) == want


def test_out_buffer_errors():
    dc = DecodedCompletion([ch([1, 2, 3], [-1.0, -2.0, -3.0], "stop")])
    n = sample_response_size(dc)
    with pytest.raises(ValueError, match="too small"):
        encode_sample_response(dc, bytearray(n), 1)
    with pytest.raises(ValueError, match="read-only"):
        encode_sample_response(dc, b"\x00" * 100)
    arr = np.zeros(64, dtype=np.int32)  # non-byte buffer formats are written as raw bytes
    assert encode_sample_response(dc, arr, 0) == n
    assert arr.tobytes()[:n] == encode_sample_response(dc)


def test_abort_never_encoded():
    dc = DecodedCompletion([ch([1], [-1.0], "length", 0), ch([2], [-1.0], "abort", 1)])
    with pytest.raises(EngineBodyError) as ei:
        encode_sample_response(dc)
    assert ei.value.where == "choices[1].finish_reason" and "abort" in ei.value.reason
    with pytest.raises(EngineBodyError):
        sample_response_size(dc)
    with pytest.raises(EngineBodyError):
        encode_sample_response(dc, bytearray(100))


def test_stop_reason_code():
    assert stop_reason_code("stop", "w") == STOP_REASON_STOP == 0
    assert stop_reason_code("repetition", "w") == STOP_REASON_STOP
    assert stop_reason_code("length", "w") == STOP_REASON_LENGTH == 1
    with pytest.raises(EngineBodyError) as ei:
        stop_reason_code("abort", "choices[0].finish_reason")
    assert ei.value.where == "choices[0].finish_reason"
    with pytest.raises(EngineBodyError, match="no Tinker StopReason"):
        stop_reason_code("error", "x")


def test_other_input_dtypes_are_converted():
    dc = DecodedCompletion(
        [DecodedChoice(0, np.array([1, 2], np.int64), np.array([-0.5, -1.5], np.float64), "stop", None)],
        prompt_logprobs=np.array([np.nan, -1.0]),
    )
    got = encode_sample_response(dc)
    want = reference_message(dc).SerializeToString()
    assert got == want


# --------------------------------------------------------------------------------------------
# Property: random shapes


@st.composite
def completions(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = draw(st.integers(1, 4))
    big = draw(st.booleans())
    choices = []
    for i in range(n):
        length = draw(st.integers(0, 40000)) if big and i == 0 else draw(st.integers(0, 300))
        toks = rng.integers(0, 2**31 - 1, size=length, dtype=np.int64).astype(np.int32)
        lps = None
        if draw(st.booleans()) or length == 0:
            lps = (-rng.exponential(2.0, size=length)).astype(np.float32)
            lps[rng.random(length) < 0.1] = -9999.0
            lps[rng.random(length) < 0.05] = rng.random() * 3  # raw_logits mode: positive
            if length and draw(st.booleans()):
                lps[0] = -0.0
            if draw(st.booleans()):
                lps = None
        finish = draw(st.sampled_from(["stop", "length", "repetition"]))
        choices.append(DecodedChoice(i, toks, lps, finish, None))
    dc = DecodedCompletion(choices, prompt_cache_hit_tokens=draw(st.integers(0, 2**31 - 1) | st.just(0)))
    if draw(st.booleans()):
        P = draw(st.integers(0, 3000))
        plp = (-rng.exponential(2.0, size=P)).astype(np.float32)
        plp[rng.random(P) < 0.1] = np.nan
        if P:
            plp[0] = np.nan
        plp[rng.random(P) < 0.05] = -9999.0
        dc.prompt_logprobs = plp
        k = draw(st.integers(0, 5))
        if k:
            ids = rng.integers(1, 151643, size=(P, k)).astype(np.int32)
            lp = np.sort(-rng.exponential(2.0, size=(P, k)).astype(np.float32), axis=1)[:, ::-1].copy()
            fill = rng.integers(0, k + 1, size=P)
            mask = np.arange(k)[None, :] >= fill[:, None]
            ids[mask] = 0
            lp[mask] = -99999.0
            dc.topk_token_ids, dc.topk_logprobs = ids, lp
    return dc


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions())
def test_property_byte_identical_and_sdk_decodes(dc):
    got = assert_identical(dc)
    sr = deserialize_sample_response(got)
    assert len(sr.sequences) == len(dc.choices)
    for s, c in zip(sr.sequences, dc.choices):
        assert s.stop_reason == ("length" if c.finish_reason == "length" else "stop")
        assert np.array_equal(s.tokens_np, c.token_ids)
        if c.logprobs is None or c.logprobs.size == 0:
            assert s.logprobs_np is None
        else:
            assert s.logprobs_np.tobytes() == c.logprobs.tobytes()  # bit-exact, incl. -0.0
    if dc.prompt_logprobs is None or dc.prompt_logprobs.size == 0:
        assert sr.prompt_logprobs_np is None
    else:
        assert sr.prompt_logprobs_np.tobytes() == dc.prompt_logprobs.tobytes()
    if dc.topk_token_ids is None or dc.topk_token_ids.size == 0:
        assert sr.topk_prompt_logprobs_np is None
    else:
        assert np.array_equal(sr.topk_prompt_logprobs_np.token_ids, dc.topk_token_ids)
        assert np.array_equal(sr.topk_prompt_logprobs_np.logprobs, dc.topk_logprobs)
    assert sr.prompt_cache_hit_tokens == dc.prompt_cache_hit_tokens


# --------------------------------------------------------------------------------------------
# The arena reservation: no real result is larger than max_sample_response_size


@st.composite
def requests_and_results(draw):
    """A sample request's size parameters and a result the engine may answer to it: every
    sequence at most ``max_tokens`` long (often exactly), prompt logprobs and top-k matrices
    of the prompt's length when requested, any ``prompt_cache_hit_tokens``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 6))
    max_tokens = draw(st.sampled_from([1, 31, 32, 4095, 4096, 40000]) | st.integers(1, 5000))
    P = draw(st.sampled_from([1, 31, 32, 4096]) | st.integers(1, 3000))
    topk = draw(st.integers(0, 20))
    want_plp = topk > 0 or draw(st.booleans())
    choices = []
    for i in range(n):
        length = draw(st.just(max_tokens) | st.integers(0, max_tokens))
        toks = rng.integers(0, 2**31 - 1, size=length, dtype=np.int64).astype(np.int32)
        lps = None if draw(st.booleans()) and length else (-rng.exponential(2.0, size=length)).astype(np.float32)
        finish = draw(st.sampled_from(["stop", "length", "repetition"]))
        choices.append(DecodedChoice(i, toks, lps, finish, None))
    dc = DecodedCompletion(choices, prompt_cache_hit_tokens=draw(st.sampled_from([0, P, 2**31 - 1])))
    if want_plp:
        dc.prompt_logprobs = (-rng.exponential(2.0, size=P)).astype(np.float32)
        if topk:
            dc.topk_token_ids = rng.integers(0, 151643, size=(P, topk)).astype(np.int32)
            dc.topk_logprobs = (-rng.exponential(2.0, size=(P, topk))).astype(np.float32)
    return (n, max_tokens, P, want_plp, topk), dc


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests_and_results())
def test_property_no_result_exceeds_max_sample_response_size(case):
    (n, max_tokens, P, want_plp, topk), dc = case
    size = len(encode_sample_response(dc))
    assert size == sample_response_size(dc)
    assert size <= max_sample_response_size(n, max_tokens, P, want_plp, topk)


@pytest.mark.parametrize("n, max_tokens, P, want_plp, topk", [
    (1, 32768, 10, False, 0), (8, 40000, 4096, True, 20), (3, 4096, 100, True, 0), (64, 1, 1, True, 1)])
def test_max_sample_response_size_of_the_largest_results(n, max_tokens, P, want_plp, topk):
    """Every sequence at max_tokens with logprobs and LENGTH, prompt logprobs with top-k, the
    largest cache-hit count: the bound holds, with at most its framing allowance to spare."""
    rng = np.random.default_rng(7)
    choices = [DecodedChoice(i, rng.integers(0, 2**31 - 1, size=max_tokens, dtype=np.int64).astype(np.int32),
                             np.full(max_tokens, -1.5, np.float32), "length", None) for i in range(n)]
    dc = DecodedCompletion(choices, prompt_cache_hit_tokens=2**31 - 1)
    if want_plp:
        dc.prompt_logprobs = np.full(P, -2.0, np.float32)
        if topk:
            dc.topk_token_ids = np.ones((P, topk), np.int32)
            dc.topk_logprobs = np.full((P, topk), -3.0, np.float32)
    size = len(encode_sample_response(dc))
    bound = max_sample_response_size(n, max_tokens, P, want_plp, topk)
    assert size <= bound <= size + 32 * n + 32 + 16 + 48
    if not want_plp and (n, max_tokens) == (1, 32768):
        assert bound == 262208  # README: "a 32k-token result is 256 KB of proto"
