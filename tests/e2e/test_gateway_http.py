"""The gateway over raw HTTP: every endpoint, both encodings, sharding, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import BASE_MODEL, engine_body, expected_prompt_logprobs, expected_sequences

pytestmark = pytest.mark.timeout(120)


def _proto(body: bytes):
    from tinker.proto import tinker_public_pb2

    m = tinker_public_pb2.SampleResponse()
    m.ParseFromString(body)
    return m


def _submit(api, ssid, prompt, *, n=1, max_tokens=8, seed=3, seq_id=0, **extra):
    body = {"sampling_session_id": ssid, "seq_id": seq_id, "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": seed, "temperature": 1.0, "top_k": -1,
                                "top_p": 1.0}, "type": "sample", **extra}
    return api.post("/api/v1/asample", body)


def test_setup_endpoints(api):
    # The session-wide poller is on by default (futures.retrieve_futures; tests/e2e/test_poller.py).
    st, h, b = api.post("/api/v1/client/config", {"sdk_version": "0.38.0"})
    assert (st, json.loads(b)) == (200, {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": True})
    st, _, b = api.post("/api/v1/client/dynamic_config", {"sdk_version": "0.38.0"})
    assert (st, json.loads(b)) == (200, {"sample_cancel_enabled": True})
    st, _, b = api.post("/api/v1/create_session", {"tags": [], "user_metadata": {}, "type": "create_session"})
    assert st == 200
    sess = json.loads(b)
    assert sess["type"] == "create_session" and sess["session_id"].startswith("s-")
    st, _, b = api.post("/api/v1/session_heartbeat", {"session_id": sess["session_id"]})
    assert (st, json.loads(b)) == (200, {"type": "session_heartbeat"})
    st, _, b = api.post("/api/v1/telemetry", {"events": [], "session_id": sess["session_id"]})
    assert (st, json.loads(b)) == (200, {"status": "accepted"})
    st, _, b = api.post("/api/v1/create_sampling_session",
                        {"session_id": sess["session_id"], "sampling_session_seq_id": 0, "base_model": BASE_MODEL})
    assert st == 200
    ssid = json.loads(b)["sampling_session_id"]
    st, _, b = api.post("/api/v1/retrieve_futures", {"target": {"sampling_session_id": ssid}, "prev_cursor": 0,
                                                     "timeout": 0})
    # Nothing submitted in the session yet: no completions, the cursor stays where it was.
    assert (st, json.loads(b)) == (200, {"completions": [], "cursor": 0})
    st, _, b = api.post(f"/api/v1/samplers/{ssid}", None)
    assert st == 200
    assert json.loads(b) == {"sampler_id": ssid, "base_model": BASE_MODEL, "model_path": None}
    st, _, b = api.post(f"/api/v1/sessions/{sess['session_id']}/finish", {"reason": {"type": "success"}})
    assert st == 200


def test_health(api):
    st, h, b = api.post("/healthz", None)
    assert st == 200 and json.loads(b)["status"] == "ok"
    st, _, b = api.post("/readyz", None)
    # The embedded simulator reports its context window in GET /v1/models (issue 10).
    assert (st, json.loads(b)) == (200, {"status": "ready", "encoders": 2, "max_model_len": {BASE_MODEL: 65536}})


def test_sample_proto_and_json_forms(api):
    ssid = api.sampling_session()
    prompt = [5, 6, 7, 8, 9]
    st, h, b = _submit(api, ssid, prompt, n=2, max_tokens=12, seed=77)
    assert st == 200, b
    fut = json.loads(b)
    rid = fut["request_id"]
    assert fut["sample_sequence_ids"] == [f"{rid}:0", f"{rid}:1"]
    want = expected_sequences(engine_body(prompt, 2, 12, 77))

    st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid, "allow_metadata_only": True},
                        headers={"Accept": "application/x-protobuf"})
    assert st == 200 and h["content-type"] == "application/x-protobuf"
    m = _proto(b)
    assert len(m.sequences) == 2
    for seq, w in zip(m.sequences, want):
        assert np.frombuffer(seq.tokens, dtype="<i4").tolist() == w["tokens"]
        assert np.array_equal(np.frombuffer(seq.logprobs, dtype="<f4"), w["logprobs"])
        assert seq.stop_reason == (1 if w["stop_reason"] == "length" else 0)
    assert not m.HasField("prompt_logprobs")

    # The same future again, as JSON (pre-0.18.1 SDKs send Accept: application/json).
    st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/json"})
    assert st == 200 and h["content-type"].startswith("application/json")
    j = json.loads(b)
    assert j["type"] == "sample" and j["prompt_logprobs"] is None
    for seq, w in zip(j["sequences"], want):
        assert seq["tokens"] == w["tokens"]
        assert seq["logprobs"] == [float(x) for x in w["logprobs"]]
        assert seq["stop_reason"] == w["stop_reason"]


def test_prompt_logprobs_and_topk_proto(api):
    ssid = api.sampling_session()
    prompt = [101, 102, 103, 104, 105, 106]
    st, _, b = _submit(api, ssid, prompt, max_tokens=3, seed=1, prompt_logprobs=True, topk_prompt_logprobs=3)
    assert st == 200, b
    rid = json.loads(b)["request_id"]
    st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid}, headers={"Accept": "application/x-protobuf"})
    assert st == 200
    m = _proto(b)
    body = engine_body(prompt, 1, 3, 1, prompt_logprobs=3)
    lps, topk = expected_prompt_logprobs(body, prompt, 3)
    got = np.frombuffer(m.prompt_logprobs, dtype="<f4")
    assert np.isnan(got[0]) and lps[0] is None
    assert got[1:].tolist() == lps[1:]
    tk = m.topk_prompt_logprobs
    assert (tk.k, tk.length) == (3, len(prompt))
    ids = np.frombuffer(tk.token_ids, dtype="<i4").reshape(len(prompt), 3)
    vals = np.frombuffer(tk.logprobs, dtype="<f4").reshape(len(prompt), 3)
    assert ids[0].tolist() == [0, 0, 0] and vals[0].tolist() == [-99999.0] * 3
    for i in range(1, len(prompt)):
        assert [(int(a), float(v)) for a, v in zip(ids[i], vals[i])][:len(topk[i])] == topk[i]


def test_asample_is_idempotent_on_session_and_seq_id(api, server):
    ssid = api.sampling_session()
    st1, _, b1 = _submit(api, ssid, [1, 2, 3], seq_id=41)
    st2, _, b2 = _submit(api, ssid, [1, 2, 3], seq_id=41)
    st3, _, b3 = _submit(api, ssid, [1, 2, 3], seq_id=42)
    assert st1 == st2 == st3 == 200
    assert json.loads(b1)["request_id"] == json.loads(b2)["request_id"]
    assert json.loads(b3)["request_id"] != json.loads(b1)["request_id"]


def test_requests_land_on_both_encoders_and_front_ends(api):
    ssid = api.sampling_session()
    shards, fronts = set(), set()
    rids = []
    for i in range(40):
        st, h, b = _submit(api, ssid, [9, 9, i], seq_id=1000 + i, max_tokens=2)
        assert st == 200, b
        shards.add(h["x-shardserver-shard"])
        fronts.add(h["x-shardserver-front-end"])
        rids.append((json.loads(b)["request_id"], h["x-shardserver-front-end"]))
        if len(shards) == 2 and len(fronts) == 2 and i >= 8:
            break
    assert shards == {"0", "1"}
    assert fronts == {"0", "1"}
    # A retrieve served by the other front-end than the one that took the asample.
    crossed = 0
    for rid, fe in rids:
        for _ in range(20):
            st, h, b = api.post("/api/v1/retrieve_future", {"request_id": rid},
                                headers={"Accept": "application/x-protobuf"})
            assert st == 200
            if h["x-shardserver-front-end"] != fe:
                crossed += 1
                assert len(_proto(b).sequences) == 1
                break
        if crossed >= 2:
            break
    assert crossed >= 2


def test_unknown_and_foreign_future_ids(api):
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": "no-such-future"})
    assert st == 404 and "never issued" in json.loads(b)["error"]
    # Well-formed but with a forged MAC: never issued.
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": "f" + "0" * 8 + "-" + "1" * 32 + "-" + "2" * 16})
    assert st in (404, 410)
    ssid = api.sampling_session()
    _, _, b = _submit(api, ssid, [3, 3, 3], seq_id=7)
    rid = json.loads(b)["request_id"]
    forged = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": forged})
    assert st == 404
    # An ID of another run (different run prefix) answers 410 so the SDK resubmits.
    other_run = "f" + ("0" * 8 if rid[1:9] != "0" * 8 else "1" * 8) + rid[9:]
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": other_run})
    assert st == 410 and "earlier run" in json.loads(b)["error"]


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"num_samples": 1}, 400, "sampling_session_id"),
    ({"sampling_session_id": "x", "num_samples": "two", "prompt": {"chunks": [{"tokens": [1]}]}}, 400, "num_samples"),
    ({"sampling_session_id": "x", "prompt": {"chunks": [{"tokens": ["a"]}]}}, 400, "tokens"),
    ({"sampling_session_id": "x", "prompt": {"chunks": []}}, 400, "prompt.chunks"),
    ({"sampling_session_id": "x", "prompt": {"chunks": [{"tokens": [1]}]},
      "sampling_params": {"temperature": 9}}, 400, "temperature"),
])
def test_asample_bad_input(api, body, status, fragment):
    st, _, b = api.post("/api/v1/asample", body)
    assert st == status
    assert fragment in json.loads(b)["error"]


def test_asample_semantic_errors(api):
    ssid = api.sampling_session()
    st, _, b = _submit(api, "ss-forged.abc", [1])
    assert st == 404 and "sampling_session_id" in json.loads(b)["error"]
    st, _, b = api.post("/api/v1/asample", {"sampling_session_id": ssid, "prompt": {"chunks": [
        {"type": "image", "data": "AAAA", "format": "png"}]}})
    assert st == 400 and "not supported" in json.loads(b)["error"]
    st, _, b = _submit(api, ssid, [1], prompt_alt_tokens_k=2)
    assert st == 400 and "prompt_alt_tokens_k is not supported" in json.loads(b)["error"]
    st, _, b = _submit(api, ssid, [1], n=1000)
    assert st == 400 and "max_num_samples" in json.loads(b)["error"]


def test_integers_beyond_int64_are_400_naming_the_field(api):
    """seq_id of 2^64 used to pass validation and fail as a 500 when the control frame was encoded."""
    ssid = api.sampling_session()
    st, _, b = _submit(api, ssid, [1], seq_id=2**64)
    assert st == 400 and "seq_id" in json.loads(b)["error"]
    st, _, b = _submit(api, ssid, [1], seq_id=2**63 - 1)
    assert st == 200 and json.loads(b)["request_id"].startswith("f")


def test_oversized_body_is_413(api, server):
    """A Content-Length over server.max_request_bytes is refused before the body is read."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (17 * 1024 * 1024))
        resp = b""
        while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            resp += chunk
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert "max_request_bytes" in json.loads(body)["error"]


