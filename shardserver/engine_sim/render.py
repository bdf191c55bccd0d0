"""Rendering a completion body: the dict form (the reference) and the fast byte form
(byte-identical to it), plus the public :func:`render_completion` and :func:`completion_dict`."""

from __future__ import annotations

import collections
import hashlib
import os
import time
from typing import Any, Mapping

import numpy as np

from .config import FaultRule, SimConfig
from .generate import _R, _Choice, _f32, _Generated, _Joined, _generate, _ints_csv, _sample_prompt_logprobs
from .request import _parse_request, _Req
from .vocab import _FakeVocab, _vocab_for
from .wire import _CLAMP, _dumps, _jstr

__all__ = ["render_completion", "completion_dict"]

def _choice_arrays(gen: _Generated, c: _Choice) -> tuple[np.ndarray, ...]:
    """(ids, lps, top1, t1_ids, t1_lps) of a choice, with ``last`` applied."""
    p, a, T = gen.pool, c.a, c.T
    ids, lps = p.ids[a:a + T].copy(), p.lps[a:a + T].copy()
    top1 = np.ones(T, dtype=bool) if gen.req.greedy else p.top1[a:a + T].copy()
    t1_ids, t1_lps = p.t1_ids[a:a + T].copy(), p.t1_lps[a:a + T].copy()
    if c.last is not None and T:
        ids[-1], lps[-1] = c.last
        top1[-1] = True
    t1_ids = np.where(top1, ids, t1_ids)
    t1_lps = np.where(top1, lps, t1_lps)
    return ids, lps, top1, t1_ids, t1_lps


def _alternatives(c: _Choice, k: int, arrays: tuple[np.ndarray, ...], V: int) -> tuple[list, list]:
    """Top-k ranks 2..k for ``logprobs >= 2``: ids and logprobs, shape [T][k-1]."""
    ids, lps, top1, t1_ids, t1_lps = arrays
    T = len(ids)
    rng = np.random.Generator(np.random.PCG64([c.a, k, 0x616C74]))
    u = rng.random((T, k - 1))
    u_sorted = -np.sort(-u, axis=1)
    between = lps[:, None] + (t1_lps - lps)[:, None] * u_sorted  # sampled ranks below top-k
    below = t1_lps[:, None] - np.cumsum(0.3 + 2.0 * u, axis=1)
    alt_lps = _f32(np.where(top1[:, None], below, between))
    alt_ids = (t1_ids[:, None] + np.cumsum(1 + (u * 997).astype(np.int64), axis=1)) % V
    return alt_ids.tolist(), alt_lps.tolist()


def _logprobs_obj(gen: _Generated, c: _Choice, vocab: _FakeVocab) -> dict[str, Any]:
    """``CompletionLogProbs`` of one choice, as ``_create_completion_logprobs`` builds it."""
    k = gen.req.logprobs
    arrays = _choice_arrays(gen, c)
    ids, lps, top1, t1_ids, t1_lps = (x.tolist() for x in arrays)
    alt_ids = alt_lps = None
    if k >= 2:
        alt_ids, alt_lps = _alternatives(c, k, arrays, gen.vocab_size)
    toks = [vocab.text(t) for t in ids]
    offs, acc = [], 0
    for t in toks:
        offs.append(acc)
        acc += len(t)
    top = []
    for j in range(len(ids)):
        by_id: dict[int, float] = {ids[j]: lps[j]}  # sampled first, then the top-k, merged by id
        if k >= 1:
            by_id[t1_ids[j]] = t1_lps[j]
            if alt_ids is not None:
                for tid, lp in zip(alt_ids[j], alt_lps[j]):
                    by_id[tid] = lp
        entry: dict[str, float] = {}  # keyed by decoded string: later value wins, first position kept
        for tid, lp in list(by_id.items())[: k + 1]:
            entry[vocab.text(tid)] = max(lp, _CLAMP)
        top.append(entry)
    return {
        "text_offset": offs,
        "token_logprobs": [max(x, _CLAMP) for x in lps],
        "tokens": toks,
        "top_logprobs": top,
    }


def _choice_text(gen: _Generated, c: _Choice, vocab: _FakeVocab) -> str:
    ids = gen.pool.ids[c.a:c.a + c.text_end].tolist()
    text = "".join([vocab.strs[i] for i in ids])
    if c.text_cut is not None:
        text = text.encode("utf-8")[: c.text_cut].decode("utf-8")
    return text


def _prompt_logprobs_list(gen: _Generated, cfg: SimConfig, vocab: _FakeVocab) -> list[Any]:
    plp = _sample_prompt_logprobs(gen.req, cfg, vocab, gen.phash)
    out: list[Any] = [None]
    for ents in plp.entries[: gen.prompt_positions - 1]:
        out.append({tid: {"logprob": lp, "rank": rank, "decoded_token": vocab.text(tid)} for tid, lp, rank in ents})
    return out


