"""Tests of the vLLM 0.30 engine simulator (shardserver.engine_sim).

Every server test starts the simulator on 127.0.0.1 with port 0 inside ``asyncio.run``
and stops it in ``finally``; nothing outlives a test. Configs use a small
``max_model_len``/``pool_starts`` so the token pool builds in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest

from shardserver.engine_sim import (
    FaultRule,
    SimConfig,
    SimRequestError,
    completion_dict,
    render_completion,
    start_sim,
    stop_sim,
)

pytestmark = pytest.mark.timeout(60)

SMALL = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True)
MODEL = SMALL.model_name


def vllm_dumps(obj: Any) -> bytes:
    """Starlette JSONResponse.render settings (spec §2.1)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def run(coro: Any, timeout: float = 30.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(config: SimConfig = SMALL) -> AsyncIterator[aiohttp.ClientSession]:
    runner, port = await start_sim(config, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await stop_sim(runner)


async def post(session: aiohttp.ClientSession, body: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    async with session.post("/v1/completions", json=body, **kw) as r:
        return r.status, dict(r.headers), await r.read()


def req(**kw: Any) -> dict[str, Any]:
    base = {"model": MODEL, "prompt": [785, 4226, 374], "max_tokens": 8, "logprobs": 1, "return_token_ids": True,
            "seed": 7}
    base.update(kw)
    return base


# ----------------------------------------------------------------------------- format


CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
               "prompt_token_ids", "routed_experts"]
TOP_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
            "kv_transfer_params", "ec_transfer_params", "metrics"]


def test_tiny_request_exact_bytes_and_key_order() -> None:
    r = req(max_tokens=4, prompt_logprobs=1)
    body = render_completion(r, SMALL, request_id="cmpl-5d2c9a4e1f0b7c38", created=1767225600)
    d = completion_dict(r, SMALL, request_id="cmpl-5d2c9a4e1f0b7c38", created=1767225600)
    assert body == vllm_dumps(d)
    # Canonical: parsing and re-rendering gives the same bytes (floats, escapes, no spaces).
    assert vllm_dumps(json.loads(body)) == body
    assert b" " not in body.replace(b'" ', b"").split(b'"text"')[0]  # no separator whitespace in the head
    pairs = json.loads(body, object_pairs_hook=lambda kv: kv)
    assert [k for k, _ in pairs] == TOP_KEYS
    top = dict(pairs)
    choice = dict(top["choices"][0])
    assert [k for k, _ in top["choices"][0]] == CHOICE_KEYS
    assert [k for k, _ in choice["logprobs"]] == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert [k for k, _ in top["usage"]] == ["prompt_tokens", "total_tokens", "completion_tokens",
                                             "prompt_tokens_details", "completion_tokens_details"]
    pos1 = choice["prompt_logprobs"][1]
    assert all([k for k, _ in v] == ["logprob", "rank", "decoded_token"] for _, v in pos1)
    assert body.startswith(b'{"id":"cmpl-5d2c9a4e1f0b7c38","object":"text_completion","created":1767225600,'
                           b'"model":"Qwen/Qwen3-8B","choices":[{"index":0,"text":')
    assert body.endswith(b'"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.30.0-8f3e21ab",'
                         b'"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4,'
                         b'"prompt_tokens_details":null,"completion_tokens_details":null},'
                         b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}')
    assert b'"prompt_token_ids":[785,4226,374]' in body


def test_no_logprobs_no_token_ids_gives_nulls() -> None:
    d = json.loads(render_completion(req(logprobs=None, return_token_ids=False), SMALL))
    c = d["choices"][0]
    assert c["logprobs"] is None and c["token_ids"] is None and c["prompt_token_ids"] is None
    assert c["prompt_logprobs"] is None and c["routed_experts"] is None


def test_fast_renderer_matches_json_dumps_randomized() -> None:
    rnd = random.Random(20260101)
    for trial in range(150):
        cfg = SimConfig(
            deterministic_ids=True, max_model_len=512, pool_starts=rnd.choice([1, 64, 1000]),
            **dict(zip(("vocab_size", "eos_token_id"), rnd.choice([(64, 5), (64, 64), (151643, 151643)]))),
            eos_probability=rnd.choice([0.0, 0.05, 0.3]), stop_token_probability=rnd.choice([0.0, 0.1]),
            clamp_rate=rnd.choice([0.0, 0.05]), collision_rate=rnd.choice([0.0, 0.3]),
            top1_fraction=rnd.choice([0.0, 0.75, 1.0]),
        )
        q = {"prompt": [rnd.randrange(0, 70) for _ in range(rnd.randint(1, 12))], "n": rnd.randint(1, 3),
             "max_tokens": rnd.randint(1, 60), "logprobs": rnd.choice([None, 0, 1, 2, 5]),
             "prompt_logprobs": rnd.choice([None, 0, 1, 3]), "return_token_ids": rnd.random() < 0.5,
             "seed": rnd.choice([None, 1, -5, 2**40]), "stop": rnd.choice([[], ["\n\n"], ["e", "a"], ["é"]]),
             "stop_token_ids": rnd.choice([[], [7, 9], [200000]]), "ignore_eos": rnd.random() < 0.2,
             "temperature": rnd.choice([1.0, 0.7])}
        if rnd.random() < 0.1:
            q.update(n=1, temperature=0.0)
        ov = None
        if rnd.random() < 0.3:
            ov = FaultRule(kind="finish_reason", finish_reason=rnd.choice(["abort", "repetition", "stop"]),
                           tokens=rnd.choice([None, 0, 3]), prompt_positions=rnd.choice([None, 1, 2]))
        body = render_completion(q, cfg, finish_override=ov)
        assert body == vllm_dumps(completion_dict(q, cfg, finish_override=ov)), (trial, q, cfg)
        check_invariants(json.loads(body), q, cfg)


def check_invariants(d: dict[str, Any], q: dict[str, Any], cfg: SimConfig) -> None:
    """Semantic rules of spec §2-§3 that hold for every body."""
    assert [c["index"] for c in d["choices"]] == list(range(q.get("n", 1)))
    total = 0
    for c in d["choices"]:
        lp = c["logprobs"]
        if q.get("logprobs") is not None:
            toks = lp["tokens"]
            n_tok = len(toks)
            assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n_tok
            offs, acc = [], 0
            for t in toks:
                offs.append(acc)
                acc += len(t)  # code points
            assert lp["text_offset"] == offs
            assert all(x <= 0.0 and x >= -9999.0 for x in lp["token_logprobs"])
            for t, x, top in zip(toks, lp["token_logprobs"], lp["top_logprobs"]):
                assert 1 <= len(top) <= q["logprobs"] + 1
                assert next(iter(top)) == t  # sampled token first
                if t in top and len(top) == 1 and q["logprobs"] == 1 and top[t] != x:
                    assert top[t] >= x  # collision: the top-1's value won
            if c["finish_reason"] == "stop" and c["stop_reason"] is None:
                assert toks[-1] == "<|endoftext|>"
            total += n_tok
        if q.get("return_token_ids"):
            assert c["prompt_token_ids"] == q["prompt"]
            if lp is not None:
                assert len(c["token_ids"]) == len(lp["tokens"])
            if c["finish_reason"] == "stop" and c["stop_reason"] is None:
                assert c["token_ids"][-1] == cfg.eos_token_id
            if c["finish_reason"] == "stop" and isinstance(c["stop_reason"], int):
                assert c["token_ids"][-1] == c["stop_reason"]
        if c["finish_reason"] == "length":
            assert c["stop_reason"] is None
            if q.get("return_token_ids"):
                assert len(c["token_ids"]) == q["max_tokens"]
        assert "<|endoftext|>" not in c["text"]
        if q.get("prompt_logprobs") is not None:
            assert c["prompt_logprobs"] == d["choices"][0]["prompt_logprobs"]
    if q.get("logprobs") is not None:
        assert d["usage"]["completion_tokens"] == total
    assert d["usage"]["prompt_tokens"] == len(q["prompt"])
    assert d["usage"]["total_tokens"] == d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"]


def test_text_excludes_eos_and_top_logprobs_shape() -> None:
    cfg = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True, eos_probability=0.05)
    d = json.loads(render_completion(req(max_tokens=2000), cfg))
    c = d["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] is None
    assert c["token_ids"][-1] == cfg.eos_token_id
    toks = c["logprobs"]["tokens"]
    assert toks[-1] == "<|endoftext|>"
    assert c["text"] == "".join(toks[:-1])
    tops = c["logprobs"]["top_logprobs"]
    sizes = {len(t) for t in tops}
    assert sizes <= {1, 2} and 1 in sizes
    for t, x, top in zip(toks, c["logprobs"]["token_logprobs"], tops):
        if len(top) == 2:
            (k0, v0), (k1, v1) = top.items()
            assert k0 == t and v0 == x and v1 >= x


def test_float32_reprs_and_clamp() -> None:
    d = json.loads(render_completion(req(max_tokens=300), SMALL))
    import numpy as np

    for x in d["choices"][0]["logprobs"]["token_logprobs"]:
        assert float(np.float32(x)) == x  # float32-derived doubles
    cfg = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True, clamp_rate=1.0)
    d = json.loads(render_completion(req(max_tokens=20), cfg))
    assert d["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0] * 20
    assert b"-9999.0" in render_completion(req(max_tokens=20), cfg)


def test_string_key_collision_later_value_wins() -> None:
    cfg = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True, collision_rate=1.0,
                    top1_fraction=0.0, clamp_rate=0.0)
    d = json.loads(render_completion(req(max_tokens=50), cfg))
    lp = d["choices"][0]["logprobs"]
    for t, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert t == "" and list(top) == [""]
        assert top[""] >= x  # the top-1's logprob, not the sampled one
    assert any(top[""] != x for x, top in zip(lp["token_logprobs"], lp["top_logprobs"]))


