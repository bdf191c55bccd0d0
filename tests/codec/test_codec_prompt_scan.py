"""The byte-level prompt_logprobs fast path (shardserver.codec.prompt_scan) against the generic path.

Every body is decoded twice: as shipped (fast path where it applies) and with the fast path
disabled (the generic ``as_list`` path, the reference). Outputs must be bit-identical
(NaN positions and the sign of zero included) and errors identical; each test also asserts
which path was taken, from ``prompt_scan.stats``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from codec_fixtures import choice_dict, logprobs_object, realistic_case, render
from shardserver.codec import CompletionDecoder, prompt_scan
from shardserver.codec import decode as decode_mod
from shardserver.errors import EngineBodyError

ADVERSARIAL = [
    '":{"logprob":',
    '},{"',
    ",null",
    "[null,",
    '\\"',
    '"',
    "\\",
    "\\\\",
    '],"prompt_token_ids":[',
    ',"rank":',
    ',"decoded_token":',
    '"}},{"1":{"logprob":-1.0,"rank":1,"decoded_token":"',
    "]",
    "[",
    "é🙂\u2028\ufffd",
    "\n\t\r\b\f",
    "\x00\x01\x1f\x7f",
    "",
    " ",
    "token_id:7",
    "<|endoftext|>",
]


def _float_text(rng: np.random.Generator, x: float, style: str) -> str:
    t = repr(float(x))
    if style == "serde" and "e-0" in t:
        t = t.replace("e-0", "e-")
    elif style == "upper":
        t = t.replace("e", "E")
    return t


def _plp_json(rows, rng: np.random.Generator, style: str) -> str:
    """Compact prompt_logprobs text with float spelling of ``style`` (python/serde/upper/mixed)."""
    parts = []
    for row in rows:
        if row is None:
            parts.append("null")
            continue
        ents = []
        for tid, (lp, rank, tok) in row.items():
            st = style if style != "mixed" else rng.choice(["python", "serde", "upper"])
            lp_t = lp if isinstance(lp, str) else _float_text(rng, lp, st)
            tok_t = "null" if tok is None else json.dumps(tok, ensure_ascii=False)
            ents.append(f'"{tid}":{{"logprob":{lp_t},"rank":{rank},"decoded_token":{tok_t}}}')
        parts.append("{" + ",".join(ents) + "}")
    return "[" + ",".join(parts) + "]"


def _random_rows(rng: np.random.Generator, pids: list[int], k: int, *, ties: bool, adversarial: bool):
    rows: list = [None]
    pool = np.array([-0.5, -1.0, -1.25, -9999.0, -0.0, 0.0], dtype=np.float64)
    for p in range(1, len(pids)):
        own = pids[p]
        if ties:
            lps = rng.choice(pool, size=k + 1)
        else:
            lps = -rng.exponential(2.0, size=k + 1).astype(np.float32).astype(np.float64)
            lps[rng.random(k + 1) < 0.05] = -9999.0
            lps[rng.random(k + 1) < 0.02] = -1.1920928244535389e-07
        others = []
        while len(others) < k:
            t = int(rng.integers(0, 200_000))
            if t != own and t not in others:
                others.append(t)
        ids = [own] + others
        if k and rng.random() < 0.4:  # own token inside the top-k: merged, k entries
            ids = ids[:k]
        order = np.arange(len(ids))
        if rng.random() < 0.2:  # own token not first (a client that reorders keys)
            order = rng.permutation(len(ids))
        row = {}
        for j in order:
            tok = rng.choice(ADVERSARIAL) if adversarial and rng.random() < 0.5 else f" p{ids[j]}"
            row[str(ids[j])] = (float(lps[j]), int(rng.integers(1, 300_000)), str(tok))
        rows.append(row)
    return rows


def _body(rng, *, P, k, n, style="python", ties=False, adversarial=True, rows=None, pids=None,
          finish="length", plp_text=None, choice_order=None):
    if pids is None:
        pids = rng.integers(0, 200_000, size=P).tolist()
    if rows is None:
        rows = _random_rows(rng, pids, k, ties=ties, adversarial=adversarial)
    text = plp_text if plp_text is not None else _plp_json(rows, rng, style)
    choices = []
    for i in range(n):
        lp = logprobs_object([-0.5, -1.0])
        choices.append(choice_dict(i, [3, 4], lp, finish_reason=finish, prompt_logprobs="@PLP@", prompt_token_ids=pids))
    if choice_order is not None:
        choices = [choices[i] for i in choice_order]
    body = render(choices, prompt_tokens=len(pids))
    return body.replace(b'"@PLP@"', text.encode("utf-8")), pids


def _decode(body, n, k, want_plp=True, prompt_token_ids=None):
    dec = CompletionDecoder()
    try:
        out = dec.decode(body, num_samples=n, prompt_logprobs=want_plp, topk_prompt_logprobs=k,
                         prompt_token_ids=prompt_token_ids)
    except EngineBodyError as e:
        return ("error", e.where, e.reason)
    return out


def _same(a, b) -> None:
    if isinstance(a, tuple) or isinstance(b, tuple):
        assert a == b
        return
    for name in ("prompt_logprobs", "topk_token_ids", "topk_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name  # bitwise: NaN positions and -0.0 included


def check(body, n, k, *, fast: bool, want_plp=True, prompt_token_ids=None, monkeypatch):
    """Decode with and without the fast path; assert identical results and the path taken."""
    before = dict(prompt_scan.stats)
    got = _decode(body, n, k, want_plp, prompt_token_ids)
    took_fast = prompt_scan.stats["fast"] > before["fast"]
    assert took_fast == fast, prompt_scan.stats["last_reason"]
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "scan_prompt_logprobs", lambda *a: None)
        ref = _decode(body, n, k, want_plp, prompt_token_ids)
    _same(got, ref)
    return got


# --------------------------------------------------------------------------------------------
# Differential: random bodies, fast path taken


@pytest.mark.parametrize("seed", range(40))
def test_random_bodies_match_generic(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    P = int(rng.choice([2, 3, 5, 17, 200, 1000, 3000], p=[0.12, 0.12, 0.12, 0.2, 0.24, 0.12, 0.08]))
    k = int(rng.integers(0, 6))
    n = int(rng.integers(1, 4))
    style = ["python", "serde", "upper", "mixed"][seed % 4]
    body, _ = _body(rng, P=P, k=k, n=n, style=style, ties=seed % 3 == 0)
    out = check(body, n, k, fast=True, monkeypatch=monkeypatch)
    assert not isinstance(out, tuple)
    assert np.isnan(out.prompt_logprobs[0])


def test_realistic_case_fast(monkeypatch):
    rng = np.random.default_rng(3)
    for k in (0, 1, 5):
        case = realistic_case(rng, n=2, gen_tokens=50, prompt_len=700, k=k)
        out = check(case.body, 2, k, fast=True, monkeypatch=monkeypatch)
        assert np.array_equal(out.prompt_logprobs, case.prompt_lp, equal_nan=True)
        if k:
            assert np.array_equal(out.topk_token_ids, case.topk_ids)
            assert np.array_equal(out.topk_logprobs, case.topk_lp)


def test_topk_only_and_plp_only(monkeypatch):
    rng = np.random.default_rng(11)
    body, _ = _body(rng, P=50, k=3, n=1)
    check(body, 1, 3, want_plp=False, fast=True, monkeypatch=monkeypatch)
    check(body, 1, 0, want_plp=True, fast=True, monkeypatch=monkeypatch)
    check(body, 1, 5, want_plp=True, fast=True, monkeypatch=monkeypatch)  # k wider than the rows


def test_number_spellings(monkeypatch):
    # Ints, -0, exponent forms with sign/case variants, and long ints all parse identically.
    spellings = ["-0.0", "0.0", "-0", "0", "-3", "-9999.0", "-9999", "-1.1920928244535389e-07",
                 "-1.1920928244535389e-7", "-1.1920928244535389E-07", "-12e+1", "-2.5E2",
                 "-9007199254740993", "-123456789012345678", "-1e-45", "-3.4028234663852886e+38"]
    pids = [1] + list(range(100, 100 + len(spellings)))
    rows = [None] + [{str(pids[i + 1]): (t, 1, "x"), "7": ("-0.5", 2, "y")} for i, t in enumerate(spellings)]
    text = _plp_json(rows, np.random.default_rng(0), "python")
    body, _ = _body(np.random.default_rng(0), P=len(pids), k=1, n=1, pids=pids, plp_text=text)
    out = check(body, 1, 2, fast=True, monkeypatch=monkeypatch)
    assert np.signbit(out.prompt_logprobs[1]) and not np.signbit(out.prompt_logprobs[3])


def test_ids_edge_values(monkeypatch):
    pids = [5, 0, 9, 12345678, 99999999, 7]
    rows = [None] + [{str(p): ("-1.5", 1, "a"), str((p + 1) % 10**8): ("-2.5", 2, "b")} for p in pids[1:]]
    text = _plp_json(rows, np.random.default_rng(0), "python")
    body, _ = _body(np.random.default_rng(0), P=len(pids), k=2, n=1, pids=pids, plp_text=text)
    out = check(body, 1, 2, fast=True, monkeypatch=monkeypatch)
    assert out.topk_token_ids[1].tolist() == [0, 1]
    assert out.topk_token_ids[4].tolist() == [99999999, 0]


def test_prompt_ids_from_argument(monkeypatch):
    rng = np.random.default_rng(5)
    body, pids = _body(rng, P=40, k=2, n=1)
    body = body.replace(b',"prompt_token_ids":[' + ",".join(map(str, pids)).encode() + b"]", b',"prompt_token_ids":null')
    # The end marker is gone: falls back, and still decodes from the caller's ids.
    check(body, 1, 2, fast=False, prompt_token_ids=np.array(pids), monkeypatch=monkeypatch)


# --------------------------------------------------------------------------------------------
# Errors: raised exactly as the generic path raises them


def test_missing_own_entry_falls_back_and_raises(monkeypatch):
    pids, text = _middle('{"4":{"logprob":-1.0,"rank":1,"decoded_token":"b"}}')
    body, _ = _body(np.random.default_rng(1), P=len(pids), k=1, n=1, pids=pids, plp_text=text)
    got = check(body, 1, 1, fast=False, monkeypatch=monkeypatch)
    assert got[0] == "error" and "no entry for the prompt token 12" in got[2]
    assert prompt_scan.stats["last_reason"] == "prompt token missing from a position"


def test_non_finite_logprob_raises_identically(monkeypatch):
    rng = np.random.default_rng(2)
    pids = [1, 2, 3]
    for rows in ([None, {"2": ("-1e300", 1, "a")}, {"3": (-1.0, 1, "b")}],
                 [None, {"2": (-1.0, 1, "a"), "9": ("-1e300", 2, "c")}, {"3": (-1.0, 1, "b")}]):
        body, _ = _body(rng, P=3, k=2, n=1, pids=pids, plp_text=_plp_json(rows, rng, "python"))
        got = check(body, 1, 2, fast=True, monkeypatch=monkeypatch)
        assert got[0] == "error" and "non-finite" in got[2]


def _middle(bad: str, n_pos: int = 6) -> tuple[list[int], str]:
    """A prompt_logprobs text whose position 2 is ``bad`` (position 1 and the last are clean,
    so the first/last-row cross-check cannot be what rejects it); other positions own id p+10."""
    pids = [1] + [p + 10 for p in range(1, n_pos)]
    rows = [f'{{"{p + 10}":{{"logprob":-1.5,"rank":1,"decoded_token":"t"}}}}' for p in range(1, n_pos)]
    rows[1] = bad
    return pids, "[null," + ",".join(rows) + "]"


def test_leading_zero_id_falls_back(monkeypatch):
    pids, text = _middle('{"012":{"logprob":-1.0,"rank":1,"decoded_token":"a"}}')
    body, _ = _body(np.random.default_rng(0), P=len(pids), k=1, n=1, pids=pids, plp_text=text)
    got = check(body, 1, 1, fast=False, monkeypatch=monkeypatch)
    assert got[0] == "error"
    assert prompt_scan.stats["last_reason"] == "id has a leading zero"


# --------------------------------------------------------------------------------------------
# Layouts that must fall back (and still decode like the generic path)


def _text(rng, P=6, k=2):
    pids = rng.integers(0, 1000, size=P).tolist()
    rows = _random_rows(rng, pids, k, ties=False, adversarial=True)
    return pids, rows, _plp_json(rows, rng, "python")


def test_fallback_pretty_printed(monkeypatch):
    rng = np.random.default_rng(20)
    pids, rows, _ = _text(rng)
    data = [None] + [{t: {"logprob": lp, "rank": r, "decoded_token": s} for t, (lp, r, s) in row.items()} for row in rows[1:]]
    c = choice_dict(0, [3], logprobs_object([-0.5]), prompt_logprobs=data, prompt_token_ids=pids)
    body = json.dumps({"choices": [c]}, indent=2).encode()
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    body = json.dumps({"choices": [c]}).encode()  # default separators: ", " and ": "
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)


def test_fallback_whitespace_inside(monkeypatch):
    # Valid JSON with one space (or a renamed or extra key) in the middle of the array: never the fast path.
    pids, text = _middle('{"12":{"logprob":-1.0,"rank":1,"decoded_token":"a"}}', n_pos=8)
    mid = text.index('{"12"')
    for variant in (text[:mid] + " " + text[mid:],  # '}},' + ' {'
                    text[:mid + 1] + " " + text[mid + 1:],  # '{ "12"'
                    text[:mid] + text[mid:].replace('"a"}', '"a" }', 1),
                    text[:mid] + text[mid:].replace('"rank":1', '"rank": 1', 1),
                    text[:mid] + text[mid:].replace('"logprob":-1.0', '"logprob": -1.0', 1),
                    text[:mid] + text[mid:].replace('-1.0,"rank"', '-1.0 ,"rank"', 1),
                    text[:mid] + text[mid:].replace('"rank":1', '"Rank":1', 1),
                    text[:mid] + text[mid:].replace('"a"}', '"a", "13":{"logprob":-2.0,"rank":2,"decoded_token":"b"}}', 1)):
        body, _ = _body(np.random.default_rng(2), P=len(pids), k=1, n=1, pids=pids, plp_text=variant)
        check(body, 1, 1, fast=False, monkeypatch=monkeypatch)


def test_fallback_rank_before_logprob(monkeypatch):
    rng = np.random.default_rng(21)
    pids, rows, text = _text(rng)
    text = text.replace('"logprob":', '"LP":').replace(',"rank":', ',"logprob_":')
    text2 = []
    for row in rows[1:]:
        text2.append("{" + ",".join(f'"{t}":{{"rank":{r},"logprob":{lp!r},"decoded_token":{json.dumps(s)}}}' for t, (lp, r, s) in row.items()) + "}")
    body, _ = _body(rng, P=len(pids), k=2, n=1, pids=pids, plp_text="[null," + ",".join(text2) + "]")
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)


def test_fallback_extra_key_and_null_token(monkeypatch):
    rng = np.random.default_rng(22)
    pids, rows, text = _text(rng)
    body, _ = _body(rng, P=len(pids), k=2, n=1, pids=pids, plp_text=text.replace('},"', ',"x":1},"', 1))
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    rows[2] = {t: (lp, r, None) for t, (lp, r, s) in rows[2].items()}  # no tokenizer: decoded_token null
    body, _ = _body(rng, P=len(pids), k=2, n=1, pids=pids, rows=rows)
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)


def test_fallback_aborted_short_list(monkeypatch):
    rng = np.random.default_rng(23)
    pids = rng.integers(0, 1000, size=8).tolist()
    rows = _random_rows(rng, pids, 2, ties=False, adversarial=True)[:5]
    body, _ = _body(rng, P=8, k=2, n=1, pids=pids, rows=rows, finish="abort")
    out = check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    assert np.isnan(out.prompt_logprobs[5:]).all()


def test_fallback_null_in_the_middle_and_empty_row(monkeypatch):
    rng = np.random.default_rng(24)
    pids = rng.integers(0, 1000, size=8).tolist()
    rows = _random_rows(rng, pids, 2, ties=False, adversarial=True)
    rows[4] = None
    body, _ = _body(rng, P=8, k=2, n=1, pids=pids, rows=rows)
    out = check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    assert np.isnan(out.prompt_logprobs[4])
    rows[4] = {}
    body, _ = _body(rng, P=8, k=2, n=1, pids=pids, rows=rows)
    got = check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    assert got[0] == "error"


def test_fallback_prompt_logprobs_before_logprobs(monkeypatch):
    rng = np.random.default_rng(25)
    pids, rows, text = _text(rng)
    c = choice_dict(0, [3, 4], logprobs_object([-0.5, -1.0]), prompt_logprobs="@PLP@", prompt_token_ids=pids)
    c = {"index": 0, "prompt_logprobs": c.pop("prompt_logprobs"), **c}
    body = render([c], prompt_tokens=len(pids)).replace(b'"@PLP@"', text.encode())
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)


def test_fallback_choice_order(monkeypatch):
    rng = np.random.default_rng(26)
    body, _ = _body(rng, P=30, k=3, n=2, choice_order=[1, 0])
    check(body, 2, 3, fast=False, monkeypatch=monkeypatch)


def test_fallback_duplicate_id_in_a_position(monkeypatch):
    bad = ('{"12":{"logprob":-1.0,"rank":1,"decoded_token":"a"},"5":{"logprob":-2.0,"rank":2,"decoded_token":"b"},'
           '"5":{"logprob":-0.5,"rank":3,"decoded_token":"c"}}')
    pids, text = _middle(bad)
    body, _ = _body(np.random.default_rng(27), P=len(pids), k=2, n=1, pids=pids, plp_text=text)
    check(body, 1, 2, fast=False, monkeypatch=monkeypatch)
    assert prompt_scan.stats["last_reason"] == "duplicate id within a position"


def test_fallback_nested_array_or_literal_logprob(monkeypatch):
    rng = np.random.default_rng(28)
    for a, b in (("[-1.0,-2.0]", "[]"), ("true", "-1.0"), ("null", "-1.0"), ("{}", "-1.0"), ("-1.0", "[]")):
        why = "logprob text does not start like a number"
        bad = (f'{{"12":{{"logprob":{a},"rank":1,"decoded_token":"a"}},'
               f'"13":{{"logprob":{b},"rank":1,"decoded_token":"d"}}}}')
        pids, text = _middle(bad)
        body, _ = _body(rng, P=len(pids), k=1, n=1, pids=pids, plp_text=text)
        got = check(body, 1, 1, fast=False, monkeypatch=monkeypatch)
        assert got[0] == "error"
        assert prompt_scan.stats["last_reason"].startswith(why), prompt_scan.stats["last_reason"]


def test_fallback_float_prompt_ids_argument(monkeypatch):
    rng = np.random.default_rng(29)
    body, pids = _body(rng, P=10, k=1, n=1)
    body = body.replace(b',"prompt_token_ids":[' + ",".join(map(str, pids)).encode() + b"]", b',"prompt_token_ids":null')
    got = check(body, 1, 1, fast=False, prompt_token_ids=np.array(pids, dtype=np.float64), monkeypatch=monkeypatch)
    assert got[0] == "error"  # str(7.0) is not a token id key


def test_structural_quotes():
    for text in (b'["a\\"b","c\\\\","\\\\\\"",""]', b'[null,{"x":"\\\\\\\\"}]'):
        R = np.frombuffer(text, dtype=np.uint8)
        want, in_str, esc = [], False, False
        for i, ch in enumerate(text):
            if in_str and esc:
                esc = False
            elif in_str and ch == 92:
                esc = True
            elif ch == 34:
                want.append(i)
                in_str = not in_str
        assert prompt_scan.structural_quotes(R).tolist() == want
