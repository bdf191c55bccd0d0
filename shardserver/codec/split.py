"""Split parse of large completion bodies: skip the ``logprobs`` fields the gateway never reads.

A vLLM completion body with ``logprobs=1`` spends most of its bytes in each choice's
``logprobs`` object (``CompletionLogProbs``: ``text_offset``, ``token_logprobs``, ``tokens``,
``top_logprobs``): 2.49 MB of a 2.65 MB body at 32768 tokens. ``SampleResponse`` needs only
``token_logprobs`` from it (683 KB); ``top_logprobs`` alone holds as many numbers again, and
number parsing is what a simdjson parse spends its time on. So for large bodies the decoder
parses two smaller documents instead of the body:

* each choice's ``token_logprobs`` array, on its own (:attr:`LogprobSpans.arrays`), and
* the *skeleton*: the body with each choice's whole ``logprobs`` object replaced by a
  placeholder string that holds a per-process random nonce and the choice's position.

The skeleton is parsed and checked exactly as a whole body is (every other field, the prompt
logprobs included); the decoder then requires that ``choices[i].logprobs`` *is* placeholder
``i`` for every position ``i``, and takes that choice's logprobs from array ``i``. Any
mismatch, and any error at all on this path, sends the body down the full parse, which
stays the reference and raises every error, so error messages do not change.

Why the spans are right
-----------------------
The spans are found by byte search in the 0.30/0.11 layout (spec §2.1): each choice is
``{"index":..,"text":"..","logprobs":{"text_offset":[..],"token_logprobs":[..],"tokens":[..],
"top_logprobs":[..]},"finish_reason":..`` with no whitespace. In valid JSON a ``"`` inside a
string is escaped, so a pattern holding a quote that is preceded by a byte other than
``\\`` (``,"logprobs":{``, ``],"token_logprobs":[``, ``]},"finish_reason":``) only matches
where that quote is structural, that is, outside strings: no ``text``, token or
``decoded_token`` content can fake one (and the bytes right before such a quote are then
structural too). ``text_offset`` and ``token_logprobs`` are flat arrays of numbers, so the
first ``]`` after each one's ``[`` closes it; the object ends at the first
``]},"finish_reason":`` after ``token_logprobs`` (``top_logprobs``' end). Every search runs
forward from the previous match, so a span never reaches past its own choice: searching
backwards from the end of the body would, in a body with a second ``choices`` key (the
fuzz regression ``escaped_duplicate_choices_key``), swallow the first array's tail.

That first ``]},"finish_reason":`` need not close the object, though: the object may close
earlier and the span run on over later keys of the choice, or past it into another object
(``..."top_logprobs":[..]},"stop_reason":7,"x":{"z":[]},"finish_reason":..``). The skeleton
is then still valid JSON with the placeholder in place, but it has lost those keys, or taken
another object's as the choice's; the placeholder check cannot see it. So the span must also
read ``..],"tokens":[..],"top_logprobs":[..]}`` with no ``[`` byte in either array
(``_top_logprobs_open`` and the caller). Then, in a valid body, those two ``[`` are the only
arrays opened after ``token_logprobs``; the pattern's ``]`` before ``,"top_logprobs"``
(structural, as above) can only close ``tokens``, so ``top_logprobs`` is a key of the object,
and the ``]`` that ends the span, structural too, can only close ``top_logprobs`` (once it is
closed no array is open to close), so the ``}`` after it closes the object. A ``[`` inside a token cannot be told from a
structural one without tracking strings over the whole span (about as slow as parsing it), so
such a body (code, markup) takes the full parse.

The placeholder check makes the layout assumptions safe for the skeleton: a placeholder can
only be read as ``choices[i].logprobs`` if the skeleton's bytes before it end, outside any
string, right where that value starts, and the bytes after it continue validly; so the
skeleton *is* the body with those values swapped, and everything outside them was parsed.

What is not checked
-------------------
Inside each replaced ``logprobs`` object only ``token_logprobs`` is parsed (and must be a
flat array of numbers); ``text_offset`` only up to its first ``]``; of ``tokens`` and
``top_logprobs`` only the bytes ``[`` and ``]`` are looked at, so malformed JSON or lengths that disagree with
``token_ids`` *there* go unnoticed on this path, where the full parse would fail the
sample. No vLLM version writes such a body, the gateway never reads those fields, and the
result is the same either way. Bodies under :data:`SPLIT_MIN_BYTES` always take the full parse.
"""

