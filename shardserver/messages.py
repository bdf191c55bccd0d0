"""Every message of the control channel, as a typed struct, and the states a future can be in.

The front-ends and the encoders talk over :mod:`shardserver.control`; this module says *what*
they say. Each request kind (:class:`Kind`) has one request struct and a fixed set of reply
structs, and each reply kind is its own type, so a call site matches on the type instead of
looking for keys::

    SUBMIT     SubmitRequest  (+ blob: the engine request body) -> SubmitAccepted | SubmitRefused
    POLL       PollRequest                                      -> PollDone | PollPending | PollFailed | PollGone
    DELIVERED  Delivered                                        -> (no reply)
    STATS      StatsRequest                                     -> StatsReply
    SESSION_POLL SessionPollRequest                             -> SessionPollReply
    CANCEL     CancelRequest                                    -> CancelReply
    SESSION_FINISHED SessionFinished                            -> (no reply)

Any request may instead be answered with an :class:`ErrorReply` in an ``ERROR`` frame (the
handler raised, or the request could not be decoded); :class:`shardserver.control.ControlClient`
folds it into the reply type of the request (a 500 refusal, a failed future, an exception).

Meta bytes are MessagePack, written by one :class:`msgspec.msgpack.Encoder` and read by one
:class:`msgspec.msgpack.Decoder` per request type and per reply union (the approach of vLLM v1's
``EngineCoreRequest`` / ``MsgpackDecoder``). Replies that share a union carry a tag naming their
kind: ``"outcome"`` (``accepted`` / ``refused``) for SUBMIT, ``"state"`` (the
:class:`FutureState` value) for POLL. Unknown fields are refused, so a misspelt field fails at
the first message instead of as a 410 or a hang.
"""

from __future__ import annotations

import enum
from typing import Literal, Union

import msgspec

from .errors import ShardServerError

__all__ = [
    "Kind",
    "FutureState",
    "ResultForm",
    "RefusalReason",
    "SubmitRequest",
    "PollRequest",
    "Delivered",
    "SessionFinished",
    "StatsRequest",
    "SessionPollRequest",
    "CancelRequest",
    "SubmitAccepted",
    "SubmitRefused",
    "SubmitReply",
    "PollDone",
    "PollPending",
    "PollFailed",
    "PollGone",
    "PollReply",
    "EngineReachability",
    "EngineOutage",
    "StatsReply",
    "CompletionEvent",
    "SessionPollReply",
    "CancelReply",
    "ErrorReply",
    "ControlProtocolError",
    "REQUEST_TYPES",
    "REPLY_TYPES",
    "encode_meta",
    "decode_request",
    "decode_reply",
    "decode_error",
]


class Kind(enum.IntEnum):
    """The ``u8 kind`` of a control frame."""

    SUBMIT = 1
    POLL = 2
    DELIVERED = 3
    STATS = 4
    SESSION_POLL = 5
    CANCEL = 6
    SESSION_FINISHED = 7
    REPLY = 128   # the answer to the request with the same tag
    ERROR = 129   # the request with the same tag could not be handled: meta is an ErrorReply


class FutureState(enum.StrEnum):
    """Where a future is in its shard (see the life cycle in :mod:`shardserver.workers.encoder`)."""

    PENDING = "pending"  # the engine has not answered yet
    DONE = "done"        # the result lies in the arena
    FAILED = "failed"    # the engine refused it or failed; the error is held
    GONE = "gone"        # lost (engine unavailable, aborted too often, no room, shutdown): polls answer 410


class ResultForm(enum.StrEnum):
    """The byte form of a result in the arena: a ``tinker.SampleResponse`` protobuf or its JSON."""

    PROTO = "proto"
    JSON = "json"


