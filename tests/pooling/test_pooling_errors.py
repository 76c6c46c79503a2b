"""Bad pooling input is refused before it reaches the engine, with InvalidArgument naming the
field (the server maps it to INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

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


def _spy_batches(engine: AsyncFrontEnd, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token counts of each batch a call hands the engine, as it hands them."""
    sent: list[list[int]] = []
    real = engine.pool_batch

    async def spy(inputs, params):  # type: ignore[no-untyped-def]
        sent.append([len(i.token_ids) for i in inputs])
        return await real(inputs, params)

    monkeypatch.setattr(engine, "pool_batch", spy)
    return sent


def _spy_steps(engine: AsyncFrontEnd, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The requests each engine step schedules (0: a step that only lands the one before)."""
    scheduler = engine.frontend.core.scheduler
    steps: list[int] = []
    real = scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        plan = real()
        steps.append(len(plan.scheduled))
        return plan

    monkeypatch.setattr(scheduler, "schedule", spy)
    return steps


def _assert_sentence_transformers(vectors: torch.Tensor, texts: list[str], st: Any) -> None:
    reference = st.encode(texts, convert_to_tensor=True).float()
    cosine = torch.nn.functional.cosine_similarity(vectors, reference, dim=-1)
    assert cosine.min().item() > 0.9999


def test_a_call_within_one_step_reaches_the_engine_whole_and_runs_in_one_step(
    minilm_async: AsyncFrontEnd, sentence_transformer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of PIPELINE_MIN_CHUNK texts on an idle engine is tokenised as one batch and sent
    as one, so one engine step runs all of it (and the next only lands it), its usage counts
    every token, and the vectors are sentence-transformers'."""
    count = pooling_api.PIPELINE_MIN_CHUNK
    texts = [f"text number {i}: " + "word " * (i % 7) for i in range(count)]
    encoder = minilm_async.frontend.input_encoder
    encoded: list[int] = []
    real_encode = encoder.encode

    def encode_spy(inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        encoded.append(len(inputs))
        return real_encode(inputs, *args, **kwargs)

    monkeypatch.setattr(encoder, "encode", encode_spy)
    sent = _spy_batches(minilm_async, monkeypatch)
    steps = _spy_steps(minilm_async, monkeypatch)
    assert is_idle(minilm_async)
    result = asyncio.run(pooling_api.embed(minilm_async, texts))
    _assert_sentence_transformers(result.embeddings, texts, sentence_transformer)
    lengths = [len(ids) for ids in minilm_async.frontend.tokenizer(texts)["input_ids"]]
    assert sum(lengths) <= minilm_async.frontend.core.config.scheduler.budget
    assert encoded == [count] and sent == [lengths]
    assert [n for n in steps if n] == [count]
    assert result.prompt_tokens == sum(lengths)


def test_a_larger_call_is_pipelined_in_input_order(
    minilm_async: AsyncFrontEnd, sentence_transformer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of more than PIPELINE_MIN_CHUNK inputs sends its first batch as soon as it is
    tokenised (the model runs it while the rest is tokenised): more than one batch, in input
    order, none over chunk_size; and the vectors are sentence-transformers' whatever the
    split."""
    texts = [f"text number {i}: " + "word " * (i % 7) for i in range(150)]
    sent = _spy_batches(minilm_async, monkeypatch)
    result = asyncio.run(pooling_api.embed(minilm_async, texts))
    _assert_sentence_transformers(result.embeddings, texts, sentence_transformer)
    assert len(sent) > 1 and max(map(len, sent)) <= pooling_api.chunk_size(len(texts))
    lengths = [len(ids) for ids in minilm_async.frontend.tokenizer(texts)["input_ids"]]
    assert [n for batch in sent for n in batch] == lengths  # in input order
    assert result.prompt_tokens == sum(lengths)
