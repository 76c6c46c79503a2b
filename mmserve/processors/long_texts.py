"""Texts far past a token limit, found so from a part of them: the rest is never tokenised.

Tokenising is linear in the text (~1.5 us a character on one core), so a 30 MB prompt held a
front-end thread for ~40 s only to be refused for exceeding the context. Here a head of the
text (its tail, where left truncation keeps the end) is tokenised instead, cut at whitespace.

Why a part speaks for the whole: pre-tokenizers split text at whitespace and punctuation,
and BPE, WordPiece and Unigram tokenise within those pieces, so a part's tokens and the whole
text's differ only near the cut (in the piece it goes through: a few tokens). MARGIN allows
far more than that: a part with more than limit + MARGIN tokens shows that the whole text
has more than `limit`. A text that may fit is always tokenised whole, so one that fits is
never refused; parts grow 4x at a time, so a text of unusually many characters a token costs
at most 2/3 more than tokenising it whole.

Truncation keeps the part's first (a tail's last) `limit` tokens, which must be exactly the
whole text's. That fails where the cut goes through a long repetitive piece ("aaaa...", or
a tokenizer without a pre-tokenizer): BPE merges a run from its start, so a tail starting
inside the run can pair its characters out of step with the whole text all the way to its
end. So a part stands for the text only when a second part, cut one character further out,
keeps the same tokens (a run repeating every p characters lines up for cuts one apart only
if p is 1); otherwise the whole text is tokenised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

MARGIN = 1024  # tokens a part may have beyond the whole text's, from its cut
CHARS_PER_TOKEN = 8  # the first part: this many characters for each token of limit + MARGIN
GROWTH = 4  # each next part this many times larger
CUT_WINDOW = 256  # characters searched back (forward, for a tail) for whitespace to cut at

Keep = Literal["head", "tail"]


@dataclass(frozen=True)
class LongText:
    """A text shown to hold more tokens than a limit by a part of it."""

    part: str  # the head (or tail) that was tokenised
    at_least: int  # a lower bound on the whole text's tokens, above the limit


def find_long_text(
    encode: Callable[[str], Sequence[int]],
    text: str,
    limit: int,
    keep: Keep = "head",
    exact: bool = False,
) -> LongText | None:
    """The part of `text` (a head, or a tail for keep="tail") that holds more than
    limit + MARGIN tokens by `encode` (a tokenizer's token ids of a string), trying parts
    only while they are at most half the text. exact: the part also holds the whole text's
    first (last) `limit` tokens, checked against a part cut one character further out.
    None: the text may fit, or its part may not stand for it; tokenise all of it."""
    size = CHARS_PER_TOKEN * (limit + MARGIN)
    while 2 * size <= len(text):
        start, end = _cut(text, size, keep)
        ids = encode(text[start:end])
        if len(ids) > limit + MARGIN:
            if exact and not _same_kept(encode, text, (start, end), ids, limit, keep):
                return None
            return LongText(text[start:end], len(ids) - MARGIN)
        size *= GROWTH
    return None


def _cut(text: str, size: int, keep: Keep) -> tuple[int, int]:
    """text[:size] (text[-size:]) as (start, end), cut before the last (at the first)
    whitespace within CUT_WINDOW characters of its edge: where pre-tokenizers end a piece,
    all but a few."""
    if keep == "head":
        end = next((i for i in range(size, size - CUT_WINDOW, -1) if text[i].isspace()), size)
        return 0, end
    start = len(text) - size
    start = next((i for i in range(start, start + CUT_WINDOW) if text[i].isspace()), start)
    return start, len(text)


def _same_kept(
    encode: Callable[[str], Sequence[int]],
    text: str,
    cut: tuple[int, int],
    ids: Sequence[int],
    limit: int,
    keep: Keep,
) -> bool:
    """Whether the part one character longer keeps the same `limit` tokens as ids."""
    start, end = cut
    if keep == "head":
        return list(encode(text[: end + 1])[:limit]) == list(ids[:limit])
    return list(encode(text[start - 1 :])[-limit:]) == list(ids[-limit:])


class TooManyTokens(ValueError):
    """A text has more tokens than a limit allows: at least `at_least`, found from a part."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least
