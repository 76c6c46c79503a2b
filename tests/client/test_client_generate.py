"""Generate / chat through the sync Client against the fake server."""

from __future__ import annotations

import grpc
import pytest
from fake_inference import RICH_DELAY_S, RICH_FIELD, FakeInference

from mmserve_client import Client, GenerateChunk, MMServeError, ToolCall, Usage


def test_generate_collects_the_stream(client: Client, fake: FakeInference) -> None:
    r = client.generate("hello", max_tokens=8, temperature=0, request_id="r1")
    assert r.text == "hello"
    assert r.token_ids == tuple(map(ord, "hello"))
    assert r.finish_reason == "stop" and r.stop == 2
    assert r.usage == Usage(prompt_tokens=5, completion_tokens=5, cached_tokens=0)
    assert r.timing is not None and r.timing.total_ms == pytest.approx(1.5)
    assert (r.request_id, r.model) == ("r1", "fake-model")
    sent = fake.requests[-1]
    assert sent.params.max_tokens == 8 and sent.params.HasField("temperature")
    assert not sent.params.HasField("top_p")  # unset stays unset: the server's default


def test_stream_chunks_concatenate(client: Client) -> None:
    chunks = list(client.generate_stream([104, 105], logprobs=2))
    assert all(isinstance(c, GenerateChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == "hi"
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert chunks[-1].usage is not None and chunks[0].usage is None
    top = chunks[0].logprobs[0].top
    assert [t.token_id for t in top] == [104, 105] and top[1].logprob == pytest.approx(-1.5)


def test_n_returns_one_result_per_choice(client: Client) -> None:
    results = client.generate("ab", n=3)
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.text for r in results] == ["ab"] * 3
    assert len(client.generate("ab", n=1)) == 1  # n given: always a list


def test_chat_tool_call_deltas_are_joined(client: Client, fake: FakeInference) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    r = client.chat(
        [{"role": "user", "content": "Paris?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=16,
    )
    assert r.finish_reason == "tool_calls"
    assert r.tool_calls == (ToolCall("call_0", "weather", '{"city": "Paris"}'),)
    assert r.tool_calls[0].parsed_arguments() == {"city": "Paris"}
    sent = fake.requests[-1]
    assert sent.chat.tool_choice.mode == sent.chat.tool_choice.MODE_REQUIRED
    assert sent.params.max_tokens == 16


def test_break_cancels_the_server_call(client: Client, fake: FakeInference) -> None:
    for chunk in client.generate_stream("slow"):
        assert chunk.text == "tick"
        break
    assert fake.slow_ended.wait(5), "the server never saw the call end"


def test_leaving_with_cancels_the_server_call(client: Client, fake: FakeInference) -> None:
    with client.chat_stream([{"role": "user", "content": "slow"}]) as stream:
        next(stream)
        assert not fake.slow_ended.is_set()
    assert fake.slow_ended.wait(5)


def test_deadline_maps_to_mmserve_error(client: Client) -> None:
    with pytest.raises(MMServeError) as e:
        client.generate("slow", timeout=0.3)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL"])
def test_server_errors_map_to_mmserve_error(client: Client, code: str) -> None:
    with pytest.raises(MMServeError) as e:
        client.generate(f"fail:{code}")
    assert e.value.code == grpc.StatusCode[code]
    assert e.value.message == f"fake failure {code}"
    assert str(e.value).startswith(code)


def test_error_details_name_the_field_and_the_retry_delay(client: Client) -> None:
    """The google.rpc details mmserve attaches reach the caller: the bad field (BadRequest)
    and how long to wait (RetryInfo), on streams and unary calls alike."""
    with pytest.raises(MMServeError) as e:
        client.generate("rich:INVALID_ARGUMENT")
    assert (e.value.field, e.value.retry_delay) == (RICH_FIELD, None)
    with pytest.raises(MMServeError) as e:
        client.tokenize("rich:RESOURCE_EXHAUSTED")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (e.value.field, e.value.retry_delay) == (None, RICH_DELAY_S)
    with pytest.raises(MMServeError) as e:  # no details: nothing invented
        client.generate("fail:INVALID_ARGUMENT")
    assert (e.value.field, e.value.retry_delay) == (None, None)


def test_api_key_sent_on_every_call(target: str, fake: FakeInference) -> None:
    with Client(target, api_key="k1", metadata=[("x-tenant", "t")]) as c:
        c.generate("a")
        c.tokenize("a")
    with Client(target) as c:
        c.list_models()
    assert [m.get("authorization") for m in fake.metadata] == ["Bearer k1", "Bearer k1", None]
    assert fake.metadata[0]["x-tenant"] == "t"


def test_unavailable_is_retried_but_never_after_a_chunk(
    client: Client, fake: FakeInference
) -> None:
    """Generate is retried only while it got nothing (gRPC commits a call at its first
    response): a stream that already gave a chunk fails, and is not replayed."""
    assert client.tokenize("flaky").token_ids == tuple(map(ord, "flaky"))
    assert fake.attempts["Tokenize:flaky"] == 2
    assert client.generate("flaky").text == "flaky"
    assert fake.attempts["Generate:flaky"] == 2
    stream = client.generate_stream("midfail")
    chunks = iter(stream)
    assert next(chunks).text == "m"
    with pytest.raises(MMServeError) as e:
        next(chunks)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert fake.attempts["Generate:midfail"] == 1


def test_unknown_keyword_is_a_type_error(client: Client) -> None:
    with pytest.raises(TypeError, match="temprature"):
        client.generate("a", temprature=0)  # type: ignore[call-arg]
