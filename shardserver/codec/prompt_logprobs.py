"""Choice 0's ``prompt_logprobs`` -> the ``SampleResponse`` prompt arrays (numpy).

vLLM 0.30 sends prompt logprobs as one row per prompt position
(``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionResponseChoice.prompt_logprobs``,
``list[dict[int, Logprob] | None]``; spec ``shared/spec/vllm_completions.md`` §2.5)::

    [null, {"<id>": {"logprob": <float>, "rank": <int>, "decoded_token": "<str>"}, ...}, ...]

Row ``i`` holds the prompt token's own entry (keyed by ``prompt_token_ids[i]``) and the
top-k entries, position 0 is ``null``. :mod:`shardserver.codec.decode` validates the
array's length and dispatches: the byte-level fast path
(:func:`shardserver.codec.prompt_scan.scan_prompt_logprobs`) or, for anything but vLLM's
exact compact layout, :func:`decode_prompt_rows` here, the generic path and the reference
the fast path is tested against. Both paths reduce to the same flat entries (position,
id, logprob in document order), which :func:`fill_own` and :func:`fill_topk` write into
the ``DecodedCompletion`` arrays: float32 ``(P,)`` own logprobs, int32 / float32
``(P, k)`` top-k matrices ranked by logprob.
"""

from __future__ import annotations

import gc
import itertools
import operator

import numpy as np

from shardserver.codec.json_types import INT32_MAX, NUMBER, type_name
from shardserver.errors import EngineBodyError

__all__ = ["decode_prompt_rows", "fill_own", "fill_topk"]

_get_logprob = operator.itemgetter("logprob")
_POW10 = 10 ** np.arange(10, dtype=np.int64)


def decode_prompt_rows(
    pl,
    pids: np.ndarray,
    L: int,
    k: int,
    where: str,
    plp: np.ndarray,
    t_ids: np.ndarray,
    t_lps: np.ndarray,
) -> None:
    """The generic path: materialize ``pl`` with ``as_list()`` once and reduce it with numpy.

    Args:
        pl: choice 0's ``prompt_logprobs`` (``simdjson.Array``), ``L`` rows, ``1 <= L <= P``.
        pids: the prompt token ids (integer array, shape ``(P,)``); row ``i`` must hold
            ``str(pids[i])``.
        L: ``len(pl)``.
        k: top-k requested (0: only the own logprobs are filled).
        where: JSON path of ``pl`` for errors, e.g. ``"choices[0].prompt_logprobs"``.
        plp: float32 ``(P,)``, NaN-filled; receives the own logprob of every non-null row.
        t_ids, t_lps: int32 / float32 ``(P, k)``, mask-filled; receive the top-k entries.

    Raises:
        EngineBodyError: a row that is not an object or null, a row without the prompt
            token's entry, an entry that is not ``{logprob: number, ...}``, a key that is not
            a token id (decimal int in ``[0, 2^31)``), a logprob beyond float32 range.
    """
    rows = _as_list(pl)
    keys = list(map(str, pids[:L].tolist()))
    nonnull, nrows, own_lp = _own_entries(rows, keys, where)
    if not nonnull:
        return
    nn = np.asarray(nonnull, dtype=np.intp)
    fill_own(plp, nn, np.asarray(own_lp, dtype=np.float64), where)
    if k == 0:
        return
    counts, ids64, lp64 = _flat_entries(rows, keys, nrows, where)
    fill_topk(t_ids, t_lps, nn, counts, ids64, lp64, k, where)


def _as_list(pl) -> list:
    """``pl.as_list()`` with the cyclic GC paused.

    ~8 Python objects per entry (k=5: ~25k dicts for a 4k prompt); the cyclic GC would run
    dozens of collections over them, none of which can free anything.
    """
    gc_on = gc.isenabled()
    gc.disable()
    try:
        return pl.as_list()
    finally:
        if gc_on:
            gc.enable()


def _own_entries(rows: list, keys: list[str], where: str) -> tuple[list[int], list[dict], list]:
    """Non-null row indexes, those rows, and each one's own logprob (looked up by ``keys[i]``)."""
    try:
        nonnull = [i for i, r in enumerate(rows) if r is not None]
        nrows = [rows[i] for i in nonnull]
        own = [r[keys[i]] for r, i in zip(nrows, nonnull)]
        own_lp = list(map(_get_logprob, own))
        if not set(map(type, own_lp)) <= {float, int}:
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        _diagnose_prompt_rows(rows, keys, where)
        raise EngineBodyError(where, "malformed prompt logprobs") from None  # pragma: no cover
    return nonnull, nrows, own_lp