# ------------------------------------------------------------------------ determinism


def test_determinism_seed_children_and_prefix_stability() -> None:
    q = req(n=3, max_tokens=40)
    assert render_completion(q, SMALL) == render_completion(q, SMALL)
    multi = json.loads(render_completion(q, SMALL))
    for i in range(3):
        single = json.loads(render_completion(req(n=1, max_tokens=40, seed=7 + i), SMALL))
        mine = dict(multi["choices"][i], index=0)
        assert mine == single["choices"][0]  # child i uses seed + i
    assert multi["choices"][0]["token_ids"] != multi["choices"][1]["token_ids"]
    short = json.loads(render_completion(req(max_tokens=10), SMALL))["choices"][0]
    long = json.loads(render_completion(req(max_tokens=40), SMALL))["choices"][0]
    assert long["token_ids"][:10] == short["token_ids"]
    # No seed: derived from the prompt, still deterministic; another prompt differs.
    a = render_completion(req(seed=None), SMALL)
    assert a == render_completion(req(seed=None), SMALL)
    assert json.loads(a)["choices"][0]["token_ids"] != json.loads(
        render_completion(req(seed=None, prompt=[1, 2, 3]), SMALL))["choices"][0]["token_ids"]
    # Greedy ignores the seed.
    g1 = json.loads(render_completion(req(temperature=0, seed=1), SMALL))["choices"][0]
    g2 = json.loads(render_completion(req(temperature=0, seed=2), SMALL))["choices"][0]
    assert g1 == g2 and all(len(t) == 1 for t in g1["logprobs"]["top_logprobs"])


