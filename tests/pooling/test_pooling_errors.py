"""Bad pooling input is refused before it reaches the engine, with InvalidArgument naming the
field (the server maps it to INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.errors import InvalidArgument
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.params import SamplingParams
from tests.utils.engine_idle import is_idle, wait_until_idle

LONG = "word " * 400  # > 256 tokens


def field_of(call: Callable[[], Any]) -> str:
    with pytest.raises(InvalidArgument) as info:
        call()
    assert str(info.value).startswith(f"{info.value.field}: ")
    return info.value.field


def test_embed_input_errors(minilm_llm: LLM) -> None:
    assert field_of(lambda: minilm_llm.embed([])) == "inputs"
    assert field_of(lambda: minilm_llm.embed(["ok", LONG])) == "inputs[1]"
    assert field_of(lambda: minilm_llm.embed([[101, 10**6, 102]])) == "inputs[0]"
    assert field_of(lambda: minilm_llm.embed([[]])) == "inputs[0]"
    assert field_of(lambda: minilm_llm.embed(["a"], dimensions=385)) == "dimensions"
    assert field_of(lambda: minilm_llm.embed(["a"], dimensions=0)) == "dimensions"
    assert field_of(lambda: minilm_llm.embed(["a"], truncate="middle")) == "truncate"
    too_many = [[101, 102]] * (pooling_api.MAX_INPUTS_PER_CALL + 1)
    assert field_of(lambda: minilm_llm.embed(too_many)) == "inputs"


def test_too_long_names_the_input_and_the_limit(minilm_llm: LLM) -> None:
    with pytest.raises(InvalidArgument, match=r"inputs\[1\]: \d+ tokens exceed the limit of 256"):
        minilm_llm.embed(["ok", LONG], truncate="none")
    assert len(minilm_llm.embed([LONG], truncate="left")[0]) == 384


def test_tasks_the_model_cannot_do(minilm_llm: LLM, tiny_llms: Callable[[str], LLM]) -> None:
    assert field_of(lambda: minilm_llm.classify(["a"])) == "model"
    assert field_of(lambda: minilm_llm.generate(["a"], SamplingParams(max_tokens=2))) == "model"
    classifier = tiny_llms("bert-classifier")  # three labels: no score
    assert field_of(lambda: classifier.embed(["a"])) == "model"
    assert field_of(lambda: classifier.score("a", ["b"])) == "model"
    assert field_of(lambda: classifier.rerank("a", ["b"])) == "model"


def test_score_and_rerank_errors(minilm_llm: LLM, tiny_llms: Callable[[str], LLM]) -> None:
    assert field_of(lambda: minilm_llm.score(["a", "b"], ["c", "d", "e"])) == "first"
    assert field_of(lambda: minilm_llm.score([], ["c"])) == "first"
    assert field_of(lambda: minilm_llm.score(["a"], [])) == "second"
    assert field_of(lambda: minilm_llm.score(["a"], ["ok", LONG])) == "second[1]"
    assert field_of(lambda: minilm_llm.rerank("q", [])) == "documents"
    assert field_of(lambda: minilm_llm.rerank("q", ["d"], top_n=0)) == "top_n"
    assert field_of(lambda: minilm_llm.rerank(" ", ["d"])) == "query"
    cross = tiny_llms("bert-cross-encoder")
    assert field_of(lambda: cross.score("a", [[101, 102]])) == "second[0]"
    assert field_of(lambda: cross.score("a", ["ok", "b " * 100])) == "second[1]"
    assert field_of(lambda: cross.rerank("a", ["ok", "b " * 100])) == "documents[1]"


def test_async_errors_raise_before_the_engine(minilm_async: AsyncFrontEnd) -> None:
    async def call(coro: Any) -> None:
        await coro

    with pytest.raises(InvalidArgument, match="^inputs: must not be empty"):
        asyncio.run(call(pooling_api.embed(minilm_async, [])))
    with pytest.raises(InvalidArgument, match="^dimensions: 999 exceeds"):
        asyncio.run(call(pooling_api.embed(minilm_async, ["a"], dimensions=999)))
    with pytest.raises(InvalidArgument, match="^model: "):
        asyncio.run(call(pooling_api.classify(minilm_async, ["a"])))
    with pytest.raises(InvalidArgument, match="^first: has 2 items"):
        asyncio.run(call(pooling_api.score(minilm_async, ["a", "b"], ["c"])))
    assert minilm_async.num_in_flight == 0


def test_a_bad_input_in_a_later_chunk_fails_the_call_and_frees_the_engine(
    minilm_async: AsyncFrontEnd,
) -> None:
    """Inputs go to the engine a chunk at a time; a bad one past the first chunk fails the call
    naming it, the chunks already sent are aborted, and the engine serves the next call."""
    texts = ["a short text"] * 70
    texts[67] = LONG
    assert pooling_api.chunk_size(len(texts)) < 67

    async def call() -> None:
        with pytest.raises(InvalidArgument, match=r"inputs\[67\]"):
            await pooling_api.embed(minilm_async, texts, truncate="none")
        await wait_until_idle(minilm_async)  # the aborts reach the engine thread
        assert is_idle(minilm_async)
        result = await pooling_api.embed(minilm_async, texts[:3])
        assert result.embeddings.shape == (3, 384)

    asyncio.run(call())


def test_token_ids_outside_the_vocabulary_name_the_first_input_holding_one(
    minilm_llm: LLM,
) -> None:
    """The vocabulary is checked over a batch in one pass: the bound itself is refused, the
    input named is the first with a bad id, and the id named is its first bad one."""
    vocab = minilm_llm.frontend.vocab_size
    assert len(minilm_llm.embed([[101, vocab - 1, 102], [0]])) == 2  # both ends allowed
    cases = [
        ([[101, 102], "text", [101, vocab, 102]], f"inputs[2]: token id {vocab} "),
        ([[101, -1, 102]], "inputs[0]: token id -1 "),
        ([[1], [2, vocab + 5, -3], [vocab]], f"inputs[1]: token id {vocab + 5} "),
        ([[1], [2, 2**70]], f"inputs[1]: token id {2**70} "),  # past int64
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidArgument) as info:
            minilm_llm.embed(inputs)
        assert str(info.value).startswith(message + f"is outside the vocabulary [0, {vocab})")
    with pytest.raises(InvalidArgument, match=r"^first\[0\]: token id"):
        minilm_llm.score([[101, vocab]], ["b"])


def test_texts_are_checked_where_the_tokenizer_can_emit_ids_past_the_vocabulary(
    minilm_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer's own ids skip the check only when none can fall outside the model's
    vocabulary; a model with fewer embeddings than its tokenizer has ids still refuses them."""
    import msgspec

    frontend = minilm_llm.frontend
    assert frontend.input_encoder.max_token_id == frontend.vocab_size - 1  # MiniLM's: trusted
    monkeypatch.setattr(frontend, "info", msgspec.structs.replace(frontend.info, vocab_size=2000))
    with pytest.raises(InvalidArgument, match=r"^inputs\[1\]: token id \d+ is outside .* 2000\)"):
        minilm_llm.embed(["the", "hello"])  # [CLS] the [SEP] fit; "hello" is 7592
