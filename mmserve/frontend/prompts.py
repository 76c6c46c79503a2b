"""Generate prompts from text: how many tokens one may have, and its tokens, found without
tokenising all of a text far past that (processors/long_texts.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

from mmserve.errors import InvalidArgument
from mmserve.processors.long_texts import find_long_text


class TokenLimit(Protocol):
    """The most tokens an input may have, and the refusal of one past it."""

    @property
    def tokens(self) -> int: ...

    def error(self, field: str, tokens: int, at_least: bool = False) -> InvalidArgument:
        """The refusal of an input of `tokens` tokens (at_least: of that many or more, found
        from a part of its text)."""
        ...


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a Generate prompt may have, and the refusal of one past it."""

    context: int  # the model's max_model_len: a prompt leaves room for one token at least
    server: int | None = None  # the server's max_prompt_tokens; None: the context's only
    # the prompt is cut to its last this many tokens (truncate_prompt_tokens) once tokenised:
    # it may come in at any length (the cut prompt is checked against the limit); a text far
    # past it is tokenised from a tail that holds its last tokens (encode_prompt)
    keep_last: int | None = None

    @property
    def tokens(self) -> int:
        if self.keep_last is not None:
            return sys.maxsize
        room = self.context - 1
        return room if self.server is None else min(room, self.server)

    def error(self, field: str, tokens: int, at_least: bool = False) -> InvalidArgument:
        """The refusal of a prompt of `tokens` tokens (at_least: of that many or more, found
        from a part of its text)."""
        count = f"at least {tokens}" if at_least else str(tokens)
        if self.server is not None and tokens > self.server:
            return InvalidArgument(field, f"{count} tokens exceed the server limit {self.server}")
        return InvalidArgument(
            field, f"{count} tokens leave no room to generate: the limit is {self.context} tokens"
        )


def encode_prompt(
    tokenizer: Any, text: str, add_special_tokens: bool, limit: TokenLimit, field: str
) -> list[int]:
    """tokenizer.encode(text); a text found far past the limit from a head of it is refused
    (InvalidArgument on field) without tokenising the rest. A limit that keeps a prompt's last
    N tokens (PromptLimit.keep_last) takes a text far longer than that from a tail holding its
    last N tokens exactly (long_texts.find_long_text, exact): ids whose last N are the whole
    text's."""

    def encode(part: str) -> list[int]:
        return list(tokenizer.encode(part, add_special_tokens=add_special_tokens))

    if isinstance(limit, PromptLimit) and limit.keep_last is not None:
        tail = find_long_text(encode, text, limit.keep_last, keep="tail", exact=True)
        return encode(text if tail is None else tail.part)
    long = find_long_text(encode, text, limit.tokens)
    if long is not None:
        raise limit.error(field, long.at_least, at_least=True)
    return encode(text)