from __future__ import annotations

import mmap
import os
from typing import NamedTuple

import numpy as np

__all__ = ["SPLIT_MIN_BYTES", "LogprobSpans", "find_logprob_spans", "searchable"]

#: Bodies from this size (bytes) try the split parse; smaller ones are parsed whole (the split
#: saves half the parse from ~400 tokens up; below ~250 tokens (20 KB) its fixed costs lose).
SPLIT_MIN_BYTES = 32 * 1024

_LP_KEY = b',"logprobs":{"text_offset":['
_TL_KEY = b'],"token_logprobs":['
_LP_END = b']},"finish_reason":'
_TOKENS_KEY = b',"tokens":['
_TOP_KEY = b'],"top_logprobs":['
#: ``]`` bytes looked at one by one before the end search becomes a plain search (a token
#: that holds ``]`` is one more stop; code can have many).
_HOPS = 64


class LogprobSpans(NamedTuple):
    """Where each choice's ``logprobs`` object lies in a body (byte offsets, in body order).

    Attributes:
        objects: ``(start, end)`` per choice: ``body[start:end]`` is the ``{...}`` object.
        arrays: ``(start, end)`` per choice: ``body[start:end]`` is its ``token_logprobs``
            array ``[...]``, inside the object.
    """

    objects: list[tuple[int, int]]
    arrays: list[tuple[int, int]]


def searchable(body: bytes | bytearray | memoryview):
    """An object with ``find(sub, start, end)`` / ``rfind`` over ``body``'s bytes, without a copy
    when it can: ``bytes`` and ``bytearray`` themselves, and the engine client's receive buffers
    (a ``memoryview`` of the first ``n`` bytes of a ``numpy`` array over an anonymous
    ``mmap``: the mapping, searched up to ``n``). Anything else is copied to ``bytes``."""
    if isinstance(body, (bytes, bytearray)):
        return body
    owner = body.obj
    base = owner
    for _ in range(8):  # ndarray -> ndarray (a slice) -> memoryview (np.frombuffer's) -> mmap
        if isinstance(base, np.ndarray):
            base = base.base
        elif isinstance(base, memoryview):
            base = base.obj
        else:
            break
    if (isinstance(base, mmap.mmap) and isinstance(owner, np.ndarray) and body.contiguous
            and owner.__array_interface__["data"][0] == np.frombuffer(base, np.uint8, 1).__array_interface__["data"][0]
            and np.frombuffer(body, np.uint8, 1).__array_interface__["data"][0]
            == owner.__array_interface__["data"][0]):
        return base
    return bytes(body)


def find_logprob_spans(body, n_bytes: int, num_samples: int) -> LogprobSpans | None:
    """Locate the ``logprobs`` object and its ``token_logprobs`` array of each of the
    ``num_samples`` choices in a compact vLLM 0.30/0.11 body (module docstring).

    Args:
        body: what :func:`searchable` returns for the body.
        n_bytes: the body's length (bytes); ``body`` may be longer (a receive buffer).
        num_samples: the choices expected.

    Returns:
        The spans, or ``None`` when the body does not have that layout (``"logprobs": null``,
        whitespace, another key order, too few choices, a ``[`` in a token ...): the caller then
        parses it whole.
    """
    objects: list[tuple[int, int]] = []
    arrays: list[tuple[int, int]] = []
    pos = 0
    for i in range(num_samples):
        k = body.find(_LP_KEY, pos, n_bytes)
        if k < 0:
            return None
        start = k + 12  # the object's '{'
        close = body.find(b"]", k + len(_LP_KEY), n_bytes)  # text_offset: a flat array of ints
        if close < 0 or body.find(_TL_KEY, close, min(close + len(_TL_KEY), n_bytes)) != close:
            return None
        a = close + len(_TL_KEY) - 1
        b = body.find(b"]", a, n_bytes)  # token_logprobs: a flat array of numbers
        if b < 0:
            return None
        b += 1
        q = _top_logprobs_open(body, b, n_bytes)
        if q < 0:
            return None
        e = _object_end(body, q + 1, n_bytes)
        if e < 0 or body.find(b"[", q + 1, e) >= 0:  # (module docstring: no '[' in top_logprobs)
            return None
        objects.append((start, e))
        arrays.append((a, b))
        pos = e
    return LogprobSpans(objects, arrays)


