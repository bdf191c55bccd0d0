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


def _read(body: bytes, max_bytes: int = 1 << 20):
    """read_json on a starlette Request fed ``body`` in two ASGI messages."""
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    from shardserver.api.common import read_json

    msgs = [{"type": "http.request", "body": body[:3], "more_body": True},
            {"type": "http.request", "body": body[3:], "more_body": False}]

    async def receive():
        return msgs.pop(0)

    app = SimpleNamespace(state=SimpleNamespace(frontend=SimpleNamespace(
        cfg=SimpleNamespace(server=SimpleNamespace(max_request_bytes=max_bytes)))))
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}
    return asyncio.run(read_json(Request(scope, receive)))


@pytest.mark.parametrize("body", [
    b'{"seq_id": 123456789012345678901234567890, "x": -0, "y": 1E5, "z": 0.1e-400}',
    b'{"a": 1, "a": 2}', b'  {"s": "\\u0000\\u00e9\\ud83d\\ude00"} ', b'[1.7976931348623157e308, 5e-324]',
    b'{"f": NaN, "g": Infinity}', b'{"h": 1e400}', b'"\\ud800"', '{"u": "é"}'.encode("utf-16"),
    b'\xef\xbb\xbf{"bom": true}', b'',
])
def test_read_json_decodes_what_json_loads_decodes(body):
    """read_json's msgspec fast path (issue 12 item 2) yields json.loads's objects, types included;
    what msgspec refuses (NaN, 1e400, lone surrogates, UTF-16, a BOM) is left to json.loads."""
    got = _read(body)
    want = json.loads(body) if body else {}
    assert repr(got) == repr(want) and json.dumps(got) == json.dumps(want)


@pytest.mark.parametrize("body, message", [
    (b'{"a": [1, 2}', "request body is not valid JSON: Expecting ',' delimiter: line 1 column 12 (char 11)"),
    (b'{"a": "\x01"}', "request body is not valid JSON: Invalid control character at: line 1 column 8 (char 7)"),
    (b"[" * 901 + b"]" * 901, "request body is not valid JSON: arrays/objects nested too deeply"),
])
def test_read_json_errors_are_the_stdlib_messages(body, message):
    from shardserver.api.common import BodyError

    with pytest.raises(BodyError) as ei:
        _read(body)
    assert (ei.value.status, ei.value.message) == (400, message)
