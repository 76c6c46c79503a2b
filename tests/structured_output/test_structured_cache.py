"""GrammarCache (LRU, once per key, errors cached, time limit) and the manager/registry."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from mmserve.errors import InvalidArgument, ResourceExhausted
from mmserve.structured_output import CompiledGrammar, GrammarMatcher, StructuredOutputParams
from mmserve.structured_output.cache import GrammarCache
from mmserve.structured_output.registry import get_backend_class
from tests.structured_output.conftest import PADDED_VOCAB, SMOLLM2_EOS


class Fake(CompiledGrammar):
    def matcher(self) -> GrammarMatcher:
        raise NotImplementedError


class Counter:
    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.calls, self.delay, self.error = 0, delay, error

    def __call__(self) -> CompiledGrammar:
        self.calls += 1
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return Fake()


def test_compiles_once_per_key_even_when_asked_concurrently() -> None:
    cache, compile_fn = GrammarCache(), Counter(delay=0.2)
    results: list[CompiledGrammar] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get("k", compile_fn)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compile_fn.calls == 1 and len({id(r) for r in results}) == 1
    cache.close()


def test_lru_bound() -> None:
    cache, compile_fn = GrammarCache(max_entries=2), Counter()
    for key in ("a", "b", "a", "c"):  # "a" was used last before "c": "b" is evicted
        cache.get(key, compile_fn)
    assert compile_fn.calls == 3 and len(cache) == 2
    cache.get("a", compile_fn)
    cache.get("b", compile_fn)
    assert compile_fn.calls == 4
    cache.close()


def test_invalid_input_is_cached_but_bugs_are_not() -> None:
    cache = GrammarCache()
    bad = Counter(error=InvalidArgument("structured.regex", "nope"))
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="nope"):
            cache.get("bad", bad)
    assert bad.calls == 1
    bug = Counter(error=RuntimeError("bug"))
    for _ in range(2):
        with pytest.raises(RuntimeError):
            cache.get("bug", bug)
    assert bug.calls == 2
    cache.close()


def test_time_limit() -> None:
    cache, slow = GrammarCache(timeout_s=0.1), Counter(delay=0.5)
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match="took too long") as info:
        cache.get("slow", slow, field="structured.json_schema")
    assert info.value.field == "structured.json_schema"
    assert time.monotonic() - start < 0.4
    with pytest.raises(InvalidArgument, match="took too long"):  # the verdict is cached
        cache.get("slow", slow)
    assert slow.calls == 1
    cache.close()


def test_no_free_worker_is_resource_exhausted() -> None:
    cache = GrammarCache(timeout_s=0.2, max_workers=1)
    with pytest.raises(InvalidArgument):
        cache.get("slow", Counter(delay=1.0))  # keeps the only worker busy after it expires
    quick = Counter()
    with pytest.raises(ResourceExhausted):
        cache.get("quick", quick)
    assert quick.calls == 0
    time.sleep(1.0)
    cache.get("quick", quick)  # not cached as a failure
    assert quick.calls == 1
    cache.close()


def test_registry_lists_valid_names() -> None:
    with pytest.raises(InvalidArgument, match="unknown backend 'nope'; valid: outlines, xgrammar"):
        get_backend_class("nope")


def test_manager(tokenizer: Any) -> None:
    from mmserve.structured_output import StructuredOutputManager

    with pytest.raises(InvalidArgument, match="valid: outlines, xgrammar"):
        StructuredOutputManager(tokenizer, PADDED_VOCAB, SMOLLM2_EOS, default_backend="nope")
    manager = StructuredOutputManager(tokenizer, PADDED_VOCAB, SMOLLM2_EOS)
    params = StructuredOutputParams("choice", ["a", "b"])
    first = manager.compile(params)
    assert manager.compile(StructuredOutputParams("choice", ("a", "b"), "xgrammar")) is first
    assert asyncio.run(manager.compile_async(params)) is first
    assert manager.backend().name == "xgrammar"
    with pytest.raises(InvalidArgument, match="structured.regex"):
        manager.compile(StructuredOutputParams("regex", "(a"))
    manager.close()
    # with outlines the default, "auto" sends what outlines cannot compile to xgrammar
    manager = StructuredOutputManager(tokenizer, PADDED_VOCAB, SMOLLM2_EOS, default_backend="outlines")
    grammar = StructuredOutputParams("grammar", 'root ::= "a"')
    assert manager.compile(grammar) is manager.compile(replace(grammar, backend="xgrammar"))
    with pytest.raises(InvalidArgument, match="structured.grammar: the outlines backend"):
        manager.compile(replace(grammar, backend="outlines"))
    assert manager.backend().name == "outlines"
    manager.close()