def test_retrieve_bad_body(api):
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": 12})
    assert st == 400 and "request_id" in json.loads(b)["error"]
    st, _, b = api.post("/api/v1/retrieve_future", b"[")
    assert st == 400


def test_training_endpoints_are_refused(api):
    st, _, b = api.post("/api/v1/forward_backward", {})
    assert st == 501 and "not supported by this gateway" in json.loads(b)["error"]
    st, _, b = api.post("/api/v1/no_such_thing", {})
    assert st == 404


def test_a_served_path_under_another_method_is_405_naming_the_method(server):
    """Found by a break test: ``GET /api/v1/asample`` answered 404 "no such endpoint" (the
    ``/api/v1/`` catch-all took it); the endpoint exists, for POST."""
    from shardserver.testing import http_json

    for path in ("/api/v1/asample", "/api/v1/retrieve_future", "/api/v1/create_sampling_session"):
        st, h, b = http_json(server.url + path, method="GET")
        assert (st, h["allow"], json.loads(b)) == (405, "POST", {"error": f"{path} does not take GET: use POST"})
    st, _, b = http_json(server.url + "/api/v1/no_such_thing", method="GET")
    assert (st, json.loads(b)) == (404, {"error": "no such endpoint: /api/v1/no_such_thing"})


def test_token_ids_out_of_int32_range_are_400(api):
    ssid = api.sampling_session()
    for bad in (2**31 + 5, -1):
        st, _, b = _submit(api, ssid, [1, bad], prompt_logprobs=True)
        assert st == 400 and f"prompt token id {bad} is outside [0, 2^31)" in json.loads(b)["error"]
    # Nothing was registered: a resubmission with a valid prompt and the same seq_id is a new request.
    st, _, b = _submit(api, ssid, [1, 2], prompt_logprobs=True)
    assert st == 200


