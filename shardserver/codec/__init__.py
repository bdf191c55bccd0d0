"""vLLM completion body -> Tinker ``SampleResponse`` codec.

* :class:`CompletionDecoder` parses a vLLM 0.30 ``/v1/completions`` body (pysimdjson,
  straight into numpy) into a :class:`DecodedCompletion` (``decode``); choice 0's prompt
  logprobs are read from the raw bytes (``prompt_scan``) or, for any other layout, through
  ``as_list()`` (``prompt_logprobs``, which also ranks the top-k matrices for both).
* :func:`encode_sample_response` writes it as ``tinker_public.SampleResponse`` protobuf
  wire bytes (hand-written framing, byte-identical to the generated module), into a
  new ``bytes`` or straight into a caller's buffer; :func:`sample_response_size` says
  how many bytes that takes, :func:`max_sample_response_size` how many a request's result
  can take at most (its arena reservation).
* :func:`sample_response_to_json` derives the pre-0.25 SDK JSON form from those bytes.
"""

from shardserver.codec.decode import (
    FINISH_REASONS,
    TOPK_MASK_LOGPROB,
    TOPK_MASK_TOKEN,
    CompletionDecoder,
    DecodedChoice,
    DecodedCompletion,
)
from shardserver.codec.encode import (
    STOP_REASON_LENGTH,
    STOP_REASON_STOP,
    encode_sample_response,
    max_sample_response_size,
    plan_sample_response,
    sample_response_size,
    stop_reason_code,
)
from shardserver.codec.json_compat import sample_response_to_json

__all__ = [
    "CompletionDecoder",
    "DecodedChoice",
    "DecodedCompletion",
    "FINISH_REASONS",
    "TOPK_MASK_TOKEN",
    "TOPK_MASK_LOGPROB",
    "STOP_REASON_STOP",
    "STOP_REASON_LENGTH",
    "stop_reason_code",
    "sample_response_size",
    "plan_sample_response",
    "max_sample_response_size",
    "encode_sample_response",
    "sample_response_to_json",
]
