"""Request bodies of the Tinker sampling API, as the SDK sends them.

Mirrors the SDK's pydantic request types (``tinker/types/sample_request.py``,
``sampling_params.py``, ``model_input.py``, ``create_session_request.py``,
``create_sampling_session_request.py``, ``future_retrieve_request.py``,
``futures_retrieve_request.py`` in tinker 0.38; ``cancel_future``'s body is the dict of
``InternalClientHolder._send_cancel_request``). Unknown fields are ignored (newer SDKs add fields); ``type``
fields are optional (SDKs before 0.20 omit them); values are validated
strictly (a string where an int belongs is a 400, not coerced).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

# Integer fields that cross the control channel (msgspec int64) are bounded here, so an
# out-of-range value is a 400 naming the field, not a 500 when the frame is encoded.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1

__all__ = [
    "EncodedTextChunk",
    "ModelInput",
    "SamplingParams",
    "SampleRequest",
    "CreateSessionRequest",
    "CreateSamplingSessionRequest",
    "RetrieveFutureRequest",
    "SamplingSessionFuturesTarget",
    "RetrieveFuturesRequest",
    "CancelFutureRequest",
    "UNSUPPORTED_SAMPLE_FIELDS",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class EncodedTextChunk(_Strict):
    """``{"type": "encoded_text", "tokens": [int, ...]}`` (``type`` absent in SDK <= 0.16)."""

    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInput(_Strict):
    """``{"chunks": [...]}``. Only token chunks are supported; image chunks are rejected by the route."""

    chunks: list[dict[str, Any]] = Field(min_length=1)


def _out_of_range(what: str, value: Any) -> PydanticCustomError:
    """The 400 detail for a value outside its range: ``"must be <what>, got <value>"``."""
    return PydanticCustomError("out_of_range", "must be {what}, got {value}", {"what": what, "value": value})


class SamplingParams(_Strict):
    """Sampling parameters, forwarded to vLLM's ``CompletionRequest`` fields of the same names.

    Each numeric field is refused (400 naming the field and its range) unless the engine takes it,
    so a bad value never reaches vLLM as a 400/422 the SDK reports late, or crashes it. The ranges
    are those of vLLM 0.30's ``CompletionRequest`` / ``SamplingParams`` and of vllm-router's typed
    ``CompletionRequest`` in front of it (``/work/shared/spec/vllm_completions.md`` §1):

    * ``temperature``: a finite number in [0, 2] (vLLM: "temperature must be in [0, 2]"; NaN and
      infinities are refused too, vLLM cannot even serialize its own error about them).
    * ``top_p``: a finite number in (0, 1] (vLLM's check).
    * ``top_k``: an integer in [-1, 2^31 - 1] (vLLM: -1, 0 or >= 1; the router's type is i32).
    * ``max_tokens``: an integer in [1, 2^32 - 1] (vLLM: >= 1; the router's type is u32); the
      context window bounds it further (:mod:`shardserver.api.sampling`).
    * ``seed``: an integer in [-2^63, 2^63 - 1] (vLLM: ``ge=_LONG_INFO.min, le=_LONG_INFO.max``,
      ``torch.iinfo(torch.long)``; the router's type is i64).
    * ``stop`` as token ids: each in [0, 2^31 - 1] (the router's ``stop_token_ids`` is Vec<i32>;
      token ids are int32 throughout the gateway).
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 <= v <= 2.0):
            raise _out_of_range("a finite number in [0, 2]", v)
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 < v <= 1.0):
            raise _out_of_range("a finite number in (0, 1]", v)
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if not -1 <= v <= INT32_MAX:
            raise _out_of_range("an integer in [-1, 2147483647] (-1 or 0: off)", v)
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= UINT32_MAX:
            raise _out_of_range("unset or an integer in [1, 4294967295]", v)
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise _out_of_range("unset or an integer in [-9223372036854775808, 9223372036854775807] (int64)", v)
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | list[int] | None) -> str | list[str] | list[int] | None:
        # vLLM refuses an empty stop string (SamplingParams._verify_args: "stop cannot contain an
        # empty string"); refused here, the SDK's sample() fails at once with a 400 naming the field
        # instead of a RequestFailedError after the engine call.
        if v == "" or (isinstance(v, list) and "" in v):
            raise _out_of_range("a non-empty string, a list of non-empty strings or a list of token ids "
                                "(an empty stop string would match everywhere; vLLM refuses it)", repr(v))
        if isinstance(v, list):
            for t in v:
                if isinstance(t, int) and not 0 <= t <= INT32_MAX:
                    raise _out_of_range("a string, a list of strings or a list of token ids in [0, 2147483647]",
                                        f"token id {t}")
        return v


class SampleRequest(_Strict):
    """``POST /api/v1/asample`` body (SDK ``SampleRequest``)."""

    sampling_session_id: str = Field(min_length=1)
    seq_id: int | None = Field(default=None, ge=0, le=INT64_MAX)
    num_samples: int = Field(default=1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=20)
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: Any = None
    prompt_logprobs_last_n: int | None = None
    type: Literal["sample"] = "sample"


# Fields the gateway does not implement; silently ignoring them would make the SDK fail later
# (spec §8.6), so a request that uses them gets a 400 naming the field.
UNSUPPORTED_SAMPLE_FIELDS = ("topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs",
                             "prompt_logprobs_last_n")


class CreateSessionRequest(_Strict):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None


class CreateSamplingSessionRequest(_Strict):
    session_id: str = Field(min_length=1)
    sampling_session_seq_id: int = Field(default=0, ge=0, le=INT64_MAX)
    base_model: str | None = None
    model_path: str | None = None


class RetrieveFutureRequest(_Strict):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionFuturesTarget(_Strict):
    """``target`` of ``retrieve_futures``: one sampling session, and which clone of its
    SamplingClient (``cloned_sampler_id`` = ``seq_id // 10**9`` of its requests; 0 for the original)."""

    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = Field(min_length=1)
    cloned_sampler_id: int = Field(default=0, ge=0, le=INT64_MAX)


class RetrieveFuturesRequest(_Strict):
    """``POST /api/v1/retrieve_futures`` body (SDK ``FuturesRetrieveRequest``, 0.26.2+).

    ``prev_cursor``: the ``cursor`` of the previous answer (0 at first); ``timeout``: absent or
    null: hold up to ``futures.long_poll_s``; 0: answer at once (ack-only); ``retrieved_request_ids``:
    futures whose results the client has fully retrieved (the server may free them).
    """

    target: SamplingSessionFuturesTarget
    prev_cursor: int = Field(default=0, ge=0, le=INT64_MAX)
    timeout: float | None = Field(default=None, ge=0)
    retrieved_request_ids: list[str] = Field(default_factory=list)


class CancelFutureRequest(_Strict):
    """``POST /api/v1/cancel_future`` body: ``{"request_id": ...}`` (SDK 0.26+)."""

    request_id: str
