"""A model served with --speculative: the answers are those of the same model without it,
usage reports the guesses checked and accepted, ListModels names the method, and a request
can opt out (through the SDK, by the proto field's name)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from mmserve.config import SpeculativeConfig
from mmserve.server.config import ModelSpec
from mmserve.server.models import load_models
from mmserve_client import Client
from tests.server.conftest import TEST_CONFIG, ServerThread, tiny_template, wait_all_blocks_free

PROMPT = "a b c a b c a b c a b"  # the tiny model falls into a loop: guesses find it


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path]) -> Iterator[tuple[ServerThread, ServerThread]]:
    spec = [ModelSpec("tiny", str(tiny_models["tiny-a"]))]
    template = replace(tiny_template(), speculative=SpeculativeConfig(method="ngram"))
    fast = ServerThread(load_models(spec, template, TEST_CONFIG), TEST_CONFIG).start()
    plain = ServerThread(load_models(spec, tiny_template(), TEST_CONFIG), TEST_CONFIG).start()
    yield fast, plain
    fast.stop()
    plain.stop()


def test_same_answers_and_usage_counts_guesses(servers: tuple[ServerThread, ServerThread]) -> None:
    fast, plain = servers
    with Client(fast.target, timeout=60) as c, Client(plain.target, timeout=60) as p:
        (info,) = c.list_models()
        assert info.speculative == "ngram"
        assert p.list_models()[0].speculative == ""
        kwargs = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
        got = c.generate(PROMPT, **kwargs)
        want = p.generate(PROMPT, **kwargs)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.usage is not None and want.usage is not None
        assert 0 < got.usage.accepted_draft_tokens <= got.usage.draft_tokens
        assert want.usage.draft_tokens == 0
        streamed = list(c.generate_stream(PROMPT, **kwargs))
        assert tuple(t for chunk in streamed for t in chunk.token_ids) == tuple(want.token_ids)
        off = c.generate(PROMPT, disable_speculation=True, **kwargs)
        assert off.token_ids == want.token_ids
        assert off.usage is not None and off.usage.draft_tokens == 0
    wait_all_blocks_free(fast.handle("tiny"))
