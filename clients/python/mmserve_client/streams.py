"""Generate streams: the chunks of one Generate call, for the sync and the asyncio client.

Stopping early cancels the call, and the server aborts the request: close() / aclose(),
leaving a (async) `with` block, `break` out of a `for` / `async for` loop written directly over
the call (CPython drops the stream at once), or garbage collection. Hold the stream in a
variable and it lives on: use `with` then. A failed call raises MMServeError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Self

import grpc
import grpc.aio

from mmserve_client import _responses
from mmserve_client.errors import MMServeError
from mmserve_client.types import GenerateChunk, GenerateResult


class GenerateStream(Iterator[GenerateChunk]):
    """Chunks of one Generate call as they arrive (choices of n > 1 interleaved by index)."""

    def __init__(self, call: Any, n: int | None) -> None:
        self._call = call  # grpc's stream call: an iterator of GenerateResponse and a grpc.Call
        self._n = n

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> GenerateChunk:
        try:
            return _responses.chunk(next(self._call))
        except grpc.RpcError as e:
            raise MMServeError.from_rpc_error(e) from e

    def collect(self) -> list[GenerateResult]:
        """Reads the rest of the stream: one result per choice, ordered by index."""
        collector = _responses.Collector()
        for chunk in self:
            collector.add(chunk)
        return collector.results(self._n or 1)

    def close(self) -> None:
        """Cancels the call if it is still running; idempotent."""
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_call"):  # __init__ may not have run
            self._call.cancel()


class AsyncGenerateStream(AsyncIterator[GenerateChunk]):
    """Async form of GenerateStream, over a grpc.aio stream call."""

    def __init__(self, call: Any, n: int | None) -> None:
        self._call = call  # grpc.aio.UnaryStreamCall of GenerateResponse
        self._n = n

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerateChunk:
        try:
            response = await self._call.read()
        except grpc.RpcError as e:
            raise MMServeError.from_rpc_error(e) from e
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return _responses.chunk(response)

    async def collect(self) -> list[GenerateResult]:
        """Reads the rest of the stream: one result per choice, ordered by index."""
        collector = _responses.Collector()
        async for chunk in self:
            collector.add(chunk)
        return collector.results(self._n or 1)

    def cancel(self) -> None:
        """Cancels the call if it is still running; idempotent."""
        self._call.cancel()

    async def aclose(self) -> None:
        """Same as cancel(), as a coroutine (the async-iterator protocol's name)."""
        self.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call") and not self._call.done():
            self._call.cancel()
