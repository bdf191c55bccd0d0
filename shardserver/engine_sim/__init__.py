"""A byte-faithful simulator of vLLM 0.30's non-streaming ``POST /v1/completions``.

The simulator is an aiohttp application that answers the way a vLLM 0.30.0 server
(optionally behind vllm-router) answers the sampling gateway. The wire format is the one
described in ``/work/shared/spec/vllm_completions.md``:

* success bodies follow vLLM's ``CompletionResponse`` / ``CompletionResponseChoice`` /
  ``CompletionLogProbs`` / ``UsageInfo`` field order (spec §2, example §6), rendered the
  way Starlette's ``JSONResponse`` renders ``model_dump()``: ``json.dumps(obj,
  ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))`` as UTF-8;
* ``finish_reason`` / ``stop_reason`` follow ``FinishReason`` and ``check_stop`` (§3);
* errors use vLLM's ``ErrorResponse`` envelope ``{"error":{message,type,param,code}}``,
  FastAPI's ``{"detail":...}`` for routing errors, or vllm-router's text/plain and empty
  bodies (§8).

Generation is fake but deterministic: the output of a request is a pure function of the
prompt token ids, the seed (choice ``i`` uses ``seed + i`` like vLLM's
``parallel_sampling.py``; without a seed one is derived from the prompt), ``max_tokens``,
the other request fields and the generation knobs of :class:`SimConfig`. Token streams are
prefix-stable: the first ``m`` tokens for ``max_tokens=m`` equal the first ``m`` tokens for
any larger ``max_tokens``. Token text comes from a deterministic fake vocabulary that
contains non-ASCII text, empty strings (0.30's partial-UTF-8 repair), ``"\\n\\n"``, quotes,
backslashes and control characters, with ``"<|endoftext|>"`` as EOS.

Speed: all generated tokens are windows of one pre-rendered token "pool" per generation
config (see :mod:`.generate`), so an uncached 32768-token body with
``logprobs=1`` is built in ~5 ms; bodies are also cached in an LRU bounded by total bytes,
keyed by the full deterministic input, and sent without copying (head and tail written
separately). Different seeds read overlapping windows of the same pool; that is fine for
a fake, but means token streams of different requests can share long stretches.

Sim-only conventions: the request's ``Content-Type`` must be ``application/json`` (as in
vLLM); ``model`` must match ``SimConfig.model_name`` when given (404 otherwise, see
``check_model``); ``stream`` is ignored (always non-streaming); a string prompt or several
prompts in one request are rejected with 400; greedy requests (temperature 0) ignore the
seed and report every sampled token as the top-1.

Public API: :class:`SimConfig`, :class:`FaultRule`, :class:`SimRequestError`,
Layout (one module per concern, in dependency order):

* ``config``: :class:`SimConfig` and :class:`FaultRule`, the knobs;
* ``vocab``: the fake vocabulary;
* ``request``: request parsing and validation, :class:`SimRequestError`;
* ``generate``: the token pool and the deterministic plan of each choice;
* ``render``: the byte renderer and the reference dict form, :func:`render_completion`,
  :func:`completion_dict`;
* ``server``: the aiohttp application, :func:`make_app`, :func:`start_sim`,
  :func:`stop_sim`, and the process entry point :func:`run_process` (used by
  ``shardserver engine-sim`` and by the supervisor) with :func:`run_standalone`;
* ``wire``: Starlette's JSON settings, shared by the above.

Public API (importable from ``shardserver.engine_sim``): :class:`SimConfig`,
:class:`FaultRule`, :class:`SimRequestError`, :func:`make_app`, :func:`start_sim`,
:func:`stop_sim`, :func:`render_completion`, :func:`completion_dict`,
:func:`run_process` and :func:`run_standalone`.
"""

from __future__ import annotations

from ..lazy import lazy_getattr
from .config import FaultRule, SimConfig

# The rest loads on first use (PEP 562): ``shardserver.config`` validates a ``[simulator]``
# section with SimConfig in every process that loads a configuration (the supervisor among
# them), and the renderer and server pull in numpy and aiohttp (~40 MiB of private memory in a
# process that never simulates anything).
_LAZY = {
    "completion_dict": ".render", "render_completion": ".render",
    "SimRequestError": ".request",
    "make_app": ".server", "run_process": ".server", "run_standalone": ".server",
    "start_sim": ".server", "stop_sim": ".server",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "SimConfig",
    "FaultRule",
    "SimRequestError",
    "make_app",
    "start_sim",
    "stop_sim",
    "render_completion",
    "completion_dict",
    "run_process",
    "run_standalone",
]
