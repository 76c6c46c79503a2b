"""Grammar jump-forward: where a constrained request's grammar admits one continuation only
(a schema's fixed keys and punctuation, `{"name": "` of a forced tool call), that text is
proposed, as the tokenizer writes it. The model verifies it like any guess, so a
tokenisation the model would not have chosen is only a shorter accepted run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmserve.request import Request
from mmserve.speculative import Proposer


class JumpForwardProposer(Proposer):
    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("speculative: jump needs the model's tokenizer (a generating model)")
        self.tokenizer = tokenizer

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        matcher = request.grammar
        if matcher is None:
            return []
        taken = 0  # the grammar's state after `after` (then rolled back)
        for token in after:
            if not matcher.accept_token(token):
                break
            taken += 1
        text = matcher.jump_forward() if taken == len(after) else ""
        matcher.rollback(taken)
        if not text:
            return []
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[:k]
