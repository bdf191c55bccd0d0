"""A byte-faithful simulator of vLLM 0.30's non-streaming ``POST /v1/completions``.

The simulator is an aiohttp application that answers the way a vLLM 0.30.0 server
(optionally behind vllm-router) answers the sampling gateway. The wire format is the one
described in ``/work/shared/spec/vllm_completions.md``:

* success bodies follow vLLM's ``CompletionResponse`` / ``CompletionResponseChoice`` /
  ``CompletionLogProbs`` / ``UsageInfo`` field order (spec §2, example §6), rendered the
  way Starlette's ``JSONResponse`` renders ``model_dump()``: ``json.dumps(obj,
  ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))`` as UTF-8;
* ``finish_reason`` / ``stop_reason`` follow ``FinishReason`` and ``check_stop`` (§3);
* errors use vLLM's ``ErrorResponse`` envelope ``{"error":{message,type,param,code}}``,
  FastAPI's ``{"detail":...}`` for routing errors, or vllm-router's text/plain and empty
  bodies (§8).

Generation is fake but deterministic: the output of a request is a pure function of the
prompt token ids, the seed (choice ``i`` uses ``seed + i`` like vLLM's
``parallel_sampling.py``; without a seed one is derived from the prompt), ``max_tokens``,
the other request fields and the generation knobs of :class:`SimConfig`. Token streams are
prefix-stable: the first ``m`` tokens for ``max_tokens=m`` equal the first ``m`` tokens for
any larger ``max_tokens``. Token text comes from a deterministic fake vocabulary that
contains non-ASCII text, empty strings (0.30's partial-UTF-8 repair), ``"\\n\\n"``, quotes,
backslashes and control characters, with ``"<|endoftext|>"`` as EOS.

Speed: all generated tokens are windows of one pre-rendered token "pool" per generation
config (see the "Deterministic generation" section), so an uncached 32768-token body with
``logprobs=1`` is built in ~5 ms; bodies are also cached in an LRU bounded by total bytes,
keyed by the full deterministic input, and sent without copying (head and tail written
separately). Different seeds read overlapping windows of the same pool; that is fine for
a fake, but means token streams of different requests can share long stretches.

Sim-only conventions: the request's ``Content-Type`` must be ``application/json`` (as in
vLLM); ``model`` must match ``SimConfig.model_name`` when given (404 otherwise, see
``check_model``); ``stream`` is ignored (always non-streaming); a string prompt or several
prompts in one request are rejected with 400; greedy requests (temperature 0) ignore the
seed and report every sampled token as the top-1.

Public API: :class:`SimConfig`, :class:`FaultRule`, :class:`SimRequestError`,
:func:`make_app`, :func:`start_sim`, :func:`stop_sim`, :func:`render_completion`,
:func:`completion_dict` and :func:`run_standalone`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import signal
import time
from typing import Any, Mapping

import numpy as np
from aiohttp import web

__all__ = [
    "SimConfig",
    "FaultRule",
    "SimRequestError",
    "make_app",
    "start_sim",
    "stop_sim",
    "render_completion",
    "completion_dict",
    "run_standalone",
]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_LN2 = math.log(2.0)
_SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below this are greedy
_CLAMP = -9999.0  # vLLM's wire form of -inf (spec §4)


def _dumps(obj: Any) -> bytes:
    """Serialize like Starlette's ``JSONResponse.render`` (spec §2.1)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode(
        "utf-8"
    )


def _jstr(s: str) -> str:
    """JSON string literal (with quotes) exactly as ``json.dumps(ensure_ascii=False)`` writes it."""
    return json.dumps(s, ensure_ascii=False)


# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------

