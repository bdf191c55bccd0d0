"""Deterministic generation: the token pool, and how each choice of a request reads it.

Every generated token comes from a per-config "pool": one long pseudo-random token
stream (ids, float32 logprobs, top-1 flags and ids) whose JSON pieces are rendered once
and joined. Choice i of a request reads the window pool[a : a + T], where the start ``a``
is drawn from (seed + i, prompt hash); the finish position comes from geometric draws
(EOS, injected stop-token ids), from stop-token ids met in the window, or from stop
strings found in the window's text. Rendering a choice is then a handful of byte-slice
copies, so uncached 32k-token bodies take milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any

import numpy as np

from .config import FaultRule, SimConfig
from .request import _Req
from .vocab import _MASK64, _FakeVocab, _vocab_for
from .wire import _CLAMP

_LN2 = math.log(2.0)


def _prompt_hash(prompt: np.ndarray) -> bytes:
    return hashlib.blake2b(prompt.astype("<i8", copy=False).tobytes(), digest_size=16).digest()


def _f32(a: np.ndarray) -> np.ndarray:
    """Round to float32 like GPU logprobs, back to float64; -0.0 becomes 0.0."""
    return a.astype(np.float32).astype(np.float64) + 0.0


def _streams(entropy: list[int], count: int) -> list[np.random.Generator]:
    ss = np.random.SeedSequence(entropy)
    return [np.random.Generator(np.random.PCG64(s)) for s in ss.spawn(count)]


_R = float.__repr__  # what json.dumps uses for finite floats


def _ints_csv(a: np.ndarray) -> bytes:
    """Comma-separated decimal text of non-negative ints, vectorized (== ",".join(map(str, a)))."""
    n = a.size
    if n == 0:
        return b""
    a = a.astype(np.int64, copy=False)
    width = len(str(int(a.max())))
    pow10 = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    out = np.empty((n, width + 1), dtype=np.uint8)
    out[:, :width] = (a[:, None] // pow10) % 10 + 48
    out[:, width] = 44
    keep = np.ones((n, width + 1), dtype=bool)
    keep[:, : width - 1] = a[:, None] >= pow10[: width - 1]
    return out[keep].tobytes()[:-1]


class _Joined:
    """Elements rendered once, UTF-8 encoded and joined with ``sep``; a run of elements is
    one slice of ``data``."""

    __slots__ = ("data", "off", "seplen")

    def __init__(self, elems: list[str], sep: bytes) -> None:
        eb = [e.encode("utf-8") for e in elems]
        lens = np.fromiter(map(len, eb), dtype=np.int64, count=len(eb)) + len(sep)
        off = np.zeros(len(eb) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        self.off = off.tolist()
        self.data = sep.join(eb) + sep
        self.seplen = len(sep)

    def slice(self, a: int, b: int) -> bytes:
        """Elements ``[a, b)`` joined by the separator (no trailing separator)."""
        if b <= a:
            return b""
        return self.data[self.off[a]:self.off[b] - self.seplen]


class _Pool:
    """The shared token stream of one generation config (see the section comment)."""

    def __init__(self, cfg: SimConfig, vocab: _FakeVocab) -> None:
        N = cfg.pool_starts + cfg.max_model_len
        V, eos = cfg.vocab_size, cfg.eos_token_id
        s = _streams([cfg.vocab_seed & _MASK64, V, eos, 0x706F6F6C], 6)
        ids = s[0].integers(0, V, size=N, dtype=np.int64)
        if eos < V:
            ids[ids == eos] = (eos + 1) % V
        mask_u = s[1].random((N, 2))
        top1 = mask_u[:, 0] < cfg.top1_fraction
        E = s[2].standard_exponential((N, 2))
        lp_top = -(E[:, 0] * 0.25)
        lp_top[mask_u[:, 1] < 0.05] = 0.0
        lp_non = -(_LN2 + E[:, 1] * 1.5)  # p <= 0.5, so p(sampled) + p(top-1) <= 1
        fr = s[3].random((N, 2))
        t1_non = np.where(fr[:, 1] < 0.03, lp_non, lp_non + (-_LN2 - lp_non) * fr[:, 0])  # ties, or in between
        lps = _f32(np.where(top1, lp_top, lp_non))
        t1_lps = np.where(top1, lps, _f32(t1_non))
        t1_draw = s[4].integers(0, V, size=N, dtype=np.int64)
        t1_draw = np.where(t1_draw == ids, (t1_draw + 1) % V, t1_draw)
        if eos < V:
            t1_draw[t1_draw == eos] = (eos + 2) % V
        t1_ids = np.where(top1, ids, t1_draw)
        cc = s[5].random((N, 2))
        ne = len(vocab.empty_ids)
        if cfg.collision_rate > 0 and ne >= 2:
            coll = (~top1) & (cc[:, 1] < cfg.collision_rate)
            first = ids[coll] % ne
            ids[coll] = vocab.empty_ids[first]
            t1_ids[coll] = vocab.empty_ids[(first + 1) % ne]
        if cfg.clamp_rate > 0:
            clamp = cc[:, 0] < cfg.clamp_rate
            lps[clamp] = _CLAMP
            t1_lps = np.where(top1, lps, t1_lps)
        self.ids, self.lps, self.top1, self.t1_ids, self.t1_lps = ids, lps, top1, t1_ids, t1_lps
        cum = np.zeros(N + 1, dtype=np.int64)
        np.cumsum(vocab.lens[ids], out=cum[1:])
        self.cum = cum  # code points before each position
        esc, strs = vocab.esc, vocab.strs
        ids_l, t1_l = ids.tolist(), t1_ids.tolist()
        lp_s = [_R(x) for x in lps.tolist()]
        t1_s = [_R(x) for x in t1_lps.tolist()]
        tok = [esc[i] for i in ids_l]
        top0 = ["{" + e + ":" + lp + "}" for e, lp in zip(tok, lp_s)]
        top1_form = []
        for si, ti, es, lp, tl, single in zip(ids_l, t1_l, tok, lp_s, t1_s, top0):
            if si == ti:
                top1_form.append(single)
            else:
                et = esc[ti]
                if es == et:  # two ids, one string: the later (top-1) value wins
                    top1_form.append("{" + es + ":" + tl + "}")
                else:
                    top1_form.append("{" + es + ":" + lp + "," + et + ":" + tl + "}")
        self.j_ids = _Joined(list(map(str, ids_l)), b",")
        self.j_lps = _Joined(lp_s, b",")
        self.j_tok = _Joined(tok, b",")
        self.j_top0 = _Joined(top0, b",")
        self.j_top1 = _Joined(top1_form, b",")
        self.j_text = _Joined([e[1:-1] for e in tok], b"")  # JSON escaping is per code point
        self.j_raw = _Joined([strs[i] for i in ids_l], b"")
        self.size = N


@functools.lru_cache(maxsize=2)
def _get_pool(key: tuple) -> _Pool:
    cfg = SimConfig(**dict(key))
    return _Pool(cfg, _vocab_for(cfg))


_POOL_KNOBS = ("vocab_size", "eos_token_id", "vocab_seed", "top1_fraction", "clamp_rate", "collision_rate",
               "pool_starts", "max_model_len")


def _pool_for(cfg: SimConfig) -> _Pool:
    return _get_pool(tuple((k, getattr(cfg, k)) for k in _POOL_KNOBS))


@dataclasses.dataclass
class _Choice:
    """One choice: the pool window ``[a, a + T)``, possibly with its last token replaced.

    ``last``: ``(id, logprob)`` written over position ``T - 1`` (EOS or an injected stop
    token id), rendered as a top-1 token. ``text_end``: how many leading tokens have their
    text in ``text`` (EOS and stop-token ids don't). ``text_cut``: when set, ``text`` is the
    first ``text_cut`` UTF-8 bytes of that text (a stop string matched there).
    """

    a: int
    T: int
    text_end: int
    last: tuple[int, float] | None
    finish_reason: str
    stop_reason: int | str | None
    text_cut: int | None = None


def _first_success(u: float, p: float) -> int:
    """0-based index of the first success of a Bernoulli(p) sequence, by inverse CDF."""
    if p >= 1.0:
        return 0
    return int(math.log1p(-u) / math.log1p(-p))


def _plan_choice(req: _Req, cfg: SimConfig, pool: _Pool, phash: bytes, index: int) -> _Choice:
    M = req.max_tokens
    ph = int.from_bytes(phash[:8], "little")
    if req.greedy:
        child = 0
    elif req.seed is None:
        child = (int.from_bytes(phash[8:16], "little") + index) & _MASK64
    else:
        child = (req.seed + index) & _MASK64  # vLLM parallel_sampling: child i gets seed + i
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [child, ph, cfg.vocab_size, cfg.eos_token_id, cfg.vocab_seed & _MASK64, int(req.greedy)])))
    u = rng.random(4).tolist()
    a = min(int(u[0] * cfg.pool_starts), cfg.pool_starts - 1)
    # Candidates (position, precedence, stop_reason, forced id); EOS first at equal positions
    # like vLLM's check_stop.
    cands: list[tuple[int, int, Any, int | None]] = []
    if not req.ignore_eos and cfg.eos_probability > 0:
        cands.append((_first_success(u[1], cfg.eos_probability), 0, None, cfg.eos_token_id))
    if req.stop_token_ids:
        sids = req.stop_token_ids
        if cfg.stop_token_probability > 0:
            sid = sids[min(int(u[3] * len(sids)), len(sids) - 1)]
            cands.append((_first_success(u[2], cfg.stop_token_probability), 1, sid, sid))
        nat = np.flatnonzero(np.isin(pool.ids[a:a + M], np.asarray(sids, dtype=np.int64)))
        if nat.size:
            j = int(nat[0])
            cands.append((j, 2, int(pool.ids[a + j]), None))
    cands = [c for c in cands if c[0] < M]
    if cands:
        j, _, stop_reason, forced = min(cands, key=lambda c: (c[0], c[1]))
        T = j + 1
        last = None if forced is None else (forced, float(pool.lps[a + j]))
        choice = _Choice(a, T, T - 1, last, "stop", stop_reason)
    else:
        choice = _Choice(a, M, M, None, "length", None)
    if req.stop:
        _apply_stop_strings(choice, req.stop, pool)
    return choice


def _apply_stop_strings(c: _Choice, stops: tuple[str, ...], pool: _Pool) -> None:
    """vLLM's detokenizer stop-string check: the earliest-completing match wins; tokens end
    with the one that completed it and ``text`` is cut before the match."""
    raw = pool.j_raw.slice(c.a, c.a + c.text_end)
    best: tuple[int, int, int] | None = None  # (match end, match start, list position)
    for pos, s in enumerate(stops):
        sb = s.encode("utf-8")
        if not sb:
            continue
        p = raw.find(sb)
        if p >= 0 and (best is None or (p + len(sb), p, pos) < best):
            best = (p + len(sb), p, pos)
    if best is None:
        return
    m_end, m_start, pos = best
    base = pool.j_raw.off[c.a]
    ends = np.asarray(pool.j_raw.off[c.a + 1:c.a + c.text_end + 1], dtype=np.int64) - base
    j = int(np.searchsorted(ends, m_end, side="left"))
    c.T = c.text_end = j + 1
    c.last = None
    c.finish_reason, c.stop_reason = "stop", stops[pos]
    c.text_cut = m_start


def _apply_override(c: _Choice, rule: FaultRule) -> None:
    """A ``finish_reason`` fault: keep ``rule.tokens`` tokens (default half)."""
    keep = c.T // 2 if rule.tokens is None else min(rule.tokens, c.T)
    if rule.finish_reason == "stop" and c.T:
        keep = max(keep, 1)
    if keep < c.T:
        c.last = None
        c.text_cut = None
    c.T = keep
    c.text_end = min(c.text_end, keep)
    if rule.finish_reason == "abort":
        c.finish_reason, c.stop_reason = "abort", None
    elif rule.finish_reason == "repetition":
        c.finish_reason, c.stop_reason = "repetition", "repetition_detected"
    else:  # the last kept token completed the stop string: its text is cut
        c.finish_reason, c.stop_reason = "stop", rule.stop_string
        c.text_end = min(c.text_end, max(keep - 1, 0))
        c.text_cut = None


@dataclasses.dataclass
class _PromptLP:
    """prompt_logprobs of one prompt: per position j >= 1, entries in insertion order."""

    entries: list[list[tuple[int, float, int]]]  # (id, logprob, rank)


def _sample_prompt_logprobs(req: _Req, cfg: SimConfig, vocab: _FakeVocab, phash: bytes) -> _PromptLP:
    """Per prompt position: the actual token first, then the top-k in rank order, merged by
    id (vLLM's ``append_logprobs_for_next_position``): k entries when the actual token is
    in the top-k, else k+1."""
    k = req.prompt_logprobs or 0
    P = len(req.prompt)
    V = cfg.vocab_size
    ph = int.from_bytes(phash[:8], "little")
    s = _streams([ph, V, cfg.eos_token_id, cfg.vocab_seed & _MASK64, 0x70726F6D7074], 2)
    u = s[0].random((P, 5))
    width = max(k, 1)
    a = s[1].random((P, width))
    is_top1 = u[:, 0] < cfg.prompt_top1_fraction
    top1_lp = -(-np.log1p(-u[:, 1]) * 0.3)
    ranks = np.where(is_top1, 1, 2 + (-np.log1p(-u[:, 2]) * 30).astype(np.int64))
    clamp = u[:, 3] < cfg.clamp_rate
    ranks = np.where(clamp, V, ranks)  # a -inf token ranks last (vocab size)
    ladder = top1_lp[:, None] - np.concatenate([np.zeros((P, 1)), np.cumsum(0.2 + 2.5 * a[:, 1:], axis=1)], axis=1)
    ladder = _f32(ladder)
    below = _f32(ladder[:, -1] - 0.05 - 3.0 * u[:, 4])
    steps = 1 + (a * 4999).astype(np.int64)
    alt = (req.prompt[:, None] + np.cumsum(steps, axis=1)) % V
    lad, alt_l, below_l, rk, cl = ladder.tolist(), alt.tolist(), below.tolist(), ranks.tolist(), clamp.tolist()
    pl = req.prompt_list
    entries: list[list[tuple[int, float, int]]] = []
    for j in range(1, P):
        actual, r = pl[j], rk[j]
        if cl[j]:
            a_lp = _CLAMP
        elif r <= k or r == 1:
            a_lp = lad[j][r - 1]
        else:
            a_lp = below_l[j]
        d: dict[int, tuple[float, int]] = {actual: (a_lp, r)}
        ai = 0
        row_l, row_a = lad[j], alt_l[j]
        for rank in range(1, k + 1):
            if rank == r:
                d[actual] = (a_lp, rank)
            else:
                d[row_a[ai]] = (row_l[rank - 1], rank)
                ai += 1
        entries.append([(tid, v[0], v[1]) for tid, v in d.items()])
    return _PromptLP(entries)


def _prompt_positions(rule: FaultRule | None, req: _Req, choices: list[_Choice]) -> int:
    """Number of ``prompt_logprobs`` list elements (including the leading null): the whole
    prompt, or fewer for an abort (the list grows per prefill chunk)."""
    P = len(req.prompt)
    if rule is None or rule.finish_reason != "abort":
        return P
    if rule.prompt_positions is not None:
        return max(1, min(rule.prompt_positions, P))
    if all(c.T == 0 for c in choices):
        return max(1, P // 2)
    return P


@dataclasses.dataclass
class _Generated:
    req: _Req
    pool: _Pool
    phash: bytes
    choices: list[_Choice]
    prompt_positions: int
    vocab_size: int


def _generate(req: _Req, cfg: SimConfig, override: FaultRule | None) -> _Generated:
    pool = _pool_for(cfg)
    phash = _prompt_hash(req.prompt)
    choices = [_plan_choice(req, cfg, pool, phash, i) for i in range(req.n)]
    if override is not None:
        for c in choices:
            _apply_override(c, override)
    return _Generated(req, pool, phash, choices, _prompt_positions(override, req, choices), cfg.vocab_size)
