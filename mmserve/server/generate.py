"""The Generate RPC: request -> prompt token ids and params -> streamed chunks.

Tokenisation of anything sizeable and chat templating run on the model's own front-end
threads (AsyncFrontEnd.run), and the engine steps on its own thread, so the event loop only
shuffles messages and one model's slow work never takes another model's threads."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mmserve.errors import EngineDead, InvalidArgument
from mmserve.frontend.chat import ChatPrompt
from mmserve.frontend.frontend import GenerateJob, GenerationDelta
from mmserve.frontend.prompts import PromptLimit, TokenLimit
from mmserve.frontend.reasoning import ChoiceReasoning, ReasoningOutput
from mmserve.frontend.tool_stream import ChoiceToolStream, ToolOutput
from mmserve.inputs import MMInput
from mmserve.processors.images import DecodedImage
from mmserve.server import calls, convert
from mmserve.server.config import ServerConfig
from mmserve.server.errors import EngineFailed, engine_error
from mmserve.server.images import ImageInputs
from mmserve.server.models import ModelHandle
from mmserve_client.v1 import generate_pb2

T = TypeVar("T")
OFF_LOOP_CHARS = 2048  # texts longer than this are tokenised on the model's front-end threads


async def off_loop(
    handle: ModelHandle, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """fn(*args) on the model's front-end threads when the input is big enough to stall the
    event loop; small inputs are done in place (a thread hop costs more than they do)."""
    if size > OFF_LOOP_CHARS:
        return await handle.engine.run(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def render_chat(
    handle: ModelHandle,
    chat: generate_pb2.Chat,
    images: ImageInputs | None,
    namespace: str = "",
    limit: TokenLimit | None = None,
) -> ChatPrompt:
    """The chat's prompt (images expanded), as Generate feeds it; limit: as for chat_prompt."""
    return await chat_prompt(handle, await chat_input(handle, chat), images, namespace, limit)


async def chat_input(handle: ModelHandle, chat: generate_pb2.Chat) -> convert.ProtoChat:
    """The chat converted, off the loop when big: each message, part and tool is Python work,
    and a 64 MiB chat of tiny ones would hold every call of the server for seconds."""
    return await off_loop(handle, chat.ByteSize(), convert.chat_input, chat)


async def chat_prompt(
    handle: ModelHandle,
    c: convert.ProtoChat,
    images: ImageInputs | None,
    namespace: str = "",
    limit: TokenLimit | None = None,
) -> ChatPrompt:
    """The chat's images loaded (`namespace`, the cache_salt, scopes their uuids), then
    rendered by the model's front end; templates are arbitrary jinja: always off the loop, on
    the model's own threads. The front end names fields within the chat: here they are
    named from the request (chat.messages[0].role). limit: a prompt found far past it is
    refused before it is tokenised (None: any length)."""
    decoded: list[DecodedImage] = []
    if c.sources:
        if images is None or not handle.frontend.info.reads_images:
            raise InvalidArgument(c.image_fields[0], f"model {handle.name!r} does not read images")
        decoded = await images.load(
            list(zip(c.image_fields, c.sources)), "chat.messages", handle.engine,
            namespace,
        )
    try:
        return await handle.engine.run(handle.frontend.render_chat, c, decoded, limit)
    except InvalidArgument as e:
        if e.field == "chat" or e.field.startswith("chat."):
            raise
        raise InvalidArgument(f"chat.{e.field}", e.message) from e


async def prompt_ids(
    request: generate_pb2.GenerateRequest,
    handle: ModelHandle,
    chat: convert.ProtoChat | None = None,
    images: ImageInputs | None = None,
    limit: PromptLimit | None = None,
) -> tuple[str, list[int], tuple[MMInput, ...]]:
    """(the input field's name, its token ids, its images as MMInputs); `chat`:
    request.chat, converted already. A text found far past `limit` (None: the context's)
    from a part of it is refused without tokenising the rest."""
    kind = request.WhichOneof("input")
    limit = limit or handle.frontend.prompt_limit()
    if kind == "prompt":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        encode = handle.frontend.encode_prompt
        return kind, await off_loop(
            handle, len(request.prompt), encode, request.prompt, add_special, limit
        ), ()
    if kind == "chat":
        c = chat or await chat_input(handle, request.chat)
        prompt = await chat_prompt(handle, c, images, request.cache_salt, limit)
        return kind, prompt.token_ids, prompt.mm_inputs
    if kind == "token_ids":
        return kind, list(request.token_ids.ids), ()
    raise InvalidArgument("input", "set one of prompt, chat or token_ids")