def test_random_ids_without_deterministic_ids() -> None:
    cfg = SimConfig(max_model_len=4096, pool_starts=1024)
    a, b = render_completion(req(), cfg), render_completion(req(), cfg)
    da, db = json.loads(a), json.loads(b)
    assert da["id"] != db["id"] and len(da["id"]) == len("cmpl-") + 16
    assert isinstance(da["created"], int)
    tail = lambda x: x[x.index(b',"model":'):]  # noqa: E731
    assert tail(a) == tail(b)


# ------------------------------------------------------------------ prompt_logprobs


def test_prompt_logprobs_k_and_k_plus_1_and_duplication() -> None:
    prompt = list(range(1000, 1200))
    k = 3
    d = json.loads(render_completion(req(prompt=prompt, prompt_logprobs=k, n=2, max_tokens=2), SMALL))
    plp = d["choices"][0]["prompt_logprobs"]
    assert d["choices"][1]["prompt_logprobs"] == plp
    assert len(plp) == len(prompt) and plp[0] is None
    seen = set()
    for j in range(1, len(prompt)):
        pos = plp[j]
        keys = list(pos)
        assert keys[0] == str(prompt[j])  # actual token first
        actual = pos[str(prompt[j])]
        in_topk = actual["rank"] <= k
        assert len(pos) == (k if in_topk else k + 1)
        seen.add(in_topk)
        others = [v for key, v in pos.items() if key != str(prompt[j])]
        ranks = [v["rank"] for v in others]
        assert ranks == sorted(ranks) and all(1 <= r <= k for r in ranks)
        lps = [v["logprob"] for v in sorted(pos.values(), key=lambda v: v["rank"])]
        assert lps == sorted(lps, reverse=True)
        assert all(isinstance(v["decoded_token"], str) for v in pos.values())
    assert seen == {True, False}
    body = render_completion(req(prompt=prompt, prompt_logprobs=k, n=2, max_tokens=2), SMALL)
    frag = json.dumps(plp, ensure_ascii=False, separators=(",", ":")).encode()
    assert body.count(frag) == 2  # byte-identical copy on every choice
    d0 = json.loads(render_completion(req(prompt=prompt, prompt_logprobs=0, max_tokens=2), SMALL))
    assert all(len(p) == 1 for p in d0["choices"][0]["prompt_logprobs"][1:])


