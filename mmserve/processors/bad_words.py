"""bad_words as the token sequences the sampler masks, made as vLLM makes them
(vllm/logits_process.py, get_bad_words_logits_processors), so a request means the same on
both servers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each word, its leading whitespace removed, tokenized as it is and with a leading space
    (no special tokens). The spaced form is kept only where it is another token sequence of
    the same length (a tokenizer that marks word starts: "hello" and " hello"); where the
    space becomes a token of its own, the plain form already covers the word."""
    out: list[list[int]] = []
    for word in words:
        plain = _encode(tokenizer, word.lstrip())
        spaced = _encode(tokenizer, " " + word.lstrip())
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
