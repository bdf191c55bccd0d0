"""Hand-written protobuf encoder for ``SampleResponse``.

Writes the wire bytes of the Tinker SDK's ``tinker_public.SampleResponse``
(``tinker/proto/tinker_public_pb2.py``; our copy of the schema is
``shardserver/proto/sample_response.proto``) straight from a
:class:`~shardserver.codec.decode.DecodedCompletion`: a few tag/length headers
around the numpy buffers, which are copied once into the destination. The
output is byte-identical to ``SerializeToString()`` of the same message built
with the generated module (proto3: zero scalars and empty non-optional bytes
omitted, ``optional`` fields emitted whenever set, fields in number order),
which the tests check.

Field map (numbers as in the schema)::

    SampleResponse
      1 sequences            one SampledSequence per choice, in index order
          1 stop_reason      finish_reason: stop/repetition -> STOP (0, omitted), length -> LENGTH (1)
          2 tokens           int32 little-endian (omitted when empty)
          3 logprobs         float32 little-endian; absent when the choice had no logprobs
      2 prompt_logprobs      float32 LE (P,), NaN where undefined; present iff requested
      3 topk_prompt_logprobs TopkLogprobs {1 token_ids int32 LE, 2 logprobs float32 LE, 3 k, 4 length}
      4 prompt_cache_hit_tokens  int32 (omitted when 0)
"""

from __future__ import annotations

import numpy as np

from shardserver.codec.decode import DecodedCompletion
from shardserver.codec.sizes import max_sample_response_size  # noqa: F401 - re-exported (it moved there)
from shardserver.errors import EngineBodyError

__all__ = [
    "STOP_REASON_STOP",
    "STOP_REASON_LENGTH",
    "stop_reason_code",
    "sample_response_size",
    "plan_sample_response",
    "max_sample_response_size",
    "encode_sample_response",
]

#: ``tinker_public.StopReason`` values.
STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1

_STOP_CODES = {"stop": STOP_REASON_STOP, "repetition": STOP_REASON_STOP, "length": STOP_REASON_LENGTH}

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def stop_reason_code(finish_reason: str, where: str) -> int:
    """Map a vLLM ``finish_reason`` to the ``StopReason`` enum of the Tinker proto.

    ``"stop"`` and ``"repetition"`` map to :data:`STOP_REASON_STOP` (0), ``"length"`` to
    :data:`STOP_REASON_LENGTH` (1).

    Raises:
        EngineBodyError: at ``where`` for ``"abort"`` (a partial sample: the caller must
            handle it, never report it as LENGTH) and for any other value.
    """
    code = _STOP_CODES.get(finish_reason)
    if code is None:
        if finish_reason == "abort":
            raise EngineBodyError(where, "aborted sample (finish_reason 'abort') cannot be encoded as a result")
        raise EngineBodyError(where, f"finish_reason {finish_reason!r} has no Tinker StopReason")
    return code


