"""Byte-level fast path for choice 0's ``prompt_logprobs`` (no Python object per entry).

The generic path (``prompt_logprobs.decode_prompt_rows``) materializes every
``{"<id>": {"logprob": f, "rank": r, "decoded_token": s}}`` entry with simdjson's
``as_list()``; at k=5 on a 4k prompt that is ~25k dicts and dominates the decode. This
module reads the same values straight from the raw body bytes with numpy, *after*
simdjson has parsed, and therefore validated, the whole body. It returns ``None``
(the caller then runs the generic path, which stays the reference and raises every
error) unless the array has exactly the layout vLLM emits (spec §2.1, §2.5)::

    [null,{"<id>":{"logprob":<float>,"rank":<int>,"decoded_token":"<str>"},...},...]

i.e. compact (no whitespace), keys in ``Logprob`` declaration order, only position 0
``null``, as many positions as prompt tokens (an aborted, shorter list falls back), ids
as canonical decimal strings of 1-8 digits, ranks 1-8 digits, logprobs JSON numbers,
every ``decoded_token`` a string, no duplicate id within a position, and the prompt
token's own id present exactly once per position.

Why reading bytes is safe
-------------------------
The body is valid JSON (simdjson accepted it), and in valid JSON:

* A backslash only occurs inside a string, and a ``"`` inside a string's content is
  always escaped. So a ``"`` byte preceded by an odd run of backslashes is escaped
  content, and every other ``"`` byte is *structural*: it opens or closes a string.
  ``structural_quotes`` computes exactly that set over the array's bytes.
* A byte pattern that contains a ``"`` at a position other than the first, preceded
  by a byte other than ``\\`` (``"prompt_logprobs":[``, ``],"prompt_token_ids":``,
  ``":{"logprob":``, ``,"rank":``, ``,"decoded_token":``), can only match where that
  quote is structural; the bytes around a structural quote then fix whether it opens
  or closes (an opening quote cannot be followed by ``:``/``,``, a closing quote
  cannot be followed by a letter or digit). So these patterns never match inside a
  ``decoded_token`` string, whatever text it holds (``":{"logprob":``, ``},{"``,
  ``[null,`` ...). Quote-free patterns such as ``,null`` *can* occur inside strings and
  are never searched for.
* Between two consecutive structural quotes where the first one opens a string lies
  exactly that string's content.

Validation then accounts for *every byte* of the array: per entry the structural
quotes come in tens (key, ``logprob``, ``rank``, ``decoded_token``, value); each fixed
piece (``":{"logprob":``, ``,"rank":``, ``,"decoded_token":``, ``}``, ``},{``, the final
``}}]``) is compared byte for byte at the position the quotes imply; the id is 1-8
digits without a leading zero (``"07"`` is not ``str(7)``), the rank 1-8 digits, the
logprob slot starts with ``-`` or a digit and ends with a digit (so, in valid JSON, it
is exactly one number with no whitespace; the gathered numbers must also parse as
exactly one float each); the only bytes not checked are string contents, and those
hold no structural quote by construction. If all of that holds, the bytes *are* that
array, so the extracted (position, id, logprob) triples are what ``as_list()`` would
have produced, in the same order, and floats are parsed by the same simdjson number
parser (an integer spelling such as ``-3`` or ``-0`` becomes the same double either
way). As a last guard the result is cross-checked against the parsed document (array
length, and every entry of the first and last position).

Locating the array: the first ``"prompt_logprobs":[`` in the body (preceded by ``,`` or
``{``, so it is a real key), which is choice 0's when choice 0 is the first choice and
the body has the 0.30/0.11 layout (top-level ``choices`` before any other nested
field, ``prompt_logprobs`` right before ``prompt_token_ids``); the caller only uses this
path when choice 0 is ``choices[0]``, the top-level object has one ``choices`` key and
choice 0 one ``prompt_logprobs`` key. That the match really is a key of ``choices[0]``
(and not of some earlier object: an unknown top-level field, or a field nested in choice
0's ``logprobs``) is proven from the bytes before it (``_check_owner``): outside strings
(structural quotes as above), the bracket depth there is 3, and the innermost open
object is the first element of the top-level ``"choices":[``. The cross-check above is a
last guard on top. The end is the first ``],"prompt_token_ids":[`` after it (the bytes
up to that marker are then validated as above, so a shorter or longer span cannot pass).
"""

