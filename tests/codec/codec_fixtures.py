"""Render vLLM-0.30-faithful ``/v1/completions`` bodies for codec tests and benchmarks.

The rendering follows ``shared/spec/vllm_completions.md`` §2: dicts built in the
declaration order of vLLM's pydantic models (``CompletionResponse``,
``CompletionResponseChoice``, ``CompletionLogProbs``, ``UsageInfo``), every field
present (unset ones ``null``), serialized the way Starlette's ``JSONResponse``
does (``json.dumps(ensure_ascii=False, allow_nan=False, separators=(",", ":"))``,
UTF-8). Logprobs are float32 values widened to Python floats
(``float(np.float32(x))``), so they print with the 8–17 significant digits real
bodies have.

Nothing here imports the codec: these helpers are the independent side of the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SPEC_EXAMPLE_BODY",
    "f32",
    "dumps",
    "logprobs_object",
    "choice_dict",
    "completion_dict",
    "render",
    "prompt_row",
    "RealisticCase",
    "realistic_case",
]

# shared/spec/vllm_completions.md §6: the byte-faithful vLLM 0.30.0 example (1103 bytes).
SPEC_EXAMPLE_BODY = (
    b'{"id":"cmpl-5d2c9a4e1f0b7c38","object":"text_completion","created":1767225600,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"text":" 4.","logprobs":{"text_offset":[0,1,2,3],"token_logprobs":'
    b'[-0.04190000146627426,-1.2999999523162842,-0.6930999755859375,0.0],"tokens":[" ","4",".","<|endoftext|>"],'
    b'"top_logprobs":[{" ":-0.04190000146627426},{"4":-1.2999999523162842,"3":-0.4075999855995178},'
    b'{".":-0.6930999755859375,"\\n\\n":-0.6930999755859375},{"<|endoftext|>":0.0}]},"finish_reason":"stop",'
    b'"stop_reason":null,"token_ids":[220,19,13,151643],"prompt_logprobs":[null,{"4226":{"logprob":-6.091300010681152,'
    b'"rank":37,"decoded_token":" answer"},"1156":{"logprob":-2.4475998878479004,"rank":1,"decoded_token":" first"}},'
    b'{"374":{"logprob":-0.36329999566078186,"rank":1,"decoded_token":" is"}}],"prompt_token_ids":[785,4226,374],'
    b'"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.30.0-8f3e21ab","usage":'
    b'{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4,"prompt_tokens_details":null,'
    b'"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
)
assert len(SPEC_EXAMPLE_BODY) == 1103


def f32(x: float) -> float:
    """The Python float that vLLM's ``.tolist()`` produces for the float32 value nearest ``x``."""
    return float(np.float32(x))