# ----------------------------------------------------------------------- stop handling


def test_stop_strings_and_stop_token_ids() -> None:
    base = json.loads(render_completion(req(max_tokens=200, stop=[]), SMALL))["choices"][0]
    text = base["text"]
    stop = text[40:43]
    first = text.find(stop)
    assert first >= 0
    c = json.loads(render_completion(req(max_tokens=200, stop=[stop]), SMALL))["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert c["text"] == text[:first]
    assert base["token_ids"][: len(c["token_ids"])] == c["token_ids"]
    joined = "".join(c["logprobs"]["tokens"])
    assert joined.startswith(text[:first] + stop) and not "".join(c["logprobs"]["tokens"][:-1]).count(stop)
    # A stop token id met in the stream: stop_reason is that int, the id is last, text omits it.
    sid = base["token_ids"][30]
    c = json.loads(render_completion(req(max_tokens=200, stop_token_ids=[sid]), SMALL))["choices"][0]
    j = base["token_ids"].index(sid)
    assert c["stop_reason"] == sid and c["token_ids"] == base["token_ids"][: j + 1]
    assert c["text"] == "".join(base["logprobs"]["tokens"][:j])
    # Injected stop-token ids (stop_token_probability), also outside the vocabulary.
    cfg = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True, stop_token_probability=0.1)
    c = json.loads(render_completion(req(max_tokens=500, stop_token_ids=[151645]), cfg))["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == 151645 and c["token_ids"][-1] == 151645
    # ignore_eos keeps generating to max_tokens.
    cfg = SimConfig(max_model_len=4096, pool_starts=1024, deterministic_ids=True, eos_probability=0.5)
    c = json.loads(render_completion(req(max_tokens=100, ignore_eos=True), cfg))["choices"][0]
    assert c["finish_reason"] == "length" and len(c["token_ids"]) == 100


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "patch,status,expected",
    [
        ({"n": 4, "temperature": 0}, 400,
         b'{"error":{"message":"n must be 1 when using greedy sampling, got 4.","type":"BadRequestError",'
         b'"param":null,"code":400}}'),
        ({"temperature": 2.5}, 400,
         b'{"error":{"message":"temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",'
         b'"type":"BadRequestError","param":"temperature","code":400}}'),
        ({"top_p": 0}, 400, b'"param":"top_p"'),
        ({"top_p": 1.5}, 400, b'"param":"top_p"'),
        ({"logprobs": 21}, 400, b'"param":"logprobs"'),
        ({"prompt_logprobs": 21}, 400, b'"param":"prompt_logprobs"'),
        ({"max_tokens": 5000}, 400, b'"param":"input_tokens"'),
        ({"prompt": None}, 400, b'"type":"Bad Request","param":"body.prompt"'),
        ({"model": "nope"}, 404,
         b'{"error":{"message":"The model `nope` does not exist.","type":"NotFoundError","param":"model",'
         b'"code":404}}'),
    ],
)
def test_validation_errors(patch: dict[str, Any], status: int, expected: bytes) -> None:
    q = req(**patch)
    with pytest.raises(SimRequestError) as ei:
        render_completion(q, SMALL)
    assert ei.value.status == status
    assert expected in ei.value.body
    if expected.startswith(b"{"):
        assert ei.value.body == expected