from __future__ import annotations

import threading

import numpy as np
import simdjson

__all__ = ["scan_prompt_logprobs", "stats"]

#: Counters for tests and diagnostics: how often the fast path was taken or fell back,
#: and the reason of the last fallback.
stats: dict[str, object] = {"fast": 0, "fallback": 0, "last_reason": None}

_INT32_MAX = 2**31 - 1

_START = b'"prompt_logprobs":['
_END = b'],"prompt_token_ids":['
_HEAD = np.frombuffer(b'[null,{"', dtype=np.uint8)


def _word(p: bytes) -> np.uint64:
    return np.frombuffer(p, dtype="<u8")[0]


# ``":{"logprob":`` (13 bytes): the word at +0 and the low 5 bytes of the word at +8.
_KEY_TAIL = b'":{"logprob":'
_KT0, _KT8 = _word(_KEY_TAIL[0:8]), _word(_KEY_TAIL[8:13] + b"\0\0\0")
_MASK5 = np.uint64((1 << 40) - 1)
# ``,"rank":`` (8 bytes): one word.
_RANK = _word(b',"rank":')
# ``,"decoded_token":`` (17 bytes): words at +0 and +8, and the low byte of the word at +16.
_DT = b',"decoded_token":'
_DT0, _DT8, _DT16 = _word(_DT[0:8]), _word(_DT[8:16]), np.uint64(_DT[16])

_SEP3 = np.uint64(int.from_bytes(b"},", "little"))
_SEP5 = np.uint64(int.from_bytes(b"}},{", "little"))
_TAIL = np.frombuffer(b"}}]", dtype=np.uint8)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_SPACES = np.uint64(0x2020202020202020)
_EIGHTS = np.arange(0, 32, 8, dtype=np.intp)
_MASK2, _MASK4 = np.uint64(0xFFFF), np.uint64(0xFFFFFFFF)

_QUOTE, _BSLASH = 34, 92

# Bracket bytes and their depth change: '[' '{' open, ']' '}' close.
_DEPTH_STEP = np.zeros(256, dtype=np.int32)
_DEPTH_STEP[[0x5B, 0x7B]] = 1
_DEPTH_STEP[[0x5D, 0x7D]] = -1
_CHOICES_KEY = b'"choices":['

_local = threading.local()


def _parser() -> simdjson.Parser:
    p = getattr(_local, "parser", None)
    if p is None:
        p = _local.parser = simdjson.Parser()
    return p


class _Fallback(Exception):
    pass


def _fail(reason: str) -> None:
    raise _Fallback(reason)


def scan_prompt_logprobs(body: bytes, pl, pids: np.ndarray, L: int):
    """Extract choice 0's prompt logprobs from ``body``'s bytes, or ``None`` to fall back.

    Args:
        body: the whole response body, already parsed successfully by simdjson.
        pl: the parsed ``prompt_logprobs`` array of the choice with index 0 (``simdjson.Array``),
            which must be ``choices[0]``.
        pids: the prompt token ids (integer array; the fast path needs ``len == L``).
        L: ``len(pl)``, at least 2.

    Returns:
        ``(nn, own64, counts, ids64, lp64)`` exactly as the generic path builds them:
        ``nn`` = non-null positions (here ``1..L-1``), ``own64`` = the prompt token's own
        logprob per such position (float64), ``counts`` = entries per position, and the
        flat ids (int64) and logprobs (float64) of all entries in document order.
        ``None`` if the bytes are not in the exact layout (see the module docstring).
    """
    try:
        res = _scan(body, pl, pids, L)
    except _Fallback as e:
        stats["fallback"] += 1
        stats["last_reason"] = str(e)
        return None
    except (IndexError, ValueError, TypeError, KeyError, RuntimeError, OverflowError) as e:
        stats["fallback"] += 1
        stats["last_reason"] = f"{type(e).__name__}: {e}"
        return None
    stats["fast"] += 1
    return res