def _varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64  # int32/int64 negatives: 10-byte two's complement, as protobuf writes them
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _bytes_view(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as a flat little-endian uint8 view (copies only if dtype/layout differ)."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1).view(np.uint8)


def _plan(dc: DecodedCompletion) -> tuple[list, int]:
    """The pieces of the message in wire order (header ``bytes`` and uint8 payload arrays) and their total size."""
    pieces: list = []
    for c in dc.choices:
        where = f"choices[{c.index}].finish_reason"
        code = stop_reason_code(c.finish_reason, where)
        tok = _bytes_view(c.token_ids, _I32)
        head = bytearray()
        if code:
            head += b"\x08" + _varint(code)
        inner: list = []
        if tok.size:
            head += b"\x12" + _varint(tok.size)
            inner.append(bytes(head))
            inner.append(tok)
            head = bytearray()
        if c.logprobs is not None:
            lp = _bytes_view(c.logprobs, _F32)
            if lp.size != tok.size:
                raise ValueError(f"choice {c.index}: {lp.size // 4} logprobs for {tok.size // 4} tokens")
            head += b"\x1a" + _varint(lp.size)
            inner.append(bytes(head))
            if lp.size:
                inner.append(lp)
            head = bytearray()
        elif head:
            inner.append(bytes(head))
        size = sum(len(p) if type(p) is bytes else p.size for p in inner)
        pieces.append(b"\x0a" + _varint(size))
        pieces.extend(inner)

    if dc.prompt_logprobs is not None:
        plp = _bytes_view(dc.prompt_logprobs, _F32)
        pieces.append(b"\x12" + _varint(plp.size))
        if plp.size:
            pieces.append(plp)

    if dc.topk_token_ids is not None or dc.topk_logprobs is not None:
        if dc.topk_token_ids is None or dc.topk_logprobs is None:
            raise ValueError("topk_token_ids and topk_logprobs must be set together")
        if dc.topk_token_ids.ndim != 2 or dc.topk_token_ids.shape != dc.topk_logprobs.shape:
            raise ValueError(
                f"top-k matrices must both be (P, k), got {dc.topk_token_ids.shape} and {dc.topk_logprobs.shape}"
            )
        length, k = dc.topk_token_ids.shape
        ids = _bytes_view(dc.topk_token_ids, _I32)
        lps = _bytes_view(dc.topk_logprobs, _F32)
        inner = []
        if ids.size:
            inner += [b"\x0a" + _varint(ids.size), ids]
        if lps.size:
            inner += [b"\x12" + _varint(lps.size), lps]
        tail = b""
        if k:
            tail += b"\x18" + _varint(k)
        if length:
            tail += b"\x20" + _varint(length)
        if tail:
            inner.append(tail)
        size = sum(len(p) if type(p) is bytes else p.size for p in inner)
        pieces.append(b"\x1a" + _varint(size))
        pieces.extend(inner)

    hits = int(dc.prompt_cache_hit_tokens)
    if hits:
        pieces.append(b"\x20" + _varint(hits))
    total = sum(len(p) if type(p) is bytes else p.size for p in pieces)
    return pieces, total


def plan_sample_response(dc: DecodedCompletion) -> tuple[list, int]:
    """The message of ``dc`` laid out but not written: ``(pieces, size in bytes)``, to pass to
    :func:`encode_sample_response` (``plan=``) after sizing its destination, so the layout is
    worked out once per result.

    Raises:
        EngineBodyError: as :func:`sample_response_size`.
        ValueError: array shapes disagree.
    """
    return _plan(dc)


def sample_response_size(dc: DecodedCompletion) -> int:
    """Exact number of bytes :func:`encode_sample_response` writes for ``dc``.

    Raises:
        EngineBodyError: if a choice is aborted or has an unknown finish_reason (see :func:`stop_reason_code`).
    """
    return _plan(dc)[1]


def encode_sample_response(dc: DecodedCompletion, out=None, offset: int = 0, *,
                           plan: tuple[list, int] | None = None) -> bytes | int:
    """Encode ``dc`` as ``tinker_public.SampleResponse`` wire bytes.

    Byte-identical to ``SerializeToString()`` of the same message built with
    ``shardserver.proto.sample_response_pb2`` (or the SDK's ``tinker_public_pb2``).

    Args:
        dc: the decoded completion. ``token_ids``/``topk_token_ids`` are written as int32 LE,
            logprob arrays as float32 LE (converted if given in another dtype).
        out: ``None`` to return a new ``bytes``; otherwise a writable buffer (``bytearray``,
            ``memoryview``, ``mmap`` or a slice of one) that receives the message at ``offset``.
            No intermediate copy of the whole message is made: each array is copied once,
            straight into ``out``.
        offset: where in ``out`` to start writing.
        plan: :func:`plan_sample_response` of this same ``dc`` (unchanged since), when the
            caller has it already.

    Returns:
        The message (``out is None``), or the number of bytes written into ``out``
        (== :func:`sample_response_size`).

    Raises:
        EngineBodyError: if any choice is aborted (``finish_reason == "abort"`` must be handled
            by the caller, never encoded as LENGTH) or has an unknown finish_reason.
        ValueError: if ``out`` is read-only or too small, or array shapes disagree.
    """
    pieces, total = _plan(dc) if plan is None else plan
    if out is None:
        return b"".join(pieces)
    mv = memoryview(out)
    if mv.readonly:
        raise ValueError("output buffer is read-only")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if offset < 0 or offset + total > mv.nbytes:
        raise ValueError(f"output buffer too small: need {total} bytes at offset {offset}, have {mv.nbytes}")
    pos = offset
    for p in pieces:
        n = len(p) if type(p) is bytes else p.size
        mv[pos : pos + n] = p
        pos += n
    return total
