"""How a pooling call's inputs reach the engine: a call of up to its least chunk
(PIPELINE_MIN_CHUNK; IDLE_PIPELINE_MIN_CHUNK on an idle engine) is tokenised as one batch and
runs in one engine step when it fits the token budget; larger calls are pipelined a chunk at a
time; either way in input order, with sentence-transformers' vectors and every token counted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from mmserve.engine.sched_output import SchedulerOutput
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.async_frontend import AsyncFrontEnd
from tests.utils.engine_idle import is_idle


def _spy_batches(engine: AsyncFrontEnd, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token counts of each batch a call hands the engine, as it hands them."""
    sent: list[list[int]] = []
    real = engine.pool_batch

    async def spy(inputs, params):  # type: ignore[no-untyped-def]
        sent.append([len(i.token_ids) for i in inputs])
        return await real(inputs, params)

    monkeypatch.setattr(engine, "pool_batch", spy)
    return sent


def _spy_steps(engine: AsyncFrontEnd, monkeypatch: pytest.MonkeyPatch) -> list[SchedulerOutput]:
    """Each engine step's plan (an empty one only lands the step before)."""
    scheduler = engine.frontend.core.scheduler
    steps: list[SchedulerOutput] = []
    real = scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        plan = real()
        steps.append(plan)
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
    every token, and the vectors are sentence-transformers'. (On an idle engine by default a
    call of more than IDLE_PIPELINE_MIN_CHUNK is pipelined: set to PIPELINE_MIN_CHUNK here.)"""
    count = pooling_api.PIPELINE_MIN_CHUNK
    monkeypatch.setattr(pooling_api, "IDLE_PIPELINE_MIN_CHUNK", count)
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
    assert [len(plan.scheduled) for plan in steps if plan.scheduled] == [count]
    assert result.prompt_tokens == sum(lengths)


@pytest.mark.parametrize("count", [150, pooling_api.PIPELINE_MIN_CHUNK], ids=["larger", "idle"])
def test_a_call_is_pipelined_in_input_order(
    count: int, minilm_async: AsyncFrontEnd, sentence_transformer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of more than PIPELINE_MIN_CHUNK inputs, or of that many finding the engine idle
    (its least chunk IDLE_PIPELINE_MIN_CHUNK), sends its first batch as soon as it is
    tokenised (the model runs it while the rest is tokenised): more than one batch, in input
    order, none over chunk_size; and the vectors are sentence-transformers' whatever the
    split."""
    texts = [f"text number {i}: " + "word " * (i % 7) for i in range(count)]
    sent = _spy_batches(minilm_async, monkeypatch)
    assert is_idle(minilm_async)
    result = asyncio.run(pooling_api.embed(minilm_async, texts))
    _assert_sentence_transformers(result.embeddings, texts, sentence_transformer)
    assert len(sent) > 1 and max(map(len, sent)) <= pooling_api.chunk_size(len(texts), idle=True)
    lengths = [len(ids) for ids in minilm_async.frontend.tokenizer(texts)["input_ids"]]
    assert [n for batch in sent for n in batch] == lengths  # in input order
    assert result.prompt_tokens == sum(lengths)


def test_a_whole_call_past_the_token_budget_is_scheduled_within_it(
    minilm_async: AsyncFrontEnd, sentence_transformer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call sent whole whose tokens exceed max_num_batched_tokens runs over several steps,
    none past the budget, and its vectors are still sentence-transformers'."""
    monkeypatch.setattr(pooling_api, "IDLE_PIPELINE_MIN_CHUNK", pooling_api.PIPELINE_MIN_CHUNK)
    budget = minilm_async.frontend.core.config.scheduler.budget
    texts = [f"number {i} " + "word " * 40 for i in range(pooling_api.PIPELINE_MIN_CHUNK)]
    lengths = [len(ids) for ids in minilm_async.frontend.tokenizer(texts)["input_ids"]]
    assert sum(lengths) > budget
    sent = _spy_batches(minilm_async, monkeypatch)
    steps = _spy_steps(minilm_async, monkeypatch)
    result = asyncio.run(pooling_api.embed(minilm_async, texts))
    _assert_sentence_transformers(result.embeddings, texts, sentence_transformer)
    assert len(sent) == 1
    tokens = [plan.num_tokens for plan in steps]
    assert len([n for n in tokens if n]) > 1 and max(tokens) <= budget
    assert sum(tokens) == sum(lengths) == result.prompt_tokens


def test_a_batch_answers_in_its_input_order_whatever_order_the_engine_finishes_it(
    minilm_async: AsyncFrontEnd, sentence_transformer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sink collects a batch's results by request id: news that come back in reverse
    still give each input its own vector."""
    frontend = minilm_async.frontend
    real = frontend.step
    monkeypatch.setattr(frontend, "step", lambda: real()[::-1])
    texts = [f"text number {i}: " + "word " * (i % 7) for i in range(20)]
    result = asyncio.run(pooling_api.embed(minilm_async, texts))
    _assert_sentence_transformers(result.embeddings, texts, sentence_transformer)


def test_a_request_failing_in_the_engine_fails_its_call(
    minilm_async: AsyncFrontEnd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pooling request the engine fails (in the first of the batch's several steps: over
    the token budget) fails its call with the engine's error; nothing stays in the engine,
    and it serves the next call."""
    from mmserve.engine.messages import EngineOutput
    from mmserve.frontend.frontend import PooledResult
    from tests.utils.engine_idle import wait_until_idle

    monkeypatch.setattr(pooling_api, "IDLE_PIPELINE_MIN_CHUNK", pooling_api.PIPELINE_MIN_CHUNK)
    frontend = minilm_async.frontend
    real = frontend.step
    failed: list[str] = []

    def failing_step():  # type: ignore[no-untyped-def]
        news = real()
        if news and not failed:
            failed.append(news[0].request_id)
            news[0] = PooledResult(failed[0], EngineOutput(failed[0], [], None, None, "abort", error="boom"))
        return news

    monkeypatch.setattr(frontend, "step", failing_step)
    texts = [f"number {i} " + "word " * 40 for i in range(pooling_api.PIPELINE_MIN_CHUNK)]

    async def call() -> None:
        with pytest.raises(RuntimeError, match=r"pooling request req-\d+ failed: boom"):
            await pooling_api.embed(minilm_async, texts)
        await wait_until_idle(minilm_async)
        assert is_idle(minilm_async)
        monkeypatch.setattr(frontend, "step", real)
        assert (await pooling_api.embed(minilm_async, texts[:2])).embeddings.shape == (2, 384)

    asyncio.run(call())