class RefusalReason(enum.StrEnum):
    """Why an encoder refused a SUBMIT (the front-end picks the HTTP status from it)."""

    NO_ROOM = "no_room"      # no free arena block for the reservation, even after evicting: retry later
    PENDING_LIMIT = "pending_limit"  # the shard holds shards.max_pending futures waiting for the engine
    PENDING_BYTES = "pending_bytes"  # ... or shards.max_pending_request_bytes of their engine request bodies
    KEY_QUOTA = "key_quota"  # the request's API key holds its share (auth.key_share) of one of those or the arena
    TOO_LARGE = "too_large"  # the largest possible result is larger than the whole arena
    INVALID = "invalid"      # the request's fields could not be used (e.g. a prompt token out of int32)
    CONFLICT = "conflict"    # (sid, seq) already names a future of a different request (digest differs)
    INTERNAL = "internal"    # the encoder failed while handling it (an ErrorReply, folded by the client)
    STOPPING = "stopping"    # the shard is shutting down: retry (the gateway's next run takes the request)


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every control message: immutable, unknown fields refused, defaults left off the
    wire. (``kw_only`` does not inherit: each message sets it, so every field is a keyword.)"""


# -- requests (front-end -> encoder) --------------------------------------------------------------
class SubmitRequest(_Message, kw_only=True):
    """Register a sample request (kind SUBMIT; the frame's blob is the engine request body, JSON bytes).

    Attributes:
        sid: the ``sampling_session_id`` (also sent to the engine as ``X-Session-ID``).
        seq: the SDK's ``seq_id``; ``(sid, seq)`` dedupes resubmissions.
        owner: the API key's owner tag, bound into the future ID's MAC ("" without auth).
        n: ``num_samples``.
        prompt_logprobs: whether the result carries prompt logprobs.
        topk: ``topk_prompt_logprobs`` (0: none).
        reserve_bytes: the largest SampleResponse this request can produce (bytes); the encoder
            reserves an arena slot of that size before it accepts.
        prompt: the prompt token ids, sent only with prompt logprobs (the decoder needs them).
        digest: 16-byte BLAKE2b of the canonical request (:func:`shardserver.api.sampling.request_digest`);
            a resubmission of ``(sid, seq)`` with another digest is refused (CONFLICT) instead of
            answered with the first request's future. Empty: not compared.
        fill_context: the client left ``max_tokens`` unset and the body's ``max_tokens`` is the
            gateway's (the context window it knew, less the prompt): when the engine refuses it
            for its context length (a restart with a smaller ``--max-model-len``), the encoder
            sends it again with the window the engine names.
    """

    sid: str
    seq: int
    owner: str = ""
    n: int
    prompt_logprobs: bool = False
    topk: int = 0
    reserve_bytes: int
    prompt: list[int] | None = None
    digest: bytes = b""
    fill_context: bool = False


class PollRequest(_Message, kw_only=True):
    """Ask where a future's result is (kind POLL), holding up to ``timeout`` seconds while it is pending.

    Attributes:
        fid: the future ID (``request_id``).
        timeout: seconds to hold a pending future (capped by ``futures.long_poll_s``; 0: answer at once).
        want: the result form the client asked for (``Accept`` header).
    """

    fid: str
    timeout: float = 0.0
    want: ResultForm = ResultForm.PROTO


class Delivered(_Message, kw_only=True):
    """One-way (kind DELIVERED, tag 0): the front-end sent this future's result or failure to a
    connected client, so the shard starts its retrieved TTL."""

    fid: str


class SessionFinished(_Message, kw_only=True):
    """One-way (kind SESSION_FINISHED, tag 0): the SDK closed a session
    (``POST /api/v1/sessions/{id}/finish``, tinker >= 0.27 on ``ServiceClient.close()``), so the
    results of its sampling sessions that were never delivered count as abandoned at once
    (``futures.abandoned_after_s``): a SUBMIT that finds no room may evict them.

    Attributes:
        session: the session ID's last 16 characters, as its sampling-session IDs carry it
            (:meth:`shardserver.ids.IdSigner.mint_sampling_session_id`).
        owner: the API key's owner tag the session is bound to ("" in open mode).
    """

    session: str
    owner: str = ""


class StatsRequest(_Message, kw_only=True):
    """Ask for the shard's counters and gauges (kind STATS)."""


class SessionPollRequest(_Message, kw_only=True):
    """Ask for the completions of one sampling session (and clone) in this shard (kind SESSION_POLL),
    for the SDK's session-wide poller ``POST /api/v1/retrieve_futures``.

    Each shard stamps every completion (a future leaving PENDING: done, failed or gone) with a
    ``time.monotonic_ns()`` value (moved up by less than 1 µs to the run's
    :func:`~shardserver.ids.cursor_tag` modulo 1024), strictly increasing within the shard;
    CLOCK_MONOTONIC is one clock for every process of the host, so a stamp is comparable across
    shards and the cursor the SDK carries is one integer (see :mod:`shardserver.api.futures`).

    Attributes:
        sid: the ``sampling_session_id``.
        clone: the ``cloned_sampler_id`` (``seq_id // 10**9`` of the session's futures).
        after: the cursor the client has seen (ns stamp): the shard forgets the session's
            completions stamped at or before it and never returns them.
        upto: return only completions stamped at or before this (ns); the front-end takes it from
            the same clock just before it sends the request, so none at or before it can be missed.
        limit: return at most this many completions (oldest first).
        acks: future IDs whose results the client has fully retrieved: the shard frees them
            (results and table entries) if they belong to ``sid`` and are no longer pending.
        timeout: seconds to hold when there is nothing to return (0: answer at once). A held
            request returns ``woke=True`` (and no events) as soon as a completion stamped after
            ``after`` exists for the session, or when another SESSION_POLL for the same session
            and clone arrives (it supersedes this one).
    """

    sid: str
    clone: int = 0
    after: int = 0
    upto: int
    limit: int
    acks: list[str] = []
    timeout: float = 0.0


class CancelRequest(_Message, kw_only=True):
    """The client abandoned this future (kind CANCEL, from ``POST /api/v1/cancel_future``): stop its
    engine request, free its reservation or result, and forget it (later polls answer 410)."""

    fid: str


# -- replies (encoder -> front-end) ---------------------------------------------------------------
class SubmitAccepted(_Message, kw_only=True, tag_field="outcome", tag="accepted"):
    """The request is registered (or was already: ``duplicate``); poll it as ``request_id``."""

    request_id: str
    duplicate: bool = False


class SubmitRefused(_Message, kw_only=True, tag_field="outcome", tag="refused"):
    """The encoder did not register the request; ``message`` says why in words for the client."""

    reason: RefusalReason
    message: str


SubmitReply = Union[SubmitAccepted, SubmitRefused]


class PollDone(_Message, kw_only=True, tag_field="state", tag=FutureState.DONE.value):
    """The result lies in the shard's arena: segment ``arena``, slot at ``offset`` holding
    ``length`` bytes, valid while the slot's ``generation`` is unchanged (see
    :class:`shardserver.shm.arena.ArenaReader`). ``form`` may be PROTO when JSON was asked for and
    the arena had no room for the JSON form: the front-end converts that one response."""

    arena: str
    offset: int
    length: int
    generation: int
    form: ResultForm


class PollPending(_Message, kw_only=True, tag_field="state", tag=FutureState.PENDING.value):
    """Not finished yet (the client re-polls). ``draining``: released early because the
    front-end is shutting down."""

    draining: bool = False


class PollFailed(_Message, kw_only=True, tag_field="state", tag=FutureState.FAILED.value):
    """The engine refused or failed the request: ``category`` ``user`` (engine 4xx) or ``server``."""

    error: str
    category: Literal["user", "server"]


class PollGone(_Message, kw_only=True, tag_field="state", tag=FutureState.GONE.value):
    """The future is unknown, expired, evicted or lost (HTTP 410: the SDK resubmits)."""

    reason: str


PollReply = Union[PollDone, PollPending, PollFailed, PollGone]


class EngineReachability(_Message, kw_only=True, omit_defaults=False):
    """The last engine probe of an encoder (:class:`shardserver.health.EngineProbe`).

    Attributes:
        ok: whether ``GET /health`` answered below 500; None: not probed yet.
        reason: why not ("" when reachable).
        age_s: seconds since the last probe, None before the first.
        models: the context window (tokens) of each model the engine serves, learned from its
            ``GET /v1/models`` (empty until then, or when the engine does not report it).
    """

    ok: bool | None
    reason: str
    age_s: float | None
    models: dict[str, int] = msgspec.field(default_factory=dict)


class EngineOutage(_Message, kw_only=True, omit_defaults=False):
    """An ongoing engine outage, as an encoder's engine calls see it
    (:meth:`shardserver.engine_client.EngineClient.unavailable`).

    Attributes:
        for_s: seconds since the first failed attempt with no answer from the engine since.
        reason: the last failure (an HTTP status and message, or a connection error).
        budget_s: ``engine.unavailable_budget_s``: how long each request is re-forwarded.
        url: the engine's completions URL (credentials masked).
    """

    for_s: float
    reason: str
    budget_s: float
    url: str


class StatsReply(_Message, kw_only=True, omit_defaults=False):
    """One shard's counters and gauges (``/stats`` shows it as is; ``/metrics`` and ``/readyz`` use it).

    Attributes:
        shard, pid: the encoder.
        futures: futures in the table by :class:`FutureState` value (states with none left out).
        delivered_held: delivered results held in the eviction queue.
        arena_bytes: the arena's size; arena_used_bytes: bytes holding results (proto + JSON);
            arena_reserved_bytes: bytes reserved for results of requests in flight.
        decode_encode_s: seconds spent decoding engine bodies and encoding results.
        counters: event counts by name (``completed``, ``evicted``, ``rejected_429``, ...).
        stages: futures by stage for the ``shardserver_futures`` gauge.
        engine: the last engine probe, None when this encoder does not probe.
        pending_request_bytes: engine request bodies held by pending futures (bytes).
        engine_calls: engine requests in flight (at most ``engine_call_limit``).
        engine_call_limit: how many may run now: ``engine.pool_size``, less while the engine
            answers held undecoded pass ``engine.answer_budget_bytes``.
        engine_queued: pending futures waiting for an engine connection.
        engine_answer_bytes: engine answers received (or being received) and not yet decoded (bytes);
            a ``Content-Length`` body counts whole from the moment it is admitted.
        engine_answers_waiting: engine answers whose bodies wait unread in their sockets for room
            in ``engine.answer_budget_bytes``.
        engine_unavailable: the engine outage its engine calls are riding out, None when the
            engine answers.
    """

    shard: int
    pid: int
    futures: dict[str, int]
    delivered_held: int
    arena_bytes: int
    arena_used_bytes: int
    arena_reserved_bytes: int
    decode_encode_s: float
    counters: dict[str, int]
    stages: dict[str, int]
    engine: EngineReachability | None
    pending_request_bytes: int = 0
    engine_calls: int = 0
    engine_call_limit: int = 0
    engine_queued: int = 0
    engine_answer_bytes: int = 0
    engine_answers_waiting: int = 0
    engine_unavailable: EngineOutage | None = None


class CompletionEvent(_Message, kw_only=True, array_like=True):
    """One completion of a session in a shard (an array on the wire: many go in one reply).

    Attributes:
        fid: the future ID.
        stamp: when it completed (``time.monotonic_ns()`` moved up to the run's cursor tag,
            strictly increasing within a shard).
        ok: True: a result lies in the arena (the SDK's ``"finished"``); False: failed or gone
            (``"failed"``: the SDK then calls ``retrieve_future``, which answers the error or 410).
        size: the result's protobuf bytes when ``ok`` (the SDK's
            ``response_payload_uncompressed_size``), else 0.
    """

    fid: str
    stamp: int
    ok: bool
    size: int = 0


class SessionPollReply(_Message, kw_only=True):
    """The answer to SESSION_POLL.

    Attributes:
        events: completions stamped in ``(after, upto]``, oldest first, at most ``limit``.
        more: True when ``limit`` cut the list (the front-end then moves the cursor only to the
            last returned stamp).
        woke: a held request ended because a completion stamped after ``after`` exists (or it
            was superseded); False when it timed out or was not held.
    """

    events: list[CompletionEvent] = []
    more: bool = False
    woke: bool = False


class CancelReply(_Message, kw_only=True):
    """The answer to CANCEL: ``was`` is the :class:`FutureState` value the future was in before it
    was cancelled, or ``"unknown"`` when the shard does not hold it (expired, never issued, lost)."""

    was: str


class ErrorReply(_Message, kw_only=True):
    """Sent in a Kind.ERROR frame instead of the normal reply: the encoder could not handle the
    request (an unknown kind, an undecodable meta, or a bug in its handler)."""

    message: str


# -- the codec ------------------------------------------------------------------------------------
class ControlProtocolError(ShardServerError, ValueError):
    """A control frame or its meta is malformed (wrong length, unknown kind, undecodable or
    mistyped fields). The message names the kind and what was wrong."""


REQUEST_TYPES: dict[Kind, type[_Message]] = {
    Kind.SUBMIT: SubmitRequest,
    Kind.POLL: PollRequest,
    Kind.DELIVERED: Delivered,
    Kind.STATS: StatsRequest,
    Kind.SESSION_POLL: SessionPollRequest,
    Kind.CANCEL: CancelRequest,
    Kind.SESSION_FINISHED: SessionFinished,
}
"""The request struct of each request kind."""

REPLY_TYPES: dict[Kind, object] = {
    Kind.SUBMIT: SubmitReply,
    Kind.POLL: PollReply,
    Kind.STATS: StatsReply,
    Kind.SESSION_POLL: SessionPollReply,
    Kind.CANCEL: CancelReply,
}
"""The reply type (a struct or a tagged union) of each request kind that is answered."""

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODERS = {k: msgspec.msgpack.Decoder(t) for k, t in REQUEST_TYPES.items()}
_REPLY_DECODERS = {k: msgspec.msgpack.Decoder(t) for k, t in REPLY_TYPES.items()}
_ERROR_DECODER = msgspec.msgpack.Decoder(ErrorReply)


def encode_meta(msg: msgspec.Struct) -> bytes:
    """The MessagePack meta bytes of one message (requests and replies alike)."""
    return _ENCODER.encode(msg)


def _kind_name(kind: int) -> str:
    try:
        return Kind(kind).name
    except ValueError:
        return str(kind)


def decode_request(kind: int, meta: bytes | memoryview) -> _Message:
    """Decode the meta of a request frame of ``kind`` into its :data:`REQUEST_TYPES` struct.

    Raises:
        ControlProtocolError: ``kind`` is not a request kind, or the meta does not decode to it.
    """
    dec = _REQUEST_DECODERS.get(kind)  # type: ignore[call-overload]
    if dec is None:
        raise ControlProtocolError(f"unknown control message kind {kind}")
    try:
        return dec.decode(meta)
    except msgspec.DecodeError as exc:
        raise ControlProtocolError(f"malformed {_kind_name(kind)} request: {exc}") from None


def decode_reply(request_kind: int, meta: bytes | memoryview) -> object:
    """Decode a REPLY frame's meta as the reply to a request of ``request_kind``
    (one of the types of :data:`REPLY_TYPES` for that kind).

    Raises:
        ControlProtocolError: ``request_kind`` has no reply, or the meta does not decode to it.
    """
    dec = _REPLY_DECODERS.get(request_kind)  # type: ignore[call-overload]
    if dec is None:
        raise ControlProtocolError(f"control message kind {_kind_name(request_kind)} has no reply")
    try:
        return dec.decode(meta)
    except msgspec.DecodeError as exc:
        raise ControlProtocolError(f"malformed reply to {_kind_name(request_kind)}: {exc}") from None


def decode_error(meta: bytes | memoryview) -> ErrorReply:
    """Decode an ERROR frame's meta.

    Raises:
        ControlProtocolError: the meta is not an :class:`ErrorReply`.
    """
    try:
        return _ERROR_DECODER.decode(meta)
    except msgspec.DecodeError as exc:
        raise ControlProtocolError(f"malformed ERROR reply: {exc}") from None
