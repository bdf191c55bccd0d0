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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integer fields that cross the control channel (msgspec int64) are bounded here, so an
# out-of-range value is a 400 naming the field, not a 500 when the frame is encoded.
INT64_MAX = 2**63 - 1

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


class SamplingParams(_Strict):
    """Sampling parameters, forwarded to vLLM's ``CompletionRequest`` fields of the same names."""

    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


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