def structural_quotes(R: np.ndarray) -> np.ndarray:
    """Indices of the unescaped ``"`` bytes in ``R`` (a valid JSON text or a slice starting outside strings).

    A quote is escaped iff it is preceded by an odd number of consecutive backslashes.
    """
    q = np.flatnonzero(R == _QUOTE)
    cand = np.flatnonzero(R[q - 1] == _BSLASH)  # q >= 1 here: R[0] is '[' (or the body's '{', BOM, whitespace)
    if cand.size:
        pos = q[cand]
        run = np.ones(cand.size, dtype=np.intp)
        active = np.ones(cand.size, dtype=bool)
        j = 2
        while True:
            idx = pos - j
            ok = idx >= 0
            active &= ok
            active[ok] &= R[idx[ok]] == _BSLASH
            if not active.any():
                break
            run += active
            j += 1
        q = np.delete(q, cand[(run & 1) == 1])
    return q


def _scan(body: bytes, pl, pids: np.ndarray, L: int):
    """:func:`scan_prompt_logprobs` without the fallback accounting; raises on any deviation.

    Each step below checks one part of the layout (module docstring) and falls back with its
    own reason; the order of the steps is the order of the checks, so a body that breaks
    several rules always reports the same reason.
    """
    if not np.issubdtype(pids.dtype, np.integer):
        _fail("prompt ids are not an integer array")
    if L != pids.size:
        _fail("prompt_logprobs shorter than the prompt (aborted request)")
    s, R = _array_bytes(body)
    W, W4 = _word_views(body, s, R.size)
    Q = _entry_quotes(R)
    E = Q.shape[0]
    c0, c1, c4, c6, c9 = Q[:, 0], Q[:, 1], Q[:, 4], Q[:, 6], Q[:, 9]
    _check_fixed_pieces(W, W4, c1, c4, c6)
    g3 = _entry_gaps(W, R, c0, c9)
    pos, starts, counts = _positions(g3, E, L)

    ids64 = _ids(W, c0 + 1, c1 - c0 - 1)
    # The rank's value is not used (nor by the generic path), but the slot must hold 1-8 digits.
    _digits_word(W, c4 + 7, c6 - 1 - (c4 + 7), "rank")
    lp64 = _floats(W, W4, c1 + 13, c4 - (c1 + 13), E)

    own = _own_mask(ids64, pids, pos, L)
    _check_unique_ids(ids64, pos, starts, counts, E)
    own64 = lp64[own]

    _cross_check(pl, pids, L, starts, counts, ids64, lp64)
    nn = np.arange(1, L, dtype=np.intp)
    return nn, own64, counts.astype(np.intp), ids64, lp64


def _array_bytes(body: bytes) -> tuple[int, np.ndarray]:
    """Offset in ``body`` and bytes (uint8 view, no copy) of choice 0's array, from its ``[`` to its ``]``."""
    j = body.find(_START)
    if j <= 0 or body[j - 1] not in b",{":
        _fail("no prompt_logprobs key")
    _check_owner(body, j)
    s = j + len(_START) - 1  # the '['
    e = _find_end(body, s)
    N = e + 1 - s
    if N < 64:
        _fail("array too short")
    R = np.frombuffer(body, dtype=np.uint8, count=N, offset=s)
    if not np.array_equal(R[:8], _HEAD):
        _fail('array does not start with [null,{"')
    return s, R