def test_http_validation_and_routing() -> None:
    async def main() -> None:
        async with serving() as s:
            st, hdr, body = await post(s, req(n=2, temperature=0))
            assert st == 400 and hdr["Content-Type"] == "application/json"
            assert json.loads(body)["error"]["code"] == 400
            async with s.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "Bad Request"
            async with s.post("/v1/completions", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 400
            st, _, body = await post(s, {"model": MODEL, "max_tokens": 3})
            assert st == 400 and json.loads(body)["error"]["param"] == "body.prompt"
            st, _, body = await post(s, {"prompt": [[1, 2, 3]], "max_tokens": 3, "unknown_key": 1})
            assert st == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
            async with s.get("/health") as r:
                assert r.status == 200 and await r.read() == b""
            async with s.get("/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == MODEL
            async with s.get("/nope") as r:
                assert r.status == 404 and await r.read() == b'{"detail":"Not Found"}'

    run(main())


# ------------------------------------------------------------------------------ server


def test_http_body_equals_render_and_request_id_header() -> None:
    async def main() -> None:
        async with serving() as s:
            q = req(n=2, prompt_logprobs=2, max_tokens=30)
            st, hdr, body = await post(s, q)
            assert st == 200 and hdr["Content-Type"] == "application/json"
            assert body == render_completion(q, SMALL)
            st, _, body2 = await post(s, q)
            assert body2 == body
            st, _, body3 = await post(s, q, headers={"X-Request-Id": "abc-1"})
            assert body3 == render_completion(q, SMALL, request_id="cmpl-abc-1")
            async with s.get("/_sim/stats") as r:
                stats = await r.json()
            assert stats["cache_misses"] == 1 and stats["cache_hits"] == 2
            assert stats["by_status"] == {"200": 3} and stats["body_bytes"] == 3 * len(body) - len(
                b"cmpl-" + json.loads(body)["id"][5:].encode()) + len(b"cmpl-abc-1")
            assert stats["cache_entries"] == 1 and stats["cache_bytes"] > len(body) // 2
            async with s.post("/_sim/reset") as r:
                assert r.status == 200
            async with s.get("/_sim/stats") as r:
                stats = await r.json()
            assert stats["requests"] == 0 and stats["cache_entries"] == 0

    run(main())


def test_sim_config_endpoint() -> None:
    async def main() -> None:
        async with serving() as s:
            async with s.post("/_sim/config", json={"eos_probability": 1.0, "latency_s": 0.0}) as r:
                assert r.status == 200 and (await r.json())["eos_probability"] == 1.0
            st, _, body = await post(s, req(max_tokens=50))
            c = json.loads(body)["choices"][0]
            assert c["finish_reason"] == "stop" and c["token_ids"] == [SMALL.eos_token_id] and c["text"] == ""
            async with s.post("/_sim/config", json={"no_such_knob": 1}) as r:
                assert r.status == 400 and "no_such_knob" in (await r.json())["error"]["message"]
            async with s.post("/_sim/config", json={"faults": [{"kind": "bogus"}]}) as r:
                assert r.status == 400
            async with s.post("/_sim/reset", json={"restore_config": True}) as r:
                assert r.status == 200
            async with s.get("/_sim/config") as r:
                assert (await r.json())["eos_probability"] == 0.0
            async with s.post("/_sim/config", json={"latency_s": 0.15}) as r:
                assert r.status == 200
            t0 = time.monotonic()
            st, _, _ = await post(s, req())
            assert st == 200 and time.monotonic() - t0 >= 0.14

    run(main())


def test_from_mapping_validates() -> None:
    cfg = SimConfig.from_mapping({"eos_probability": 0.1, "faults": [{"kind": "nan", "every_nth": 2}]})
    assert cfg.eos_probability == 0.1 and cfg.faults == (FaultRule(kind="nan", every_nth=2),)
    with pytest.raises(ValueError, match="bogus"):
        SimConfig.from_mapping({"bogus": 1})
    with pytest.raises(ValueError, match="typo"):
        SimConfig.from_mapping({"faults": [{"kind": "nan", "typo": 1}]})
    with pytest.raises(ValueError):
        SimConfig.from_mapping({"vocab_size": "big"})
    assert SimConfig.from_mapping(cfg.to_mapping()) == cfg


# ------------------------------------------------------------------------------ faults


def faulty(*rules: dict[str, Any]) -> SimConfig:
    return SimConfig.from_mapping({"faults": list(rules)}, base=SMALL)


def test_status_faults() -> None:
    cfg = faulty(
        {"kind": "status", "status": 500, "first_token_id": 1},
        {"kind": "status", "status": 503, "body": "router", "first_token_id": 2},
        {"kind": "status", "status": 429, "body": "empty", "first_token_id": 3},
        {"kind": "status", "status": 404, "body": "detail", "first_token_id": 4},
        {"kind": "status", "status": 422, "body": "router", "first_token_id": 5},
        {"kind": "status", "status": 503, "first_token_id": 6},
    )

    async def main() -> None:
        async with serving(cfg) as s:
            st, hdr, body = await post(s, req(prompt=[1, 9]))
            assert st == 500 and body == (b'{"error":{"message":"Internal server error","type":"InternalServerError",'
                                          b'"param":null,"code":500}}')
            st, hdr, body = await post(s, req(prompt=[2, 9]))
            assert st == 503 and hdr["Content-Type"].startswith("text/plain")
            assert body == b"No available workers (all circuits open or unhealthy)"
            st, hdr, body = await post(s, req(prompt=[3, 9]))
            assert st == 429 and body == b"" and "Content-Type" not in hdr
            st, hdr, body = await post(s, req(prompt=[4, 9]))
            assert st == 404 and body == b'{"detail":"Not Found"}'
            st, hdr, body = await post(s, req(prompt=[5, 9]))
            assert st == 422 and body.startswith(b"Failed to deserialize the JSON body")
            st, hdr, body = await post(s, req(prompt=[6, 9]))
            assert st == 503 and json.loads(body)["error"]["type"] == "Service Unavailable"
            st, _, body = await post(s, req(prompt=[7, 9]))
            assert st == 200

    run(main())


def test_truncate_non_json_nan_and_stall() -> None:
    cfg = faulty(
        {"kind": "truncate", "first_token_id": 1},
        {"kind": "non_json", "first_token_id": 2},
        {"kind": "nan", "first_token_id": 3},
        {"kind": "stall", "stall_s": 0.6, "first_token_id": 4},
    )

    async def main() -> None:
        async with serving(cfg) as s:
            with pytest.raises(aiohttp.ClientPayloadError):
                await post(s, req(prompt=[1, 9], max_tokens=500))
            st, hdr, body = await post(s, req(prompt=[2, 9]))
            assert st == 200 and hdr["Content-Type"].startswith("text/html") and body.lstrip().startswith(b"<")
            st, hdr, body = await post(s, req(prompt=[3, 9]))
            assert st == 400 and body == (
                b'{"error":{"message":"Out of range float values are not JSON compliant: nan",'
                b'"type":"BadRequestError","param":null,"code":400}}')
            with pytest.raises(asyncio.TimeoutError):
                await post(s, req(prompt=[4, 9]), timeout=aiohttp.ClientTimeout(total=0.2))
            t0 = time.monotonic()
            st, _, _ = await post(s, req(prompt=[4, 9]))
            assert st == 200 and time.monotonic() - t0 >= 0.55
            # The server is still healthy after the closed connection.
            st, _, body = await post(s, req(prompt=[5, 9]))
            assert st == 200
            async with s.get("/_sim/stats") as r:
                stats = await r.json()
            assert stats["faults"] == {"truncate": 1, "non_json": 1, "nan": 1, "stall": 2}

    run(main())


def test_finish_reason_faults() -> None:
    abort0 = {"kind": "finish_reason", "finish_reason": "abort", "tokens": 0, "first_token_id": 1}
    abort3 = {"kind": "finish_reason", "finish_reason": "abort", "tokens": 3, "first_token_id": 2}
    rep = {"kind": "finish_reason", "finish_reason": "repetition", "first_token_id": 3}
    stop = {"kind": "finish_reason", "finish_reason": "stop", "tokens": 5, "stop_string": "</answer>",
            "first_token_id": 4}
    cfg = faulty(abort0, abort3, rep, stop)
    prompt_tail = list(range(100, 120))

    async def main() -> None:
        async with serving(cfg) as s:
            q = req(prompt=[1] + prompt_tail, prompt_logprobs=1, n=2, max_tokens=20)
            st, _, body = await post(s, q)
            assert st == 200
            assert body == render_completion(q, SMALL, finish_override=FaultRule.from_mapping(abort0))
            d = json.loads(body)
            for c in d["choices"]:
                assert c["finish_reason"] == "abort" and c["stop_reason"] is None
                assert c["token_ids"] == [] and c["text"] == ""
                assert c["logprobs"] == {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
                assert 1 <= len(c["prompt_logprobs"]) < len(q["prompt"])  # cut short, like an abort in prefill
            assert d["usage"]["completion_tokens"] == 0
            q = req(prompt=[2] + prompt_tail, max_tokens=20)
            d = json.loads((await post(s, q))[2])
            full = json.loads(render_completion(q, SMALL))["choices"][0]
            c = d["choices"][0]
            assert c["finish_reason"] == "abort" and c["token_ids"] == full["token_ids"][:3]
            assert c["text"] == "".join(full["logprobs"]["tokens"][:3])
            d = json.loads((await post(s, req(prompt=[3] + prompt_tail, max_tokens=20)))[2])
            assert d["choices"][0]["finish_reason"] == "repetition"
            assert d["choices"][0]["stop_reason"] == "repetition_detected"
            assert len(d["choices"][0]["token_ids"]) == 10
            d = json.loads((await post(s, req(prompt=[4] + prompt_tail, max_tokens=20)))[2])
            c = d["choices"][0]
            assert c["finish_reason"] == "stop" and c["stop_reason"] == "</answer>" and len(c["token_ids"]) == 5
            assert c["text"] == "".join(c["logprobs"]["tokens"][:4])

    run(main())


def test_fault_matchers_every_nth_times_probability() -> None:
    cfg = faulty(
        {"kind": "status", "status": 500, "every_nth": 3},
        {"kind": "status", "status": 503, "first_token_id": 42, "times": 1},
    )

    async def main() -> None:
        async with serving(cfg) as s:
            statuses = [(await post(s, req()))[0] for _ in range(6)]
            assert statuses == [200, 200, 500, 200, 200, 500]
            statuses = [(await post(s, req(prompt=[42, 1])))[0] for _ in range(2)]
            assert statuses == [503, 200]  # fires once, then the request succeeds (retry tests)
            await s.post("/_sim/reset")
            rules = [{"kind": "status", "status": 500, "probability": 0.5}]
            async with s.post("/_sim/config", json={"faults": rules, "fault_seed": 3}) as r:
                assert r.status == 200
            first = [(await post(s, req()))[0] for _ in range(20)]
            async with s.post("/_sim/reset") as r:
                assert r.status == 200
            second = [(await post(s, req()))[0] for _ in range(20)]
            assert first == second and {200, 500} == set(first)  # seeded, reproducible

    run(main())


# ------------------------------------------------------------------------ performance


def test_32k_token_body_build_time() -> None:
    cfg = SimConfig(max_model_len=40960, pool_starts=1024, deterministic_ids=True)
    q = {"prompt": list(range(1000, 5096)), "max_tokens": 32768, "logprobs": 1, "return_token_ids": True,
         "seed": 3}
    render_completion(q, cfg)  # builds the pool
    t0 = time.perf_counter()
    body = render_completion(q, cfg)
    dt = time.perf_counter() - t0
    d = json.loads(body)
    c = d["choices"][0]
    assert len(c["token_ids"]) == 32768 == len(c["logprobs"]["top_logprobs"])
    assert 60 * 32768 < len(body) < 110 * 32768  # spec §9: ~77 B/token
    assert dt < 1.0, f"32k-token body took {dt * 1000:.1f} ms"
    print(f"\n32768-token body: {len(body) / 1e6:.2f} MB built in {dt * 1000:.1f} ms")


# ------------------------------------------------------------------------- standalone


def test_run_standalone_exits_on_sigterm() -> None:
    code = (
        "import sys; from shardserver.engine_sim import run_standalone, SimConfig; "
        "run_standalone('127.0.0.1', int(sys.argv[1]), SimConfig(max_model_len=2048, pool_starts=64))"
    )
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = proc.stdout.readline()
        assert b"listening" in line, proc.stderr.read() if proc.poll() is not None else line

        async def probe() -> None:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"prompt": [1, 2], "max_tokens": 3}) as r:
                    assert r.status == 200

        run(probe(), timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
