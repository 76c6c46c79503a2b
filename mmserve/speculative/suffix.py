"""Suffix decoding (after Snowflake's arctic-inference): the context's tail is matched in a
suffix trie of the request's own prompt and output, and in a trie of recent outputs of other
requests of the same tenant (cache_salt); from the longest match the most frequent
continuation is followed while its estimated probability stays above MIN_PROB, for at most
MAX_FACTOR x the match length tokens. So the guess is long where the text repeated often
and short where it did not.

The tries are depth-bounded (DEPTH): each new token extends the nodes of the context's
suffixes, O(DEPTH) per token. Outputs of other requests are kept per cache_salt, never
across tenants, at most CACHE_TOKENS per tenant and CACHE_TENANTS tenants (oldest first out).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.request import Request
from mmserve.speculative import Proposer

DEPTH = 12  # longest substring a trie holds (match length + continuation)
MIN_PROB = 0.1  # a continuation is followed while its estimated probability is at least this
MAX_FACTOR = 1.0  # a guess is at most this many times as long as the match it comes from
PROMPT_TOKENS = 8192  # a prompt's last tokens that its request's trie holds
CACHE_TOKENS = 1 << 16  # output tokens of finished requests kept per tenant
CACHE_TENANTS = 64  # tenants (cache_salt values) with a cache


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0  # occurrences of the substring this node spells


class SuffixTrie:
    """Every substring of at most DEPTH tokens of the sequences added, with its count."""

    def __init__(self) -> None:
        self.root = Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Adds (sign 1) or removes (sign -1, of a sequence added before) whole sequences."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + DEPTH]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def longest_match(self, context: Sequence[int]) -> tuple[Node | None, int]:
        """The node of the longest tail of context that occurred followed by something."""
        for length in range(min(DEPTH - 1, len(context)), 0, -1):
            node: Node | None = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token) if node is not None else None
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0


class Growing:
    """A suffix trie built one token at a time: the nodes of the context's tails are kept
    (`tails`, longest first), and each token extends them."""

    def __init__(self) -> None:
        self.trie = SuffixTrie()
        self.tails: list[Node] = []  # nodes spelling the context's last 1..DEPTH-1 tokens, longest first
        self.num_tokens = 0

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            grown = []
            for node in [*self.tails, self.trie.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += 1
                grown.append(child)
            self.tails = grown[-(DEPTH - 1) :]
            self.num_tokens += 1

    def longest_match(self, after: Sequence[int] = ()) -> tuple[Node | None, int]:
        """The longest tail that occurred before, followed by something (of the context
        followed by `after`, when given: the tails walked on through those tokens)."""
        tails = [(node, len(self.tails) - i) for i, node in enumerate(self.tails)]
        for token in after:
            grown = [(node.children[token], n + 1) for node, n in [*tails, (self.trie.root, 0)]
                     if token in node.children]  # fmt: skip
            tails = [(node, n) for node, n in grown if n < DEPTH]
        for node, n in tails:
            if node.children:
                return node, n
        return None, 0


def follow(node: Node, match_len: int, k: int) -> tuple[list[int], float]:
    """The most frequent continuation from node, and its expected accepted length."""
    limit = min(k, max(1, int(MAX_FACTOR * match_len)))
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while node.children and len(tokens) < limit:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / sum(c.count for c in node.children.values())
        if prob < MIN_PROB:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


@dataclass
class _TenantCache:
    trie: SuffixTrie = field(default_factory=SuffixTrie)
    outputs: deque[list[int]] = field(default_factory=deque)
    num_tokens: int = 0

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[-CACHE_TOKENS:]
        self.trie.add(tokens)
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        while self.num_tokens > CACHE_TOKENS:
            old = self.outputs.popleft()
            self.trie.add(old, sign=-1)
            self.num_tokens -= len(old)


class SuffixProposer(Proposer):
    def __init__(self) -> None:
        self._requests: dict[str, Growing] = {}
        self._tenants: OrderedDict[str | None, _TenantCache] = OrderedDict()

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        own = self._requests.get(request.request_id)
        if own is None:
            own = self._requests[request.request_id] = Growing()
            start = max(0, request.num_prompt_tokens - PROMPT_TOKENS)
            own.num_tokens = start
        known = request.num_known_tokens
        if known > own.num_tokens:
            own.extend(request.token_ids_range(own.num_tokens, known))
        best: tuple[list[int], float] = ([], 0.0)
        node, length = own.longest_match(after)
        if node is not None:
            best = follow(node, length, k)
        cache = self._tenants.get(request.cache_salt)
        if cache is not None:
            self._tenants.move_to_end(request.cache_salt)
            tail = request.token_ids_range(max(0, known - DEPTH + 1), known) + list(after)
            node, length = cache.trie.longest_match(tail[-(DEPTH - 1) :])
            if node is not None:
                found = follow(node, length, k)
                if found[1] > best[1]:
                    best = found
        return best[0]

    def finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        if not request.output_token_ids or request.pooling is not None:
            return
        cache = self._tenants.get(request.cache_salt)
        if cache is None:
            cache = self._tenants[request.cache_salt] = _TenantCache()
            while len(self._tenants) > CACHE_TENANTS:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(request.cache_salt)
        cache.add(list(request.output_token_ids))
