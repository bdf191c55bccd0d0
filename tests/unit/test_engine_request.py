"""completion_request_body: the exact vLLM /v1/completions bytes for each form of the SDK's fields."""

from __future__ import annotations

import json

import pytest

from shardserver.engine_request import completion_request_body, context_window, parse_model_windows

BASE = dict(model="Qwen/Qwen3-8B", prompt=[1, 2, 3], n=2, max_tokens=16, temperature=0.7, top_p=0.9, top_k=-1,
            seed=None, stop=None, prompt_logprobs=None)
HEAD = (b'{"model":"Qwen/Qwen3-8B","prompt":[1,2,3],"n":2,"max_tokens":16,"temperature":0.7,"top_p":0.9,'
        b'"top_k":-1,"logprobs":1,"return_token_ids":true')


@pytest.mark.parametrize("fields, tail", [
    ({}, b"}"),
    ({"seed": 0}, b',"seed":0}'),
    ({"prompt_logprobs": 0}, b',"prompt_logprobs":0}'),
    ({"seed": 42, "prompt_logprobs": 20, "stop": "\n\n"},
     b',"seed":42,"prompt_logprobs":20,"stop":["\\n\\n"],"skip_special_tokens":false}'),
    ({"stop": []}, b',"ignore_eos":true}'),
    ({"stop": [151643, 151645]}, b',"stop_token_ids":[151643,151645]}'),
    ({"stop": ["</s>", "END"]}, b',"stop":["</s>","END"],"skip_special_tokens":false}'),
    # Issue 10 input 5: a stop string that is a special token matches only with skip_special_tokens false.
    ({"stop": "<|im_end|>"}, b',"stop":["<|im_end|>"],"skip_special_tokens":false}'),
    ({"stop": ["<|im_end|>"]}, b',"stop":["<|im_end|>"],"skip_special_tokens":false}'),
])
def test_body_bytes(fields, tail):
    body = completion_request_body(**{**BASE, **fields})
    assert body == HEAD + tail
    json.loads(body)  # one valid JSON object


def test_model_windows_from_v1_models():
    """vLLM's GET /v1/models: base models carry max_model_len; a LoRA card has none and names its
    parent; a router may list bare ids."""
    body = json.dumps({"object": "list", "data": [
        {"id": "Qwen/Qwen3-8B", "object": "model", "root": "Qwen/Qwen3-8B", "parent": None, "max_model_len": 4096},
        {"id": "my-lora", "object": "model", "root": "/loras/a", "parent": "Qwen/Qwen3-8B"},
        {"id": "bare"}, {"id": "bool", "max_model_len": True}, "junk"]}).encode()
    windows = parse_model_windows(body)
    assert windows == {"Qwen/Qwen3-8B": 4096, "my-lora": 4096}
    assert context_window(windows, "my-lora", 65536) == (4096, True)
    assert context_window(windows, "other-name", 65536) == (4096, True)  # one engine, one window
    assert context_window({"a": 4096, "b": 8192}, "c", 65536) == (65536, False)
    assert context_window({}, "a", 65536) == (65536, False)
    with pytest.raises(ValueError):
        parse_model_windows(b'{"detail":"Not Found"}')
    with pytest.raises(ValueError):
        parse_model_windows(b"<html>")


def _reference_body(**f) -> bytes:
    """The body as one json.dumps of the whole object (the writer before the prompt went through
    msgspec): the bytes the request digest of a journaled future was computed over."""
    req = {"model": f["model"], "prompt": list(f["prompt"]), "n": f["n"], "max_tokens": f["max_tokens"],
           "temperature": f["temperature"], "top_p": f["top_p"], "top_k": f["top_k"],
           "logprobs": 1, "return_token_ids": True}
    if f["seed"] is not None:
        req["seed"] = f["seed"]
    if f["prompt_logprobs"] is not None:
        req["prompt_logprobs"] = f["prompt_logprobs"]
    stop = f["stop"]
    if isinstance(stop, str):
        req["stop"] = [stop]
    elif stop is not None and len(stop) == 0:
        req["ignore_eos"] = True
    elif stop:
        req["stop_token_ids" if all(isinstance(s, int) for s in stop) else "stop"] = stop
    if "stop" in req:
        req["skip_special_tokens"] = False
    return json.dumps(req, separators=(",", ":")).encode()