def _word_views(body: bytes, s: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Unaligned little-endian uint64 views (no copy) of the ``N``-byte array at ``body[s:]``.

    ``W[i]`` is the word at byte ``i`` of the array, shape ``(N + 14,)``; ``W4[i]`` the four
    consecutive words at byte ``i`` (bytes ``i .. i+31``), shape ``(N - 10, 4)``. They may read
    up to 21 bytes past the array, into the ``,"prompt_token_ids":[`` that ``_find_end`` found
    there; those bytes are always masked off or compared as part of a longer pattern.
    """
    X = N + len(_END) - 1
    W = np.ndarray((X - 7,), dtype="<u8", buffer=body, offset=s, strides=(1,))
    W4 = np.ndarray((X - 31, 4), dtype="<u8", buffer=body, offset=s, strides=(1, 8))
    return W, W4


def _entry_quotes(R: np.ndarray) -> np.ndarray:
    """The structural quotes of ``R``, one row of 10 per entry (intp, shape ``(E, 10)``), placed as the layout says.

    Quote offsets within an entry: key ``c0..c1``, ``"logprob"`` at ``c1+3..c1+11``, ``"rank"``
    at ``c4..c4+5``, ``"decoded_token"`` at ``c6..c6+14``, the value string opens at ``c6+16``
    and closes at ``c9``; the first key opens at byte 7 (after ``[null,{``), the last value
    closes 3 bytes before the end (``}}]``).
    """
    N = R.size
    sq = structural_quotes(R)
    if sq.size % 10:
        _fail("structural quote count is not 10 per entry")
    Q = sq.reshape(sq.size // 10, 10)
    c1, c4, c6 = Q[:, 1], Q[:, 4], Q[:, 6]
    if Q[0, 0] != 7:
        _fail("first entry misplaced")
    if not (
        (Q[:, 2] - c1 == 3).all()
        and (Q[:, 3] - c1 == 11).all()
        and (Q[:, 5] - c4 == 5).all()
        and (Q[:, 7] - c6 == 14).all()
        and (Q[:, 8] - c6 == 16).all()
    ):
        _fail("quotes not where the layout puts them")
    if int(Q[-1, 9]) + 3 != N - 1:
        _fail("array does not end right after the last entry")
    return Q


def _check_fixed_pieces(W: np.ndarray, W4: np.ndarray, c1: np.ndarray, c4: np.ndarray, c6: np.ndarray) -> None:
    """The fixed pieces between the quotes, byte for byte (as 8-byte words; W4 rows are 4 consecutive words)."""
    kt = W4[c1, :2]  # '":{"logprob":' + 3 bytes of the number
    dt = W4[c6 - 1, :3]  # ',"decoded_token":' + 7 bytes of the value
    if not (
        (kt[:, 0] == _KT0).all()
        and ((kt[:, 1] & _MASK5) == _KT8).all()
        and (W[c4 - 1] == _RANK).all()
        and (dt[:, 0] == _DT0).all()
        and (dt[:, 1] == _DT8).all()
        and ((dt[:, 2] & np.uint64(0xFF)) == _DT16).all()
    ):
        _fail("unexpected keys or key order")


def _entry_gaps(W: np.ndarray, R: np.ndarray, c0: np.ndarray, c9: np.ndarray) -> np.ndarray:
    """The bytes between entries; returns, per entry after the first, whether it continues the same position (bool).

    After each value string: ``}`` closes the entry, then ``,`` + the next entry of the same
    position (gap 3), or ``},{`` + the first entry of the next position (gap 5); the last
    entry is followed by ``}}]``, the end of the array.
    """
    gap = c0[1:] - c9[:-1]
    g3 = gap == 3
    if not (g3 | (gap == 5)).all():
        _fail("unexpected bytes between entries (null row, whitespace, extra keys?)")
    # Little-endian 32-bit words at c9+1: '},' + 2 bytes of the next key (masked off) for
    # gap 3, '}},{' for gap 5.
    w4 = W[c9[:-1] + 1]
    if not ((w4 & np.where(g3, _MASK2, _MASK4)) == np.where(g3, _SEP3, _SEP5)).all():
        _fail("bad separator between entries")
    if not np.array_equal(R[R.size - 3 :], _TAIL):
        _fail("array does not end with }}]")
    return g3


def _positions(g3: np.ndarray, E: int, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per entry its position ``1..L-1`` (intp, ``(E,)``); per position its first entry and entry count (``(L-1,)``).

    The first entry and every entry after a ``},{`` open a new position; there must be
    exactly ``L - 1`` (only position 0 is ``null``).
    """
    newpos = np.empty(E, dtype=bool)
    newpos[0] = True
    np.logical_not(g3, out=newpos[1:])
    starts = np.flatnonzero(newpos)
    if starts.size != L - 1:
        _fail(f"{starts.size} non-null positions for an array of {L} (null or empty rows?)")
    pos = np.cumsum(newpos)  # 1..L-1
    counts = np.diff(starts, append=E)
    return pos, starts, counts


def _own_mask(ids64: np.ndarray, pids: np.ndarray, pos: np.ndarray, L: int) -> np.ndarray:
    """Mask (bool, ``(E,)``) of the prompt token's own entry per position, found by id (never by place in the row).

    Exactly one per position, else fall back.
    """
    own = ids64 == pids[pos].astype(np.int64)
    hits = np.bincount(pos[own], minlength=L)
    if hits[0] != 0 or not (hits[1:] == 1).all():
        _fail("prompt token missing from a position")
    return own


