"""The arena reservation of a sample request: pure arithmetic, no numpy.

In a module of its own so that front-ends (which size every ``asample``'s reservation) need not
import the encoder (numpy) to compute it; :mod:`shardserver.codec.encode` re-exports it.
"""

from __future__ import annotations

__all__ = ["max_sample_response_size"]


def max_sample_response_size(
    num_samples: int, max_tokens: int, prompt_tokens: int, prompt_logprobs: bool, topk_prompt_logprobs: int
) -> int:
    """Upper bound, in bytes, on :func:`shardserver.codec.encode.sample_response_size` of any
    result of one sample request.

    ``asample`` reserves this many bytes of the owning shard's arena before the engine runs, so
    that a finished result always has room (the slot is shrunk to the real size at completion).
    The bound follows the field map at the top of :mod:`shardserver.codec.encode`, counting
    every length varint as 5 bytes (enough for any field under 32 GiB):

    * per sequence, ``8 * max_tokens + 32``: int32 token ids and float32 logprobs
      (4 + 4 bytes per token), plus the ``SampledSequence`` header (1 + 5), ``stop_reason``
      (2), and the tag and length of ``tokens`` and of ``logprobs`` (2 x (1 + 5)) = 20;
    * ``32`` for the message: ``prompt_cache_hit_tokens`` (1 + up to 10);
    * with prompt logprobs, ``4 * prompt_tokens + 16``: float32 per prompt token plus its tag
      and length (1 + 5);
    * with top-k prompt logprobs (k > 0), ``8 * prompt_tokens * k + 48``: a ``(P, k)`` int32
      and a ``(P, k)`` float32 matrix, plus ``TopkLogprobs``' header, the two tags and
      lengths, ``k`` and ``length`` (5 x (1 + 5)) = 30.

    Args:
        num_samples: ``n``, sequences in the result (>= 1).
        max_tokens: most tokens the engine generates per sequence (the request's ``max_tokens``).
        prompt_tokens: ``P``, tokens in the prompt.
        prompt_logprobs: whether the result carries prompt logprobs (also true when
            ``topk_prompt_logprobs > 0``: the top-k rows come with them).
        topk_prompt_logprobs: ``k``, entries per prompt position in the top-k matrices (0: none).

    Returns:
        The bound in bytes; e.g. 262208 for one sequence of at most 32768 tokens without prompt
        logprobs. A result whose engine answered more than ``max_tokens`` tokens can exceed it.
    """
    size = num_samples * (8 * max_tokens + 32) + 32
    if prompt_logprobs:
        size += 4 * prompt_tokens + 16 + (8 * prompt_tokens * topk_prompt_logprobs + 48 if topk_prompt_logprobs else 0)
    return size