def test_chunked_oversized_body_is_413(api, server):
    """Without Content-Length the limit is enforced while receiving."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * (1 << 20)
        resp = b""
        try:
            for _ in range(40):  # 40 MiB offered; the server stops at 16 MiB
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
                part = sock.recv(65536)
                if not part:
                    break
                resp += part
        except ConnectionResetError:
            pass
    assert resp.startswith(b"HTTP/1.1 413 "), resp[:200]
    assert b"max_request_bytes" in resp


def test_model_names_are_bounded(api):
    st, _, b = api.post("/api/v1/create_session", {"tags": []})
    sid = json.loads(b)["session_id"]
    st, _, b = api.post("/api/v1/create_sampling_session", {"session_id": sid, "base_model": "m" * 600})
    assert st == 400 and "at most 512" in json.loads(b)["error"]


_RANGE_INT64 = "unset or an integer in [-9223372036854775808, 9223372036854775807] (int64)"


@pytest.mark.parametrize("params,status,message", [
    ({"temperature": float("nan")}, 400,
     "sampling_params.temperature: must be a finite number in [0, 2], got nan"),
    ({"temperature": float("inf")}, 400,
     "sampling_params.temperature: must be a finite number in [0, 2], got inf"),
    ({"temperature": 2.5}, 400, "sampling_params.temperature: must be a finite number in [0, 2], got 2.5"),
    ({"temperature": -0.1}, 400, "sampling_params.temperature: must be a finite number in [0, 2], got -0.1"),
    ({"top_p": float("nan")}, 400, "sampling_params.top_p: must be a finite number in (0, 1], got nan"),
    ({"top_p": 0.0}, 400, "sampling_params.top_p: must be a finite number in (0, 1], got 0.0"),
    ({"top_k": -2}, 400, "sampling_params.top_k: must be an integer in [-1, 2147483647] (-1 or 0: off), got -2"),
    ({"top_k": 2**31}, 400,
     "sampling_params.top_k: must be an integer in [-1, 2147483647] (-1 or 0: off), got 2147483648"),
    ({"max_tokens": 0}, 400, "sampling_params.max_tokens: must be unset or an integer in [1, 4294967295], got 0"),
    ({"max_tokens": 2**32}, 400,
     "sampling_params.max_tokens: must be unset or an integer in [1, 4294967295], got 4294967296"),
    ({"seed": 2**70}, 400, f"sampling_params.seed: must be {_RANGE_INT64}, got 1180591620717411303424"),
    ({"seed": -(2**63) - 1}, 400, f"sampling_params.seed: must be {_RANGE_INT64}, got -9223372036854775809"),
    ({"stop": [7, 2**31]}, 400, "sampling_params.stop: must be a string, a list of strings or a list of token "
                                "ids in [0, 2147483647], got token id 2147483648"),
    ({"stop": [-1]}, 400, "sampling_params.stop: must be a string, a list of strings or a list of token "
                          "ids in [0, 2147483647], got token id -1"),
    # Found by a break test: vLLM refuses an empty stop string, so the sample failed after the engine call.
    ({"stop": ""}, 400, "sampling_params.stop: must be a non-empty string, a list of non-empty strings or a list "
                        "of token ids (an empty stop string would match everywhere; vLLM refuses it), got ''"),
    ({"stop": ["ok", ""]}, 400, "sampling_params.stop: must be a non-empty string, a list of non-empty strings or a "
                                "list of token ids (an empty stop string would match everywhere; vLLM refuses it), "
                                "got ['ok', '']"),
    # The edges of every range are accepted and forwarded.
    ({"seed": 2**63 - 1, "top_k": 2**31 - 1, "temperature": 2.0, "top_p": 1.0}, 200, None),
    ({"seed": -(2**63), "top_k": 0, "temperature": 0.0, "stop": [0, 2**31 - 1]}, 200, None),
])
def test_sampling_param_ranges_are_400_naming_the_field_and_range(api, params, status, message):
    """Numeric sampling params outside what vLLM (and vllm-router in front of it) accept are refused at
    asample; before, NaN said "<= 2" and a seed beyond int64 or an int32-overflowing top_k / stop token
    id was forwarded to the engine."""
    ssid = api.sampling_session()
    body = {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 2, **params}}
    st, _, b = api.post("/api/v1/asample", body)
    assert st == status, b
    if message is None:
        assert json.loads(b)["request_id"].startswith("f")
    else:
        assert json.loads(b) == {"error": "invalid request body: " + message}


def test_compressed_request_bodies_are_415_naming_the_header(api):
    """The SDK never compresses a sampling-path body; gzip bytes used to be parsed as JSON (a
    confusing 400 "not valid JSON"). Any coding other than identity is 415 naming the header."""
    import gzip

    ssid = api.sampling_session()
    body = {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}
    raw = gzip.compress(json.dumps(body).encode())
    for path, coding in (("/api/v1/asample", "gzip"), ("/api/v1/asample", "br"), ("/api/v1/create_session", "zstd")):
        st, _, b = api.post(path, raw, headers={"Content-Encoding": coding})
        assert (st, json.loads(b)) == (415, {"error": f"Content-Encoding: {coding} is not supported: send the "
                                                      "request body uncompressed (identity)"})
    st, _, b = api.post("/api/v1/asample", body, headers={"Content-Encoding": "identity"})
    assert st == 200 and json.loads(b)["request_id"].startswith("f")


def test_resubmitted_seq_id_dedupes_only_the_same_request(api):
    """(sampling_session_id, seq_id) names one request: resending it (the SDK's retry after a lost
    answer sends the same SampleRequest) returns the same future; the same key with a different body
    used to return the first request's future too (its result silently answered the second request).
    Now that is 409 naming the key, with x-should-retry: false (the SDK's HTTP layer retries 409s)."""
    ssid = api.sampling_session()
    first = {"sampling_session_id": ssid, "seq_id": 5, "num_samples": 2,
             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 6]}]},
             "sampling_params": {"max_tokens": 3, "seed": 11, "temperature": 0.7}, "type": "sample"}
    st, _, b = api.post("/api/v1/asample", first)
    assert st == 200, b
    fid = json.loads(b)["request_id"]
    # The same request again (fields in another order: the canonical request is compared).
    again = {k: first[k] for k in reversed(list(first))}
    st, _, b = api.post("/api/v1/asample", again)
    assert (st, json.loads(b)["request_id"]) == (200, fid)
    conflict = (f"seq_id 5 of this sampling session already names future {fid}, submitted with a different "
                "request (prompt, num_samples or sampling params); a retry must resend the same request, a new "
                "request needs a new seq_id")
    for change in ({"sampling_params": {"max_tokens": 3, "seed": 12, "temperature": 0.7}},
                   {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 7]}]}},
                   {"num_samples": 3},
                   {"sampling_params": {"max_tokens": 4, "seed": 11, "temperature": 0.7}},
                   {"prompt_logprobs": True}):
        st, h, b = api.post("/api/v1/asample", {**first, **change})
        assert (st, json.loads(b), h.get("x-should-retry")) == (409, {"error": conflict}, "false"), change
    st, _, b = api.post("/api/v1/asample", first)
    assert (st, json.loads(b)["request_id"]) == (200, fid)
    # Unset max_tokens (the SDK's default): the same request dedupes as well.
    unset = {**first, "seq_id": 6, "sampling_params": {"seed": 11}}
    st, _, b = api.post("/api/v1/asample", unset)
    assert st == 200, b
    fid6 = json.loads(b)["request_id"]
    st, _, b = api.post("/api/v1/asample", unset)
    assert (st, json.loads(b)["request_id"]) == (200, fid6)
    st, _, b = api.post("/api/v1/retrieve_future", {"request_id": fid})
    assert st == 200 and len(json.loads(b)["sequences"]) == 2