def _dict_from(gen: _Generated, cfg: SimConfig, request_id: str, created: int) -> dict[str, Any]:
    vocab = _vocab_for(cfg)
    req = gen.req
    plp = _prompt_logprobs_list(gen, cfg, vocab) if req.prompt_logprobs is not None else None
    choices = []
    for i, c in enumerate(gen.choices):
        choices.append(
            {
                "index": i,
                "text": _choice_text(gen, c, vocab),
                "logprobs": _logprobs_obj(gen, c, vocab) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": _choice_arrays(gen, c)[0].tolist() if req.return_token_ids else None,
                "prompt_logprobs": plp,
                "prompt_token_ids": list(req.prompt_list) if req.return_token_ids else None,
                "routed_experts": None,
            }
        )
    completion_tokens = sum(c.T for c in gen.choices)
    P = len(req.prompt)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": cfg.model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": cfg.system_fingerprint,
        "usage": {
            "prompt_tokens": P,
            "total_tokens": P + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _window(j: _Joined, c: _Choice, last: bytes | None) -> bytes:
    if last is None:
        return j.slice(c.a, c.a + c.T)
    head = j.slice(c.a, c.a + c.T - 1)
    return head + b"," + last if head else last


def _render_logprobs(gen: _Generated, c: _Choice, vocab: _FakeVocab) -> list[bytes]:
    """The choice's ``logprobs`` object as a list of byte pieces."""
    k = gen.req.logprobs
    if k >= 2:
        return [_dumps(_logprobs_obj(gen, c, vocab))]
    pool = gen.pool
    offs = pool.cum[c.a:c.a + c.T] - pool.cum[c.a]
    tok_last = lp_last = top_last = None
    if c.last is not None:
        tid, lp = c.last
        e, r = vocab.esc_of(tid), _R(max(lp, _CLAMP))
        tok_last, lp_last, top_last = e.encode(), r.encode(), ("{" + e + ":" + r + "}").encode()
    top_j = pool.j_top0 if (k == 0 or gen.req.greedy) else pool.j_top1
    return [
        b'{"text_offset":[', _ints_csv(offs),
        b'],"token_logprobs":[', _window(pool.j_lps, c, lp_last),
        b'],"tokens":[', _window(pool.j_tok, c, tok_last),
        b'],"top_logprobs":[', _window(top_j, c, top_last),
        b"]}",
    ]


_PLP_CACHE: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()


def _render_prompt_logprobs(gen: _Generated, cfg: SimConfig, vocab: _FakeVocab) -> bytes:
    key = (gen.phash, len(gen.req.prompt), gen.req.prompt_logprobs, gen.prompt_positions, cfg.vocab_size,
           cfg.eos_token_id, cfg.vocab_seed, cfg.prompt_top1_fraction, cfg.clamp_rate)
    hit = _PLP_CACHE.get(key)
    if hit is not None:
        _PLP_CACHE.move_to_end(key)
        return hit
    plp = _sample_prompt_logprobs(gen.req, cfg, vocab, gen.phash)
    parts = ["null"]
    esc_of = vocab.esc_of
    for ents in plp.entries[: gen.prompt_positions - 1]:
        parts.append("{" + ",".join(
            [f'"{tid}":{{"logprob":{_R(lp)},"rank":{rank},"decoded_token":{esc_of(tid)}}}' for tid, lp, rank in ents]
        ) + "}")
    out = ("[" + ",".join(parts) + "]").encode("utf-8")
    _PLP_CACHE[key] = out
    while len(_PLP_CACHE) > 16:
        _PLP_CACHE.popitem(last=False)
    return out


def _render_tail(gen: _Generated, cfg: SimConfig) -> bytes:
    """Everything after ``"created":<int>`` (starts with ``,"model":``)."""
    vocab = _vocab_for(cfg)
    req, pool = gen.req, gen.pool
    plp = _render_prompt_logprobs(gen, cfg, vocab) if req.prompt_logprobs is not None else b"null"
    pids = b"[" + _ints_csv(req.prompt) + b"]" if req.return_token_ids else b"null"
    parts = [b',"model":', _jstr(cfg.model_name).encode(), b',"choices":[']
    for i, c in enumerate(gen.choices):
        if i:
            parts.append(b",")
        sr = c.stop_reason
        sr_s = "null" if sr is None else (str(sr) if isinstance(sr, int) else _jstr(sr))
        if c.text_cut is None:
            text = b'"' + pool.j_text.slice(c.a, c.a + c.text_end) + b'"'
        else:
            text = _jstr(pool.j_raw.slice(c.a, c.a + c.text_end)[: c.text_cut].decode("utf-8")).encode()
        if req.return_token_ids:
            token_ids = b"[" + _window(pool.j_ids, c, None if c.last is None else str(c.last[0]).encode()) + b"]"
        else:
            token_ids = b"null"
        parts += [b'{"index":', str(i).encode(), b',"text":', text, b',"logprobs":']
        parts += _render_logprobs(gen, c, vocab) if req.logprobs is not None else [b"null"]
        parts += [
            b',"finish_reason":', _jstr(c.finish_reason).encode(),
            b',"stop_reason":', sr_s.encode(),
            b',"token_ids":', token_ids,
            b',"prompt_logprobs":', plp,
            b',"prompt_token_ids":', pids,
            b',"routed_experts":null}',
        ]
    completion_tokens = sum(c.T for c in gen.choices)
    P = len(req.prompt)
    fp = "null" if cfg.system_fingerprint is None else _jstr(cfg.system_fingerprint)
    parts.append(
        (
            f'],"service_tier":null,"system_fingerprint":{fp},"usage":{{"prompt_tokens":{P},'
            f'"total_tokens":{P + completion_tokens},"completion_tokens":{completion_tokens},'
            '"prompt_tokens_details":null,"completion_tokens_details":null},'
            '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
        ).encode()
    )
    return b"".join(parts)


def _head(request_id: str, created: int) -> bytes:
    return ('{"id":' + _jstr(request_id) + ',"object":"text_completion","created":' + str(int(created))).encode("utf-8")


_GEN_KNOBS = ("model_name", "vocab_size", "eos_token_id", "vocab_seed", "system_fingerprint", "eos_probability",
              "stop_token_probability", "top1_fraction", "prompt_top1_fraction", "clamp_rate", "collision_rate",
              "pool_starts", "max_model_len")


def _cache_key(req: _Req, cfg: SimConfig, override: FaultRule | None) -> bytes:
    """Hash of everything the body tail depends on."""
    h = hashlib.blake2b(digest_size=24)
    h.update(req.prompt.astype("<i8", copy=False).tobytes())
    req_fields = (req.n, req.max_tokens, req.greedy, req.seed, req.logprobs, req.prompt_logprobs,
                  req.return_token_ids, req.stop, req.stop_token_ids, req.ignore_eos)
    ov = None if override is None else (override.finish_reason, override.tokens, override.prompt_positions,
                                        override.stop_string)
    h.update(repr((tuple(getattr(cfg, k) for k in _GEN_KNOBS), req_fields, ov)).encode("utf-8"))
    return h.digest()


def _ids_for(cfg: SimConfig, key: bytes, request_id: str | None, created: int | None) -> tuple[str, int]:
    if request_id is None:
        request_id = "cmpl-" + (key[:8].hex() if cfg.deterministic_ids else os.urandom(8).hex())
    if created is None:
        created = cfg.fixed_created if cfg.deterministic_ids else int(time.time())
    return request_id, created


def render_completion(
    request: Mapping[str, Any],
    config: SimConfig | None = None,
    *,
    request_id: str | None = None,
    created: int | None = None,
    finish_override: FaultRule | None = None,
) -> bytes:
    """The exact 200 body the simulator sends for ``request`` (a decoded request JSON object).

    ``request_id`` is the full id (the server uses ``"cmpl-" + X-Request-Id`` when that
    header is sent); when None it is ``"cmpl-"`` + 16 hex, derived from the input with
    ``deterministic_ids``, else random. ``created`` defaults to ``config.fixed_created``
    (``deterministic_ids``) or the current unix time. ``finish_override`` is a
    ``kind="finish_reason"`` :class:`FaultRule` to apply, as the server does for a
    matching rule. Raises :class:`SimRequestError` for requests vLLM would reject.
    """
    cfg = config or SimConfig()
    req = _parse_request(dict(request), cfg)
    key = _cache_key(req, cfg, finish_override)
    rid, cr = _ids_for(cfg, key, request_id, created)
    return _head(rid, cr) + _render_tail(_generate(req, cfg, finish_override), cfg)


def completion_dict(
    request: Mapping[str, Any],
    config: SimConfig | None = None,
    *,
    request_id: str | None = None,
    created: int | None = None,
    finish_override: FaultRule | None = None,
) -> dict[str, Any]:
    """The response of :func:`render_completion` as the dict vLLM's ``model_dump()`` gives
    (``CompletionResponse`` field order, int keys in ``prompt_logprobs``). Built the slow
    way, independently of the byte renderer; ``json.dumps(d, ensure_ascii=False,
    allow_nan=False, separators=(",", ":")).encode()`` equals the rendered body."""
    cfg = config or SimConfig()
    req = _parse_request(dict(request), cfg)
    key = _cache_key(req, cfg, finish_override)
    rid, cr = _ids_for(cfg, key, request_id, created)
    return _dict_from(_generate(req, cfg, finish_override), cfg, rid, cr)
