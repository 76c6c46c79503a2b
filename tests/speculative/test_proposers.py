"""The proposers against brute-force references: prompt lookup finds the latest earlier
occurrence of the longest tail n-gram (incrementally, as tokens arrive); the suffix tries
count every substring and follow the most frequent continuation while it is likely enough,
never across tenants; jump-forward proposes the grammar's forced text; the registry names
what it knows."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.params import SamplingParams
from mmserve.request import Request
from mmserve.speculative import ChainedProposer, create_proposer, ngram, suffix
from mmserve.speculative.jump_forward import JumpForwardProposer
from mmserve.speculative.ngram import NgramProposer
from mmserve.speculative.suffix import SuffixProposer, SuffixTrie


def request(tokens: list[int], prompt_len: int | None = None, rid: str = "r", salt: str | None = None) -> Request:
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    r = Request(rid, tokens[:prompt_len], SamplingParams(), frozenset(), 64, cache_salt=salt)
    r.output_token_ids = tokens[prompt_len:]
    return r


def ngram_reference(tokens: list[int], k: int) -> list[int]:
    """Longest n first; the latest occurrence ending before the last token."""
    for n in range(min(ngram.MAX_N, len(tokens) - 1), ngram.MIN_N - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.data())
def test_ngram_matches_the_brute_force_as_tokens_arrive(tokens: list[int], data: st.DataObject) -> None:
    proposer = NgramProposer()
    r = request(tokens[:1])
    for i in range(1, len(tokens) + 1):  # the output grows a token, or several, at a time
        r.output_token_ids = tokens[1:i]
        if i == len(tokens) or data.draw(st.booleans()):
            k = data.draw(st.integers(1, 6))
            assert proposer.propose(r, k) == ngram_reference(tokens[:i], k)
    proposer.finished(r)
    assert not proposer._histories


def test_ngram_examples() -> None:
    proposer = NgramProposer()
    assert proposer.propose(request([1, 2, 3, 9, 1, 2]), 3) == [3, 9, 1]
    assert proposer.propose(request([5, 6, 7], rid="b"), 3) == []  # nothing repeats
    # the 3-gram wins over a later 2-gram
    assert proposer.propose(request([7, 1, 2, 8, 0, 1, 2, 4, 7, 1, 2], rid="c"), 2) == [8, 0]


def substring_counts(sequences: list[list[int]]) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + suffix.DEPTH, len(seq)) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], suffix.Node]] = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5), st.data())
def test_suffix_trie_counts_every_substring_and_forgets_exactly(
    sequences: list[list[int]], data: st.DataObject
) -> None:
    trie = SuffixTrie()
    for seq in sequences:
        trie.add(seq)
    assert trie_counts(trie) == substring_counts(sequences)
    gone = data.draw(st.integers(0, len(sequences) - 1))
    trie.add(sequences[gone], sign=-1)
    assert trie_counts(trie) == substring_counts(sequences[:gone] + sequences[gone + 1 :])
    grown = suffix.Growing()  # one token at a time: the same counts
    for i in range(0, len(sequences[0]), 3):
        grown.extend(sequences[0][i : i + 3])
    assert trie_counts(grown.trie) == substring_counts(sequences[:1])


def test_suffix_follows_the_frequent_continuation_and_stops_when_unsure() -> None:
    proposer = SuffixProposer()
    # "1 2 3" twice then "1 2 4" once: after "1 2" it guesses 3 (2/3), then what followed
    tokens = [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 9, 9, 1, 2]
    assert proposer.propose(request(tokens), 4) == [3, 5]
    # the guess is at most as long as the match (MAX_FACTOR 1)
    long = [7, 8, 9, 10, 11, 12, 7]
    assert proposer.propose(request(long, rid="b"), 6) == [8]


def test_suffix_learns_from_finished_requests_of_the_same_tenant_only() -> None:
    proposer = SuffixProposer()
    done = request([1, 2, 3] + [40, 41, 42, 43, 44, 45], prompt_len=3, rid="a", salt="t1")
    proposer.finished(done)
    same = request([9, 40, 41, 42], rid="b", salt="t1")
    assert proposer.propose(same, 3) == [43, 44, 45]
    other = request([9, 40, 41, 42], rid="c", salt="t2")
    assert proposer.propose(other, 3) == []  # never across tenants
    untagged = request([9, 40, 41, 42], rid="d")
    assert proposer.propose(untagged, 3) == []


def test_suffix_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suffix, "CACHE_TOKENS", 20)
    monkeypatch.setattr(suffix, "CACHE_TENANTS", 2)
    proposer = SuffixProposer()
    rng = random.Random(0)
    for i in range(10):
        out = [rng.randrange(100) for _ in range(8)]
        proposer.finished(request([0] + out, prompt_len=1, rid=f"r{i}", salt=f"t{i % 3}"))
    assert len(proposer._tenants) == 2
    for cache in proposer._tenants.values():
        assert cache.num_tokens <= 20
        assert trie_counts(cache.trie) == substring_counts(list(cache.outputs))


def test_registry_names_what_it_knows() -> None:
    with pytest.raises(ValueError, match="unknown proposer 'eagle'; valid: draft=PATH, jump, ngram, suffix"):
        create_proposer("eagle")
    assert isinstance(create_proposer("ngram"), NgramProposer)
    chained = create_proposer("ngram+suffix")
    assert isinstance(chained, ChainedProposer)
    with pytest.raises(ValueError, match="tokenizer"):
        create_proposer("jump")


def test_jump_forward_proposes_the_forced_text() -> None:
    from mmserve.structured_output import create_backend
    from mmserve.structured_output.params import StructuredOutputParams
    from tests.utils.tiny_models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    size = len(tokenizer)
    eos = [int(tokenizer.eos_token_id)]
    backend = create_backend("xgrammar", tokenizer, size, eos)
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"}}, "required": ["name"]}
    schema["additionalProperties"] = False
    grammar = backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))
    matcher = grammar.matcher()
    r = request([1, 2])
    r.grammar = matcher
    proposer = JumpForwardProposer(tokenizer)
    assert proposer.propose(r, 4) == tokenizer.encode("{", add_special_tokens=False)
    for token in tokenizer.encode('{"', add_special_tokens=False):  # (whitespace may follow {)
        assert matcher.accept_token(token)
    forced = matcher.jump_forward()
    assert forced == 'name"'
    guesses = proposer.propose(r, 32)
    assert guesses and tokenizer.decode(guesses) == forced
    assert proposer.propose(r, 2) == guesses[:2]
    r.grammar = None
    assert proposer.propose(r, 4) == []


class _Nothing(ChainedProposer):
    def __init__(self) -> None:
        super().__init__([])


def test_a_step_does_not_speculate_while_every_request_rests() -> None:
    """A proposer that keeps finding nothing: after EMPTY_LIMIT tries the request rests, and
    while all rest the engine keeps async scheduling (active() is False), RETRY_AFTER steps;
    then it tries again. Refused guesses do the same through k halving to 0."""
    from mmserve.config import SpeculativeConfig
    from mmserve.speculative import controller

    speculator = controller.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    speculator.proposer = _Nothing()
    r = request([1, 2, 3, 4])
    r.num_computed_tokens = r.num_tokens - 1  # decoding
    running = [r]
    pattern = []
    for _ in range(40):
        on = speculator.active(running, [], 64, 8)
        pattern.append(on)
        if on:
            speculator.propose(running)
    assert pattern[: controller.EMPTY_LIMIT] == [True] * controller.EMPTY_LIMIT
    off = pattern.index(False)
    back = pattern.index(True, off)
    assert controller.RETRY_AFTER - 2 <= back - off <= controller.RETRY_AFTER
    # refused guesses: k 4 -> 2 -> 1 -> 0, then rest
    wrong = controller.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    ks = []
    for _ in range(3):
        ks.append(wrong._next_k(r))
        r.num_draft_tokens += ks[-1]  # all refused
    assert ks == [4, 2, 1]
    assert wrong._next_k(r) == 0 and wrong._resting(r)


def test_rests_grow_while_retries_keep_failing() -> None:
    """After each rest whose one guess is refused again the next rest is twice as long (up
    to RETRY_AFTER << MAX_BACKOFF); an accepted guess resets it."""
    from mmserve.config import SpeculativeConfig
    from mmserve.speculative import controller

    speculator = controller.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=1))
    r = request([1, 2, 3, 4])

    def rest_after(accept: bool) -> int:
        """Steps of rest after one checked guess (accepted or refused)."""
        assert speculator._next_k(r) == 1
        r.num_draft_tokens += 1
        r.num_accepted_draft_tokens += accept
        steps = 0
        while speculator._next_k(r) == 0:
            steps += 1
        return steps

    rests = [rest_after(False) for _ in range(controller.MAX_BACKOFF + 2)]
    base = controller.RETRY_AFTER
    assert rests == [base << min(i, controller.MAX_BACKOFF) for i in range(len(rests))]
    rest_after(True)  # (k 1 -> 1: no rest) and the count of failed retries starts again
    assert rest_after(False) == base


def test_a_chain_puts_its_first_proposer_ahead() -> None:
    """jump+ngram: the grammar's forced tokens, then what prompt lookup finds after them;
    ngram's own longer guess wins when the chain is shorter. `after` reaches each proposer."""

    class Fixed(NgramProposer):
        def __init__(self, tokens: list[int]) -> None:
            super().__init__()
            self.tokens = tokens

        def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
            return self.tokens[:k]

    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6]  # after "5 6" came "7 8 9"
    ngram_proposer = NgramProposer()
    r = request(tokens)
    assert ngram_proposer.propose(r, 3) == [7, 8, 9]
    assert ngram_proposer.propose(r, 3, after=[7]) == [8, 9, 1]  # as if 7 were next
    assert ngram_proposer.propose(r, 2, after=[7, 8]) == [9, 1]
    chain = ChainedProposer([Fixed([7]), ngram_proposer])
    assert chain.propose(r, 4) == [7, 8, 9, 1]
    assert ChainedProposer([Fixed([3]), ngram_proposer]).propose(r, 4) == [7, 8, 9, 1]  # alone wins
    assert ChainedProposer([Fixed([]), ngram_proposer]).propose(r, 2) == [7, 8]
    suffix_proposer = SuffixProposer()
    # "5 6" then 7 matches "5 6 7" (3 tokens long): up to 3 tokens follow
    assert suffix_proposer.propose(request(tokens, rid="s"), 3, after=[7]) == [8, 9, 1]
    assert suffix_proposer.propose(request(tokens, rid="s"), 2, after=[7, 8]) == [9, 1]
    assert suffix_proposer.propose(request(tokens, rid="s"), 3, after=[4]) == []