def test_body_bytes_equal_one_json_dumps_of_the_whole_request():
    """The prompt written by msgspec, the rest by json.dumps: byte for byte one json.dumps of the
    whole object, for long prompts, tuples, non-ASCII model names and stop strings (escaped as
    \\uXXXX), awkward floats, and an int subclass (the json.dumps fallback)."""
    import random

    class TokenId(int):
        pass

    rng = random.Random(7)
    cases = [dict(BASE, prompt=[]), dict(BASE, prompt=(5, 6)), dict(BASE, prompt=[TokenId(3), 4]),
             dict(BASE, prompt=[0, 2**31 - 1], model="模型/é", stop=["终", "\u2028"]),
             dict(BASE, temperature=1e-07, top_p=1.0, seed=2**63 - 1, stop=[])]
    for _ in range(200):
        stop = rng.choice([None, "\n", [], [rng.randrange(2**31)], ["a", "ß"]])
        cases.append(dict(BASE, prompt=[rng.randrange(2**31) for _ in range(rng.randrange(0, 9000))],
                          n=rng.randrange(1, 17), max_tokens=rng.randrange(1, 40000),
                          temperature=rng.random() * 2, top_p=rng.random(), top_k=rng.choice([-1, 1, 50]),
                          seed=rng.choice([None, 0, rng.randrange(2**32)]), stop=stop,
                          prompt_logprobs=rng.choice([None, 0, 5, 20])))
    for c in cases:
        assert completion_request_body(**c) == _reference_body(**c)


def _prompt_tokens_reference(req):
    """_prompt_tokens as it was before its msgspec fast path: pydantic per chunk, then min/max."""
    from shardserver.api.models import EncodedTextChunk
    from shardserver.api.sampling import _Refused

    tokens = []
    for i, chunk in enumerate(req.prompt.chunks):
        ctype = chunk.get("type", "encoded_text")
        if ctype != "encoded_text":
            raise _Refused(400, f"prompt.chunks[{i}]: chunk type {ctype!r} is not supported by this gateway "
                                "(token prompts only)")
        tokens.extend(EncodedTextChunk.model_validate(chunk).tokens)
    if tokens and not (0 <= min(tokens) and max(tokens) < 2**31):
        bad = next(t for t in tokens if not 0 <= t < 2**31)
        raise _Refused(400, f"prompt token id {bad} is outside [0, 2^31)")
    if not tokens:
        raise _Refused(400, "prompt has no tokens")
    return tokens


@pytest.mark.parametrize("chunks", [
    [{"tokens": [1, 2]}, {"type": "encoded_text", "tokens": [0, 2**31 - 1]}],
    [{"tokens": [1, 2**31]}], [{"tokens": [5]}, {"tokens": [-1, 3]}], [{"tokens": [2**70]}],
    [{"tokens": [True, 2]}], [{"tokens": [1.0]}], [{"tokens": ["7"]}], [{"tokens": [None]}],
    [{"tokens": [1]}, {"tokens": [[2]]}], [{"tokens": []}], [{"tokens": []}, {"tokens": [9]}],
    [{"type": "image", "tokens": [1]}], [{"type": None, "tokens": [1]}], [{}], [{"tokens": "12"}],
    [{"tokens": {"a": 1}}], [{"tokens": [3], "extra": 1}], [{"tokens": [2**31]}, {"tokens": ["x"]}],
])
def test_prompt_tokens_fast_path_answers_as_pydantic_did(chunks):
    """The msgspec conversion of a chunk's ids gives the same list, and every input it refuses
    the same error (pydantic's, the range message, the chunk-type message) as before it."""
    import pydantic

    from shardserver.api.models import SampleRequest
    from shardserver.api.sampling import _prompt_tokens, _Refused

    req = SampleRequest.model_validate({"sampling_session_id": "s", "prompt": {"chunks": chunks}})

    def outcome(fn):
        try:
            out = fn(req)
            return ("ok", out, [type(t) for t in out])
        except _Refused as exc:
            return ("refused", exc.status, exc.message)
        except pydantic.ValidationError as exc:
            return ("invalid", str(exc))

    assert outcome(_prompt_tokens) == outcome(_prompt_tokens_reference)
