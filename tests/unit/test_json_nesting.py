"""The JSON nesting limit of request bodies is MAX_JSON_NESTING levels, not however deep the ASGI
stack above the handler happens to be (issue 12 item 2: the fast path is shallower than FastAPI's
routing, so the stdlib parser alone would accept deeper bodies there)."""

import json

import pytest

from shardserver.api.common import MAX_JSON_NESTING, json_nesting


@pytest.mark.parametrize("body, depth", [
    (b"7", 0), (b'"[[[{{{"', 0), (b"[]", 1), (b"{}", 1), (b'{"a": [1, {"b": "]]]}}}"}]}', 3),
    (b'["\\"[[[", [[]]]', 3), (b'{"prompt": {"chunks": [{"tokens": [1, 2, 3]}]}}', 5),
    (b"[" * 900 + b"]" * 900, 900), (b"[" * 901 + b"]" * 901, 901),
    (b'{"a":' * 965 + b"1" + b"}" * 965, 965), ('["é\\u005b", {"ü": []}]'.encode(), 3),
])
def test_json_nesting(body, depth):
    if depth < 950:
        json.loads(body)  # a valid document
    assert json_nesting(body) == depth
    assert MAX_JSON_NESTING == 900
