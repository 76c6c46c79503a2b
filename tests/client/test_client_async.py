"""The AsyncClient against the fake server (plain asyncio.run, no plugin)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_inference import POOLING_MODEL, RICH_DELAY_S, RICH_FIELD, VECTOR, FakeInference

from mmserve_client import AsyncClient, MMServeError


def test_async_client_end_to_end(target: str, fake: FakeInference) -> None:
    async def main() -> None:
        async with AsyncClient(target, api_key="ak", timeout=10) as c:
            await c.wait_ready(5)
            r = await c.generate("hey", max_tokens=4)
            assert (r.text, r.finish_reason) == ("hey", "stop")
            texts = [ch.text async for ch in c.chat_stream([{"role": "user", "content": "yo"}])]
            assert "".join(texts) == "yo"
            assert [x.text for x in await c.generate("ab", n=2)] == ["ab", "ab"]
            (vec,) = await c.embed(["abc"], encoding="fp16")
            assert list(vec) == pytest.approx(VECTOR)
            assert (await c.rerank("a", ["a", "b"]))[0].index == 0
            assert (await c.classify("tiny"))[0].label == "short"
            scores = await c.score("q", ["q"])
            assert scores == [1.0] and (scores.model, scores.request_id) == (POOLING_MODEL, "pool-1")
            assert (await c.embed(["abc"])).usage is not None
            assert (await c.tokenize("hi")).token_ids == (104, 105)
            assert await c.detokenize([104]) == "h"
            assert (await c.list_models())[0].name == "fake-model"

    asyncio.run(main())
    assert {m.get("authorization") for m in fake.metadata} == {"Bearer ak"}


def test_async_break_cancels_the_server_call(target: str, fake: FakeInference) -> None:
    async def main() -> None:
        async with AsyncClient(target) as c:
            async for chunk in c.generate_stream("slow"):
                assert chunk.text == "tick"
                break
            # Checked while the channel is still open: closing it would cancel anyway.
            assert await asyncio.to_thread(fake.slow_ended.wait, 5)

    asyncio.run(main())


def test_async_errors_and_retries(target: str, fake: FakeInference) -> None:
    async def main() -> None:
        async with AsyncClient(target) as c:
            with pytest.raises(MMServeError) as e:
                await c.generate("fail:RESOURCE_EXHAUSTED")
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(MMServeError) as e:
                await c.embed("rich:INVALID_ARGUMENT")
            assert e.value.field == RICH_FIELD
            with pytest.raises(MMServeError) as e:
                async for _ in c.generate_stream("rich:RESOURCE_EXHAUSTED"):
                    pass
            assert e.value.retry_delay == RICH_DELAY_S
            with pytest.raises(MMServeError) as e:
                async for _ in c.generate_stream("slow", timeout=0.3):
                    pass
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await c.detokenize([1, 2])) == "\x01\x02"
            assert (await c.tokenize("flaky")).token_ids[0] == ord("f")

    asyncio.run(main())
    assert fake.attempts["Tokenize:flaky"] == 2
