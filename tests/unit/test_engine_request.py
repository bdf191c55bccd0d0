"""completion_request_body: the exact vLLM /v1/completions bytes for each form of the SDK's fields."""

from __future__ import annotations

import json

import pytest

from shardserver.engine_request import completion_request_body

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
