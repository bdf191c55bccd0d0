"""The simulator's knobs: :class:`SimConfig` and its fault-injection rules, :class:`FaultRule`."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..fields import FieldError, check_fields

__all__ = ["SimConfig", "FaultRule"]

_FAULT_KINDS = ("status", "truncate", "non_json", "stall", "finish_reason", "nan")
_BODY_KINDS = ("vllm", "router", "empty", "detail")
_FINISH_OVERRIDES = ("abort", "repetition", "stop")


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """One fault-injection rule, applied to the ``/v1/completions`` requests it matches.

    Matching (all given matchers must hold; a rule with no matcher matches every request):

    * ``every_nth``: the running count of valid completion requests (1-based, since start
      or ``/_sim/reset``) is a multiple of N.
    * ``probability``: a draw from this rule's own ``random.Random`` (seeded from
      ``SimConfig.fault_seed`` and the rule's position) is below p. One draw is made per
      request whose other matchers passed, so the sequence is reproducible (re-seeded by
      ``/_sim/reset`` and whenever the fault list changes).
    * ``first_token_id``: the prompt's first token id equals this value; lets a test target
      one request deterministically.
    * ``times``: fire at most this many times (None = unlimited), e.g. "fail once, then
      succeed" for retry tests.

    Kinds (``kind``):

    * ``"status"``: answer ``status`` with a body of kind ``body``: ``"vllm"`` (the
      ``{"error":{...}}`` envelope, type from the status as in spec §8.1), ``"router"``
      (vllm-router's text/plain, §8.2), ``"empty"`` (no body, no content type) or
      ``"detail"`` (FastAPI's ``{"detail":"Not Found"}``). ``message`` overrides the text.
      The generation has run (latency applies), like a vLLM 500 after the work was done.
    * ``"truncate"``: send the headers with the full Content-Length, then a valid prefix
      of the body (``truncate_bytes``, or ``truncate_fraction`` of it), then close the
      connection. Clients see a payload error.
    * ``"non_json"``: 200 with an HTML page (``content_type``, default ``text/html``).
    * ``"stall"``: sleep ``stall_s`` seconds before answering (other rules still apply).
    * ``"finish_reason"``: override the finish of every choice: ``"abort"`` (partial,
      ``tokens`` kept, possibly 0; ``prompt_logprobs`` cut to ``prompt_positions`` list
      elements, default half the prompt when 0 tokens are kept), ``"repetition"``
      (``stop_reason`` ``"repetition_detected"``), ``"stop"`` (``stop_reason`` =
      ``stop_string``, the last kept token is the one that completed the match and its
      text is cut). ``tokens=None`` keeps half of what the choice generated.
    * ``"nan"``: vLLM 0.30's NaN-serialization failure: 400 ``BadRequestError``
      ``"Out of range float values are not JSON compliant: nan"`` after the work ran.

    Several rules can match one request: every matching ``stall`` sleeps, the first
    matching ``finish_reason`` applies, and the first matching status/truncate/non_json/nan
    rule decides the response.
    """

    kind: str
    every_nth: int | None = None
    probability: float | None = None
    first_token_id: int | None = None
    times: int | None = None
    status: int = 500
    body: str = "vllm"
    message: str | None = None
    truncate_fraction: float = 0.5
    truncate_bytes: int | None = None
    content_type: str = "text/html"
    stall_s: float = 0.0
    finish_reason: str = "abort"
    tokens: int | None = None
    prompt_positions: int | None = None
    stop_string: str = "\n\n"

    def __post_init__(self) -> None:
        if self.kind not in _FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {_FAULT_KINDS}, got {self.kind!r}")
        if self.body not in _BODY_KINDS:
            raise ValueError(f"fault body must be one of {_BODY_KINDS}, got {self.body!r}")
        if self.finish_reason not in _FINISH_OVERRIDES:
            raise ValueError(f"fault finish_reason must be one of {_FINISH_OVERRIDES}, got {self.finish_reason!r}")
        if self.every_nth is not None and self.every_nth < 1:
            raise ValueError("fault every_nth must be >= 1")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError("fault probability must be in [0, 1]")
        if not 100 <= self.status <= 599:
            raise ValueError("fault status must be an HTTP status")
        if not 0.0 <= self.truncate_fraction < 1.0:
            raise ValueError("fault truncate_fraction must be in [0, 1)")
        if self.stall_s < 0:
            raise ValueError("fault stall_s must be >= 0")
        for name in ("tokens", "prompt_positions", "truncate_bytes", "times"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"fault {name} must be >= 0")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "FaultRule":
        """Build from a JSON object; unknown keys raise ``ValueError`` naming the key."""
        if isinstance(m, FaultRule):
            return m
        if not isinstance(m, Mapping):
            raise ValueError(f"fault rule must be an object, got {type(m).__name__}")
        return cls(**_check_fields(cls, m, "fault."))

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulator. Frozen; change at runtime through ``POST /_sim/config``.

    Served model (vLLM server flags):
        model_name: served model name; ``model`` in requests must match (404
            ``NotFoundError`` otherwise, unless ``check_model`` is False; absent/null is OK).
        max_model_len: prompt + max_tokens limit (400, ``param:"input_tokens"``). Default
            65536 fits a 4096-token prompt plus 32768 generated tokens.
        max_logprobs: server ``--max-logprobs`` (20); larger ``logprobs`` or
            ``prompt_logprobs`` are rejected with 400.
        system_fingerprint: the top-level fingerprint string (None renders ``null``).

    Fake generation (all affect the output; all are part of the cache key):
        vocab_size: sampled ids are in ``[0, vocab_size)`` (151643, Qwen's text vocab).
        eos_token_id: primary EOS id (151643), decoded as ``"<|endoftext|>"``.
        vocab_seed: seed of the fake vocabulary's strings.
        eos_probability: per-token probability that EOS is sampled (finish ``stop``,
            ``stop_reason`` null, EOS id last); 0 = always run to ``max_tokens``.
        stop_token_probability: per-token probability that one of the request's
            ``stop_token_ids`` is sampled (``stop_reason`` = that int).
        top1_fraction: fraction of positions where the sampled token is the top-1 (its
            ``top_logprobs`` then has 1 entry at ``logprobs=1``; otherwise 2).
        prompt_top1_fraction: same for prompt positions in ``prompt_logprobs``.
        clamp_rate: fraction of sampled logprobs rendered as ``-9999.0`` (-inf).
        collision_rate: fraction of non-top-1 positions whose sampled and top-1 tokens
            are different ids that decode to the same string (``""``), so
            ``top_logprobs`` shrinks to one entry holding the top-1 value (spec §2.4).

    Latency (seconds, slept after the body is built):
        queue_delay_s + latency_s + per_token_latency_s * completion tokens (all choices).

    Misc:
        deterministic_ids: ids become ``"cmpl-"`` + 16 hex of the input's hash and
            ``created`` becomes ``fixed_created``, so whole bodies are reproducible.
        fixed_created: the ``created`` value used with ``deterministic_ids``.
        cache_max_bytes: bound of the rendered-body LRU (512 MiB); 0 disables it.
        pool_starts: number of distinct window starts in the pre-rendered token pool
            (65536). The pool holds ``pool_starts + max_model_len`` positions (~115 B
            each, ~15 MB and ~0.5 s to build at the defaults; rebuilt when a knob it
            depends on changes).
        faults: tuple of :class:`FaultRule` (from JSON: a list of objects).
        fault_seed: seeds the rules' probability draws.
    """

    model_name: str = "Qwen/Qwen3-8B"
    vocab_size: int = 151643
    eos_token_id: int = 151643
    vocab_seed: int = 0
    max_model_len: int = 65536
    max_logprobs: int = 20
    check_model: bool = True
    system_fingerprint: str | None = "vllm-0.30.0-8f3e21ab"
    eos_probability: float = 0.0
    stop_token_probability: float = 0.0
    top1_fraction: float = 0.75
    prompt_top1_fraction: float = 0.5
    clamp_rate: float = 1e-4
    collision_rate: float = 1e-3
    latency_s: float = 0.0
    per_token_latency_s: float = 0.0
    queue_delay_s: float = 0.0
    deterministic_ids: bool = False
    fixed_created: int = 1767225600
    cache_max_bytes: int = 512 * 1024 * 1024
    pool_starts: int = 65536
    faults: tuple[FaultRule, ...] = ()
    fault_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.faults, list):
            object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "faults", tuple(FaultRule.from_mapping(f) for f in self.faults))
        if self.vocab_size < 16:
            raise ValueError("vocab_size must be >= 16")
        if self.eos_token_id < 0:
            raise ValueError("eos_token_id must be >= 0")
        if self.max_model_len < 1 or self.max_logprobs < 0:
            raise ValueError("max_model_len must be >= 1 and max_logprobs >= 0")
        for name in ("eos_probability", "stop_token_probability", "top1_fraction", "prompt_top1_fraction",
                     "clamp_rate", "collision_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        for name in ("latency_s", "per_token_latency_s", "queue_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.cache_max_bytes < 0:
            raise ValueError("cache_max_bytes must be >= 0")
        if self.pool_starts < 1:
            raise ValueError("pool_starts must be >= 1")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], base: "SimConfig | None" = None) -> "SimConfig":
        """Build from a JSON-like mapping, on top of ``base`` (defaults when None).

        Unknown keys raise ``ValueError`` naming the key; wrong types raise ``ValueError``.
        ``faults`` is a list of :class:`FaultRule` objects/mappings and replaces the
        whole list.
        """
        if not isinstance(m, Mapping):
            raise ValueError(f"config must be an object, got {type(m).__name__}")
        fields = _check_fields(cls, m, "")
        if "faults" in fields:
            f = fields["faults"]
            if not isinstance(f, (list, tuple)):
                raise ValueError("faults must be a list")
            fields["faults"] = tuple(FaultRule.from_mapping(x) for x in f)
        return dataclasses.replace(base or cls(), **fields)

    def to_mapping(self) -> dict[str, Any]:
        """JSON-able dict of every knob (faults as a list of objects)."""
        d = dataclasses.asdict(self)
        d["faults"] = [f.to_mapping() for f in self.faults]
        return d


_TYPE_WORDS = {"bool": "a boolean", "int": "an integer", "float": "a finite number", "str": "a string"}


def _check_fields(cls: type, m: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Keys and types of ``m`` checked by :func:`shardserver.fields.check_fields`; ValueError
    ``"unknown SimConfig key 'x'"`` or ``"<prefix>key must be an integer[ or null]"``."""
    try:
        return check_fields(cls, m)
    except FieldError as exc:
        if exc.problem == "unknown":
            raise ValueError(f"unknown {cls.__name__} key {prefix}{exc.key!r}") from None
        null = " or null" if exc.kind.nullable else ""
        raise ValueError(f"{prefix}{exc.key} must be {_TYPE_WORDS[exc.kind.name]}{null}") from None
