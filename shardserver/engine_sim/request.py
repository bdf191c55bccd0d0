"""Request parsing and validation, following vLLM's ``CompletionRequest`` / ``SamplingParams``
rules, and the error bodies of a rejected request (:class:`SimRequestError`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .config import SimConfig
from .wire import _dumps

__all__ = ["SimRequestError"]

_SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below this are greedy


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
    """Validate a decoded request body the way vLLM 0.30 does, in vLLM's order: the body
    shape and every field's type first (FastAPI/pydantic 400s), then the model (404), then
    the sampling values and the context length (``VLLMValidationError`` 400s).

    Raises:
        SimRequestError: the exact status and body vLLM would answer.
    """
    if not isinstance(obj, dict):
        raise _pydantic("", "model_attributes_type",
                        "Input should be a valid dictionary or object to extract fields from")
    prompt = _read_prompt(obj)
    fields = _read_fields(obj)
    _check_values(fields, cfg)
    _check_length(len(prompt), fields["max_tokens"], cfg)
    return _Req(prompt=np.asarray(prompt, dtype=np.int64), prompt_list=tuple(prompt), **fields)


def _read_prompt(obj: dict[str, Any]) -> list[int]:
    """The one prompt of the request as token ids (``[[ids]]`` is unwrapped)."""
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
    return prompt


def _opt_int(obj: dict[str, Any], name: str, default: Any) -> Any:
    v = obj.get(name, default)
    if v is None:
        return None
    if not _is_int(v):
        raise _pydantic(name, "int_type", "Input should be a valid integer")
    return v


def _opt_num(obj: dict[str, Any], name: str, default: Any) -> Any:
    v = obj.get(name, default)
    if v is None:
        return default
    if not _is_num(v):
        raise _pydantic(name, "float_type", "Input should be a valid number")
    return float(v)


def _opt_bool(obj: dict[str, Any], name: str, default: bool) -> bool:
    v = obj.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _pydantic(name, "bool_type", "Input should be a valid boolean")
    return v


def _read_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """Every :class:`_Req` field but the prompt, type-checked (pydantic-style 400s), with
    vLLM's defaults for absent or null fields."""
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _pydantic("model", "string_type", "Input should be a valid string")
    n = _opt_int(obj, "n", 1)
    max_tokens = _opt_int(obj, "max_tokens", 16)
    temperature = _opt_num(obj, "temperature", 1.0)
    top_p = _opt_num(obj, "top_p", 1.0)
    top_k = _opt_int(obj, "top_k", -1)
    seed = _opt_int(obj, "seed", None)
    logprobs = _opt_int(obj, "logprobs", None)
    prompt_logprobs = _opt_int(obj, "prompt_logprobs", None)
    return_token_ids = _opt_bool(obj, "return_token_ids", False)
    ignore_eos = _opt_bool(obj, "ignore_eos", False)
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
    return {
        "model": model,
        "n": 1 if n is None else n,
        "max_tokens": 16 if max_tokens is None else max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1 if top_k is None else top_k,
        "seed": seed,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "return_token_ids": return_token_ids,
        "stop": tuple(stop),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": ignore_eos,
    }


def _check_values(f: dict[str, Any], cfg: SimConfig) -> None:
    """The served model (404) and vLLM's ``SamplingParams`` value checks (400), in vLLM's order."""
    model, n, temperature, top_p, top_k = f["model"], f["n"], f["temperature"], f["top_p"], f["top_k"]
    max_tokens = f["max_tokens"]
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
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        v = f[name]
        if v is None:
            continue
        if v < -1:
            raise _bad(f"{name} must be non-negative or -1, got {v}.", name, v)
        if v == -1 or v > cfg.max_logprobs:
            shown = cfg.vocab_size if v == -1 else v
            raise _bad(f"Requested {what} logprobs of {shown}, which is greater than max allowed: {cfg.max_logprobs}",
                       name, v)


def _check_length(plen: int, max_tokens: int, cfg: SimConfig) -> None:
    """vLLM's context-length check: prompt + max_tokens must fit ``max_model_len``."""
    if plen + max_tokens > cfg.max_model_len:
        raise SimRequestError(
            400,
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{plen + max_tokens} tokens ({plen} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.",
            "BadRequestError",
            "input_tokens",
        )


def _num_text(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else repr(v)
