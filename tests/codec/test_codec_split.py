"""The split parse of large bodies (shardserver.codec.split): same results as the whole parse.

Every case decodes the same bytes twice, with the split parse on (bodies of
``SPLIT_MIN_BYTES`` or more) and off, and compares the two ``SampleResponse`` encodings byte
for byte and the decoded arrays with the values the fixture computed independently. The
counters ``split_decodes`` / ``whole_decodes`` say which path a body took.
"""

from __future__ import annotations

import json
import mmap

import numpy as np
import pytest

from codec_fixtures import dumps, realistic_case
from shardserver.codec import CompletionDecoder, encode_sample_response
from shardserver.codec import decode as decode_mod
from shardserver.codec.split import SPLIT_MIN_BYTES, find_logprob_spans, searchable
from shardserver.engine_http import BodyBuffers
from shardserver.errors import EngineBodyError


def _whole(body, **kw):
    saved = decode_mod.SPLIT_MIN_BYTES
    decode_mod.SPLIT_MIN_BYTES = 1 << 62
    try:
        return CompletionDecoder().decode(body, **kw)
    finally:
        decode_mod.SPLIT_MIN_BYTES = saved


def _split(body, **kw):
    """Decode with the split parse; returns (result, took the split path)."""
    d = CompletionDecoder()
    out = d.decode(body, **kw)
    assert d.split_decodes + d.whole_decodes == 1
    return out, d.split_decodes == 1


def _kw(case, want_plp=False):
    return {"num_samples": case.n, "prompt_token_ids": case.prompt_ids if case.prompt_ids.size else None,
            "prompt_logprobs": want_plp, "topk_prompt_logprobs": max(case.k, 0) if want_plp else 0}


def _assert_case(out, case):
    for c, toks, lps in zip(out.choices, case.tokens, case.logprobs):
        assert c.token_ids.tobytes() == toks.tobytes()
        assert c.logprobs.tobytes() == lps.tobytes()


@pytest.mark.parametrize("n,tokens,prompt_len,k", [(1, 32768, 0, -1), (3, 4096, 0, -1), (1, 2048, 512, 3),
                                                   (2, 3000, 64, 0)])
def test_large_bodies_decode_alike_both_ways(n, tokens, prompt_len, k):
    case = realistic_case(np.random.default_rng(7 + n + tokens), n=n, gen_tokens=tokens, prompt_len=prompt_len, k=k)
    assert len(case.body) >= SPLIT_MIN_BYTES
    kw = _kw(case, want_plp=k >= 0)
    got, took = _split(case.body, **kw)
    ref = _whole(case.body, **kw)
    assert took
    _assert_case(got, case)
    assert encode_sample_response(got) == encode_sample_response(ref)
    if k >= 0:
        assert got.prompt_logprobs.tobytes() == case.prompt_lp.tobytes()
        if k > 0:
            assert got.topk_token_ids.tobytes() == case.topk_ids.tobytes()
            assert got.topk_logprobs.tobytes() == case.topk_lp.tobytes()


def test_the_receive_buffer_is_searched_in_place_and_reused_after():
    case = realistic_case(np.random.default_rng(3), n=2, gen_tokens=6000)
    bufs = BodyBuffers(keep_bytes=64 << 20)
    view = bufs.take(len(case.body))
    view[:] = case.body
    assert isinstance(searchable(view), mmap.mmap)  # no copy of the body to search it
    d = CompletionDecoder()
    out = d.decode(view, num_samples=2)
    assert d.split_decodes == 1
    _assert_case(out, case)
    bufs.give(view)
    assert bufs.kept > 0  # no view of the buffer outlived the decode: it is kept for reuse
    again = bufs.take(len(case.body))
    assert bufs.reused == 1
    bufs.give(again)


def _big_choice(tokens: list[str], lps: list[float], ids: list[int], text: str = "x") -> dict:
    offs = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()
    return {"index": 0, "text": text,
            "logprobs": {"text_offset": offs, "token_logprobs": lps, "tokens": tokens,
                         "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)]},
            "finish_reason": "stop", "stop_reason": "]},\"finish_reason\":", "token_ids": ids,
            "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}


def _body(choices: list[dict]) -> bytes:
    return dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": choices,
                  "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1,
                            "prompt_tokens_details": {"cached_tokens": 5}}})


