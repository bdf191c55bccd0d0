"""Decode vLLM ``/v1/completions`` bodies straight into numpy arrays.

The input is the non-streaming body of vLLM 0.30's OpenAI-compatible completions
route (``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionResponse``,
``CompletionResponseChoice``, ``CompletionLogProbs``; the gateway always sends
``logprobs`` and ``return_token_ids=true``). Older layouts (0.10.2+, 0.11) decode
the same way: keys are looked up by name, unknown keys are ignored, and a missing
key means ``null``. See ``shared/spec/vllm_completions.md``.

The output, :class:`DecodedCompletion`, holds exactly what the Tinker
``SampleResponse`` needs (``tinker/proto/tinker_public_pb2.py``), already in the
dtypes of the wire: int32 token ids, float32 logprobs.

Performance: the body is parsed once with a reusable ``simdjson.Parser``.
``token_ids`` and ``token_logprobs`` are copied out of the parsed document with
``Array.as_buffer`` (one C loop each), so no Python object is created per
generated token. Prompt logprobs (``{id: {logprob, rank, decoded_token}}`` per
prompt position) are read straight from the raw bytes with numpy when they have
vLLM's exact compact layout (:mod:`shardserver.codec.prompt_scan`, choice 0 only);
otherwise they are materialized with ``Array.as_list`` once and reduced with numpy
(:mod:`shardserver.codec.prompt_logprobs`, which also builds the top-k matrices for
both paths). This module validates the body, the choices and the prompt ids, and picks
the path (``_decode_prompt_logprobs``).

Bodies of :data:`~shardserver.codec.split.SPLIT_MIN_BYTES` or more first try the split parse
(:mod:`shardserver.codec.split`): each choice's ``logprobs`` object is cut out of the body and
only its ``token_logprobs`` array is parsed, the rest of the body is parsed and checked as
usual; if anything on that path does not fit, the body is parsed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simdjson

from shardserver.codec.json_types import INT32_MAX, NUMBER, is_int, type_name
from shardserver.codec.prompt_logprobs import decode_prompt_rows, fill_own, fill_topk
from shardserver.codec.prompt_scan import scan_prompt_logprobs
from shardserver.codec.split import (
    SPLIT_MIN_BYTES,
    find_logprob_spans,
    placeholder,
    placeholder_nonce,
    searchable,
    skeleton,
)
from shardserver.errors import EngineBodyError

__all__ = [
    "CompletionDecoder",
    "DecodedChoice",
    "DecodedCompletion",
    "FINISH_REASONS",
    "TOPK_MASK_TOKEN",
    "TOPK_MASK_LOGPROB",
]

#: ``finish_reason`` values of vLLM 0.30 that can arrive in a 200 (``v1/engine/__init__.py``
#: ``FinishReason``; ``error`` becomes an HTTP 500 and never reaches the decoder).
FINISH_REASONS = frozenset({"stop", "length", "abort", "repetition"})

#: Fill of undefined top-k cells: the SDK's sentinel (``tinker/types/topk_logprobs.py``).
TOPK_MASK_TOKEN = 0
TOPK_MASK_LOGPROB = -99999.0

_Array = simdjson.Array
_Object = simdjson.Object


@dataclass(slots=True)
class DecodedChoice:
    """One sample of a completion, in wire dtypes.

    Attributes:
        index: ``choices[i].index`` (0..n-1).
        token_ids: int32, shape ``(T,)``: every generated id including a final EOS/stop id.
        logprobs: float32, shape ``(T,)``: the sampled tokens' logprobs as vLLM sent them
            (``-9999.0`` is vLLM's clamp of ``-inf`` and is kept). ``None`` when the choice
            had ``"logprobs": null`` (never zero-filled).
        finish_reason: raw vLLM string, one of :data:`FINISH_REASONS`.
        stop_reason: raw vLLM ``stop_reason``: a stop token id, a stop string, or ``None``.
    """

    index: int
    token_ids: np.ndarray
    logprobs: np.ndarray | None
    finish_reason: str
    stop_reason: int | str | None


@dataclass(slots=True)
class DecodedCompletion:
    """A decoded completion body: what ``SampleResponse`` is built from.

    Attributes:
        choices: one :class:`DecodedChoice` per sample, sorted by ``index``; ``len == n``.
        prompt_logprobs: float32, shape ``(P,)``, one per prompt token; NaN where undefined
            (position 0, ``null`` rows, and rows past the end of an aborted request's list).
            ``None`` when prompt logprobs were not requested.
        topk_token_ids: int32, shape ``(P, k)``: per position the ids of the ``k`` entries
            with the highest logprob (ties keep vLLM's order); undefined cells hold
            :data:`TOPK_MASK_TOKEN`. ``None`` when top-k was not requested.
        topk_logprobs: float32, shape ``(P, k)``, aligned with ``topk_token_ids``; undefined
            cells hold :data:`TOPK_MASK_LOGPROB`. ``None`` when top-k was not requested.
        prompt_cache_hit_tokens: ``usage.prompt_tokens_details.cached_tokens``, else 0.
    """

    choices: list[DecodedChoice]
    prompt_logprobs: np.ndarray | None = None
    topk_token_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    prompt_cache_hit_tokens: int = 0

    @property
    def aborted(self) -> bool:
        """True if any choice has ``finish_reason == "abort"`` (a partial sample vLLM still answers 200 for)."""
        return any(c.finish_reason == "abort" for c in self.choices)


def _fail_not_json(body: bytes | bytearray | memoryview, exc: Exception) -> EngineBodyError:
    msg = str(exc)
    body = bytes(body)
    head = body[:256].lstrip()
    if not head:
        return EngineBodyError("$", "empty body (HTTP 2xx with no JSON)")
    if head[:1] == b"<":
        return EngineBodyError("$", f"body is HTML, not JSON (a proxy or ingress page?): {head[:80]!r}")
    hints = []
    if b"NaN" in body or b"Infinity" in body:
        hints.append("it contains NaN/Infinity, which JSON does not allow (a non-finite logprob?)")
    tail = body[-40:]
    if not body.rstrip().endswith(b"}"):
        hints.append(f"it does not end with '}}' (truncated? {len(body)} bytes, ends {tail!r})")
    hint = ("; " + "; ".join(hints)) if hints else ""
    return EngineBodyError("$", f"body is not valid JSON ({msg}){hint}")


# Bodies above this size (bytes) are parsed and then the parser is replaced (see decode()).
PARSER_KEEP_BYTES = 32 * 1024 * 1024


class CompletionDecoder:
    """Decodes vLLM completion bodies; one per process (it owns a reusable ``simdjson.Parser``).

    Not thread-safe: the parser's buffers are reused across calls.
    """

    __slots__ = ("_parser", "_lp_parser", "_nonce", "split_decodes", "whole_decodes")

    def __init__(self) -> None:
        self._parser = simdjson.Parser()
        self._lp_parser = simdjson.Parser()  # token_logprobs arrays of the split parse
        self._nonce = placeholder_nonce()
        #: bodies decoded by the split parse / parsed whole (split attempts that fell back included)
        self.split_decodes = 0
        self.whole_decodes = 0

    def decode(
        self,
        body: bytes,
        *,
        num_samples: int,
        prompt_token_ids: np.ndarray | None = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> DecodedCompletion:
        """Decode one HTTP-2xx body of vLLM's ``POST /v1/completions``.

        Args:
            body: the raw body (UTF-8 JSON): ``bytes``, ``bytearray`` or a contiguous byte
                ``memoryview`` (the engine client's receive buffer) are parsed in place; other
                buffers are copied to ``bytes`` first.
            num_samples: the ``n`` the gateway asked for; the body must have exactly this many choices.
            prompt_token_ids: the prompt the gateway sent (int array, shape ``(P,)``). Used to
                look up prompt logprobs when the body has no ``prompt_token_ids``, and checked
                against the body's copy when both exist.
            prompt_logprobs: whether prompt logprobs were requested (fills
                :attr:`DecodedCompletion.prompt_logprobs`).
            topk_prompt_logprobs: ``k`` of the top-k prompt logprobs requested, 0 for none
                (fills the ``topk_*`` matrices, shape ``(P, k)``).

        Returns:
            The decoded completion, choices sorted by index.

        Raises:
            EngineBodyError: for any body that is not a complete, well-typed completion: empty,
                HTML, non-JSON or truncated bodies; error envelopes (``{"error": {...}}``,
                ``{"detail": ...}``, ``{"object": "error", ...}``); missing or empty ``choices``;
                a choice count other than ``num_samples``; duplicate or missing indexes;
                missing ``token_ids``; mistyped fields; ``len(token_ids) !=
                len(token_logprobs)``; ``null`` or non-finite sampled logprobs; unknown
                ``finish_reason``; prompt logprobs missing, of the wrong length (unless aborted)
                or lacking the prompt token's own entry. ``where`` is the JSON path.
            ValueError: for invalid arguments (``num_samples < 1``, ``topk_prompt_logprobs < 0``).
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs must be >= 0, got {topk_prompt_logprobs}")
        if not isinstance(body, (bytes, bytearray, memoryview)):
            body = bytes(body)
        try:
            if len(body) >= SPLIT_MIN_BYTES:
                try:
                    out = self._decode_split(body, num_samples, prompt_token_ids, prompt_logprobs,
                                             topk_prompt_logprobs)
                except (_NotSplit, EngineBodyError, ValueError, UnicodeDecodeError, RuntimeError):
                    out = None  # the whole parse below decides, with its own error messages
                if out is not None:
                    self.split_decodes += 1
                    return out
            self.whole_decodes += 1
            return self._decode(body, num_samples, prompt_token_ids, prompt_logprobs, topk_prompt_logprobs)
        except EngineBodyError as e:
            # Drop the traceback and context: their frames hold simdjson proxies, and a live
            # proxy makes the next Parser.parse() refuse to reuse the parser.
            e.__context__ = None
            e.__cause__ = None
            raise e.with_traceback(None) from None
        finally:
            if len(body) > PARSER_KEEP_BYTES:
                # A reused Parser keeps buffers sized for the largest document it has seen
                # (about 10x the body): after a rare huge body, start over with a small one.
                self._parser = simdjson.Parser()

    # -- internals ---------------------------------------------------------------------------

    def _decode_split(
        self,
        body: bytes | bytearray | memoryview,
        num_samples: int,
        prompt_ids_arg: np.ndarray | None,
        want_plp: bool,
        k: int,
    ) -> DecodedCompletion | None:
        """The split parse (:mod:`shardserver.codec.split`): None when the body's layout does not
        allow it. Any exception it raises means "parse the body whole" to the caller."""
        n = len(body)
        spans = find_logprob_spans(searchable(body), n, num_samples)
        if spans is None:
            return None
        view = body if isinstance(body, memoryview) else memoryview(body)
        arrays: list[np.ndarray] = []
        try:
            for i, (a, b) in enumerate(spans.arrays):
                piece = view[a:b]
                try:
                    arr = self._parse_lp(piece)
                finally:
                    piece.release()
                try:
                    arrays.append(_float_array(arr, f"choices[{i}].logprobs.token_logprobs"))
                finally:
                    del arr  # a live proxy would stop the parser's reuse
        finally:
            if view is not body:
                view.release()
        holders = [placeholder(self._nonce, i) for i in range(num_samples)]
        skel = skeleton(body, n, spans, [h for h, _ in holders])
        return self._decode(skel, num_samples, prompt_ids_arg, want_plp, k,
                            split=([v for _, v in holders], arrays))

    def _parse_lp(self, data: memoryview):
        """Parse one ``token_logprobs`` array of the split parse (a second parser, so the
        skeleton's document can stay alive)."""
        try:
            return self._lp_parser.parse(data)
        except RuntimeError:
            self._lp_parser = simdjson.Parser()
            return self._lp_parser.parse(data)

    def _parse(self, body: bytes):
        """Parse ``body``; simdjson's errors (ValueError, UnicodeDecodeError, RuntimeError) propagate.

        pysimdjson raises RuntimeError both for a parser that is still referenced by live
        proxies of an earlier document (then a fresh parser is used) and for some document
        errors (DEPTH_ERROR, BIGINT_ERROR), which the caller reports as not-JSON (those
        also replace the parser, which is harmless).
        """
        try:
            return self._parser.parse(body)
        except RuntimeError:
            # Either a proxy from an earlier document is still alive somewhere, or a document
            # error: retry once with a fresh parser, which re-raises the document error.
            self._parser = simdjson.Parser()
            return self._parser.parse(body)

    def _decode(
        self,
        body: bytes,
        num_samples: int,
        prompt_ids_arg: np.ndarray | None,
        want_plp: bool,
        k: int,
        split: tuple[list[str], list[np.ndarray]] | None = None,
    ) -> DecodedCompletion:
        """:meth:`decode` after the argument checks: parse, then each part of the body in turn.

        ``split``: for a skeleton (:meth:`_decode_split`), the placeholder each choice position
        must hold as its ``logprobs`` and that position's already decoded logprobs."""
        doc = self._parse_document(body)
        choices = _choices_array(doc, num_samples)
        decoded, choice0, c0pos = _decode_choices(choices, split)
        aborted = any(c.finish_reason == "abort" for c in decoded)
        where0 = f"choices[{c0pos}]"
        pids = _prompt_ids(choice0, where0, prompt_ids_arg)

        out = DecodedCompletion(choices=decoded)
        if want_plp or k > 0:
            # The byte-level fast path locates choices[0]'s prompt_logprobs in the raw bytes; it
            # needs choice 0 first and no duplicate keys (get() returns the first of duplicates).
            fast_ok = c0pos == 0 and _key_once(doc, "choices") and _key_once(choice0, "prompt_logprobs")
            _decode_prompt_logprobs(
                choice0.get("prompt_logprobs"), pids, where0, aborted, want_plp, k, out,
                (body if isinstance(body, bytes) else bytes(body)) if fast_ok else None
            )

        usage = doc.get("usage")
        if usage is not None:
            out.prompt_cache_hit_tokens = _cached_tokens(usage)
        return out

    def _parse_document(self, body: bytes):
        """``body`` -> its top-level ``simdjson.Object``, after the error-envelope check.

        Raises:
            EngineBodyError: at ``$`` for an empty, non-JSON or non-object body; at the
                envelope's key for an error body (:func:`_check_error_envelope`).
        """
        if not body:
            raise EngineBodyError("$", "empty body (HTTP 2xx with no JSON)")
        try:
            doc = self._parse(body)
        except (ValueError, UnicodeDecodeError, RuntimeError) as e:
            # RuntimeError: simdjson's DEPTH_ERROR (nesting beyond 1024) and BIGINT_ERROR
            # (an integer beyond 64 bits, e.g. 2**70), which pysimdjson maps to RuntimeError.
            raise _fail_not_json(body, e) from None

        if not isinstance(doc, _Object):
            raise EngineBodyError("$", f"top-level JSON value is {type_name(doc)}, expected an object")
        _check_error_envelope(doc)
        return doc


def _choices_array(doc, num_samples: int):
    """``doc["choices"]`` (a ``simdjson.Array`` of exactly ``num_samples`` elements) or EngineBodyError."""
    choices = doc.get("choices")
    if choices is None:
        raise EngineBodyError("choices", "missing or null (not a completion body)")
    if not isinstance(choices, _Array):
        raise EngineBodyError("choices", f"expected an array, got {type_name(choices)}")
    m = len(choices)
    if m == 0:
        raise EngineBodyError("choices", "empty array")
    if m != num_samples:
        raise EngineBodyError("choices", f"{m} choices, expected num_samples={num_samples}")
    return choices


class _NotSplit(Exception):
    """A skeleton whose ``logprobs`` values are not the placeholders where they must be."""


def _decode_choices(choices, split: tuple[list[str], list[np.ndarray]] | None = None
                    ) -> tuple[list[DecodedChoice], object, int]:
    """Decode every choice; returns them sorted by index, plus the index-0 choice's proxy and position.

    ``split``: see :meth:`CompletionDecoder._decode`.

    Raises:
        EngineBodyError: a choice that is not an object or fails :func:`_decode_choice`, a
            duplicate or missing index.
        _NotSplit: with ``split``, a choice whose ``logprobs`` is not its placeholder.
    """
    m = len(choices)
    slots: list[DecodedChoice | None] = [None] * m
    choice0 = None
    c0pos = 0
    for pos in range(m):
        c = choices[pos]
        where = f"choices[{pos}]"
        if not isinstance(c, _Object):
            raise EngineBodyError(where, f"expected an object, got {type_name(c)}")
        dc = _decode_choice(c, where, m, None if split is None else (split[0][pos], split[1][pos]))
        if slots[dc.index] is not None:
            raise EngineBodyError(f"{where}.index", f"duplicate index {dc.index}")
        slots[dc.index] = dc
        if dc.index == 0:
            choice0, c0pos = c, pos
    # m distinct indexes in [0, m) means none is missing; keep the check explicit anyway.
    missing = [i for i, s in enumerate(slots) if s is None]
    if missing:
        raise EngineBodyError("choices", f"missing index {missing[0]}")
    return slots, choice0, c0pos  # type: ignore[return-value]


def _prompt_ids(choice0, where0: str, prompt_ids_arg: np.ndarray | None) -> np.ndarray | None:
    """The prompt token ids: the body's copy (choice with index 0, int32) or else the caller's.

    Raises:
        EngineBodyError: the body's copy is mistyped, or differs from the caller's.
        ValueError: the caller's array is not one-dimensional.
    """
    body_pids = _int_array(choice0.get("prompt_token_ids"), f"{where0}.prompt_token_ids", allow_null=True)
    arg_pids = None
    if prompt_ids_arg is not None:
        arg_pids = np.asarray(prompt_ids_arg)
        if arg_pids.ndim != 1:
            raise ValueError("prompt_token_ids must be one-dimensional")
    if body_pids is not None and arg_pids is not None:
        if body_pids.shape != arg_pids.shape or not np.array_equal(body_pids, arg_pids):
            raise EngineBodyError(
                f"{where0}.prompt_token_ids",
                f"differs from the prompt the gateway sent ({body_pids.size} ids in the body, "
                f"{arg_pids.size} sent)",
            )
    return body_pids if body_pids is not None else arg_pids


def _key_once(obj, key: str) -> bool:
    """Whether ``obj`` (a simdjson Object) has ``key`` exactly once (keys compared decoded)."""
    return sum(1 for k in obj.keys() if k == key) == 1


def _check_error_envelope(doc) -> None:
    err = doc.get("error")
    if err is not None:
        if isinstance(err, _Object):
            msg = err.get("message")
            typ = err.get("type")
            code = err.get("code")
            raise EngineBodyError("error", f"engine returned an error body: {typ} (code {code}): {msg}")
        raise EngineBodyError("error", f"engine returned an error body: {err!r}")
    if "detail" in doc and "choices" not in doc:
        detail = doc.get("detail")
        if isinstance(detail, (_Object, _Array)):
            detail = detail.mini.decode("utf-8", "replace")
        raise EngineBodyError("detail", f"engine returned an error body: detail={detail!r}")
    if doc.get("object") == "error":
        raise EngineBodyError(
            "object",
            f"engine returned an error body (pre-0.10.1 flat form): {doc.get('type')} "
            f"(code {doc.get('code')}): {doc.get('message')}",
        )


def _cached_tokens(usage) -> int:
    if not isinstance(usage, _Object):
        raise EngineBodyError("usage", f"expected an object, got {type_name(usage)}")
    details = usage.get("prompt_tokens_details")
    if details is None:
        return 0
    if not isinstance(details, _Object):
        raise EngineBodyError("usage.prompt_tokens_details", f"expected an object, got {type_name(details)}")
    n = details.get("cached_tokens")
    if n is None:
        return 0
    if not is_int(n) or not 0 <= n <= INT32_MAX:
        raise EngineBodyError("usage.prompt_tokens_details.cached_tokens", f"expected an int in [0, 2^31), got {n!r}")
    return n


def _int_array(arr, where: str, *, allow_null: bool) -> np.ndarray | None:
    """Token ids (a JSON array of ints) -> int32 array, via one C copy."""
    if arr is None:
        if allow_null:
            return None
        raise EngineBodyError(where, "missing or null")
    if not isinstance(arr, _Array):
        raise EngineBodyError(where, f"expected an array of ints, got {type_name(arr)}")
    n = len(arr)
    try:
        a = np.frombuffer(arr.as_buffer(of_type="i"), dtype=np.int64)
    except (TypeError, ValueError):
        _diagnose_int_array(arr.as_list(), where)
        raise EngineBodyError(where, "expected an array of ints") from None  # pragma: no cover
    if a.size != n or _has_nested(arr, n):  # as_buffer flattens nested arrays
        raise EngineBodyError(where, "expected a flat array of ints, found nested arrays")
    if n and (int(a.min()) < 0 or int(a.max()) > INT32_MAX):
        j = int(np.flatnonzero((a < 0) | (a > INT32_MAX))[0])
        raise EngineBodyError(f"{where}[{j}]", f"token id {int(a[j])} outside [0, 2^31)")
    return a.astype(np.int32)


def _diagnose_int_array(items: list, where: str) -> None:
    for j, v in enumerate(items):
        if not is_int(v):
            raise EngineBodyError(f"{where}[{j}]", f"expected an int token id, got {type_name(v)} {v!r}")
        if not 0 <= v <= INT32_MAX:
            raise EngineBodyError(f"{where}[{j}]", f"token id {v} outside [0, 2^31)")


def _has_nested(arr, n: int) -> bool:
    """Whether a numbers array visibly holds arrays: its first or last element is one.

    ``as_buffer`` flattens nested arrays; the caller's size check catches every nesting that
    changes the number count, and this O(1) look at both ends catches ``[[5],[6],[7]]`` and
    ``[[5,6],[]]``. An array nested only in its middle with an unchanged count would still be
    flattened: no engine emits that, and an exact check costs a Python object per element
    (about 1 ms per 32k-token array) on every body.
    """
    return n > 0 and (isinstance(arr[0], _Array) or isinstance(arr[n - 1], _Array))


def _float_array(arr, where: str) -> np.ndarray:
    """Sampled logprobs (a JSON array of numbers) -> float32 array, via one C copy."""
    if not isinstance(arr, _Array):
        raise EngineBodyError(where, f"expected an array of numbers, got {type_name(arr)}")
    n = len(arr)
    try:
        a = np.frombuffer(arr.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError):
        # Slow exact path: find the offending element (null, string, boolean, nested ...).
        for j, v in enumerate(arr.as_list()):
            if v is None:
                raise EngineBodyError(
                    f"{where}[{j}]",
                    "null sampled logprob (only echo/prompt positions have null, and the gateway never uses echo)",
                ) from None
            if type(v) not in NUMBER:
                raise EngineBodyError(f"{where}[{j}]", f"expected a number, got {type_name(v)} {v!r}") from None
        raise EngineBodyError(where, "expected a flat array of numbers") from None
    if a.size != n or _has_nested(arr, n):
        raise EngineBodyError(where, "expected a flat array of numbers, found nested arrays")
    with np.errstate(over="ignore"):  # beyond float32 -> inf, reported below
        f = a.astype(np.float32)
    if n and not np.isfinite(f).all():
        j = int(np.flatnonzero(~np.isfinite(f))[0])
        raise EngineBodyError(f"{where}[{j}]", f"non-finite logprob {float(a[j])!r} (NaN/inf or beyond float32 range)")
    return f


def _decode_choice(c, where: str, m: int, split: tuple[str, np.ndarray] | None = None) -> DecodedChoice:
    index = c.get("index")
    if not is_int(index):
        raise EngineBodyError(f"{where}.index", f"expected an int, got {type_name(index)}")
    if not 0 <= index < m:
        raise EngineBodyError(f"{where}.index", f"index {index} outside [0, {m})")

    finish = c.get("finish_reason")
    if finish is None:
        raise EngineBodyError(f"{where}.finish_reason", "missing or null")
    if not isinstance(finish, str):
        raise EngineBodyError(f"{where}.finish_reason", f"expected a string, got {type_name(finish)}")
    if finish not in FINISH_REASONS:
        raise EngineBodyError(
            f"{where}.finish_reason", f"unknown finish_reason {finish!r} (expected one of {sorted(FINISH_REASONS)})"
        )
    stop_reason = c.get("stop_reason")
    if stop_reason is not None and not (is_int(stop_reason) or isinstance(stop_reason, str)):
        raise EngineBodyError(
            f"{where}.stop_reason", f"expected an int, a string or null, got {type_name(stop_reason)}"
        )

    tids = c.get("token_ids")
    if tids is None:
        raise EngineBodyError(
            f"{where}.token_ids",
            "missing or null: the gateway always requests return_token_ids=true, so this engine "
            "(vLLM < 0.10.2, or a proxy that dropped the flag) is not usable",
        )
    token_ids = _int_array(tids, f"{where}.token_ids", allow_null=False)

    lp = c.get("logprobs")
    logprobs = None
    if split is not None:
        if not (isinstance(lp, str) and lp == split[0]):
            raise _NotSplit(where)
        logprobs = split[1]
        if logprobs.size != token_ids.size:
            raise EngineBodyError(
                f"{where}.logprobs.token_logprobs",
                f"{logprobs.size} logprobs for {token_ids.size} token_ids",
            )
    elif lp is not None:
        if not isinstance(lp, _Object):
            raise EngineBodyError(f"{where}.logprobs", f"expected an object or null, got {type_name(lp)}")
        tl = lp.get("token_logprobs")
        if tl is None:
            raise EngineBodyError(f"{where}.logprobs.token_logprobs", "missing or null in a logprobs object")
        logprobs = _float_array(tl, f"{where}.logprobs.token_logprobs")
        if logprobs.size != token_ids.size:
            raise EngineBodyError(
                f"{where}.logprobs.token_logprobs",
                f"{logprobs.size} logprobs for {token_ids.size} token_ids",
            )
        # The parallel lists must agree too (cheap: len() of a proxy is O(1)).
        for key in ("tokens", "top_logprobs", "text_offset"):
            other = lp.get(key)
            if other is not None and isinstance(other, _Array) and len(other) != token_ids.size:
                raise EngineBodyError(
                    f"{where}.logprobs.{key}", f"{len(other)} entries for {token_ids.size} token_ids"
                )
    return DecodedChoice(index, token_ids, logprobs, finish, stop_reason)


def _decode_prompt_logprobs(
    pl,
    pids: np.ndarray | None,
    where0: str,
    aborted: bool,
    want_plp: bool,
    k: int,
    out: DecodedCompletion,
    body: bytes | None = None,
) -> None:
    """Fill ``out``'s prompt logprob arrays from choice 0's ``prompt_logprobs`` (``pl``).

    Allocates the arrays (:class:`DecodedCompletion`: float32 ``(P,)``, int32 / float32
    ``(P, k)``) and checks ``pl``'s length against the prompt's ``P`` tokens (shorter only
    when ``aborted``). ``body``: the raw body when choice 0 is ``choices[0]``; enables the
    byte-level fast path (:mod:`shardserver.codec.prompt_scan`), which returns ``None`` for
    anything but vLLM's exact compact layout, and then the generic path
    (:func:`shardserver.codec.prompt_logprobs.decode_prompt_rows`, the reference) runs.

    Raises:
        EngineBodyError: unknown prompt ids, ``pl`` null (unless aborted), not an array or
            of the wrong length, or any malformed row (see ``decode_prompt_rows``).
    """
    where = f"{where0}.prompt_logprobs"
    if pids is None:
        raise EngineBodyError(
            f"{where0}.prompt_token_ids",
            "prompt logprobs were requested but the prompt token ids are unknown "
            "(not in the body and not passed by the caller)",
        )
    P = int(pids.size)
    plp = np.full(P, np.nan, dtype=np.float32)
    kk = max(k, 0)
    t_ids = np.zeros((P, kk), dtype=np.int32)
    t_lps = np.full((P, kk), TOPK_MASK_LOGPROB, dtype=np.float32)
    if want_plp:
        out.prompt_logprobs = plp
    if k > 0:
        out.topk_token_ids = t_ids
        out.topk_logprobs = t_lps

    if pl is None:
        if aborted:
            return
        raise EngineBodyError(where, "missing or null although prompt logprobs were requested")
    if not isinstance(pl, _Array):
        raise EngineBodyError(where, f"expected an array, got {type_name(pl)}")
    L = len(pl)
    if L > P or (L < P and not aborted):
        raise EngineBodyError(where, f"{L} positions for a {P}-token prompt")
    if L == 0:
        return

    if body is not None and L >= 2:
        fast = scan_prompt_logprobs(body, pl, pids, L)
        if fast is not None:
            nn, own64, counts, ids64, lp64 = fast
            fill_own(plp, nn, own64, where)
            if k > 0:
                fill_topk(t_ids, t_lps, nn, counts, ids64, lp64, k, where)
            return
    decode_prompt_rows(pl, pids, L, k, where, plp, t_ids, t_lps)
