"""The pre-0.25 SDK JSON form of a sample result, derived from the proto bytes.

SDKs up to 0.24.1 accept a JSON ``SampleResponse`` (``shared/spec/tinker_sdk_protocol.md``
§5.2; the pydantic model of ``tinker 0.15.0: types/sample_response.py`` and
``sampled_sequence.py``), and SDKs up to 0.18.0 accept only that. The gateway
stores a result once, as proto bytes, and derives this JSON from them for such
clients, so both forms always say the same thing. The conversion follows what
the proto-capable SDK itself makes of the bytes (``tinker/proto/response_conv.py``,
``tinker/types/topk_logprobs.py: topk_to_lists``):

* logprobs are the float32 values widened to Python floats (``float(np.float32(x))``);
* empty ``logprobs`` / ``prompt_logprobs`` bytes mean ``null``; NaN prompt logprobs are ``null``;
* top-k is ``null`` unless present with ``k > 0`` and ``length > 0``; a row whose first cell is
  the mask (token 0, logprob -99999.0) is ``null``; trailing mask cells of a row are dropped.
"""

from __future__ import annotations

import json

import numpy as np

from shardserver.proto import sample_response_pb2 as pb

__all__ = ["sample_response_to_json"]

_MASK_LOGPROB = np.float32(-99999.0)
_STOP_NAMES = {pb.STOP_REASON_STOP: "stop", pb.STOP_REASON_LENGTH: "length"}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _floats(buf: bytes) -> list[float]:
    return np.frombuffer(buf, dtype="<f4").astype(np.float64).tolist()


def sample_response_to_json(proto: bytes | memoryview) -> bytes:
    """Render ``SampleResponse`` wire bytes as the pre-0.25 SDK JSON result.

    Output (compact UTF-8 JSON, keys in this order)::

        {"type":"sample",
         "sequences":[{"stop_reason":"stop"|"length","tokens":[int...],"logprobs":[float...]|null}...],
         "prompt_logprobs":null|[null|float...],
         "topk_prompt_logprobs":null|[null|[[token_id,logprob]...]...],
         "prompt_cache_hit_tokens":int}

    Args:
        proto: the bytes :func:`~shardserver.codec.encode.encode_sample_response` wrote
            (any ``tinker_public.SampleResponse`` wire bytes).

    Returns:
        The JSON body as UTF-8 bytes.

    Raises:
        ValueError: if the bytes do not parse as ``SampleResponse``, a stop reason is not
            STOP/LENGTH, a byte field's length is not a multiple of 4, or a logprob is infinite.
    """
    msg = pb.SampleResponse()
    try:
        msg.ParseFromString(bytes(proto))
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ValueError(f"not a SampleResponse: {e}") from None

    parts = ['{"type":"sample","sequences":[']
    for i, seq in enumerate(msg.sequences):
        name = _STOP_NAMES.get(seq.stop_reason)
        if name is None:
            raise ValueError(f"sequence {i}: unknown stop_reason enum value {seq.stop_reason}")
        if i:
            parts.append(",")
        tokens = np.frombuffer(seq.tokens, dtype="<i4").tolist()
        logprobs = _floats(seq.logprobs) if seq.logprobs else None
        parts.append(f'{{"stop_reason":"{name}","tokens":{_dumps(tokens)},"logprobs":{_dumps(logprobs)}}}')
    parts.append("]")

    plp = None
    if msg.prompt_logprobs:
        arr = np.frombuffer(msg.prompt_logprobs, dtype="<f4")
        plp = arr.astype(np.float64).tolist()
        for j in np.flatnonzero(np.isnan(arr)).tolist():
            plp[j] = None
    parts.append(f',"prompt_logprobs":{_dumps(plp)}')

    topk = None
    if msg.HasField("topk_prompt_logprobs"):
        t = msg.topk_prompt_logprobs
        n, k = t.length, t.k
        if n and k:
            ids = np.frombuffer(t.token_ids, dtype="<i4").reshape(n, k)
            lps = np.frombuffer(t.logprobs, dtype="<f4").reshape(n, k)
            masked = (ids == 0) & (lps == _MASK_LOGPROB)
            # Keep cells up to the last unmasked one; rows starting with the mask are null.
            keep = k - np.argmin(masked[:, ::-1], axis=1)
            keep[masked.all(axis=1)] = 0
            keep[masked[:, 0]] = 0
            id_rows = ids.tolist()
            lp_rows = lps.astype(np.float64).tolist()
            topk = [
                [[a, b] for a, b in zip(id_rows[r][:m], lp_rows[r][:m])] if m else None
                for r, m in enumerate(keep.tolist())
            ]
    parts.append(f',"topk_prompt_logprobs":{_dumps(topk)}')
    parts.append(f',"prompt_cache_hit_tokens":{int(msg.prompt_cache_hit_tokens)}}}')
    return "".join(parts).encode("utf-8")