@dataclass
class Prepared:
    """A Generate request checked and ready for the engine."""

    handle: ModelHandle
    request_id: str  # the caller's, or a generated one: only echoed in the chunks
    job: GenerateJob  # validated by the model's front end, under an id of the engine's own
    received: float  # time.monotonic() when the call arrived
    tools: ToolOutput | None = None  # how to read tool calls; None: the output is only text
    reasoning: ReasoningOutput | None = None  # how to read a thought; None: the model has none


async def prepare(
    request: generate_pb2.GenerateRequest,
    handle: ModelHandle,
    config: ServerConfig,
    received: float,
    images: ImageInputs | None = None,
) -> Prepared:
    """The request as front-end values with the server's own limits applied, then validated
    once by the model's front end; InvalidArgument names the field."""
    handle.require_serving()  # a dead (or restarting) engine: UNAVAILABLE before any work
    structured = convert.structured_output(request, config.structured_output_backend)
    params = convert.sampling_params(request.params, config)
    chat = await chat_input(handle, request.chat) if request.WhichOneof("input") == "chat" else None
    limit = handle.frontend.prompt_limit(config.max_prompt_tokens, params.truncate_prompt_tokens)
    field_name, ids, mm_inputs = await prompt_ids(request, handle, chat, images, limit)
    ids = handle.frontend.truncate_prompt(
        ids, params, mm_inputs, field="params.truncate_prompt_tokens"
    )  # before the limits, tools and thought read it
    if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
        raise limit.error(field_name, len(ids))
    convert.resolve_max_tokens(params, len(ids), handle.facts.max_context, config.max_tokens)
    params.structured = structured  # validated on its own: its errors name structured.*
    tool_request = chat.tool_request if chat is not None else None
    reading = None
    if tool_request is not None:  # under a forced tool_choice this constrains params
        backend = convert.structured_backend(request, config.structured_output_backend)
        # off the loop: strict tools' schemas are checked (jsonschema), seconds for big ones
        reading = await handle.engine.run(
            handle.frontend.read_tools, tool_request, ids, params, backend, config.tool_parser
        )
    thought = handle.frontend.read_reasoning(ids, params, config.reasoning_parser)
    # The caller's request_id is only echoed: callers may reuse ids, the engine must not.
    job = handle.frontend.validate(
        ids, params, request_id=uuid.uuid4().hex, cache_salt=request.cache_salt or None,
        mm_inputs=mm_inputs, field=field_name, params_field="params.", reasoning=thought,
    )
    caller_id = request.request_id or uuid.uuid4().hex
    return Prepared(handle, caller_id, job, received, reading, thought)


@dataclass
class _Choice:
    completion_tokens: int = 0
    first_token: float | None = None  # time.monotonic() of its first token
    reasoning: ChoiceReasoning | None = None  # its thought apart from its answer


