"""The fake vocabulary: a deterministic token id -> string table with the awkward strings
(non-ASCII, empty, quotes, backslashes, control characters) a real tokenizer produces."""

from __future__ import annotations

import functools

import numpy as np

from .config import SimConfig
from .wire import _jstr

_MASK64 = (1 << 64) - 1


_PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", "/", "'", "=", "+", "*", "#", "...", " -", " (", "):", "/*"]
_WS = ["\n", "\n\n", "\t", "  ", " \n", "\r\n", "    ", "\n\n\n", " "]
_NONASCII = ["é", " über", "中文", "日本語", "🙂", "\u2028", "\u00a0", "ß", "\ufffd", "Ω", " naïve", "—",
             " café",
             "\u2029", "😀😀", " 京", "Ж", "ü", "→", "\u200b"]
_ESCAPEY = ['"', "\\", '\\"', "\\n", "\x00", "\x01", "\x1b", "\x1f", "\x7f", "\b", "\f", '"}', "',", '{"',
            "\\\\", "\r", "\x0b", "</", "<think>", " \"\\"]


class _FakeVocab:
    """Deterministic id -> string table. Entry ``eos_token_id`` is ``"<|endoftext|>"``."""

    def __init__(self, vocab_size: int, eos_token_id: int, seed: int) -> None:
        n = max(vocab_size, eos_token_id + 1)
        rng = np.random.default_rng([seed & _MASK64, 0x766F636162])
        cat = rng.choice(8, size=n, p=[0.52, 0.24, 0.05, 0.05, 0.03, 0.06, 0.03, 0.02])
        wlen = rng.integers(1, 9, size=n)
        letters = rng.integers(97, 123, size=n * 8, dtype=np.uint8).tobytes().decode("ascii")
        pick = rng.integers(0, 1 << 30, size=n)
        strs: list[str] = []
        append = strs.append
        for i, (c, L, p) in enumerate(zip(cat.tolist(), wlen.tolist(), pick.tolist())):
            if c == 0:
                append(" " + letters[i * 8:i * 8 + L])
            elif c == 1:
                append(letters[i * 8:i * 8 + L])
            elif c == 2:
                append(_PUNCT[p % len(_PUNCT)])
            elif c == 3:
                append(str(p % 1000))
            elif c == 4:
                append(_WS[p % len(_WS)])
            elif c == 5:
                append(_NONASCII[p % len(_NONASCII)])
            elif c == 6:
                append(_ESCAPEY[p % len(_ESCAPEY)])
            else:
                append("")
        strs[eos_token_id] = "<|endoftext|>"
        # A few fixed entries so that small tests meet the interesting strings.
        fixed = {0: "!", 1: '"', 2: "\\", 3: "\n\n", 4: "", 5: "é", 6: "\x01", 7: " the", 8: "", 9: "🙂"}
        for k, v in fixed.items():
            if k != eos_token_id and k < n:
                strs[k] = v
        self.size = n
        self.strs = strs
        self.esc = [_jstr(s) for s in strs]
        self.lens = np.fromiter((len(s) for s in strs), dtype=np.int64, count=n)
        empty = np.flatnonzero(self.lens == 0)
        self.empty_ids = empty[empty != eos_token_id]

    def text(self, i: int) -> str:
        if 0 <= i < self.size:
            return self.strs[i]
        return f"<|extra_{i}|>"

    def esc_of(self, i: int) -> str:
        if 0 <= i < self.size:
            return self.esc[i]
        return _jstr(self.text(i))

    def length(self, i: int) -> int:
        return len(self.text(i))


@functools.lru_cache(maxsize=4)
def _get_vocab(vocab_size: int, eos_token_id: int, seed: int) -> _FakeVocab:
    return _FakeVocab(vocab_size, eos_token_id, seed)


def _vocab_for(cfg: SimConfig) -> _FakeVocab:
    return _get_vocab(cfg.vocab_size, cfg.eos_token_id, cfg.vocab_seed)
