"""The asyncio front of an LLMEngine: the engine steps on its own thread, so the event loop
never waits on a model step; each request gets an asyncio queue of deltas, and a cancelled
consumer aborts its request in the engine, which frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from mmserve.engine.llm_engine import GenerationDelta, LLMEngine
from mmserve.errors import ResourceExhausted
from mmserve.params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: Callable[[GenerationDelta | BaseException], None]
    grammar: Any = None  # CompiledGrammar of params.structured, compiled off the loop
    mm_inputs: tuple[Any, ...] = ()  # the prompt's images (MMInput), expanded already


@dataclass
class _AddPooling:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None
    sink: Callable[[GenerationDelta | BaseException], None]
    mm_inputs: tuple[Any, ...] = ()  # an image input (dual encoders)


@dataclass
class PoolInput:
    """One input of a pooling batch."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None
    mm_inputs: tuple[Any, ...] = ()


@dataclass
class _AddPoolingBatch:
    items: list[_AddPooling]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Thread-safe: commands go in through a queue, deltas come out on the caller's loop."""

    def __init__(self, engine: LLMEngine, max_pending: int = 1024) -> None:
        self.engine = engine
        self.max_pending = max_pending  # admission bound on requests in flight
        self._commands: queue.SimpleQueue[_Add | _AddPoolingBatch | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[GenerationDelta | BaseException], None]] = {}
        self._num_in_flight = 0
        self._lock = threading.Lock()
        self.dead: BaseException | None = None  # set if the engine loop crashed
        self._thread = threading.Thread(target=self._loop, name="mmserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.engine.shutdown()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        mm_inputs: tuple[Any, ...] = (),
    ) -> AsyncIterator[GenerationDelta]:
        """Yields deltas until every choice has finished. Validation errors raise before the
        first delta; leaving the iteration early aborts the request."""
        self.engine.validate(prompt_token_ids, params)
        self.engine.check_images(prompt_token_ids, mm_inputs)
        grammar = None
        if params.structured is not None:  # compiling can take a while: not on the loop
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params)
        request_id = request_id or self.engine.new_request_id()

        def make(sink: Callable[[GenerationDelta | BaseException], None]) -> _Add:
            return _Add(
                request_id, list(prompt_token_ids), params, cache_salt, sink, grammar, mm_inputs
            )

        async for item in self._submit(request_id, make, params.n):
            yield item

    async def pool_batch(
        self, inputs: list[PoolInput], params: PoolingParams
    ) -> list[GenerationDelta]:
        """Pools several inputs as one command (they reach the engine together, so they share
        its steps) with one wakeup of the caller's loop when the last one finishes; their
        final deltas, in order. The first failure fails the batch and aborts the rest; so
        does cancelling it."""
        for item in inputs:  # here, so that a bad input fails before anything is sent
            self.engine.validate_pooling(item.token_ids, params, item.mm_inputs)
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead}")
        count = len(inputs)
        with self._lock:
            if self._num_in_flight + count > self.max_pending:
                raise ResourceExhausted(f"{self._num_in_flight} requests in flight; retry later")
            self._num_in_flight += count
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[GenerationDelta]] = loop.create_future()
        results: list[GenerationDelta | None] = [None] * count
        remaining = [count]  # touched on the engine thread only

        def finish(item: list[GenerationDelta] | BaseException) -> None:  # on the loop
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            else:
                done.set_result(item)

        def sink_for(index: int) -> Callable[[GenerationDelta | BaseException], None]:
            def sink(item: GenerationDelta | BaseException) -> None:  # on the engine thread
                if isinstance(item, BaseException):
                    loop.call_soon_threadsafe(finish, item)
                    return
                results[index] = item
                remaining[0] -= 1
                if not remaining[0]:
                    loop.call_soon_threadsafe(finish, results)  # type: ignore[arg-type]

            return sink

        ids = [self.engine.new_request_id() for _ in inputs]
        self._commands.put(
            _AddPoolingBatch(
                [
                    _AddPooling(
                        rid, list(item.token_ids), params, item.token_type_ids, sink_for(i),
                        item.mm_inputs,
                    )
                    for i, (rid, item) in enumerate(zip(ids, inputs, strict=True))
                ]
            )
        )
        try:
            return await done
        finally:
            with self._lock:
                self._num_in_flight -= count
            if not done.done() or done.cancelled() or done.exception() is not None:
                for request_id, result in zip(ids, results, strict=True):
                    if result is None:
                        self._commands.put(_Abort(request_id))

    async def _submit(
        self,
        request_id: str,
        make: Callable[[Callable[[GenerationDelta | BaseException], None]], _Add],
        num_choices: int,
    ) -> AsyncIterator[GenerationDelta]:
        if self.dead is not None:
            raise RuntimeError(f"engine is dead: {self.dead}")
        with self._lock:
            if self._num_in_flight >= self.max_pending:
                raise ResourceExhausted(f"{self._num_in_flight} requests in flight; retry later")
            self._num_in_flight += 1
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[GenerationDelta | BaseException] = asyncio.Queue()

        def sink(item: GenerationDelta | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        self._commands.put(make(sink))
        remaining = num_choices
        try:
            while remaining:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finish_reason is not None
                yield item
        finally:
            with self._lock:
                self._num_in_flight -= 1
            if remaining:
                self._commands.put(_Abort(request_id))

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished
                if not self._drain(block):
                    return
                if self.engine.has_unfinished:
                    self._dispatch(self.engine.step())
        except BaseException as e:  # the engine is broken: fail everyone, loudly
            logger.exception("engine loop died")
            self.dead = e
            for sink in self._sinks.values():
                sink(RuntimeError(f"engine failed: {e}"))

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; waits for one when idle. False means shut down."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
                continue
            for add in cmd.items if isinstance(cmd, _AddPoolingBatch) else [cmd]:
                self._add(add)

    def _add(self, cmd: _Add | _AddPooling) -> None:
        try:
            if isinstance(cmd, _AddPooling):
                self.engine.add_pooling_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.token_type_ids,
                    cmd.mm_inputs, checked=True,  # pool_batch validated it before sending
                )
            else:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt,
                    cmd.grammar, cmd.mm_inputs,
                )
            self._sinks[cmd.request_id] = cmd.sink
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            cmd.sink(e)

    def _dispatch(self, deltas: list[GenerationDelta]) -> None:
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is not None:
                sink(d)
        # Only after the whole step: with n > 1, several choices of one request can finish in
        # the same step, and the engine forgets the request before any delta is dispatched.
        for d in deltas:
            if d.finish_reason is not None and not self.engine.is_active(d.request_id):
                self._sinks.pop(d.request_id, None)
