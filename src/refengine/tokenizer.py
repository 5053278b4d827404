"""Byte-level tokenizer: token ``b`` is byte ``b``; four specials follow (vocab 260)."""

from __future__ import annotations

from collections.abc import Sequence

BOS, EOS, PAD, SEP = 256, 257, 258, 259


def encode(text: str, bos: bool = True) -> list[int]:
    """UTF-8 bytes of ``text``, after a ``BOS`` token unless ``bos`` is false."""
    return [BOS] * bos + list(text.encode())


def decode(tokens: Sequence[int]) -> str:
    """Bytes back to text; specials are dropped and invalid UTF-8 is replaced."""
    return bytes(t for t in tokens if t < 256).decode(errors="replace")