@pytest.mark.parametrize("with_open_bracket", [False, True])
def test_strings_that_spell_the_patterns_do_not_move_the_spans(with_open_bracket):
    # Tokens and text holding every pattern the search uses, and more than 64 "]" (the end
    # search's hop limit) before the real end of the logprobs object. A "[" in tokens or
    # top_logprobs is not told apart from a structural one (split._top_logprobs_open): such a body
    # takes the whole parse, with the same result.
    n = 9000
    rng = np.random.default_rng(11)
    patterns = ["]", ']},"finish_reason":', "\\]", "é]", " w", '],"top_logprobs":', ']}},"finish_reason":']
    if with_open_bracket:
        patterns += [',"logprobs":{"text_offset":[', '],"token_logprobs":[', '],"top_logprobs":[']
    tokens = [patterns[i % len(patterns)] for i in range(n)]
    lps = [float(np.float32(-x)) for x in rng.exponential(1.0, n)]
    ids = rng.integers(0, 151000, n).tolist()
    text = ',"logprobs":{"text_offset":[1],"token_logprobs":[2]},"finish_reason":"stop"' * 50
    body = _body([_big_choice(tokens, lps, ids, text)])
    assert body.count(b"]") > 1000
    got, took = _split(body, num_samples=1)
    assert took != with_open_bracket
    c = got.choices[0]
    assert (c.token_ids.tolist(), c.logprobs.tolist(), c.stop_reason) == (ids, lps, ']},"finish_reason":')
    assert got.prompt_cache_hit_tokens == 5
    assert encode_sample_response(got) == encode_sample_response(_whole(body, num_samples=1))


@pytest.mark.parametrize("how", ["logprobs null", "whitespace", "other key order", "top_logprobs null",
                                 "too few choices"])
def test_other_layouts_are_parsed_whole(how):
    n = 4000
    rng = np.random.default_rng(5)
    tokens = [f" t{i}" for i in range(n)]
    lps = [float(np.float32(-x)) for x in rng.exponential(1.0, n)]
    ids = rng.integers(0, 151000, n).tolist()
    ch = _big_choice(tokens, lps, ids)
    num = 1
    if how == "logprobs null":
        ch["logprobs"] = None
        ch["text"] = "y" * SPLIT_MIN_BYTES
    elif how == "other key order":
        lp = ch["logprobs"]
        ch["logprobs"] = {"token_logprobs": lp["token_logprobs"], "text_offset": lp["text_offset"],
                          "tokens": lp["tokens"], "top_logprobs": lp["top_logprobs"]}
    elif how == "top_logprobs null":
        ch["logprobs"]["top_logprobs"] = None
    elif how == "too few choices":
        num = 2
    body = json.dumps(json.loads(_body([ch])), indent=1).encode() if how == "whitespace" else _body([ch])
    assert len(body) >= SPLIT_MIN_BYTES
    d = CompletionDecoder()
    if how == "too few choices":
        with pytest.raises(EngineBodyError) as ei:
            d.decode(body, num_samples=num)
        assert (ei.value.where, ei.value.reason) == ("choices", "1 choices, expected num_samples=2")
    else:
        got = d.decode(body, num_samples=num)
        assert got.choices[0].token_ids.tolist() == ids
        assert got.choices[0].logprobs is None if how == "logprobs null" else got.choices[0].logprobs.tolist() == lps
    assert (d.split_decodes, d.whole_decodes) == (0, 1)


def test_errors_are_the_whole_parse_errors():
    n = 5000
    tokens = [f" t{i}" for i in range(n)]
    lps = [-0.5] * n
    ids = list(range(n))
    ch = _big_choice(tokens, lps[:-1], ids)  # one logprob short
    body = _body([ch])
    d = CompletionDecoder()
    with pytest.raises(EngineBodyError) as ei:
        d.decode(body, num_samples=1)
    assert (ei.value.where, ei.value.reason) == ("choices[0].logprobs.token_logprobs", f"{n - 1} logprobs for {n} token_ids")
    ch = _big_choice(tokens, lps, ids)
    ch["finish_reason"] = "exploded"
    with pytest.raises(EngineBodyError) as ei:
        d.decode(_body([ch]), num_samples=1)
    assert ei.value.where == "choices[0].finish_reason"
    bad = _body([_big_choice(tokens, lps, ids)]).replace(b'"token_logprobs":[-0.5,', b'"token_logprobs":[null,', 1)
    with pytest.raises(EngineBodyError) as ei:
        d.decode(bad, num_samples=1)
    assert ei.value.where == "choices[0].logprobs.token_logprobs[0]"
    assert d.split_decodes == 0


