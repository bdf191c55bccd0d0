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

from shardserver.lazy import lazy_getattr

# Submodules load on first use (PEP 562): a front-end needs only max_sample_response_size (and
# sample_response_to_json for pre-0.25 SDKs), and importing the decoder and encoder costs it
# numpy and simdjson (~20 MiB of private memory per front-end).
_LAZY = {
    "FINISH_REASONS": ".decode", "TOPK_MASK_LOGPROB": ".decode", "TOPK_MASK_TOKEN": ".decode",
    "CompletionDecoder": ".decode", "DecodedChoice": ".decode", "DecodedCompletion": ".decode",
    "STOP_REASON_LENGTH": ".encode", "STOP_REASON_STOP": ".encode", "encode_sample_response": ".encode",
    "plan_sample_response": ".encode", "sample_response_size": ".encode", "stop_reason_code": ".encode",
    "max_sample_response_size": ".sizes",
    "sample_response_to_json": ".json_compat",
}

__getattr__ = lazy_getattr(__name__, _LAZY)


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