def _check_owner(body: bytes, j: int) -> None:
    """Fall back unless the key at ``j`` is a key of the top-level ``choices`` array's first object.

    ``body[:j]`` ends outside any string (``body[j]`` is a structural quote). Over it, the
    brackets outside strings must leave depth 3 (top-level object, ``choices`` array, choice
    object), and the innermost object still open must be the first element of the array
    opened right after the top-level key ``"choices":`` (compact ``"choices":[{``).
    """
    B = np.frombuffer(body, dtype=np.uint8, count=j)
    if B[0] == _QUOTE:
        _fail("body starts with a string")  # not an object; structural_quotes needs B[0] != '"'
    sq = structural_quotes(B)
    if sq.size % 2:
        _fail("key inside a string?")  # cannot happen in valid JSON
    low = B | np.uint8(0x20)  # '[' -> '{', ']' -> '}'
    br = np.flatnonzero((low == 0x7B) | (low == 0x7D))
    br = br[(np.searchsorted(sq, br) & 1) == 0]  # an odd number of quotes before: inside a string
    step = _DEPTH_STEP[B[br]]
    depth = np.cumsum(step)
    if depth.size < 3 or depth[-1] != 3:
        _fail("prompt_logprobs key not at choice depth")
    # The innermost open object: the last bracket that opened depth 3 (depth never fell below
    # 3 after it, else a later one would have reopened it).
    o_i = int(np.flatnonzero((step == 1) & (depth == 3))[-1])
    o = int(br[o_i])
    if not (
        B[o] == 0x7B
        and o_i >= 1
        and int(br[o_i - 1]) == o - 1
        and depth[o_i - 1] == 2  # the '[' at o-1 opened depth 2: a value of the top-level object
        and body[max(o - len(_CHOICES_KEY), 0) : o] == _CHOICES_KEY
    ):
        _fail("prompt_logprobs key is not in choices[0]")
    # The '"' opening "choices" must be structural (then the 8 bytes are the key "choices").
    kq = o - len(_CHOICES_KEY)
    i = int(np.searchsorted(sq, kq))
    if i >= sq.size or int(sq[i]) != kq:
        _fail("choices key is not structural")


def _find_end(body: bytes, s: int) -> int:
    """Index of the ``]`` of the first ``],"prompt_token_ids":`` after ``s``.

    Tries the next few ``]`` bytes first (a memchr each; in vLLM's layout the first ``]``
    after the array's start is usually its end, unless a decoded_token contains one), then
    a full substring search.
    """
    e = s
    for _ in range(16):
        e = body.find(b"]", e + 1)
        if e < 0:
            _fail("prompt_logprobs not followed by prompt_token_ids")
        if body.startswith(_END, e):
            return e
    e = body.find(_END, e)
    if e < 0:
        _fail("prompt_logprobs not followed by prompt_token_ids")
    return e


def _digits_word(W: np.ndarray, start: np.ndarray, length: np.ndarray, what: str):
    """Check that each ``length`` (1-8) bytes at ``start`` are ASCII digits; returns (first word, right-aligned word)."""
    if int(length.min()) < 1 or int(length.max()) > 8:
        _fail(f"{what} is not 1-8 digits")
    # Right-align the digits in the word (little-endian: the first digit is the low byte, so a
    # left shift by the unused byte count moves it up and fills the low bytes with zeros).
    w0 = W[start]
    w = w0 << (np.uint64(8) * (np.uint64(8) - length.astype(np.uint64)))
    b = w.view(np.uint8).reshape(-1, 8)
    if not (((b - np.uint8(48)) <= 9) | (b == 0)).all():  # a NUL byte is never in valid JSON text
        _fail(f"{what} is not decimal digits")
    return w0, w