def _object_end(body, pos: int, n_bytes: int) -> int:
    """The offset just past the ``}`` that closes a ``logprobs`` object: the first
    ``]},"finish_reason":`` at or after ``pos`` (``top_logprobs``' ``]``, the object's ``}``), or -1.

    ``]`` is rare in ``tokens`` and ``top_logprobs`` (two per choice, plus tokens that hold
    one), so the search hops from ``]`` to ``]`` (``memchr`` speed: 0.015 ms over a 32k-token
    choice, where a plain search for the pattern takes 0.5 ms), then searches plainly."""
    m = len(_LP_END)
    for _ in range(_HOPS):
        pos = body.find(b"]", pos, n_bytes)
        if pos < 0:
            return -1
        if body.find(_LP_END, pos, min(pos + m, n_bytes)) == pos:
            return pos + 2
        pos += 1
    pos = body.find(_LP_END, pos, n_bytes)
    return -1 if pos < 0 else pos + 2


def _top_logprobs_open(body, b: int, n_bytes: int) -> int:
    """The offset of ``top_logprobs``' ``[`` when ``body[b:]`` (just past the ``token_logprobs``
    array) reads ``,"tokens":[..],"top_logprobs":[`` with no ``[`` byte inside ``tokens``, else -1.
    The caller then requires no ``[`` in ``top_logprobs`` either (module docstring). A ``memchr``
    to the first ``[``, so a token that holds one is turned away before the end search."""
    if body.find(_TOKENS_KEY, b, min(b + len(_TOKENS_KEY), n_bytes)) != b:
        return -1
    q = body.find(b"[", b + len(_TOKENS_KEY), n_bytes)
    t = q + 1 - len(_TOP_KEY)
    if q < 0 or t < b + len(_TOKENS_KEY) or body.find(_TOP_KEY, t, q + 1) != t:
        return -1
    return q


def placeholder_nonce() -> str:
    """A fresh random nonce for :func:`placeholder` (hex, 32 characters)."""
    return os.urandom(16).hex()


def placeholder(nonce: str, i: int) -> tuple[bytes, str]:
    """The JSON string standing for choice ``i``'s ``logprobs`` object in a skeleton: its
    bytes and the string value simdjson reads back."""
    value = f"\x00shardserver-logprobs:{nonce}:{i}"
    return f'"\\u0000shardserver-logprobs:{nonce}:{i}"'.encode(), value


def skeleton(body: bytes | bytearray | memoryview, n_bytes: int, spans: LogprobSpans,
             holders: list[bytes]) -> bytes:
    """``body[:n_bytes]`` with the ``i``-th object span replaced by ``holders[i]`` (a new ``bytes``;
    no view of ``body`` outlives the call, so a receive buffer can be reused after it)."""
    view = body if isinstance(body, memoryview) else memoryview(body)
    parts: list[object] = []
    pos = 0
    for (s, e), h in zip(spans.objects, holders):
        parts.append(view[pos:s])
        parts.append(h)
        pos = e
    parts.append(view[pos:n_bytes])
    try:
        return b"".join(parts)  # type: ignore[arg-type]
    finally:
        for p in parts:
            if isinstance(p, memoryview):
                p.release()
        parts.clear()
        if view is not body:
            view.release()