def _flat_entries(
    rows: list, keys: list[str], nrows: list[dict], where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries per non-null row (intp), and every entry's id (int64) and logprob (float64) in document order."""
    counts = np.fromiter(map(len, nrows), dtype=np.intp, count=len(nrows))
    flat_keys = list(itertools.chain.from_iterable(nrows))
    try:
        flat_lp = list(map(_get_logprob, itertools.chain.from_iterable(map(dict.values, nrows))))
        if not set(map(type, flat_lp)) <= {float, int}:
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        _diagnose_prompt_rows(rows, keys, where)
        raise EngineBodyError(where, "malformed prompt logprobs") from None  # pragma: no cover
    ids64 = _parse_decimal_keys(flat_keys)
    if ids64 is None:
        _diagnose_prompt_keys(rows, where)
    if ids64.size and int(ids64.max()) > INT32_MAX:
        _diagnose_prompt_keys(rows, where)
    lp64 = np.fromiter(flat_lp, dtype=np.float64, count=len(flat_lp))
    return counts, ids64, lp64


def fill_own(plp: np.ndarray, nn: np.ndarray, own64: np.ndarray, where: str) -> None:
    """``plp[nn] = own64`` (float64 -> float32) after checking every value fits float32.

    Raises:
        EngineBodyError: at ``{where}[row]`` for the first logprob beyond float32 range.
    """
    _check_finite(own64, nn, where)
    plp[nn] = own64


def fill_topk(
    t_ids: np.ndarray,
    t_lps: np.ndarray,
    nn: np.ndarray,
    counts: np.ndarray,
    ids64: np.ndarray,
    lp64: np.ndarray,
    k: int,
    where: str,
) -> None:
    """Top-k matrices from the flat entries (document order) of the non-null rows ``nn``.

    Args:
        t_ids, t_lps: int32 / float32 ``(P, k)``; row ``nn[r]`` receives the ``k`` entries of
            non-null row ``r`` with the highest logprob (ties keep document order).
        nn: intp, the non-null row indexes; ``counts`` (intp, same length): entries per row.
        ids64, lp64: int64 ids / float64 logprobs of all entries, ``counts.sum()`` each.

    Raises:
        EngineBodyError: at ``{where}[row]`` for the first logprob beyond float32 range.
    """
    row = np.repeat(nn, counts)
    _check_finite(lp64, row, where)
    starts = np.cumsum(counts) - counts
    col = np.arange(lp64.size) - np.repeat(starts, counts)  # position of each entry in its row
    rank = _rank_in_rows(lp64, col, counts, row, starts)
    keep = rank < k
    t_ids[row[keep], rank[keep]] = ids64[keep]
    t_lps[row[keep], rank[keep]] = lp64[keep]


def _parse_decimal_keys(keys: list[str]) -> np.ndarray | None:
    """Token-id keys (decimal strings) -> int64, vectorized; None if any key is not 1-10 ASCII digits."""
    if not keys:
        return np.zeros(0, dtype=np.int64)
    joined = "".join(keys)
    if not (joined.isascii() and joined.isdigit()):  # one C pass over every key
        return None
    lens = np.fromiter(map(len, keys), dtype=np.intp, count=len(keys))
    if int(lens.min()) == 0 or int(lens.max()) > 10:
        return None
    digits = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).astype(np.int64) - 48
    ends = np.cumsum(lens)
    power = np.repeat(ends, lens) - np.arange(digits.size) - 1  # digit's place value exponent
    return np.add.reduceat(digits * _POW10[power], ends - lens)


def _rank_in_rows(lp: np.ndarray, col: np.ndarray, counts: np.ndarray, row: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Rank of each entry within its row when the row is sorted by logprob, descending, stable.

    rank(i) = #{j in row: lp[j] > lp[i]} + #{j in row, j before i: lp[j] == lp[i]}. vLLM rows
    are short (k or k+1 entries), so this is computed on a padded (rows, width) matrix with
    pairwise comparisons; very wide rows fall back to two stable argsorts.
    """
    width = int(counts.max())
    if width * width * counts.size > 8_000_000:
        order = np.argsort(-lp, kind="stable")
        order = order[np.argsort(row[order], kind="stable")]
        rank = np.empty(lp.size, dtype=np.intp)
        rank[order] = np.arange(lp.size) - np.repeat(starts, counts)
        return rank
    r = np.repeat(np.arange(counts.size), counts)
    m = np.full((counts.size, width), -np.inf)
    m[r, col] = lp  # padding stays -inf: never > or == a finite logprob
    mj = m[:, None, :]  # [row, i, j] -> m[row, j]
    mi = m[:, :, None]  # [row, i, j] -> m[row, i]
    before = np.tri(width, width, -1, dtype=bool)  # [i, j] = j < i
    return np.count_nonzero((mj > mi) | ((mj == mi) & before), axis=2)[r, col]


def _check_finite(lp64: np.ndarray, rowidx: np.ndarray, where: str) -> None:
    with np.errstate(over="ignore"):
        f = lp64.astype(np.float32)
    if not np.isfinite(f).all():
        j = int(np.flatnonzero(~np.isfinite(f))[0])
        raise EngineBodyError(
            f"{where}[{int(rowidx[j])}]", f"non-finite logprob {float(lp64[j])!r} (beyond float32 range)"
        )


def _diagnose_prompt_rows(rows: list, keys: list[str], where: str) -> None:
    for i, r in enumerate(rows):
        if r is None:
            continue
        w = f"{where}[{i}]"
        if not isinstance(r, dict):
            raise EngineBodyError(w, f"expected an object or null, got {type_name(r)}")
        if keys[i] not in r:
            raise EngineBodyError(w, f"no entry for the prompt token {keys[i]} at this position")
        for key, e in r.items():
            we = f'{w}["{key}"]'
            if not isinstance(e, dict):
                raise EngineBodyError(we, f"expected an object {{logprob, rank, decoded_token}}, got {type_name(e)}")
            if "logprob" not in e or e["logprob"] is None:
                raise EngineBodyError(f"{we}.logprob", "missing or null")
            if type(e["logprob"]) not in NUMBER:
                raise EngineBodyError(f"{we}.logprob", f"expected a number, got {type_name(e['logprob'])}")


def _diagnose_prompt_keys(rows: list, where: str) -> None:
    for i, r in enumerate(rows):
        if r is None:
            continue
        for key in r:
            if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > INT32_MAX:
                raise EngineBodyError(f"{where}[{i}]", f"key {key!r} is not a token id (decimal int in [0, 2^31))")
    raise EngineBodyError(where, "malformed token id keys")  # pragma: no cover