def prompt_text(request: generate_pb2.GenerateRequest) -> str:
    """The request's input as the access log shows it with --log-requests."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "chat":
        return "\n".join(
            f"{m.role}: " + "".join(p.text for p in m.content if p.WhichOneof("part") == "text")
            for m in request.chat.messages
        )
    return f"token_ids: {list(request.token_ids.ids)}"


@dataclass
class _Stream:
    """Per-call state of the chunks sent so far."""

    prep: Prepared
    queued: float  # when the request was handed to the engine
    record: calls.CallRecord  # the call's, for metrics, the access log and tracing
    choices: dict[int, _Choice] = field(default_factory=dict)
    sent_any: bool = False
    tool_streams: dict[int, ChoiceToolStream] = field(default_factory=dict)

    async def chunk(self, delta: GenerationDelta) -> generate_pb2.GenerateResponse:
        handle, now = self.prep.handle, time.monotonic()
        out = convert.response(delta, self.prep.request_id, handle.token_text)
        choice = self.choices.setdefault(delta.index, _Choice())
        if self.prep.reasoning is not None or self.prep.tools is not None:
            # the parsers run on the model's front-end threads: a degenerate output is the
            # model's own threads' work, never the event loop's
            await handle.engine.run(self._parse, choice, out, delta)
        choice.completion_tokens += len(delta.token_ids)
        if delta.token_ids and choice.first_token is None:
            choice.first_token = now
        self._record(delta, out, now)
        if not self.sent_any:  # stream-wide facts travel once, on the first chunk
            self.sent_any = True
            out.model = handle.name
            if delta.prompt_logprobs:
                out.prompt_logprobs.extend(
                    convert.prompt_logprobs(delta.prompt_logprobs, handle.token_text)
                )
        if delta.finish_reason is not None:
            prompt_len = len(self.prep.job.prompt_token_ids)
            reasoning = choice.reasoning.reasoning_tokens if choice.reasoning else 0
            drafts = (delta.num_draft_tokens, delta.num_accepted_draft_tokens)
            out.usage.CopyFrom(convert.usage(
                prompt_len, choice.completion_tokens, delta.num_cached_tokens, reasoning, drafts
            ))
            # queue_ms runs to the engine's first step for the request when it reports one
            queued = delta.first_scheduled_time or self.queued
            out.timing.CopyFrom(
                convert.timing(self.prep.received, queued, choice.first_token, now)
            )
        return out

    def _record(
        self, delta: GenerationDelta, out: generate_pb2.GenerateResponse, now: float
    ) -> None:
        """The delta into the call's record: every choice counts as a request from the
        engine's first answer to any of them."""
        record = self.record
        if not record.choices:
            n = self.prep.job.params.n
            record.choices = {i: calls.ChoiceRecord(self.queued) for i in range(n)}
        c = record.choices[delta.index]
        c.scheduled = c.scheduled or delta.first_scheduled_time
        if delta.token_ids:
            if c.last_token is not None:
                c.gaps.append(now - c.last_token)
            c.first_token, c.last_token = c.first_token or now, now
            c.output_tokens += len(delta.token_ids)
            record.output_tokens += len(delta.token_ids)
        if record.keep_text:
            c.text.append(out.text)
        if delta.finish_reason is not None:
            c.finish_reason, c.finished = delta.finish_reason, now
            record.cached_tokens = max(record.cached_tokens, delta.num_cached_tokens)

    def _parse(
        self, choice: _Choice, out: generate_pb2.GenerateResponse, delta: GenerationDelta
    ) -> None:
        """The chunk's text split into thought and answer, and the answer into content and
        tool calls (one choice's chunks are parsed one at a time, in order)."""
        if self.prep.reasoning is not None:
            self._thought(self.prep.reasoning, choice, out, delta)
        if self.prep.tools is not None:
            self._tool_calls(self.prep.tools, out, delta)

    def _thought(
        self, reading: ReasoningOutput, choice: _Choice, out: generate_pb2.GenerateResponse,
        delta: GenerationDelta,
    ) -> None:
        """The chunk's text as its thought (reasoning_text) and its answer (text)."""
        if choice.reasoning is None:
            choice.reasoning = reading.stream()
        done = delta.finish_reason is not None
        out.reasoning_text, out.text = choice.reasoning.update(delta.text, delta.token_ids, done)

    def _tool_calls(
        self, tools: ToolOutput, out: generate_pb2.GenerateResponse, delta: GenerationDelta
    ) -> None:
        """The chunk's answer text (out.text) as content and tool calls; TOOL_CALLS when the
        choice stopped (EOS, stop token or string, or its grammar completed) after calls."""
        stream = self.tool_streams.get(delta.index)
        if stream is None:
            reasoning = self.prep.reasoning
            stream = self.tool_streams[delta.index] = tools.stream(
                reasoning.text_stream if reasoning is not None else None
            )
        done = delta.finish_reason is not None
        out.text, calls = stream.update(out.text, delta.token_ids, done, delta.ends_on_stop_token)
        out.tool_calls.extend(convert.call_deltas(calls))
        if delta.finish_reason == "stop" and stream.num_calls:
            out.finish_reason = generate_pb2.FINISH_REASON_TOOL_CALLS


async def stream(prep: Prepared) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
    """The engine's deltas as chunks. Leaving early (the call is cancelled or its deadline
    passes) closes the engine's iterator, which aborts the request and frees its KV blocks."""
    handle = prep.handle
    handle.require_serving()
    state = _Stream(prep, queued=time.monotonic(), record=calls.current())
    deltas = handle.engine.generate(prep.job)
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                if delta.error:
                    raise EngineFailed(f"model {handle.name!r} failed the request: {delta.error}")
                yield await state.chunk(delta)
    except EngineDead as e:
        raise engine_error(handle.name, e) from e