def _ids(W: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Id keys (1-8 ASCII digits at ``start``, no leading zero) -> int64, SWAR-style on 8-byte words."""
    w0, w = _digits_word(W, start, length, "id")
    if (((w0 & np.uint64(0xFF)) == 48) & (length > 1)).any():  # the low byte is the first digit
        _fail("id has a leading zero")  # "07" is not str(7): the generic lookup would miss it
    # simdjson's parse_eight_digits_unrolled; the zero bytes act as leading '0' digits.
    v = w & np.uint64(0x0F0F0F0F0F0F0F0F)
    v = (v * np.uint64(2561)) >> np.uint64(8)
    v = ((v & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
    v = ((v & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
    return v.astype(np.int64)


def _floats(W: np.ndarray, W4: np.ndarray, start: np.ndarray, length: np.ndarray, E: int) -> np.ndarray:
    """Logprob texts (``length`` includes the ',' of ',"rank":') -> float64, parsed by simdjson.

    The texts are copied into a ``[t1,  t2,   ...]`` buffer of fixed 32-byte rows (four
    8-byte words each; the rest of a row blanked with spaces, which JSON ignores).
    """
    if int(length.min()) < 2 or int(length.max()) > 32:
        _fail("logprob text empty or too long")
    words = W4[start]  # (E, 4): the 32 bytes from each start
    # A JSON number starts with '-' or a digit and ends with a digit: no whitespace around it.
    first = words[:, 0] & np.uint64(0xFF)
    if not (((first - np.uint64(48)) <= 9) | (first == 45)).all():
        _fail("logprob text does not start like a number")
    last = W[start + length - 2] & np.uint64(0xFF)
    if not ((last - np.uint64(48)) <= 9).all():
        _fail("logprob text does not end with a digit")
    # Mask of the text's bytes in each word: all-ones >> (64 - 8 * valid bytes); a shift by
    # 64 or more gives 0 in numpy.
    valid = np.clip(length[:, None] - _EIGHTS, 0, 8).astype(np.uint64)
    keep = _ALL >> (np.uint64(64) - np.uint64(8) * valid)
    words &= keep
    words |= _SPACES & ~keep
    rows = words.view(np.uint8).reshape(E, 32)
    rows[E - 1, int(length[-1]) - 1] = 32  # the last text's trailing comma
    buf = b"[" + rows.tobytes() + b"]"
    if buf.find(b"[", 1) >= 0:  # a nested array would be flattened by as_buffer
        _fail("logprob is not a number")
    return _parse_floats(buf, E)


def _parse_floats(buf: bytes, E: int) -> np.ndarray:
    p = _parser()
    try:
        doc = p.parse(buf)
    except RuntimeError:  # a proxy of an earlier parse is still alive: use a fresh parser
        p = _local.parser = simdjson.Parser()
        doc = p.parse(buf)
    try:
        lp = np.frombuffer(doc.as_buffer(of_type="d"), dtype=np.float64)
    finally:
        del doc
    if lp.size != E:
        _fail("not exactly one number per logprob")
    return lp


def _check_unique_ids(ids64: np.ndarray, pos: np.ndarray, starts: np.ndarray, counts: np.ndarray, E: int) -> None:
    """Fall back if an id repeats within a position (a dict would keep only one of them)."""
    w = int(counts.max())
    if w == 1:
        return
    npos = counts.size
    if w * w * npos <= 4_000_000:
        col = np.arange(E) - np.repeat(starts, counts)
        m = np.full((npos, w), -1, dtype=np.int64)
        m[pos - 1, col] = ids64
        eq = m[:, :, None] == m[:, None, :]
        eq &= (m >= 0)[:, :, None]
        eq[:, np.arange(w), np.arange(w)] = False
        if eq.any():
            _fail("duplicate id within a position")
    else:
        key = np.sort(pos.astype(np.int64) * (1 << 32) + ids64)
        if (key[1:] == key[:-1]).any():
            _fail("duplicate id within a position")


def _cross_check(pl, pids, L, starts, counts, ids64, lp64) -> None:
    """Compare the first and last rows with the parsed document (guards against a foreign match).

    Kept to two rows: reaching row ``i`` walks the document's tape over ``i`` elements.
    """
    for i in (1, L - 1) if L > 2 else (1,):
        row = pl[i]
        n = int(counts[i - 1])
        if not isinstance(row, simdjson.Object) or len(row) != n:
            _fail("cross-check: row size differs")
        b = int(starts[i - 1])
        for t in range(n):
            ent = row.get(str(int(ids64[b + t])))
            if not isinstance(ent, simdjson.Object) or ent.get("logprob") != float(lp64[b + t]):
                _fail("cross-check: entry differs")
        if row.get(str(int(pids[i]))) is None:
            _fail("cross-check: own entry missing")