_FAULT_KINDS = ("status", "truncate", "non_json", "stall", "finish_reason", "nan")
_BODY_KINDS = ("vllm", "router", "empty", "detail")
_FINISH_OVERRIDES = ("abort", "repetition", "stop")


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """One fault-injection rule, applied to the ``/v1/completions`` requests it matches.

    Matching (all given matchers must hold; a rule with no matcher matches every request):

    * ``every_nth``: the running count of valid completion requests (1-based, since start
      or ``/_sim/reset``) is a multiple of N.
    * ``probability``: a draw from this rule's own ``random.Random`` (seeded from
      ``SimConfig.fault_seed`` and the rule's position) is below p. One draw is made per
      request whose other matchers passed, so the sequence is reproducible (re-seeded by
      ``/_sim/reset`` and whenever the fault list changes).
    * ``first_token_id``: the prompt's first token id equals this value; lets a test target
      one request deterministically.
    * ``times``: fire at most this many times (None = unlimited), e.g. "fail once, then
      succeed" for retry tests.

    Kinds (``kind``):

    * ``"status"``: answer ``status`` with a body of kind ``body``: ``"vllm"`` (the
      ``{"error":{...}}`` envelope, type from the status as in spec §8.1), ``"router"``
      (vllm-router's text/plain, §8.2), ``"empty"`` (no body, no content type) or
      ``"detail"`` (FastAPI's ``{"detail":"Not Found"}``). ``message`` overrides the text.
      The generation has run (latency applies), like a vLLM 500 after the work was done.
    * ``"truncate"``: send the headers with the full Content-Length, then a valid prefix
      of the body (``truncate_bytes``, or ``truncate_fraction`` of it), then close the
      connection. Clients see a payload error.
    * ``"non_json"``: 200 with an HTML page (``content_type``, default ``text/html``).
    * ``"stall"``: sleep ``stall_s`` seconds before answering (other rules still apply).
    * ``"finish_reason"``: override the finish of every choice: ``"abort"`` (partial,
      ``tokens`` kept, possibly 0; ``prompt_logprobs`` cut to ``prompt_positions`` list
      elements, default half the prompt when 0 tokens are kept), ``"repetition"``
      (``stop_reason`` ``"repetition_detected"``), ``"stop"`` (``stop_reason`` =
      ``stop_string``, the last kept token is the one that completed the match and its
      text is cut). ``tokens=None`` keeps half of what the choice generated.
    * ``"nan"``: vLLM 0.30's NaN-serialization failure: 400 ``BadRequestError``
      ``"Out of range float values are not JSON compliant: nan"`` after the work ran.

    Several rules can match one request: every matching ``stall`` sleeps, the first
    matching ``finish_reason`` applies, and the first matching status/truncate/non_json/nan
    rule decides the response.
    """

    kind: str
    every_nth: int | None = None
    probability: float | None = None
    first_token_id: int | None = None
    times: int | None = None
    status: int = 500
    body: str = "vllm"
    message: str | None = None
    truncate_fraction: float = 0.5
    truncate_bytes: int | None = None
    content_type: str = "text/html"
    stall_s: float = 0.0
    finish_reason: str = "abort"
    tokens: int | None = None
    prompt_positions: int | None = None
    stop_string: str = "\n\n"

    def __post_init__(self) -> None:
        if self.kind not in _FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {_FAULT_KINDS}, got {self.kind!r}")
        if self.body not in _BODY_KINDS:
            raise ValueError(f"fault body must be one of {_BODY_KINDS}, got {self.body!r}")
        if self.finish_reason not in _FINISH_OVERRIDES:
            raise ValueError(f"fault finish_reason must be one of {_FINISH_OVERRIDES}, got {self.finish_reason!r}")
        if self.every_nth is not None and self.every_nth < 1:
            raise ValueError("fault every_nth must be >= 1")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError("fault probability must be in [0, 1]")
        if not 100 <= self.status <= 599:
            raise ValueError("fault status must be an HTTP status")
        if not 0.0 <= self.truncate_fraction < 1.0:
            raise ValueError("fault truncate_fraction must be in [0, 1)")
        if self.stall_s < 0:
            raise ValueError("fault stall_s must be >= 0")
        for name in ("tokens", "prompt_positions", "truncate_bytes", "times"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"fault {name} must be >= 0")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "FaultRule":
        """Build from a JSON object; unknown keys raise ``ValueError`` naming the key."""
        if isinstance(m, FaultRule):
            return m
        if not isinstance(m, Mapping):
            raise ValueError(f"fault rule must be an object, got {type(m).__name__}")
        return cls(**_check_fields(cls, m, "fault."))

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulator. Frozen; change at runtime through ``POST /_sim/config``.

    Served model (vLLM server flags):
        model_name: served model name; ``model`` in requests must match (404
            ``NotFoundError`` otherwise, unless ``check_model`` is False; absent/null is OK).
        max_model_len: prompt + max_tokens limit (400, ``param:"input_tokens"``). Default
            65536 fits a 4096-token prompt plus 32768 generated tokens.
        max_logprobs: server ``--max-logprobs`` (20); larger ``logprobs`` or
            ``prompt_logprobs`` are rejected with 400.
        system_fingerprint: the top-level fingerprint string (None renders ``null``).

    Fake generation (all affect the output; all are part of the cache key):
        vocab_size: sampled ids are in ``[0, vocab_size)`` (151643, Qwen's text vocab).
        eos_token_id: primary EOS id (151643), decoded as ``"<|endoftext|>"``.
        vocab_seed: seed of the fake vocabulary's strings.
        eos_probability: per-token probability that EOS is sampled (finish ``stop``,
            ``stop_reason`` null, EOS id last); 0 = always run to ``max_tokens``.
        stop_token_probability: per-token probability that one of the request's
            ``stop_token_ids`` is sampled (``stop_reason`` = that int).
        top1_fraction: fraction of positions where the sampled token is the top-1 (its
            ``top_logprobs`` then has 1 entry at ``logprobs=1``; otherwise 2).
        prompt_top1_fraction: same for prompt positions in ``prompt_logprobs``.
        clamp_rate: fraction of sampled logprobs rendered as ``-9999.0`` (-inf).
        collision_rate: fraction of non-top-1 positions whose sampled and top-1 tokens
            are different ids that decode to the same string (``""``), so
            ``top_logprobs`` shrinks to one entry holding the top-1 value (spec §2.4).

    Latency (seconds, slept after the body is built):
        queue_delay_s + latency_s + per_token_latency_s * completion tokens (all choices).

    Misc:
        deterministic_ids: ids become ``"cmpl-"`` + 16 hex of the input's hash and
            ``created`` becomes ``fixed_created``, so whole bodies are reproducible.
        fixed_created: the ``created`` value used with ``deterministic_ids``.
        cache_max_bytes: bound of the rendered-body LRU (512 MiB); 0 disables it.
        pool_starts: number of distinct window starts in the pre-rendered token pool
            (65536). The pool holds ``pool_starts + max_model_len`` positions (~115 B
            each, ~15 MB and ~0.5 s to build at the defaults; rebuilt when a knob it
            depends on changes).
        faults: tuple of :class:`FaultRule` (from JSON: a list of objects).
        fault_seed: seeds the rules' probability draws.
    """

    model_name: str = "Qwen/Qwen3-8B"
    vocab_size: int = 151643
    eos_token_id: int = 151643
    vocab_seed: int = 0
    max_model_len: int = 65536
    max_logprobs: int = 20
    check_model: bool = True
    system_fingerprint: str | None = "vllm-0.30.0-8f3e21ab"
    eos_probability: float = 0.0
    stop_token_probability: float = 0.0
    top1_fraction: float = 0.75
    prompt_top1_fraction: float = 0.5
    clamp_rate: float = 1e-4
    collision_rate: float = 1e-3
    latency_s: float = 0.0
    per_token_latency_s: float = 0.0
    queue_delay_s: float = 0.0
    deterministic_ids: bool = False
    fixed_created: int = 1767225600
    cache_max_bytes: int = 512 * 1024 * 1024
    pool_starts: int = 65536
    faults: tuple[FaultRule, ...] = ()
    fault_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.faults, list):
            object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "faults", tuple(FaultRule.from_mapping(f) for f in self.faults))
        if self.vocab_size < 16:
            raise ValueError("vocab_size must be >= 16")
        if self.eos_token_id < 0:
            raise ValueError("eos_token_id must be >= 0")
        if self.max_model_len < 1 or self.max_logprobs < 0:
            raise ValueError("max_model_len must be >= 1 and max_logprobs >= 0")
        for name in ("eos_probability", "stop_token_probability", "top1_fraction", "prompt_top1_fraction",
                     "clamp_rate", "collision_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        for name in ("latency_s", "per_token_latency_s", "queue_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.cache_max_bytes < 0:
            raise ValueError("cache_max_bytes must be >= 0")
        if self.pool_starts < 1:
            raise ValueError("pool_starts must be >= 1")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], base: "SimConfig | None" = None) -> "SimConfig":
        """Build from a JSON-like mapping, on top of ``base`` (defaults when None).

        Unknown keys raise ``ValueError`` naming the key; wrong types raise ``ValueError``.
        ``faults`` is a list of :class:`FaultRule` objects/mappings and replaces the
        whole list.
        """
        if not isinstance(m, Mapping):
            raise ValueError(f"config must be an object, got {type(m).__name__}")
        fields = _check_fields(cls, m, "")
        if "faults" in fields:
            f = fields["faults"]
            if not isinstance(f, (list, tuple)):
                raise ValueError("faults must be a list")
            fields["faults"] = tuple(FaultRule.from_mapping(x) for x in f)
        return dataclasses.replace(base or cls(), **fields)

    def to_mapping(self) -> dict[str, Any]:
        """JSON-able dict of every knob (faults as a list of objects)."""
        d = dataclasses.asdict(self)
        d["faults"] = [f.to_mapping() for f in self.faults]
        return d


_INT_FIELDS_NULLABLE = {"every_nth", "first_token_id", "times", "truncate_bytes", "tokens", "prompt_positions"}


def _check_fields(cls: type, m: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    known = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in m.items():
        if key not in known:
            raise ValueError(f"unknown {cls.__name__} key {prefix}{key!r}")
        default = known[key].default
        if key == "faults":
            out[key] = value
            continue
        if key in _INT_FIELDS_NULLABLE or key == "system_fingerprint" or key == "message" or key == "probability":
            if value is None:
                out[key] = None
                continue
            if key in ("system_fingerprint", "message"):
                if not isinstance(value, str):
                    raise ValueError(f"{prefix}{key} must be a string or null")
            elif key == "probability":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{prefix}{key} must be a number or null")
                value = float(value)
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{prefix}{key} must be an integer or null")
            out[key] = value
            continue
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{prefix}{key} must be a boolean")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{prefix}{key} must be an integer")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{prefix}{key} must be a number")
            value = float(value)
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"{prefix}{key} must be a string")
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------
# Fake vocabulary
# ---------------------------------------------------------------------------------------

_PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", "/", "'", "=", "+", "*", "#", "...", " -", " (", "):", "/*"]
_WS = ["\n", "\n\n", "\t", "  ", " \n", "\r\n", "    ", "\n\n\n", " "]
_NONASCII = ["é", " über", "中文", "日本語", "🙂", "\u2028", "\u00a0", "ß", "\ufffd", "Ω", " naïve", "—",
             " café",
             "\u2029", "😀😀", " 京", "Ж", "ü", "→", "\u200b"]
_ESCAPEY = ['"', "\\", '\\"', "\\n", "\x00", "\x01", "\x1b", "\x1f", "\x7f", "\b", "\f", '"}', "',", '{"',
            "\\\\", "\r", "\x0b", "</", "<think>", " \"\\"]


class _FakeVocab:
    """Deterministic id -> string table. Entry ``eos_token_id`` is ``"<|endoftext|>"``."""

    def __init__(self, vocab_size: int, eos_token_id: int, seed: int) -> None:
        n = max(vocab_size, eos_token_id + 1)
        rng = np.random.default_rng([seed & _MASK64, 0x766F636162])
        cat = rng.choice(8, size=n, p=[0.52, 0.24, 0.05, 0.05, 0.03, 0.06, 0.03, 0.02])
        wlen = rng.integers(1, 9, size=n)
        letters = rng.integers(97, 123, size=n * 8, dtype=np.uint8).tobytes().decode("ascii")
        pick = rng.integers(0, 1 << 30, size=n)
        strs: list[str] = []
        append = strs.append
        for i, (c, L, p) in enumerate(zip(cat.tolist(), wlen.tolist(), pick.tolist())):
            if c == 0:
                append(" " + letters[i * 8:i * 8 + L])
            elif c == 1:
                append(letters[i * 8:i * 8 + L])
            elif c == 2:
                append(_PUNCT[p % len(_PUNCT)])
            elif c == 3:
                append(str(p % 1000))
            elif c == 4:
                append(_WS[p % len(_WS)])
            elif c == 5:
                append(_NONASCII[p % len(_NONASCII)])
            elif c == 6:
                append(_ESCAPEY[p % len(_ESCAPEY)])
            else:
                append("")
        strs[eos_token_id] = "<|endoftext|>"
        # A few fixed entries so that small tests meet the interesting strings.
        fixed = {0: "!", 1: '"', 2: "\\", 3: "\n\n", 4: "", 5: "é", 6: "\x01", 7: " the", 8: "", 9: "🙂"}
        for k, v in fixed.items():
            if k != eos_token_id and k < n:
                strs[k] = v
        self.size = n
        self.strs = strs
        self.esc = [_jstr(s) for s in strs]
        self.lens = np.fromiter((len(s) for s in strs), dtype=np.int64, count=n)
        empty = np.flatnonzero(self.lens == 0)
        self.empty_ids = empty[empty != eos_token_id]

    def text(self, i: int) -> str:
        if 0 <= i < self.size:
            return self.strs[i]
        return f"<|extra_{i}|>"

    def esc_of(self, i: int) -> str:
        if 0 <= i < self.size:
            return self.esc[i]
        return _jstr(self.text(i))

    def length(self, i: int) -> int:
        return len(self.text(i))


@functools.lru_cache(maxsize=4)
def _get_vocab(vocab_size: int, eos_token_id: int, seed: int) -> _FakeVocab:
    return _FakeVocab(vocab_size, eos_token_id, seed)


def _vocab_for(cfg: SimConfig) -> _FakeVocab:
    return _get_vocab(cfg.vocab_size, cfg.eos_token_id, cfg.vocab_seed)


# ---------------------------------------------------------------------------------------
# Request parsing and validation (vLLM CompletionRequest / SamplingParams rules)
# ---------------------------------------------------------------------------------------


class SimRequestError(ValueError):
    """A request the simulated vLLM rejects.

    Attributes:
        status: HTTP status (400, 404).
        body: the exact response body bytes (vLLM's ``ErrorResponse`` envelope).
    """

    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = _error_body(status, message, err_type, param)


def _error_body(status: int, message: str, err_type: str, param: str | None) -> bytes:
    return _dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


def _bad(message: str, param: str | None = None, value: Any = None, *, with_value: bool = True) -> SimRequestError:
    """A ``VLLMValidationError``-style 400 (message ends with ``(parameter=X, value=Y)``)."""
    if param is not None and with_value:
        message = f"{message} (parameter={param}, value={value})"
    return SimRequestError(400, message, "BadRequestError", param)


def _pydantic(field: str, kind: str, msg: str) -> SimRequestError:
    """A FastAPI ``RequestValidationError``-style 400 (type ``"Bad Request"``)."""
    loc = "('body',)" if not field else f"('body', {field!r})"
    message = f"1 validation error:\n  {{'type': {kind!r}, 'loc': {loc}, 'msg': {msg!r}}}"
    return SimRequestError(400, message, "Bad Request", "body" + (f".{field}" if field else ""))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class _Req:
    prompt: np.ndarray  # int64
    prompt_list: tuple[int, ...]
    model: str | None
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    return_token_ids: bool
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _parse_request(obj: Any, cfg: SimConfig) -> _Req:
    if not isinstance(obj, dict):
        raise _pydantic("", "model_attributes_type",
                        "Input should be a valid dictionary or object to extract fields from")
    if "prompt" not in obj or obj["prompt"] is None:
        raise _pydantic("prompt", "missing", "Field required")
    prompt = obj["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        raise _pydantic("prompt", "value_error", "engine-sim serves one prompt per request")
    if not isinstance(prompt, list) or not set(map(type, prompt)) <= {int}:
        raise _pydantic("prompt", "list_type", "prompt must be a list of token ids (engine-sim does not tokenize)")
    if not prompt:
        raise _bad("Prompt cannot be empty", "prompt", [], with_value=False)
    if min(prompt) < 0 or max(prompt) > 0x7FFFFFFF:
        bad_id = next(t for t in prompt if t < 0 or t > 0x7FFFFFFF)
        raise _bad(f"Token id {bad_id} is out of vocabulary", "prompt", bad_id, with_value=False)

    def opt_int(name: str, default: Any) -> Any:
        v = obj.get(name, default)
        if v is None:
            return None
        if not _is_int(v):
            raise _pydantic(name, "int_type", "Input should be a valid integer")
        return v

    def opt_num(name: str, default: Any) -> Any:
        v = obj.get(name, default)
        if v is None:
            return default
        if not _is_num(v):
            raise _pydantic(name, "float_type", "Input should be a valid number")
        return float(v)

    def opt_bool(name: str, default: bool) -> bool:
        v = obj.get(name, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _pydantic(name, "bool_type", "Input should be a valid boolean")
        return v

    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _pydantic("model", "string_type", "Input should be a valid string")
    n = opt_int("n", 1)
    n = 1 if n is None else n
    max_tokens = opt_int("max_tokens", 16)
    max_tokens = 16 if max_tokens is None else max_tokens
    temperature = opt_num("temperature", 1.0)
    top_p = opt_num("top_p", 1.0)
    top_k = opt_int("top_k", -1)
    top_k = -1 if top_k is None else top_k
    seed = opt_int("seed", None)
    logprobs = opt_int("logprobs", None)
    prompt_logprobs = opt_int("prompt_logprobs", None)
    return_token_ids = opt_bool("return_token_ids", False)
    ignore_eos = opt_bool("ignore_eos", False)
    stop = obj.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _pydantic("stop", "list_type", "Input should be a valid list of strings")
    stop_ids = obj.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(s) for s in stop_ids):
        raise _pydantic("stop_token_ids", "list_type", "Input should be a valid list of integers")

    if cfg.check_model and model is not None and model != cfg.model_name:
        raise SimRequestError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if n < 1:
        raise _bad(f"n must be at least 1, got {n}.", "n", n)
    if temperature < 0.0 or temperature > 2.0:
        t = _num_text(temperature)
        raise _bad(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if n > 1 and temperature < _SAMPLING_EPS:
        raise SimRequestError(400, f"n must be 1 when using greedy sampling, got {n}.", "BadRequestError", None)
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {_num_text(top_p)}.", "top_p", _num_text(top_p))
    if top_k < -1:
        raise _bad(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k", top_k)
    if max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    for name, v, what in (("logprobs", logprobs, "sample"), ("prompt_logprobs", prompt_logprobs, "prompt")):
        if v is None:
            continue
        if v < -1:
            raise _bad(f"{name} must be non-negative or -1, got {v}.", name, v)
        if v == -1 or v > cfg.max_logprobs:
            shown = cfg.vocab_size if v == -1 else v
            raise _bad(f"Requested {what} logprobs of {shown}, which is greater than max allowed: {cfg.max_logprobs}",
                       name, v)
    plen = len(prompt)
    if plen + max_tokens > cfg.max_model_len:
        raise SimRequestError(
            400,
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{plen + max_tokens} tokens ({plen} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.",
            "BadRequestError",
            "input_tokens",
        )
    return _Req(
        prompt=np.asarray(prompt, dtype=np.int64),
        prompt_list=tuple(prompt),
        model=model,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        return_token_ids=return_token_ids,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )


def _num_text(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else repr(v)


# ---------------------------------------------------------------------------------------
# Deterministic generation
#
# Every generated token comes from a per-config "pool": one long pseudo-random token
# stream (ids, float32 logprobs, top-1 flags and ids) whose JSON pieces are rendered once
# and joined. Choice i of a request reads the window pool[a : a + T], where the start ``a``
# is drawn from (seed + i, prompt hash); the finish position comes from geometric draws
# (EOS, injected stop-token ids), from stop-token ids met in the window, or from stop
# strings found in the window's text. Rendering a choice is then a handful of byte-slice
# copies, so uncached 32k-token bodies take milliseconds.
# ---------------------------------------------------------------------------------------


def _prompt_hash(prompt: np.ndarray) -> bytes:
    return hashlib.blake2b(prompt.astype("<i8", copy=False).tobytes(), digest_size=16).digest()


def _f32(a: np.ndarray) -> np.ndarray:
    """Round to float32 like GPU logprobs, back to float64; -0.0 becomes 0.0."""
    return a.astype(np.float32).astype(np.float64) + 0.0


def _streams(entropy: list[int], count: int) -> list[np.random.Generator]:
    ss = np.random.SeedSequence(entropy)
    return [np.random.Generator(np.random.PCG64(s)) for s in ss.spawn(count)]


_R = float.__repr__  # what json.dumps uses for finite floats


def _ints_csv(a: np.ndarray) -> bytes:
    """Comma-separated decimal text of non-negative ints, vectorized (== ",".join(map(str, a)))."""
    n = a.size
    if n == 0:
        return b""
    a = a.astype(np.int64, copy=False)
    width = len(str(int(a.max())))
    pow10 = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    out = np.empty((n, width + 1), dtype=np.uint8)
    out[:, :width] = (a[:, None] // pow10) % 10 + 48
    out[:, width] = 44
    keep = np.ones((n, width + 1), dtype=bool)
    keep[:, : width - 1] = a[:, None] >= pow10[: width - 1]
    return out[keep].tobytes()[:-1]


class _Joined:
    """Elements rendered once, UTF-8 encoded and joined with ``sep``; a run of elements is
    one slice of ``data``."""

    __slots__ = ("data", "off", "seplen")

    def __init__(self, elems: list[str], sep: bytes) -> None:
        eb = [e.encode("utf-8") for e in elems]
        lens = np.fromiter(map(len, eb), dtype=np.int64, count=len(eb)) + len(sep)
        off = np.zeros(len(eb) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        self.off = off.tolist()
        self.data = sep.join(eb) + sep
        self.seplen = len(sep)

    def slice(self, a: int, b: int) -> bytes:
        """Elements ``[a, b)`` joined by the separator (no trailing separator)."""
        if b <= a:
            return b""
        return self.data[self.off[a]:self.off[b] - self.seplen]


class _Pool:
    """The shared token stream of one generation config (see the section comment)."""

    def __init__(self, cfg: SimConfig, vocab: _FakeVocab) -> None:
        N = cfg.pool_starts + cfg.max_model_len
        V, eos = cfg.vocab_size, cfg.eos_token_id
        s = _streams([cfg.vocab_seed & _MASK64, V, eos, 0x706F6F6C], 6)
        ids = s[0].integers(0, V, size=N, dtype=np.int64)
        if eos < V:
            ids[ids == eos] = (eos + 1) % V
        mask_u = s[1].random((N, 2))
        top1 = mask_u[:, 0] < cfg.top1_fraction
        E = s[2].standard_exponential((N, 2))
        lp_top = -(E[:, 0] * 0.25)
        lp_top[mask_u[:, 1] < 0.05] = 0.0
        lp_non = -(_LN2 + E[:, 1] * 1.5)  # p <= 0.5, so p(sampled) + p(top-1) <= 1
        fr = s[3].random((N, 2))
        t1_non = np.where(fr[:, 1] < 0.03, lp_non, lp_non + (-_LN2 - lp_non) * fr[:, 0])  # ties, or in between
        lps = _f32(np.where(top1, lp_top, lp_non))
        t1_lps = np.where(top1, lps, _f32(t1_non))
        t1_draw = s[4].integers(0, V, size=N, dtype=np.int64)
        t1_draw = np.where(t1_draw == ids, (t1_draw + 1) % V, t1_draw)
        if eos < V:
            t1_draw[t1_draw == eos] = (eos + 2) % V
        t1_ids = np.where(top1, ids, t1_draw)
        cc = s[5].random((N, 2))
        ne = len(vocab.empty_ids)
        if cfg.collision_rate > 0 and ne >= 2:
            coll = (~top1) & (cc[:, 1] < cfg.collision_rate)
            first = ids[coll] % ne
            ids[coll] = vocab.empty_ids[first]
            t1_ids[coll] = vocab.empty_ids[(first + 1) % ne]
        if cfg.clamp_rate > 0:
            clamp = cc[:, 0] < cfg.clamp_rate
            lps[clamp] = _CLAMP
            t1_lps = np.where(top1, lps, t1_lps)
        self.ids, self.lps, self.top1, self.t1_ids, self.t1_lps = ids, lps, top1, t1_ids, t1_lps
        cum = np.zeros(N + 1, dtype=np.int64)
        np.cumsum(vocab.lens[ids], out=cum[1:])
        self.cum = cum  # code points before each position
        esc, strs = vocab.esc, vocab.strs
        ids_l, t1_l = ids.tolist(), t1_ids.tolist()
        lp_s = [_R(x) for x in lps.tolist()]
        t1_s = [_R(x) for x in t1_lps.tolist()]
        tok = [esc[i] for i in ids_l]
        top0 = ["{" + e + ":" + lp + "}" for e, lp in zip(tok, lp_s)]
        top1_form = []
        for si, ti, es, lp, tl, single in zip(ids_l, t1_l, tok, lp_s, t1_s, top0):
            if si == ti:
                top1_form.append(single)
            else:
                et = esc[ti]
                if es == et:  # two ids, one string: the later (top-1) value wins
                    top1_form.append("{" + es + ":" + tl + "}")
                else:
                    top1_form.append("{" + es + ":" + lp + "," + et + ":" + tl + "}")
        self.j_ids = _Joined(list(map(str, ids_l)), b",")
        self.j_lps = _Joined(lp_s, b",")
        self.j_tok = _Joined(tok, b",")
        self.j_top0 = _Joined(top0, b",")
        self.j_top1 = _Joined(top1_form, b",")
        self.j_text = _Joined([e[1:-1] for e in tok], b"")  # JSON escaping is per code point
        self.j_raw = _Joined([strs[i] for i in ids_l], b"")
        self.size = N


@functools.lru_cache(maxsize=2)
def _get_pool(key: tuple) -> _Pool:
    cfg = SimConfig(**dict(key))
    return _Pool(cfg, _vocab_for(cfg))


_POOL_KNOBS = ("vocab_size", "eos_token_id", "vocab_seed", "top1_fraction", "clamp_rate", "collision_rate",
               "pool_starts", "max_model_len")


def _pool_for(cfg: SimConfig) -> _Pool:
    return _get_pool(tuple((k, getattr(cfg, k)) for k in _POOL_KNOBS))


@dataclasses.dataclass
class _Choice:
    """One choice: the pool window ``[a, a + T)``, possibly with its last token replaced.

    ``last``: ``(id, logprob)`` written over position ``T - 1`` (EOS or an injected stop
    token id), rendered as a top-1 token. ``text_end``: how many leading tokens have their
    text in ``text`` (EOS and stop-token ids don't). ``text_cut``: when set, ``text`` is the
    first ``text_cut`` UTF-8 bytes of that text (a stop string matched there).
    """

    a: int
    T: int
    text_end: int
    last: tuple[int, float] | None
    finish_reason: str
    stop_reason: int | str | None
    text_cut: int | None = None


def _first_success(u: float, p: float) -> int:
    """0-based index of the first success of a Bernoulli(p) sequence, by inverse CDF."""
    if p >= 1.0:
        return 0
    return int(math.log1p(-u) / math.log1p(-p))


def _plan_choice(req: _Req, cfg: SimConfig, pool: _Pool, phash: bytes, index: int) -> _Choice:
    M = req.max_tokens
    ph = int.from_bytes(phash[:8], "little")
    if req.greedy:
        child = 0
    elif req.seed is None:
        child = (int.from_bytes(phash[8:16], "little") + index) & _MASK64
    else:
        child = (req.seed + index) & _MASK64  # vLLM parallel_sampling: child i gets seed + i
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [child, ph, cfg.vocab_size, cfg.eos_token_id, cfg.vocab_seed & _MASK64, int(req.greedy)])))
    u = rng.random(4).tolist()
    a = min(int(u[0] * cfg.pool_starts), cfg.pool_starts - 1)
    # Candidates (position, precedence, stop_reason, forced id); EOS first at equal positions
    # like vLLM's check_stop.
    cands: list[tuple[int, int, Any, int | None]] = []
    if not req.ignore_eos and cfg.eos_probability > 0:
        cands.append((_first_success(u[1], cfg.eos_probability), 0, None, cfg.eos_token_id))
    if req.stop_token_ids:
        sids = req.stop_token_ids
        if cfg.stop_token_probability > 0:
            sid = sids[min(int(u[3] * len(sids)), len(sids) - 1)]
            cands.append((_first_success(u[2], cfg.stop_token_probability), 1, sid, sid))
        nat = np.flatnonzero(np.isin(pool.ids[a:a + M], np.asarray(sids, dtype=np.int64)))
        if nat.size:
            j = int(nat[0])
            cands.append((j, 2, int(pool.ids[a + j]), None))
    cands = [c for c in cands if c[0] < M]
    if cands:
        j, _, stop_reason, forced = min(cands, key=lambda c: (c[0], c[1]))
        T = j + 1
        last = None if forced is None else (forced, float(pool.lps[a + j]))
        choice = _Choice(a, T, T - 1, last, "stop", stop_reason)
    else:
        choice = _Choice(a, M, M, None, "length", None)
    if req.stop:
        _apply_stop_strings(choice, req.stop, pool)
    return choice


def _apply_stop_strings(c: _Choice, stops: tuple[str, ...], pool: _Pool) -> None:
    """vLLM's detokenizer stop-string check: the earliest-completing match wins; tokens end
    with the one that completed it and ``text`` is cut before the match."""
    raw = pool.j_raw.slice(c.a, c.a + c.text_end)
    best: tuple[int, int, int] | None = None  # (match end, match start, list position)
    for pos, s in enumerate(stops):
        sb = s.encode("utf-8")
        if not sb:
            continue
        p = raw.find(sb)
        if p >= 0 and (best is None or (p + len(sb), p, pos) < best):
            best = (p + len(sb), p, pos)
    if best is None:
        return
    m_end, m_start, pos = best
    base = pool.j_raw.off[c.a]
    ends = np.asarray(pool.j_raw.off[c.a + 1:c.a + c.text_end + 1], dtype=np.int64) - base
    j = int(np.searchsorted(ends, m_end, side="left"))
    c.T = c.text_end = j + 1
    c.last = None
    c.finish_reason, c.stop_reason = "stop", stops[pos]
    c.text_cut = m_start


def _apply_override(c: _Choice, rule: FaultRule) -> None:
    """A ``finish_reason`` fault: keep ``rule.tokens`` tokens (default half)."""
    keep = c.T // 2 if rule.tokens is None else min(rule.tokens, c.T)
    if rule.finish_reason == "stop" and c.T:
        keep = max(keep, 1)
    if keep < c.T:
        c.last = None
        c.text_cut = None
    c.T = keep
    c.text_end = min(c.text_end, keep)
    if rule.finish_reason == "abort":
        c.finish_reason, c.stop_reason = "abort", None
    elif rule.finish_reason == "repetition":
        c.finish_reason, c.stop_reason = "repetition", "repetition_detected"
    else:  # the last kept token completed the stop string: its text is cut
        c.finish_reason, c.stop_reason = "stop", rule.stop_string
        c.text_end = min(c.text_end, max(keep - 1, 0))
        c.text_cut = None


@dataclasses.dataclass
class _PromptLP:
    """prompt_logprobs of one prompt: per position j >= 1, entries in insertion order."""

    entries: list[list[tuple[int, float, int]]]  # (id, logprob, rank)


def _sample_prompt_logprobs(req: _Req, cfg: SimConfig, vocab: _FakeVocab, phash: bytes) -> _PromptLP:
    """Per prompt position: the actual token first, then the top-k in rank order, merged by
    id (vLLM's ``append_logprobs_for_next_position``): k entries when the actual token is
    in the top-k, else k+1."""
    k = req.prompt_logprobs or 0
    P = len(req.prompt)
    V = cfg.vocab_size
    ph = int.from_bytes(phash[:8], "little")
    s = _streams([ph, V, cfg.eos_token_id, cfg.vocab_seed & _MASK64, 0x70726F6D7074], 2)
    u = s[0].random((P, 5))
    width = max(k, 1)
    a = s[1].random((P, width))
    is_top1 = u[:, 0] < cfg.prompt_top1_fraction
    top1_lp = -(-np.log1p(-u[:, 1]) * 0.3)
    ranks = np.where(is_top1, 1, 2 + (-np.log1p(-u[:, 2]) * 30).astype(np.int64))
    clamp = u[:, 3] < cfg.clamp_rate
    ranks = np.where(clamp, V, ranks)  # a -inf token ranks last (vocab size)
    ladder = top1_lp[:, None] - np.concatenate([np.zeros((P, 1)), np.cumsum(0.2 + 2.5 * a[:, 1:], axis=1)], axis=1)
    ladder = _f32(ladder)
    below = _f32(ladder[:, -1] - 0.05 - 3.0 * u[:, 4])
    steps = 1 + (a * 4999).astype(np.int64)
    alt = (req.prompt[:, None] + np.cumsum(steps, axis=1)) % V
    lad, alt_l, below_l, rk, cl = ladder.tolist(), alt.tolist(), below.tolist(), ranks.tolist(), clamp.tolist()
    pl = req.prompt_list
    entries: list[list[tuple[int, float, int]]] = []
    for j in range(1, P):
        actual, r = pl[j], rk[j]
        if cl[j]:
            a_lp = _CLAMP
        elif r <= k or r == 1:
            a_lp = lad[j][r - 1]
        else:
            a_lp = below_l[j]
        d: dict[int, tuple[float, int]] = {actual: (a_lp, r)}
        ai = 0
        row_l, row_a = lad[j], alt_l[j]
        for rank in range(1, k + 1):
            if rank == r:
                d[actual] = (a_lp, rank)
            else:
                d[row_a[ai]] = (row_l[rank - 1], rank)
                ai += 1
        entries.append([(tid, v[0], v[1]) for tid, v in d.items()])
    return _PromptLP(entries)


def _prompt_positions(rule: FaultRule | None, req: _Req, choices: list[_Choice]) -> int:
    """Number of ``prompt_logprobs`` list elements (including the leading null): the whole
    prompt, or fewer for an abort (the list grows per prefill chunk)."""
    P = len(req.prompt)
    if rule is None or rule.finish_reason != "abort":
        return P
    if rule.prompt_positions is not None:
        return max(1, min(rule.prompt_positions, P))
    if all(c.T == 0 for c in choices):
        return max(1, P // 2)
    return P


@dataclasses.dataclass
class _Generated:
    req: _Req
    pool: _Pool
    phash: bytes
    choices: list[_Choice]
    prompt_positions: int
    vocab_size: int


def _generate(req: _Req, cfg: SimConfig, override: FaultRule | None) -> _Generated:
    pool = _pool_for(cfg)
    phash = _prompt_hash(req.prompt)
    choices = [_plan_choice(req, cfg, pool, phash, i) for i in range(req.n)]
    if override is not None:
        for c in choices:
            _apply_override(c, override)
    return _Generated(req, pool, phash, choices, _prompt_positions(override, req, choices), cfg.vocab_size)


# ---------------------------------------------------------------------------------------
# Rendering: the dict form (the reference) and the fast byte form (byte-identical to it)
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------


class _BodyCache:
    """LRU of rendered body tails, bounded by total bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: collections.OrderedDict[bytes, tuple[bytes, int]] = collections.OrderedDict()

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: bytes, value: tuple[bytes, int]) -> None:
        size = len(value[0]) + 128
        if size > self.max_bytes or key in self._d:
            return
        self._d[key] = value
        self.bytes += size
        self.shrink()

    def shrink(self) -> None:
        while self.bytes > self.max_bytes and self._d:
            _, (tail, _) = self._d.popitem(last=False)
            self.bytes -= len(tail) + 128

    def clear(self) -> None:
        self._d.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)


class _SimState:
    def __init__(self, config: SimConfig) -> None:
        self.initial = config
        self.config = config
        self.cache = _BodyCache(config.cache_max_bytes)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counter = 0
        self.rule_fired = [0] * len(self.config.faults)
        self.rule_rng = [random.Random(self.config.fault_seed * 1000003 + i) for i in range(len(self.config.faults))]
        self.stats: dict[str, Any] = {
            "requests": 0,
            "by_status": {},
            "body_bytes": 0,
            "cache_hits": 0,
            "cache_misses": 0,
            "faults": {},
            "completion_tokens": 0,
            "build_seconds": 0.0,
            "in_flight": 0,
        }

    def set_config(self, config: SimConfig) -> None:
        faults_changed = config.faults != self.config.faults or config.fault_seed != self.config.fault_seed
        self.config = config
        self.cache.max_bytes = config.cache_max_bytes
        self.cache.shrink()
        if faults_changed:
            self.rule_fired = [0] * len(config.faults)
            self.rule_rng = [random.Random(config.fault_seed * 1000003 + i) for i in range(len(config.faults))]

    def match(self, req: _Req, count: int) -> list[FaultRule]:
        out = []
        for i, rule in enumerate(self.config.faults):
            if rule.times is not None and self.rule_fired[i] >= rule.times:
                continue
            if rule.every_nth is not None and count % rule.every_nth != 0:
                continue
            if rule.first_token_id is not None and req.prompt_list[0] != rule.first_token_id:
                continue
            if rule.probability is not None and self.rule_rng[i].random() >= rule.probability:
                continue
            self.rule_fired[i] += 1
            out.append(rule)
        return out

    def snapshot(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["by_status"] = dict(s["by_status"])
        s["faults"] = dict(s["faults"])
        s["cache_entries"] = len(self.cache)
        s["cache_bytes"] = self.cache.bytes
        s["counter"] = self.counter
        return s


_STATE = web.AppKey("engine_sim_state", _SimState)

_STATUS_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                 501: "NotImplementedError", 503: "Service Unavailable"}
_VLLM_MESSAGES = {
    500: "Internal server error",
    503: "The engine is currently busy and cannot accept new requests. Please try again later or on a different "
         "instance.",
    501: "The model does not support Completions API",
    400: "Injected fault",
}
_ROUTER_MESSAGES = {
    422: "Failed to deserialize the JSON body into the target type: logprobs: invalid type: boolean `true`, "
         "expected u32 at line 1 column 1",
    503: "No available workers (all circuits open or unhealthy)",
    500: "Request failed: error sending request for url (http://127.0.0.1:8000/v1/completions)",
    400: "Failed to parse the request body as JSON",
}
_HTML = (b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n<body><center><h1>502 Bad Gateway"
         b"</h1></center><hr><center>nginx</center></body></html>\n")


def _json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


def _fault_response(rule: FaultRule, cfg: SimConfig) -> web.Response:
    st = rule.status
    if rule.body == "empty":
        return web.Response(status=st)
    if rule.body == "detail":
        msg = rule.message or {404: "Not Found", 405: "Method Not Allowed"}.get(st, "Not Found")
        return _json_response(st, _dumps({"detail": msg}))
    if rule.body == "router":
        msg = rule.message or _ROUTER_MESSAGES.get(st, f"injected router error {st}")
        return web.Response(status=st, text=msg, content_type="text/plain", charset="utf-8")
    err_type = _STATUS_TYPES.get(st, "InternalServerError" if st >= 500 else "BadRequestError")
    param = None
    if st == 404:
        msg = rule.message or f"The model `{cfg.model_name}-missing` does not exist."
        param = "model"
    else:
        msg = rule.message or _VLLM_MESSAGES.get(st, f"Injected fault {st}")
    return _json_response(st, _error_body(st, msg, err_type, param))


@web.middleware
async def _errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json_response(404, b'{"detail":"Not Found"}')
    except web.HTTPMethodNotAllowed:
        return _json_response(405, b'{"detail":"Method Not Allowed"}')


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[_STATE].config
    created = cfg.fixed_created
    body = {
        "object": "list",
        "data": [
            {
                "id": cfg.model_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": cfg.model_name,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }
        ],
    }
    return _json_response(200, _dumps(body))


def _count(st: _SimState, status: int, nbytes: int) -> None:
    key = str(status)
    st.stats["by_status"][key] = st.stats["by_status"].get(key, 0) + 1
    st.stats["body_bytes"] += nbytes


async def _completions(request: web.Request) -> web.StreamResponse:
    st = request.app[_STATE]
    st.stats["requests"] += 1
    st.stats["in_flight"] += 1
    try:
        return await _completions_inner(request, st)
    finally:
        st.stats["in_flight"] -= 1


async def _completions_inner(request: web.Request, st: _SimState) -> web.StreamResponse:
    cfg = st.config
    raw = await request.read()
    ctype = request.headers.get("Content-Type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        err = SimRequestError(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request", None)
        _count(st, 400, len(err.body))
        return _json_response(400, err.body)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        msg = getattr(exc, "msg", "JSON decode error")
        err = SimRequestError(
            400,
            "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', %d), 'msg': 'JSON decode error', "
            "'input': {}, 'ctx': {'error': %r}}" % (getattr(exc, "pos", 0) or 0, msg),
            "Bad Request",
            "body",
        )
        _count(st, 400, len(err.body))
        return _json_response(400, err.body)
    try:
        req = _parse_request(obj, cfg)
    except SimRequestError as err:
        _count(st, err.status, len(err.body))
        return _json_response(err.status, err.body)

    st.counter += 1
    rules = st.match(req, st.counter)
    override = None
    terminal = None
    for rule in rules:
        st.stats["faults"][rule.kind] = st.stats["faults"].get(rule.kind, 0) + 1
        if rule.kind == "stall":
            await asyncio.sleep(rule.stall_s)
        elif rule.kind == "finish_reason":
            override = override or rule
        elif terminal is None:
            terminal = rule

    key = _cache_key(req, cfg, override)
    hit = st.cache.get(key) if cfg.cache_max_bytes > 0 else None
    if hit is not None:
        st.stats["cache_hits"] += 1
        tail, ntok = hit
    else:
        st.stats["cache_misses"] += 1
        t0 = time.perf_counter()
        gen = _generate(req, cfg, override)
        tail = _render_tail(gen, cfg)
        ntok = sum(c.T for c in gen.choices)
        st.stats["build_seconds"] += time.perf_counter() - t0
        if cfg.cache_max_bytes > 0:
            st.cache.put(key, (tail, ntok))
    st.stats["completion_tokens"] += ntok

    delay = cfg.queue_delay_s + cfg.latency_s + cfg.per_token_latency_s * ntok
    if delay > 0:
        await asyncio.sleep(delay)

    if terminal is not None:
        if terminal.kind == "status":
            resp = _fault_response(terminal, cfg)
            _count(st, resp.status, len(resp.body or b""))
            return resp
        if terminal.kind == "nan":
            body = _error_body(400, "Out of range float values are not JSON compliant: nan", "BadRequestError", None)
            _count(st, 400, len(body))
            return _json_response(400, body)
        if terminal.kind == "non_json":
            _count(st, 200, len(_HTML))
            return web.Response(status=200, body=_HTML, content_type=terminal.content_type)

    xrid = request.headers.get("X-Request-Id")
    rid, created = _ids_for(cfg, key, ("cmpl-" + xrid) if xrid else None, None)
    head = _head(rid, created)
    total = len(head) + len(tail)
    # Head and (cached) tail go out as two writes: no copy of a multi-MB body per request.
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.content_length = total
    await resp.prepare(request)

    if terminal is not None and terminal.kind == "truncate":
        cut = terminal.truncate_bytes
        if cut is None:
            cut = int(total * terminal.truncate_fraction)
        cut = max(0, min(cut, total - 1))
        if cut:
            await resp.write(head[:cut])
            if cut > len(head):
                await resp.write(tail[: cut - len(head)])
        _count(st, 200, cut)
        transport = request.transport
        if transport is not None:
            transport.close()  # flushes what was written, then closes: the client sees a short body
        raise asyncio.CancelledError()  # keep aiohttp from finishing the response

    await resp.write(head)
    await resp.write(tail)
    await resp.write_eof()
    _count(st, 200, total)
    return resp


async def _sim_config_get(request: web.Request) -> web.Response:
    return _json_response(200, _dumps(request.app[_STATE].config.to_mapping()))


async def _sim_config_post(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    try:
        patch = json.loads(await request.read() or b"{}")
        cfg = SimConfig.from_mapping(patch, base=st.config)
    except (ValueError, TypeError) as exc:
        return _json_response(400, _error_body(400, str(exc), "BadRequestError", None))
    _pool_for(cfg)  # build the fake vocabulary and the token pool now
    st.set_config(cfg)
    return _json_response(200, _dumps(cfg.to_mapping()))


async def _sim_stats(request: web.Request) -> web.Response:
    return _json_response(200, _dumps(request.app[_STATE].snapshot()))


async def _sim_reset(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    raw = await request.read()
    try:
        opts = json.loads(raw) if raw else {}
    except ValueError:
        opts = {}
    if isinstance(opts, dict) and opts.get("restore_config"):
        st.set_config(st.initial)
    st.cache.clear()
    st.reset_counters()
    return _json_response(200, b'{"ok":true}')


def make_app(config: SimConfig | None = None) -> web.Application:
    """The simulator as an aiohttp application.

    Routes:
        ``POST /v1/completions``: vLLM 0.30 non-streaming completions (see module doc).
        ``GET /health``: 200, empty body. ``GET /v1/models``: vLLM's model list.
        ``GET|POST /_sim/config``: read / JSON-patch the :class:`SimConfig` (returns it).
        ``GET /_sim/stats``: counters: ``requests``, ``by_status`` (status string ->
            count), ``body_bytes``, ``cache_hits``, ``cache_misses``, ``cache_entries``,
            ``cache_bytes``, ``faults`` (kind -> fired), ``completion_tokens``,
            ``build_seconds``, ``in_flight``, ``counter``.
        ``POST /_sim/reset``: zero the stats and the request counter, re-seed fault
            rules, clear the cache; ``{"restore_config": true}`` also restores the
            startup config.
    Unknown paths answer FastAPI's ``{"detail":"Not Found"}``.
    """
    config = config or SimConfig()
    _pool_for(config)  # build the fake vocabulary and the token pool now, not on the first request
    app = web.Application(middlewares=[_errors_middleware], client_max_size=256 * 1024 * 1024)
    app[_STATE] = _SimState(config)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/_sim/config", _sim_config_get)
    app.router.add_post("/_sim/config", _sim_config_post)
    app.router.add_get("/_sim/stats", _sim_stats)
    app.router.add_post("/_sim/reset", _sim_reset)
    return app


async def start_sim(
    config: SimConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    shutdown_timeout: float = 1.0,
) -> tuple[web.AppRunner, int]:
    """Serve the simulator on the running loop. ``port=0`` picks a free port.

    Returns ``(runner, actual_port)``; pass the runner to :func:`stop_sim`.
    ``shutdown_timeout`` (seconds) bounds how long :func:`stop_sim` waits for in-flight
    requests (e.g. stalled ones) before closing their connections.
    """
    runner = web.AppRunner(make_app(config), access_log=None, handle_signals=False,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    actual = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            actual = addr[1]
            break
    return runner, actual


async def stop_sim(runner: web.AppRunner) -> None:
    """Stop serving and close every connection of a runner from :func:`start_sim`."""
    await runner.cleanup()


def run_standalone(host: str = "127.0.0.1", port: int = 8000, config: SimConfig | None = None) -> None:
    """Run the simulator forever on uvloop (blocking) until SIGTERM or SIGINT, then exit
    cleanly. Sets the process title ``shardserver: engine-sim``."""
    try:
        import setproctitle

        setproctitle.setproctitle("shardserver: engine-sim")
    except ImportError:  # pragma: no cover - setproctitle is a dependency
        pass
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner, actual = await start_sim(config, host, port)
        logger.info("engine-sim listening on http://%s:%d", host, actual)
        print(f"engine-sim listening on http://{host}:{actual}", flush=True)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await stop_sim(runner)

    uvloop.run(main())