def dumps(obj: Any) -> bytes:
    """Serialize like Starlette 1.x ``JSONResponse.render`` (compact, raw UTF-8, no NaN)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def logprobs_object(
    token_logprobs: list[float | None],
    tokens: list[str] | None = None,
    top_logprobs: list[dict[str, float] | None] | None = None,
) -> dict[str, Any]:
    """``CompletionLogProbs`` in 0.30 key order; ``tokens``/``top_logprobs``/``text_offset`` filled in if omitted."""
    n = len(token_logprobs)
    if tokens is None:
        tokens = [f" t{i}" for i in range(n)]
    if top_logprobs is None:
        top_logprobs = [{tok: lp} for tok, lp in zip(tokens, token_logprobs)]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def choice_dict(
    index: int,
    token_ids: list[int] | None,
    logprobs: dict[str, Any] | None,
    *,
    finish_reason: str = "length",
    stop_reason: int | str | None = None,
    prompt_logprobs: list[Any] | None = None,
    prompt_token_ids: list[int] | None = None,
    text: str = "",
    version: str = "0.30",
) -> dict[str, Any]:
    """``CompletionResponseChoice`` in the key order of ``version`` ("0.30", "0.11" or "0.10" = pre-token_ids)."""
    d: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if version in ("0.30", "0.11"):
        d["token_ids"] = token_ids
    d["prompt_logprobs"] = prompt_logprobs
    if version in ("0.30", "0.11"):
        d["prompt_token_ids"] = prompt_token_ids
    if version == "0.30":
        d["routed_experts"] = None
    return d


def completion_dict(
    choices: list[dict[str, Any]],
    *,
    prompt_tokens: int = 3,
    cached_tokens: int | None = None,
    version: str = "0.30",
) -> dict[str, Any]:
    """``CompletionResponse`` in the key order of ``version`` around the given choice dicts."""
    completion_tokens = sum(len(c.get("token_ids") or []) for c in choices)
    details = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }
    d: dict[str, Any] = {
        "id": "cmpl-5d2c9a4e1f0b7c38" if version == "0.30" else "cmpl-f266de8ae5f64e14a2f3fa53560e4fbf",
        "object": "text_completion",
        "created": 1767225600,
        "model": "Qwen/Qwen3-8B",
        "choices": choices,
    }
    if version in ("0.30", "0.11"):
        d["service_tier"] = None
        d["system_fingerprint"] = "vllm-0.30.0-8f3e21ab" if version == "0.30" else None
    if version == "0.30":
        usage["completion_tokens_details"] = None
    d["usage"] = usage
    d["kv_transfer_params"] = None
    if version == "0.30":
        d["ec_transfer_params"] = None
        d["metrics"] = None
    return d


def render(choices: list[dict[str, Any]], **kw: Any) -> bytes:
    """``dumps(completion_dict(choices, **kw))``."""
    return dumps(completion_dict(choices, **kw))


def prompt_row(own_id: int, own_lp: float, top: list[tuple[int, float]], k: int) -> dict[str, dict[str, Any]]:
    """One ``prompt_logprobs`` position as vLLM builds it (``append_logprobs_for_next_position``).

    The actual token is inserted first; then the top-``k`` ``(id, logprob)`` pairs in rank
    order. An id already present (the actual token being in the top-k) is merged, so the
    row has ``k`` or ``k + 1`` entries.
    """
    row: dict[str, dict[str, Any]] = {}
    rank_own = 1 + sum(1 for _, lp in top if lp > own_lp)
    row[str(own_id)] = {"logprob": own_lp, "rank": rank_own, "decoded_token": f" p{own_id}"}
    for r, (tid, lp) in enumerate(top[:k], start=1):
        key = str(tid)
        if key in row:
            continue
        row[key] = {"logprob": lp, "rank": r, "decoded_token": f" p{tid}"}
    return row


@dataclass
class RealisticCase:
    """A rendered body plus the values a correct decoder must produce from it."""

    body: bytes
    n: int
    prompt_ids: np.ndarray  # int32 (P,)
    tokens: list[np.ndarray]  # per choice, int32 (T,)
    logprobs: list[np.ndarray]  # per choice, float32 (T,)
    prompt_lp: np.ndarray | None  # float32 (P,), NaN at 0
    topk_ids: np.ndarray | None  # int32 (P, k), mask 0
    topk_lp: np.ndarray | None  # float32 (P, k), mask -99999.0
    k: int


def _rand_f32_logprobs(rng: np.random.Generator, size: int) -> np.ndarray:
    # Mostly small negative values with full float32 mantissas (17-digit reprs), some exact.
    x = -rng.exponential(1.5, size=size).astype(np.float32)
    x[rng.random(size) < 0.02] = np.float32(-9999.0)
    return x


def realistic_case(
    rng: np.random.Generator,
    *,
    n: int,
    gen_tokens: int,
    prompt_len: int = 0,
    k: int = -1,
    vocab: int = 151643,
) -> RealisticCase:
    """A realistic 0.30 body (spec §9): logprobs=1, return_token_ids, ~25% positions with a 2nd top entry.

    ``k >= 0`` adds ``prompt_logprobs=k`` over a ``prompt_len``-token prompt (copied onto every
    choice, as vLLM does). The expected decode (``tokens``, ``logprobs``, ``prompt_lp``, top-k
    matrices) is computed independently of the JSON.
    """
    prompt_ids = rng.integers(0, vocab, size=prompt_len, dtype=np.int64)
    choices = []
    toks_all, lps_all = [], []
    for i in range(n):
        toks = rng.integers(0, vocab, size=gen_tokens, dtype=np.int64)
        lps = _rand_f32_logprobs(rng, gen_tokens)
        lp_list = lps.astype(np.float64).tolist()
        tokens = [(" w" if j % 2 else "ab") + str(t % 97) for j, t in enumerate(toks.tolist())]
        second = rng.random(gen_tokens) < 0.25
        top = []
        for j in range(gen_tokens):
            if second[j]:
                top.append({tokens[j]: lp_list[j], tokens[j] + "x": f32(lp_list[j] / 2)})
            else:
                top.append({tokens[j]: lp_list[j]})
        choices.append(
            {
                "index": i,
                "text": "".join(tokens),
                "logprobs": {
                    "text_offset": np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist() if gen_tokens else [],
                    "token_logprobs": lp_list,
                    "tokens": tokens,
                    "top_logprobs": top,
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": toks.tolist(),
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids.tolist() if prompt_len else None,
                "routed_experts": None,
            }
        )
        toks_all.append(toks.astype(np.int32))
        lps_all.append(lps)

    prompt_lp = topk_ids = topk_lp = None
    if k >= 0 and prompt_len:
        rows: list[Any] = [None]
        prompt_lp = np.full(prompt_len, np.nan, dtype=np.float32)
        kk = max(k, 1)
        topk_ids = np.zeros((prompt_len, kk), dtype=np.int32)
        topk_lp = np.full((prompt_len, kk), -99999.0, dtype=np.float32)
        for p in range(1, prompt_len):
            own = int(prompt_ids[p])
            top_lps = np.sort(_rand_f32_logprobs(rng, k))[::-1].astype(np.float64).tolist()
            top_ids = rng.integers(0, vocab, size=k).tolist()
            in_top = k > 0 and rng.random() < 0.5
            if in_top:  # the actual token is the top-1: merged, k entries
                top_ids[0] = own
                own_lp = top_lps[0]
            else:
                own_lp = f32(min(top_lps[-1] if k else 0.0, -0.5) - rng.exponential(2.0))
            row = prompt_row(own, own_lp, list(zip(top_ids, top_lps)), k)
            rows.append(row)
            prompt_lp[p] = own_lp
            ent = sorted(((int(key), v["logprob"]) for key, v in row.items()), key=lambda t: -t[1])[:kk]
            for c, (tid, lp) in enumerate(ent):
                topk_ids[p, c] = tid
                topk_lp[p, c] = lp
        for c in choices:
            c["prompt_logprobs"] = rows
        if k == 0:
            topk_ids = topk_lp = None
    body = render(choices, prompt_tokens=prompt_len)
    return RealisticCase(body, n, prompt_ids.astype(np.int32), toks_all, lps_all, prompt_lp, topk_ids, topk_lp, k)
