"""ReasoningMatcher: free thought (stop tokens held off while a grammar waits), the budget's
forced end marker, the grammar from `</think>` on, and rollback across the boundary."""

from __future__ import annotations

import torch

from mmserve.processors.reasoning_parsers import ANSWER, OPEN, THOUGHT, ReasoningGate
from mmserve.structured_output.backend import GrammarMatcher, allocate_bitmask, unpack_bitmask
from mmserve.structured_output.reasoning import ReasoningMatcher

VOCAB, START, END, EOS = 64, 60, 61, 63


class OnlyFive(GrammarMatcher):
    """A grammar of one token, 5, then EOS."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        want = 5 if not self.taken else EOS
        if token_id != want or len(self.taken) == 2:
            return False
        self.taken.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        word, bit = divmod(5 if not self.taken else EOS, 32)
        bitmask[row, word] = 1 << bit if bit < 31 else -(1 << 31)

    def rollback(self, num_tokens: int) -> None:
        del self.taken[len(self.taken) - num_tokens :]

    def is_terminated(self) -> bool:
        return self.taken[-1:] == [EOS]

    def reset(self) -> None:
        self.taken.clear()


def allowed(m: GrammarMatcher) -> set[int]:
    mask = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(mask, 0)
    return {i for i, ok in enumerate(unpack_bitmask(mask, VOCAB)[0].tolist()) if ok}


def gate(state: str, budget: int | None = None) -> ReasoningGate:
    return ReasoningGate(state, (START,), (END,), ANSWER, budget)


def test_thought_then_grammar_with_a_budget() -> None:
    inner = OnlyFive()
    m = ReasoningMatcher(gate(THOUGHT, budget=2), inner, [EOS])
    assert allowed(m) == set(range(VOCAB)) - {EOS}  # free thought, but no end before an answer
    assert m.accept_token(7) and m.accept_token(5)  # a 5 in the thought is thought
    assert inner.taken == [] and allowed(m) == {END}  # the budget forces </think>
    assert not m.accept_token(7) and m.accept_token(END)
    assert allowed(m) == {5} and m.accept_token(5) and m.accept_token(EOS)
    assert m.is_terminated()
    m.rollback(3)  # EOS, 5 and </think>: back inside the thought
    assert inner.taken == [] and allowed(m) == {END} and not m.is_terminated()
    m.reset()
    assert allowed(m) == set(range(VOCAB)) - {EOS}


def test_open_output_may_think_or_answer_at_once() -> None:
    m = ReasoningMatcher(gate(OPEN), OnlyFive(), [EOS])
    assert allowed(m) == {5, START}
    assert m.accept_token(5) and allowed(m) == {EOS}  # answered without a thought
    m = ReasoningMatcher(gate(OPEN), OnlyFive(), [EOS])
    assert m.accept_token(START) and EOS not in allowed(m) and m.accept_token(END)
    assert allowed(m) == {5}


def test_a_budget_alone_leaves_the_answer_free() -> None:
    m = ReasoningMatcher(gate(THOUGHT, budget=0), None, [EOS])
    assert allowed(m) == {END} and m.accept_token(END)
    assert allowed(m) == set(range(VOCAB)) and not m.is_terminated()
