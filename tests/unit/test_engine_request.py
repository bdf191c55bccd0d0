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