def test_unused_logprobs_fields_are_not_read_on_the_split_path():
    # The documented difference: garbage in top_logprobs (a field the gateway never reads) fails
    # the whole parse but not the split parse, whose result is the clean body's.
    n = 5000
    tokens = [f" t{i}" for i in range(n)]
    lps = [float(np.float32(-i / n)) for i in range(n)]
    ids = list(range(n))
    clean = _body([_big_choice(tokens, lps, ids)])
    dirty = clean.replace(b'{" t7":', b'{" t7" -', 1)
    assert dirty != clean
    with pytest.raises(EngineBodyError):
        _whole(dirty, num_samples=1)
    got, took = _split(dirty, num_samples=1)
    assert took
    assert encode_sample_response(got) == encode_sample_response(_whole(clean, num_samples=1))


def test_find_logprob_spans_offsets():
    body = _body([_big_choice([" a", " b"], [-1.0, -2.0], [1, 2])])
    spans = find_logprob_spans(body, len(body), 1)
    (s, e), = spans.objects
    (a, b), = spans.arrays
    assert body[s:e] == b'{"text_offset":[0,2],"token_logprobs":[-1.0,-2.0],"tokens":[" a"," b"],' \
                        b'"top_logprobs":[{" a":-1.0},{" b":-2.0}]}'
    assert body[a:b] == b"[-1.0,-2.0]"
    assert find_logprob_spans(body, len(body), 2) is None
    # A receive buffer holds stale bytes past the body: nothing is matched across n_bytes.
    for cut in (e - 1, b + 5):
        assert find_logprob_spans(body, cut, 1) is None


# A logprobs object whose span (up to the first ``]},"finish_reason":``) is not one JSON value:
# the object closes early and the span runs on over later keys, into another object or past the
# choice. The skeleton is then valid JSON with the placeholder where it must be, but it is not
# the body with one value swapped (keys of the body are dropped from it, or keys of another
# object become the choice's). These bodies must decode exactly as the whole parse does.
_LP = b'{"text_offset":[0],"token_logprobs":[-1.0],"tokens":["a"],"top_logprobs":[{"a":-1.0}]}'
_PAD = b"p" * SPLIT_MIN_BYTES


@pytest.mark.parametrize("body,expect", [
    # keys after logprobs in the choice, the last one before finish_reason an object ending in an array
    (b'{"choices":[{"index":0,"text":"' + _PAD + b'","logprobs":' + _LP
     + b',"stop_reason":7,"x":{"z":[]},"finish_reason":"stop","token_ids":[5]}]}', ([5], 7)),
    (b'{"choices":[{"index":0,"text":"' + _PAD + b'","logprobs":' + _LP
     + b',"token_ids":[5],"x":{"z":[]},"finish_reason":"stop","token_ids":[6]}]}', ([5], None)),
    # the span runs past the choice into an object of another top-level array
    (b'{"choices":[{"index":0,"text":"' + _PAD + b'","finish_reason":"stop","token_ids":[5],"logprobs":' + _LP
     + b'}],"other":[{"q":{"w":[]},"finish_reason":"length","stop_reason":7}],"usage":null}', ([5], None)),
])
def test_a_span_that_is_not_the_logprobs_object_is_parsed_whole(body, expect):
    assert len(body) >= SPLIT_MIN_BYTES
    d = CompletionDecoder()
    got = d.decode(body, num_samples=1)
    c = got.choices[0]
    assert (c.token_ids.tolist(), c.logprobs.tolist(), c.finish_reason, c.stop_reason) == (
        expect[0], [-1.0], "stop", expect[1])
    assert (d.split_decodes, d.whole_decodes) == (0, 1)


def test_a_span_that_swallows_the_next_choice_is_parsed_whole():
    # Two choices; the span of choice 0's logprobs runs into choice 1, so the skeleton has one
    # choice: the whole parse's error must be raised, not a one-choice result.
    body = (b'{"choices":[{"index":0,"text":"' + _PAD + b'","logprobs":' + _LP
            + b'},{"index":1,"q":{"w":[]},"finish_reason":"stop","token_ids":[5]}]}')
    d = CompletionDecoder()
    with pytest.raises(EngineBodyError) as ei:
        d.decode(body, num_samples=1)
    assert (ei.value.where, ei.value.reason) == ("choices", "2 choices, expected num_samples=1")
    assert (d.split_decodes, d.whole_decodes) == (0, 1)
