"""The vLLM ``/v1/completions`` request body for one Tinker sample request.

Engine protocol knowledge, kept out of the HTTP handlers: ``asample``
(:mod:`shardserver.api.sampling`) validates the SDK's request and hands the fields to
:func:`completion_request_body`; the encoder that owns the future forwards the bytes to the
engine unchanged (and re-forwards them on ``finish_reason: abort``). The fields are those of
vLLM's ``CompletionRequest`` (``vllm/entrypoints/openai/protocol.py``; the bundled simulator,
:mod:`shardserver.engine_sim`, parses the same ones).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import msgspec

__all__ = ["completion_request_body", "parse_model_windows", "context_window"]

_IDS_ENCODER = msgspec.json.Encoder()


def completion_request_body(
    *,
    model: str,
    prompt: Sequence[int],
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: str | list[str] | list[int] | None,
    prompt_logprobs: int | None,
) -> bytes:
    """The JSON body (compact, UTF-8) of a ``POST /v1/completions`` for one sample request.

    vLLM fields set, in this order:

    * ``model``, ``prompt`` (token ids, not text), ``n``, ``max_tokens``, ``temperature``,
      ``top_p``, ``top_k``: as given.
    * ``logprobs: 1``: every choice carries the sampled tokens' logprobs (``SampleResponse``
      sequences always have them).
    * ``return_token_ids: true``: every choice carries its generated token ids (the SDK gets
      tokens, never text).
    * ``seed``: only when not None.
    * ``prompt_logprobs``: only when not None; ``k`` top entries per prompt position besides
      the prompt token's own logprob (0: only that one).
    * From the SDK's ``stop``: a string becomes ``stop: [string]``; a list of strings
      ``stop``; a list of ints ``stop_token_ids``; the empty list ``ignore_eos: true`` (the
      SDK's ``stop=[]`` means no stop at all, EOS included); None sets nothing.
    * ``skip_special_tokens: false`` whenever ``stop`` strings are sent: vLLM matches stop
      strings against the detokenized text, and special tokens (``<|im_end|>``) appear in it
      only then. It costs nothing: the gateway reads ``token_ids``, never ``text``.

    Args:
        model: the model name the engine serves (``engine.model``, else the session's).
        prompt: the prompt's token ids, each in [0, 2^31).
        n: sequences to sample (>= 1).
        max_tokens: most tokens generated per sequence (>= 1).
        temperature, top_p, top_k: the SDK's ``SamplingParams`` (``top_k = -1``: off).
        seed: the SDK's ``SamplingParams.seed``.
        stop: the SDK's ``SamplingParams.stop``.
        prompt_logprobs: None when the request wants no prompt logprobs, else its
            ``topk_prompt_logprobs`` (0..20).

    Returns:
        The body bytes, e.g. ``{"model":"m","prompt":[1,2],"n":1,"max_tokens":4,"temperature":1.0,
        "top_p":1.0,"top_k":-1,"logprobs":1,"return_token_ids":true}`` (one line).
    """
    # The prompt (up to the context window: ~1 ms for 8k ids through json.dumps) is written by
    # msgspec, ~20x faster and the same bytes for a list of ints; the few other fields by
    # json.dumps, whose output (escapes, float repr) the request digest has always hashed.
    req: dict[str, Any] = {
        "n": n, "max_tokens": max_tokens,
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "logprobs": 1, "return_token_ids": True,
    }
    if seed is not None:
        req["seed"] = seed
    if prompt_logprobs is not None:
        req["prompt_logprobs"] = prompt_logprobs
    if isinstance(stop, str):
        req["stop"] = [stop]
    elif stop is not None and len(stop) == 0:
        req["ignore_eos"] = True  # the SDK's stop=[]: no stop at all, EOS included
    elif stop:
        if all(isinstance(s, int) for s in stop):
            req["stop_token_ids"] = stop
        else:
            req["stop"] = stop
    if "stop" in req:
        req["skip_special_tokens"] = False  # so that "<|im_end|>" can match (see above)
    try:
        ids = _encode_ids(prompt)
    except TypeError:  # not a list or tuple of plain ints
        ids = json.dumps(list(prompt), separators=(",", ":")).encode()
    head = json.dumps({"model": model}, separators=(",", ":")).encode()
    tail = json.dumps(req, separators=(",", ":")).encode()
    return b"".join((head[:-1], b',"prompt":', ids, b",", tail[1:]))


def _encode_ids(ids: Sequence[int]) -> bytes:
    """``[1,2,3]`` for a list or tuple of ints: msgspec's compact JSON, byte for byte what
    ``json.dumps(ids, separators=(",", ":"))`` writes for ints (bool, int subclasses and any
    other type raise TypeError: the caller falls back to json.dumps)."""
    if type(ids) not in (list, tuple):
        raise TypeError("not a list")
    return _IDS_ENCODER.encode(ids)


def parse_model_windows(body: bytes) -> dict[str, int]:
    """The context window of each model in a ``GET /v1/models`` answer: ``{model id: tokens}``.

    vLLM lists each served model as ``{"id", "root", "parent", "max_model_len", ...}`` (its
    ``ModelCard``; ``max_model_len`` is the engine's ``--max-model-len``). A LoRA adapter's card
    has no ``max_model_len`` and names its base model in ``parent``: it gets the base's window.
    Entries without a usable window are left out (routers and proxies may list bare ids).

    Raises:
        ValueError: the body is not JSON with a ``data`` list.
    """
    obj = json.loads(body)
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise ValueError("GET /v1/models answer has no data list")
    out: dict[str, int] = {}
    parents: dict[str, str] = {}
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        mlen = m.get("max_model_len")
        if isinstance(mlen, int) and not isinstance(mlen, bool) and mlen > 0:
            out[m["id"]] = mlen
        elif isinstance(m.get("parent"), str):
            parents[m["id"]] = m["parent"]
    for mid, parent in parents.items():
        if parent in out:
            out[mid] = out[parent]
    return out


def context_window(windows: Mapping[str, int], model: str, default: int) -> tuple[int, bool]:
    """The context window (tokens) for requests naming ``model``: ``(tokens, learned)``.

    ``windows`` is what the engine reported (:func:`parse_model_windows`). Its entry for
    ``model`` if there is one; else, when every model the engine serves has the same window,
    that window (one engine, one ``--max-model-len``); else ``default``
    (``engine.max_model_len``) with ``learned`` False.
    """
    w = windows.get(model)
    if w is not None:
        return w, True
    values = set(windows.values())
    if len(values) == 1:
        return values.pop(), True
    return default, False
