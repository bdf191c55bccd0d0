"""CompletionDecoder: vLLM 0.30 completion bodies -> DecodedCompletion (exact values, every error path)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from codec_fixtures import (
    SPEC_EXAMPLE_BODY,
    choice_dict,
    dumps,
    f32,
    logprobs_object,
    prompt_row,
    realistic_case,
    render,
)
from shardserver.codec import TOPK_MASK_LOGPROB, CompletionDecoder, DecodedCompletion
from shardserver.errors import EngineBodyError

MASK = np.float32(TOPK_MASK_LOGPROB)


@pytest.fixture(scope="module")
def dec() -> CompletionDecoder:
    return CompletionDecoder()


def _choice(i=0, ids=(5, 6, 7), lps=(-0.5, -1.25, -9999.0), **kw):
    lp = None if lps is None else logprobs_object([f32(x) if x is not None else None for x in lps])
    return choice_dict(i, None if ids is None else list(ids), lp, **kw)


def _err(dec, body, *, where, msg, n=1, **kw) -> EngineBodyError:
    with pytest.raises(EngineBodyError) as ei:
        dec.decode(body, num_samples=n, **kw)
    e = ei.value
    assert e.where == where, (e.where, e.reason)
    assert msg in e.reason, e.reason
    return e


# --------------------------------------------------------------------------------------------
# The spec §6 example, byte for byte


def test_spec_example_exact(dec):
    out = dec.decode(SPEC_EXAMPLE_BODY, num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=1)
    assert isinstance(out, DecodedCompletion)
    (c,) = out.choices
    assert c.index == 0 and c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids.dtype == np.int32 and c.token_ids.tolist() == [220, 19, 13, 151643]
    assert c.logprobs.dtype == np.float32
    assert c.logprobs.tolist() == [
        -0.04190000146627426,
        -1.2999999523162842,
        -0.6930999755859375,
        0.0,
    ]
    plp = out.prompt_logprobs
    assert plp.dtype == np.float32 and plp.shape == (3,)
    assert math.isnan(plp[0])
    assert plp[1:].tolist() == [-6.091300010681152, -0.36329999566078186]
    # top-1 per position: position 1's actual token (rank 37) loses to 1156.
    assert out.topk_token_ids.dtype == np.int32 and out.topk_token_ids.shape == (3, 1)
    assert out.topk_token_ids.tolist() == [[0], [1156], [374]]
    assert out.topk_logprobs.dtype == np.float32
    assert out.topk_logprobs.tolist() == [[-99999.0], [-2.4475998878479004], [-0.36329999566078186]]
    assert out.prompt_cache_hit_tokens == 0
    assert not out.aborted


def test_spec_example_without_prompt_logprobs(dec):
    out = dec.decode(SPEC_EXAMPLE_BODY, num_samples=1)
    assert out.prompt_logprobs is None and out.topk_token_ids is None and out.topk_logprobs is None


def test_spec_example_topk_wider_than_rows(dec):
    out = dec.decode(SPEC_EXAMPLE_BODY, num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=3)
    assert out.topk_token_ids.tolist() == [[0, 0, 0], [1156, 4226, 0], [374, 0, 0]]
    assert out.topk_logprobs.tolist() == [
        [-99999.0] * 3,
        [-2.4475998878479004, -6.091300010681152, -99999.0],
        [-0.36329999566078186, -99999.0, -99999.0],
    ]


def test_topk_only_without_prompt_logprobs_flag(dec):
    out = dec.decode(SPEC_EXAMPLE_BODY, num_samples=1, topk_prompt_logprobs=1)
    assert out.prompt_logprobs is None
    assert out.topk_token_ids.tolist() == [[0], [1156], [374]]


def test_parser_reused_after_errors(dec):
    for _ in range(3):
        with pytest.raises(EngineBodyError):
            dec.decode(b'{"choices":[{"index":0,"token_ids":[1,null]}]}', num_samples=1)
        assert dec.decode(SPEC_EXAMPLE_BODY, num_samples=1).choices[0].token_ids.tolist() == [220, 19, 13, 151643]


def test_buffer_inputs(dec):
    for body in (bytearray(SPEC_EXAMPLE_BODY), memoryview(SPEC_EXAMPLE_BODY)):
        assert dec.decode(body, num_samples=1).choices[0].token_ids.tolist() == [220, 19, 13, 151643]


# --------------------------------------------------------------------------------------------
# Layouts and value forms


def test_n4_prompt_logprobs_copied_and_index_order(dec):
    rows = [None, prompt_row(11, f32(-1.5), [(12, f32(-0.25)), (13, f32(-0.75))], 2), prompt_row(12, f32(-0.5), [(12, f32(-0.5)), (9, f32(-2.0))], 2)]
    choices = [
        _choice(i, ids=[100 + i, 200 + i], lps=[-0.1 * (i + 1), -1.0], prompt_logprobs=rows, prompt_token_ids=[10, 11, 12])
        for i in range(4)
    ]
    choices[0]["finish_reason"] = "stop"
    choices[0]["stop_reason"] = 151645
    choices[1]["finish_reason"] = "repetition"
    choices[1]["stop_reason"] = "repetition_detected"
    choices[2]["stop_reason"] = "###"
    body = render(choices[::-1], prompt_tokens=3)  # array order != index order
    out = dec.decode(body, num_samples=4, prompt_logprobs=True, topk_prompt_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.token_ids.tolist() for c in out.choices] == [[100 + i, 200 + i] for i in range(4)]
    assert [c.logprobs.tolist() for c in out.choices] == [[f32(-0.1 * (i + 1)), f32(-1.0)] for i in range(4)]
    assert [c.finish_reason for c in out.choices] == ["stop", "repetition", "length", "length"]
    assert [c.stop_reason for c in out.choices] == [151645, "repetition_detected", "###", None]
    assert np.array_equal(out.prompt_logprobs, np.array([np.nan, -1.5, -0.5], np.float32), equal_nan=True)
    assert out.topk_token_ids.tolist() == [[0, 0], [12, 13], [12, 9]]
    assert out.topk_logprobs.tolist() == [[MASK, MASK], [-0.25, -0.75], [-0.5, -2.0]]


def test_prompt_ids_from_argument_and_key_order_ignored(dec):
    # Keys reordered numerically (as a JS proxy would); own token found by str(id), not position.
    row = {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}, "42": {"logprob": -2.0, "rank": 9, "decoded_token": "b"}}
    c = _choice(0, prompt_logprobs=[None, row])
    out = dec.decode(render([c]), num_samples=1, prompt_token_ids=np.array([7, 42]), prompt_logprobs=True, topk_prompt_logprobs=1)
    assert out.prompt_logprobs[1] == -2.0
    assert out.topk_token_ids.tolist() == [[0], [3]]


def test_topk_ties_keep_vllm_order(dec):
    row = {"5": {"logprob": -1.0, "rank": 1, "decoded_token": ""}, "6": {"logprob": -1.0, "rank": 1, "decoded_token": ""}, "4": {"logprob": -1.0, "rank": 1, "decoded_token": ""}}
    c = _choice(0, prompt_logprobs=[None, row], prompt_token_ids=[1, 5])
    out = dec.decode(render([c]), num_samples=1, topk_prompt_logprobs=2)
    assert out.topk_token_ids.tolist() == [[0, 0], [5, 6]]


def test_topk_k_plus_one_entries(dec):
    # actual token outside the top-k: k+1 entries, actual first; the top-k are the other k.
    row = prompt_row(9, f32(-7.0), [(1, f32(-0.1)), (2, f32(-0.2))], 2)
    assert list(row) == ["9", "1", "2"]
    c = _choice(0, prompt_logprobs=[None, row], prompt_token_ids=[3, 9])
    out = dec.decode(render([c]), num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=2)
    assert out.prompt_logprobs[1] == f32(-7.0)
    assert out.topk_token_ids.tolist() == [[0, 0], [1, 2]]
    assert out.topk_logprobs[1].tolist() == [f32(-0.1), f32(-0.2)]


def test_null_rows_inside_prompt_are_nan_and_masked(dec):
    c = _choice(0, prompt_logprobs=[None, None, prompt_row(3, -1.0, [], 0)], prompt_token_ids=[1, 2, 3])
    out = dec.decode(render([c]), num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=1)
    assert np.isnan(out.prompt_logprobs[:2]).all() and out.prompt_logprobs[2] == -1.0
    assert out.topk_token_ids.tolist() == [[0], [0], [3]]
    assert out.topk_logprobs.tolist() == [[MASK], [MASK], [-1.0]]


def test_abort_with_short_prompt_logprobs(dec):
    c = _choice(0, ids=[], lps=[], finish_reason="abort", prompt_logprobs=[None, prompt_row(8, -3.0, [], 0)], prompt_token_ids=[7, 8, 9, 10])
    out = dec.decode(render([c]), num_samples=1, prompt_logprobs=True, topk_prompt_logprobs=2)
    assert out.aborted
    assert out.choices[0].token_ids.size == 0 and out.choices[0].logprobs.size == 0
    assert np.array_equal(out.prompt_logprobs, np.array([np.nan, -3.0, np.nan, np.nan], np.float32), equal_nan=True)
    assert out.topk_token_ids.shape == (4, 2) and out.topk_token_ids[1].tolist() == [8, 0]


def test_abort_with_null_prompt_logprobs(dec):
    c = _choice(0, ids=[], lps=[], finish_reason="abort", prompt_logprobs=None, prompt_token_ids=[7, 8])
    out = dec.decode(render([c]), num_samples=1, prompt_logprobs=True)
    assert out.aborted and np.isnan(out.prompt_logprobs).all()


def test_logprobs_null_means_none(dec):
    out = dec.decode(render([_choice(0, lps=None)]), num_samples=1)
    assert out.choices[0].logprobs is None
    assert out.choices[0].token_ids.tolist() == [5, 6, 7]


def test_empty_generation_length(dec):
    out = dec.decode(render([_choice(0, ids=[], lps=[], finish_reason="length")]), num_samples=1)
    c = out.choices[0]
    assert c.token_ids.shape == (0,) and c.token_ids.dtype == np.int32
    assert c.logprobs.shape == (0,) and c.logprobs.dtype == np.float32


def test_vllm_011_layout(dec):
    c = _choice(0, version="0.11", prompt_logprobs=[None, prompt_row(2, -1.0, [], 0)], prompt_token_ids=[1, 2])
    body = render([c], version="0.11")
    assert b"routed_experts" not in body and b"metrics" not in body
    out = dec.decode(body, num_samples=1, prompt_logprobs=True)
    assert out.choices[0].token_ids.tolist() == [5, 6, 7]
    assert out.prompt_logprobs[1] == -1.0


def test_pre_token_ids_layout_is_an_error(dec):
    body = render([_choice(0, version="0.10")], version="0.10")
    _err(dec, body, where="choices[0].token_ids", msg="return_token_ids")


def test_exponent_floats_both_styles_and_negative_zero(dec):
    body = (
        b'{"choices":[{"index":0,"logprobs":{"token_logprobs":[-1.1920928244535389e-07,-1.1920928244535389e-7,'
        b'-2.499999993688107E-05,-0.0,0,-3,1.5]},"finish_reason":"length","stop_reason":null,'
        b'"token_ids":[1,2,3,4,5,6,7]}]}'
    )
    lp = dec.decode(body, num_samples=1).choices[0].logprobs
    want = [f32(-1.1920928244535389e-07)] * 2 + [f32(-2.499999993688107e-05), -0.0, 0.0, -3.0, 1.5]
    assert lp.tolist() == want
    assert math.copysign(1.0, float(lp[3])) == -1.0  # -0.0 kept
    assert lp[6] == 1.5  # positive (raw_logits mode) allowed


def test_clamp_value_kept(dec):
    out = dec.decode(render([_choice(0, lps=[-9999.0, -9999.0, -0.5])]), num_samples=1)
    assert out.choices[0].logprobs.tolist() == [-9999.0, -9999.0, -0.5]


def test_non_ascii_tokens_keys_and_unknown_fields(dec):
    tokens = ["é", "\ufffd", "🙂\n\"\\"]
    lp = logprobs_object([f32(-0.1), f32(-0.2), f32(-0.3)], tokens=tokens, top_logprobs=[{"é": -0.1, "\u2028": -0.5}, {"": -0.2}, {"🙂\n\"\\": -0.3}])
    c = choice_dict(0, [1, 2, 3], lp, text="é\ufffd🙂", finish_reason="stop", stop_reason="⏹")
    d = {"ünknown": {"ключ": [1, "ß"]}, "choices": [c], "metrics": {"a": None}}
    body = dumps(d)
    assert "🙂".encode() in body
    out = dec.decode(body, num_samples=1)
    assert out.choices[0].token_ids.tolist() == [1, 2, 3]
    assert out.choices[0].stop_reason == "⏹"


def test_cached_tokens(dec):
    out = dec.decode(render([_choice()], cached_tokens=2048), num_samples=1)
    assert out.prompt_cache_hit_tokens == 2048
    out = dec.decode(render([_choice()], cached_tokens=None), num_samples=1)
    assert out.prompt_cache_hit_tokens == 0


def test_whitespace_and_any_key_order(dec):
    body = b' {\n "choices" : [ { "token_ids" : [ 3 , 4 ] , "finish_reason" : "stop" , "index" : 0 ,\n "logprobs" : { "token_logprobs" : [ -1.0 , -2.0 ] } } ] } \n'
    out = dec.decode(body, num_samples=1)
    assert out.choices[0].token_ids.tolist() == [3, 4] and out.choices[0].logprobs.tolist() == [-1.0, -2.0]


def test_realistic_bodies_roundtrip(dec):
    rng = np.random.default_rng(7)
    for n, k in ((1, 5), (3, 0), (2, -1)):
        case = realistic_case(rng, n=n, gen_tokens=300, prompt_len=120 if k >= 0 else 0, k=k)
        out = dec.decode(
            case.body,
            num_samples=n,
            prompt_token_ids=case.prompt_ids if k >= 0 else None,
            prompt_logprobs=k >= 0,
            topk_prompt_logprobs=max(k, 0),
        )
        for c, toks, lps in zip(out.choices, case.tokens, case.logprobs):
            assert np.array_equal(c.token_ids, toks) and np.array_equal(c.logprobs, lps)
        if k >= 0:
            assert np.array_equal(out.prompt_logprobs, case.prompt_lp, equal_nan=True)
        if k > 0:
            assert np.array_equal(out.topk_token_ids, case.topk_ids)
            assert np.array_equal(out.topk_logprobs, case.topk_lp)


# --------------------------------------------------------------------------------------------
# Error bodies: one EngineBodyError each, with the JSON path


def test_err_empty_body(dec):
    _err(dec, b"", where="$", msg="empty body")
    _err(dec, b"   \n", where="$", msg="empty body")


def test_err_html(dec):
    _err(dec, b"<html><body>502 Bad Gateway</body></html>", where="$", msg="HTML")


def test_err_not_json(dec):
    _err(dec, b"Failed to deserialize the JSON body into the target type: logprobs", where="$", msg="not valid JSON")


def test_err_truncated(dec):
    _err(dec, SPEC_EXAMPLE_BODY[:700], where="$", msg="truncated")


def test_err_nan_literal(dec):
    body = b'{"choices":[{"index":0,"logprobs":{"token_logprobs":[NaN]},"finish_reason":"stop","token_ids":[1]}]}'
    _err(dec, body, where="$", msg="NaN")


def test_err_top_level_not_object(dec):
    _err(dec, b"[1,2]", where="$", msg="array, expected an object")
    _err(dec, b'"x"', where="$", msg="string, expected an object")


def test_err_error_envelope(dec):
    body = b'{"error":{"message":"n must be 1 when using greedy sampling, got 4.","type":"BadRequestError","param":null,"code":400}}'
    e = _err(dec, body, where="error", msg="n must be 1 when using greedy sampling, got 4.")
    assert "BadRequestError" in e.reason and "400" in e.reason


def test_err_detail(dec):
    _err(dec, b'{"detail":"Not Found"}', where="detail", msg="Not Found")


def test_err_old_flat_error(dec):
    body = b'{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError","param":null,"code":404}'
    _err(dec, body, where="object", msg="The model `x` does not exist.")


def test_err_missing_choices(dec):
    _err(dec, b'{"id":"cmpl-1","object":"text_completion"}', where="choices", msg="missing")
    _err(dec, b'{"choices":null}', where="choices", msg="missing")


def test_err_empty_choices(dec):
    _err(dec, render([]), where="choices", msg="empty")


def test_err_choices_mistyped(dec):
    _err(dec, b'{"choices":{"index":0}}', where="choices", msg="expected an array")
    _err(dec, b'{"choices":[1]}', where="choices[0]", msg="expected an object")


def test_err_wrong_number_of_choices(dec):
    _err(dec, render([_choice(0), _choice(1)]), n=3, where="choices", msg="2 choices, expected num_samples=3")


def test_err_duplicate_index(dec):
    _err(dec, render([_choice(0), _choice(0)]), n=2, where="choices[1].index", msg="duplicate index 0")


def test_err_index_out_of_range_or_missing(dec):
    _err(dec, render([_choice(0), _choice(2)]), n=2, where="choices[1].index", msg="outside [0, 2)")
    c = _choice(0)
    del c["index"]
    _err(dec, render([c]), where="choices[0].index", msg="expected an int, got null")
    _err(dec, render([_choice("0")]), where="choices[0].index", msg="expected an int, got string")


def test_err_missing_token_ids(dec):
    _err(dec, render([_choice(0, ids=None)]), where="choices[0].token_ids", msg="return_token_ids")


def test_err_token_ids_mistyped(dec):
    c = _choice(0)
    c["token_ids"] = "5 6 7"
    _err(dec, render([c]), where="choices[0].token_ids", msg="expected an array of ints, got string")
    c["token_ids"] = [5, 6.0, 7]
    _err(dec, render([c]), where="choices[0].token_ids[1]", msg="expected an int token id, got number")
    c["token_ids"] = [5, None, 7]
    _err(dec, render([c]), where="choices[0].token_ids[1]", msg="got null")
    c["token_ids"] = [5, True, 7]
    _err(dec, render([c]), where="choices[0].token_ids[1]", msg="got boolean")
    c["token_ids"] = [5, [6, 1], 7]
    _err(dec, render([c]), where="choices[0].token_ids", msg="nested")


def test_err_token_id_out_of_int32(dec):
    c = _choice(0)
    c["token_ids"] = [5, 2**31, 7]
    _err(dec, render([c]), where="choices[0].token_ids[1]", msg="outside [0, 2^31)")
    c["token_ids"] = [5, 6, -1]
    _err(dec, render([c]), where="choices[0].token_ids[2]", msg="outside [0, 2^31)")
    c["token_ids"] = [2**63 + 1, 6, 7]  # uint64 in simdjson
    _err(dec, render([c]), where="choices[0].token_ids[0]", msg="outside [0, 2^31)")


def test_err_length_mismatch(dec):
    _err(dec, render([_choice(0, ids=[1, 2, 3], lps=[-1.0, -2.0])]), where="choices[0].logprobs.token_logprobs", msg="2 logprobs for 3 token_ids")


def test_err_parallel_lists_mismatch(dec):
    c = _choice(0)
    c["logprobs"]["tokens"] = ["a", "b"]
    _err(dec, render([c]), where="choices[0].logprobs.tokens", msg="2 entries for 3 token_ids")


def test_err_null_sampled_logprob(dec):
    _err(dec, render([_choice(0, lps=[-1.0, None, -2.0])]), where="choices[0].logprobs.token_logprobs[1]", msg="echo")


def test_err_logprob_mistyped(dec):
    c = _choice(0)
    c["logprobs"]["token_logprobs"] = [-1.0, "x", -2.0]
    _err(dec, render([c]), where="choices[0].logprobs.token_logprobs[1]", msg="expected a number, got string")
    c["logprobs"]["token_logprobs"] = [-1.0, False, -2.0]
    _err(dec, render([c]), where="choices[0].logprobs.token_logprobs[1]", msg="got boolean")
    c["logprobs"] = [1, 2]
    _err(dec, render([c]), where="choices[0].logprobs", msg="expected an object or null, got array")
    c["logprobs"] = {"tokens": []}
    _err(dec, render([c]), where="choices[0].logprobs.token_logprobs", msg="missing or null")


def test_err_non_finite_logprob(dec):
    body = b'{"choices":[{"index":0,"logprobs":{"token_logprobs":[-1.0,1e39]},"finish_reason":"stop","token_ids":[1,2]}]}'
    _err(dec, body, where="choices[0].logprobs.token_logprobs[1]", msg="non-finite")
    body = b'{"choices":[{"index":0,"logprobs":{"token_logprobs":[-1e999]},"finish_reason":"stop","token_ids":[1]}]}'
    _err(dec, body, where="$", msg="not valid JSON")


def test_err_unknown_finish_reason(dec):
    _err(dec, render([_choice(0, finish_reason="stop_token")]), where="choices[0].finish_reason", msg="unknown finish_reason 'stop_token'")
    _err(dec, render([_choice(0, finish_reason="error")]), where="choices[0].finish_reason", msg="unknown finish_reason 'error'")
    c = _choice(0)
    c["finish_reason"] = None
    _err(dec, render([c]), where="choices[0].finish_reason", msg="missing or null")
    c["finish_reason"] = 1
    _err(dec, render([c]), where="choices[0].finish_reason", msg="expected a string")


def test_err_stop_reason_mistyped(dec):
    _err(dec, render([_choice(0, stop_reason=1.5)]), where="choices[0].stop_reason", msg="expected an int, a string or null")


def test_err_cached_tokens_mistyped(dec):
    d = {"choices": [_choice()], "usage": {"prompt_tokens_details": {"cached_tokens": "9"}}}
    _err(dec, dumps(d), where="usage.prompt_tokens_details.cached_tokens", msg="expected an int")


def test_err_prompt_ids_differ(dec):
    c = _choice(0, prompt_token_ids=[1, 2, 3])
    _err(dec, render([c]), where="choices[0].prompt_token_ids", msg="differs", prompt_token_ids=np.array([1, 2, 4]))
    _err(dec, render([c]), where="choices[0].prompt_token_ids", msg="differs", prompt_token_ids=np.array([1, 2]))


def test_err_prompt_ids_unknown(dec):
    c = _choice(0, prompt_logprobs=[None, prompt_row(2, -1.0, [], 0)])
    _err(dec, render([c]), where="choices[0].prompt_token_ids", msg="unknown", prompt_logprobs=True)


def test_err_prompt_logprobs_missing(dec):
    c = _choice(0, prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs", msg="missing or null", prompt_logprobs=True)


def test_err_prompt_logprobs_wrong_length(dec):
    c = _choice(0, prompt_logprobs=[None], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs", msg="1 positions for a 2-token prompt", prompt_logprobs=True)
    c = _choice(0, prompt_logprobs=[None, prompt_row(2, -1.0, [], 0), None], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs", msg="3 positions for a 2-token prompt", prompt_logprobs=True)


def test_err_prompt_logprobs_own_token_missing(dec):
    c = _choice(0, prompt_logprobs=[None, prompt_row(5, -1.0, [], 0)], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs[1]", msg="no entry for the prompt token 2", prompt_logprobs=True)


def test_err_prompt_logprobs_entry_mistyped(dec):
    c = _choice(0, prompt_logprobs=[None, {"2": -1.0}], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where='choices[0].prompt_logprobs[1]["2"]', msg="expected an object", prompt_logprobs=True)
    c = _choice(0, prompt_logprobs=[None, {"2": {"logprob": None, "rank": 1}}], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where='choices[0].prompt_logprobs[1]["2"].logprob', msg="missing or null", prompt_logprobs=True)
    row = {"2": {"logprob": -1.0, "rank": 1}, "7": {"logprob": "x", "rank": 2}}
    c = _choice(0, prompt_logprobs=[None, row], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where='choices[0].prompt_logprobs[1]["7"].logprob', msg="expected a number", topk_prompt_logprobs=2)
    c = _choice(0, prompt_logprobs=[None, [1, 2]], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs[1]", msg="expected an object or null, got array", prompt_logprobs=True)
    c = _choice(0, prompt_logprobs={"1": 2}, prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs", msg="expected an array", prompt_logprobs=True)


def test_err_prompt_logprobs_bad_key(dec):
    for bad in ("x1", "+7", "\u0663", "99999999999"):
        row = {"2": {"logprob": -1.0, "rank": 1}, bad: {"logprob": -0.5, "rank": 1}}
        c = _choice(0, prompt_logprobs=[None, row], prompt_token_ids=[1, 2])
        _err(dec, render([c]), where="choices[0].prompt_logprobs[1]", msg="is not a token id", topk_prompt_logprobs=1)


def test_invalid_arguments(dec):
    with pytest.raises(ValueError):
        dec.decode(SPEC_EXAMPLE_BODY, num_samples=0)
    with pytest.raises(ValueError):
        dec.decode(SPEC_EXAMPLE_BODY, num_samples=1, topk_prompt_logprobs=-1)


def test_err_prompt_logprob_beyond_float32(dec):
    row = {"2": {"logprob": -1e39, "rank": 1, "decoded_token": "x"}}
    c = _choice(0, prompt_logprobs=[None, row], prompt_token_ids=[1, 2])
    _err(dec, render([c]), where="choices[0].prompt_logprobs[1]", msg="non-finite", prompt_logprobs=True)


def test_dropped_error_keeps_parser_usable(dec):
    # An EngineBodyError kept alive by the caller must not pin simdjson proxies.
    kept = []
    parser = dec._parser
    for bad in (b'{"choices":[{"index":0,"token_ids":[1],"finish_reason":"nope"}]}', b"[]"):
        with pytest.raises(EngineBodyError) as ei:
            dec.decode(bad, num_samples=1)
        kept.append(ei)
    assert dec.decode(SPEC_EXAMPLE_BODY, num_samples=1).choices[0].token_ids.tolist() == [220, 19, 13, 151643]
    assert dec._parser is parser  # reused, not replaced by the fallback
