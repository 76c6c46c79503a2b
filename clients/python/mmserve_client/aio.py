"""asyncio client of the mmserve v1 API: Client's methods as coroutines / async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, Unpack, overload

import grpc
import grpc.aio

from mmserve_client import _requests, _responses
from mmserve_client._channel import ClientBase
from mmserve_client._chat import ChatKwargs, ChatOptions, chat_from_kwargs, chat_request
from mmserve_client._requests import GenerateKwargs
from mmserve_client.errors import MMServeError
from mmserve_client.streams import AsyncGenerateStream
from mmserve_client.types import (
    Classification,
    EmbeddingEncoding,
    GenerateResult,
    InputLike,
    LoadReport,
    ModelInfo,
    RerankResult,
    ResultList,
    TokenizeResult,
    Truncate,
)
from mmserve_client.v1 import models_pb2, tokenize_pb2

Messages = Sequence[Mapping[str, Any]]


class AsyncClient(ClientBase):
    """asyncio client of one mmserve endpoint: Client's constructor and methods, as coroutines
    (generate_stream / chat_stream return async iterators). Create it inside the event loop
    that uses it; `async with AsyncClient(...) as c` closes it.
    """

    _api = grpc.aio

    async def close(self) -> None:
        """Closes the channel; running calls are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the channel is connected; MMServeError(UNAVAILABLE) after `timeout`."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError as e:
            raise MMServeError(grpc.StatusCode.UNAVAILABLE, "channel not ready in time") from e

    async def _unary(self, rpc: str, request: Any, timeout: float | None) -> Any:
        try:
            return await getattr(self._stub, rpc)(request, **self._call_options(timeout))
        except grpc.RpcError as e:
            raise MMServeError.from_rpc_error(e) from e

    def _stream(self, source: Any, n: int | None, kw: GenerateKwargs) -> AsyncGenerateStream:
        return AsyncGenerateStream(self._start_generate(source, n, kw), n)

    @staticmethod
    async def _collect(
        stream: AsyncGenerateStream, n: int | None
    ) -> GenerateResult | list[GenerateResult]:
        async with stream:
            results = await stream.collect()
        return results if n is not None else results[0]

    @overload
    async def generate(
        self, prompt: str | Sequence[int], *, n: None = None, **kw: Unpack[GenerateKwargs]
    ) -> GenerateResult: ...
    @overload
    async def generate(
        self, prompt: str | Sequence[int], *, n: int, **kw: Unpack[GenerateKwargs]
    ) -> list[GenerateResult]: ...
    async def generate(
        self, prompt: str | Sequence[int], *, n: int | None = None, **kw: Unpack[GenerateKwargs]
    ) -> GenerateResult | list[GenerateResult]:
        """Generates from raw text (no chat template) or token ids, and waits for the end.

        Returns one GenerateResult; with `n` given (even n=1), a list of n, ordered by index.
        Keywords: GenerateKwargs (sampling, stop, logprobs, json_schema/regex/choice/grammar/
        structural_tag, model, request_id, cache_salt, timeout).
        """
        return await self._collect(self._stream(prompt, n, kw), n)

    def generate_stream(
        self, prompt: str | Sequence[int], *, n: int | None = None, **kw: Unpack[GenerateKwargs]
    ) -> AsyncGenerateStream:
        """Like generate, but yields GenerateChunks as they arrive."""
        return self._stream(prompt, n, kw)

    @overload
    async def chat(
        self, messages: Messages, *, n: None = None, **kw: Unpack[ChatKwargs]
    ) -> GenerateResult: ...
    @overload
    async def chat(
        self, messages: Messages, *, n: int, **kw: Unpack[ChatKwargs]
    ) -> list[GenerateResult]: ...
    async def chat(
        self, messages: Messages, *, n: int | None = None, **kw: Unpack[ChatKwargs]
    ) -> GenerateResult | list[GenerateResult]:
        """Generates the next assistant turn of a conversation of OpenAI-style dicts.

        Keywords: tools, tool_choice, add_generation_prompt, template_kwargs,
        continue_final_message (see mmserve_client._chat.chat_request for accepted shapes),
        plus everything generate takes. Returns like generate; tool calls come back parsed in
        GenerateResult.tool_calls.
        """
        chat, rest = chat_from_kwargs(messages, kw)
        return await self._collect(self._stream(chat, n, rest), n)

    def chat_stream(
        self, messages: Messages, *, n: int | None = None, **kw: Unpack[ChatKwargs]
    ) -> AsyncGenerateStream:
        """Like chat, but yields GenerateChunks as they arrive."""
        chat, rest = chat_from_kwargs(messages, kw)
        return self._stream(chat, n, rest)

    async def embed(
        self,
        inputs: InputLike | Sequence[InputLike],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: Truncate | None = None,
        encoding: EmbeddingEncoding = "fp32",
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
        prompt_name: str | None = None,
    ) -> ResultList[Any]:
        """One vector per input (text, image bytes / Image, or token ids), in input order:
        float32 numpy arrays when numpy is installed, else lists of floats. normalize
        (default true) and dimensions (Matryoshka) are applied by the server; `encoding` is
        the wire format ("fp32" packed, "fp16" packed, "float" repeated). prompt_name: one
        of the model's sentence-transformers prompts (e.g. "query") before each text; None:
        the model's default prompt, if any; "": none. The list carries the call's usage,
        timing, model and request_id (ResultList), as rerank, classify and score do."""
        req = _requests.embed_request(
            inputs, normalize, dimensions, truncate, encoding, model, request_id, prompt_name
        )
        return _responses.vectors(await self._unary("Embed", req, timeout), req.encoding)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        return_documents: bool = False,
        truncate: Truncate | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> ResultList[RerankResult]:
        """Documents ranked by relevance to `query`, highest first (the best top_n, if set)."""
        req = _requests.rerank_request(
            query, documents, top_n, return_documents, truncate, model, request_id
        )
        return _responses.rerank_results(await self._unary("Rerank", req, timeout))

    async def classify(
        self,
        inputs: InputLike | Sequence[InputLike],
        *,
        truncate: Truncate | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> ResultList[Classification]:
        """Label probabilities of each input, in input order."""
        req = _requests.classify_request(inputs, truncate, model, request_id)
        return _responses.classifications(await self._unary("Classify", req, timeout))

    async def score(
        self,
        first: InputLike | Sequence[InputLike],
        second: InputLike | Sequence[InputLike],
        *,
        truncate: Truncate | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> ResultList[float]:
        """One score per item of `second`: against `first` if it is one input, else pairwise."""
        req = _requests.score_request(first, second, truncate, model, request_id)
        return _responses.scores(await self._unary("Score", req, timeout))

    async def tokenize(
        self,
        text: str | Messages,
        *,
        add_special_tokens: bool | None = None,
        return_tokens: bool = False,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
        **chat: Unpack[ChatOptions],
    ) -> TokenizeResult:
        """Tokens of a text, or of a conversation rendered as chat() would render it (then the
        ChatOptions keywords apply)."""
        source = text if isinstance(text, str) else chat_request(text, **chat)
        req = _requests.tokenize_request(
            source, add_special_tokens, return_tokens, model, request_id
        )
        return _responses.tokenize_result(await self._unary("Tokenize", req, timeout))

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = False,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> str:
        """The text of `token_ids`."""
        req = tokenize_pb2.DetokenizeRequest(
            model=model,
            request_id=request_id,
            token_ids=token_ids,
            skip_special_tokens=skip_special_tokens,
        )
        return str((await self._unary("Detokenize", req, timeout)).text)

    async def watch_load(
        self,
        *,
        model: str = "",
        interval_ms: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[LoadReport]:
        """Client.watch_load as an async iterator; closing it cancels the call."""
        call = self._start_watch_load(model, interval_ms, timeout, request_id)
        try:
            async for report in call:
                yield _responses.load_report(report)
        except grpc.RpcError as e:
            raise MMServeError.from_rpc_error(e) from e
        finally:
            call.cancel()

    async def list_models(
        self, *, model: str = "", request_id: str = "", timeout: float | None = None
    ) -> ResultList[ModelInfo]:
        """The hosted models (only `model`, if given) and what each can do."""
        req = models_pb2.ListModelsRequest(model=model, request_id=request_id)
        return _responses.model_list(await self._unary("ListModels", req, timeout))
