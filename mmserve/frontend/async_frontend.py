"""The asyncio side of a FrontEnd: its engine side (adding requests, stepping the engine
client, detokenising) runs on its own thread, so the event loop never waits on a model step;
each request gets an asyncio queue of deltas, and a cancelled consumer aborts its request in
the engine, which frees its KV blocks at once. The model's blocking front-end work (chat
templates, tokenising, images, pooling inputs) runs on threads of its own, never shared with
another model, so one model's slow templates or inputs hold up only its own calls."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from mmserve.config import DEFAULT_FRONTEND_THREADS
from mmserve.engine.messages import EngineStats
from mmserve.errors import EngineDead, ResourceExhausted
from mmserve.frontend.frontend import FrontEnd, GenerateJob, GenerationDelta, PooledResult
from mmserve.frontend.pooling_inputs import EncodedInput
from mmserve.params import PoolingParams
from mmserve.structured_output.schema_tree import RelaxedKeyword

logger = logging.getLogger(__name__)
LIVENESS_POLL_S = 0.5  # an idle engine thread checks this often that its engine still lives

P = ParamSpec("P")
T = TypeVar("T")
# threads per model that wait for grammar compiles (the grammar cache bounds the compiles
# themselves, with workers and a time limit of its own); waiting costs no CPU
GRAMMAR_WAITERS = 8

News = GenerationDelta | PooledResult
Sink = Callable[[News | BaseException], None]


@dataclass
class _Add:
    job: GenerateJob  # validated already
    sink: Sink


@dataclass
class _AddPoolingBatch:
    request_ids: list[str]
    inputs: list[EncodedInput]  # validated already; their lists are handed to the engine
    params: PoolingParams
    sink: _BatchSink  # every request's


class _BatchSink:
    """The sink of every request of one pooling batch (called on the engine thread): holds
    their results in batch order and wakes the caller's loop once, when the last one came
    or at the first failure."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        finish: Callable[[list[PooledResult] | BaseException], None],  # called on the loop
        request_ids: list[str],
    ) -> None:
        self.loop = loop
        self.finish = finish
        self.index = {request_id: i for i, request_id in enumerate(request_ids)}
        self.results: list[PooledResult | None] = [None] * len(request_ids)
        self.remaining = len(request_ids)

    def __call__(self, item: News | BaseException) -> None:
        if isinstance(item, BaseException):
            self.loop.call_soon_threadsafe(self.finish, item)
            return
        self.results[self.index[item.request_id]] = item  # type: ignore[assignment]  # pooling news
        self.remaining -= 1
        if not self.remaining:
            self.loop.call_soon_threadsafe(self.finish, self.results)  # type: ignore[arg-type]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _KVBlocks:
    answer: Future[tuple[int, int]]


class AsyncFrontEnd:
    """Thread-safe: commands go in through a queue, deltas come out on the caller's loop."""

    def __init__(
        self, frontend: FrontEnd, max_pending: int = 1024, threads: int = DEFAULT_FRONTEND_THREADS
    ) -> None:
        """threads: this model's front-end workers (run())."""
        self.frontend = frontend
        self.max_pending = max_pending  # admission bound on requests in flight
        self.threads = threads
        self._shut_down = False
        self._commands: queue.SimpleQueue[_Add | _AddPoolingBatch | _Abort | _KVBlocks | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._num_in_flight = 0
        self._lock = threading.Lock()
        self.dead: BaseException | None = None  # set if the engine died, crashed or stalled
        self._busy_since = time.monotonic()  # when the engine last went from idle to busy
        self._thread = threading.Thread(target=self._loop, name="mmserve-engine", daemon=True)
        self._thread.start()
        # the model's own threads for blocking front-end work (run()), shared with no model
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="mmserve-frontend")
        self._grammar_waits = ThreadPoolExecutor(GRAMMAR_WAITERS, thread_name_prefix="mmserve-grammar")

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def stalled_for(self) -> float:
        """Seconds the engine has had work without a sign of progress (0 when idle). Safe
        from any thread: the server's watchdog reads it."""
        if not self.frontend.has_unfinished:
            return 0.0
        since = max(self.frontend.client.last_progress, self._busy_since)
        return max(0.0, time.monotonic() - since)

    def stats(self) -> EngineStats:
        """The engine's load and counters as of its latest step (metrics, load reports);
        never waits, safe from any thread."""
        return self.frontend.client.latest_stats

    def kv_blocks(self, timeout: float = 30.0) -> tuple[int, int]:
        """(KV blocks in all, free ones), asked on the engine thread (the client is not
        thread-safe): for monitoring and soaks, from any thread but the engine's."""
        if self.dead is not None:
            raise EngineDead(f"engine is dead: {self.dead}")
        answer: Future[tuple[int, int]] = Future()
        self._commands.put(_KVBlocks(answer))
        return answer.result(timeout)

    def fail(self, error: EngineDead) -> None:
        """Declares the engine dead (the watchdog saw it stall): every call in flight fails
        with `error` now, new ones are refused, and the engine thread stops at its next turn.
        Safe from any thread, also while the engine thread is stuck inside a step."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink(error)

    def shutdown(self) -> None:
        self._shut_down = True
        # running front-end work ends by itself (templates have a time limit); queued is dropped
        for pool in (self.executor, self._grammar_waits):
            pool.shutdown(wait=True, cancel_futures=True)
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.frontend.shutdown()

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on this model's front-end threads: blocking work (chat
        templates, tokenising, images, pooling inputs), awaited without blocking the loop."""
        call = functools.partial(fn, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, call)
        except RuntimeError as e:  # "cannot schedule new futures after shutdown"
            if self._shut_down:  # a restart replaced this engine while the call came in
                raise EngineDead("the model's engine was shut down (it may be restarting)") from e
            raise

    async def generate(self, job: GenerateJob) -> AsyncGenerator[GenerationDelta, None]:
        """Yields the deltas of a request FrontEnd.validate made until every choice has
        finished (a constraint that fails to compile raises before the first); leaving the
        iteration early aborts the request."""
        relaxed: tuple[RelaxedKeyword, ...] = ()
        if job.params.structured is not None:  # compiling can take a while: not on the loop
            loop = asyncio.get_running_loop()
            grammar = await loop.run_in_executor(
                self._grammar_waits, self.frontend.compile_grammar, job.params
            )
            relaxed = grammar.relaxed if grammar is not None else ()
        # aclosing: closing this generator closes _submit at once, which aborts the request;
        # left to the garbage collector, a request abandoned in a reference cycle ran on
        async with aclosing(self._submit(job)) as items:
            async for item in items:
                if relaxed and item.finish_reason is not None:
                    item = dataclasses.replace(item, relaxed_keywords=relaxed)
                yield item

    async def pool_batch(
        self, inputs: list[EncodedInput], params: PoolingParams
    ) -> list[PooledResult]:
        """Pools several inputs as one command (they reach the engine together, so they share
        its steps) with one wakeup of the caller's loop when the last one finishes; their
        final deltas, in order. The first failure fails the batch and aborts the rest; so
        does cancelling it. The inputs come from a pooling plan's encode(), which checked
        them; their token lists go to the engine as they are (not to be changed after)."""
        if self.dead is not None:
            raise EngineDead(f"engine is dead: {self.dead}")
        count = len(inputs)
        with self._lock:
            if self._num_in_flight + count > self.max_pending:
                raise ResourceExhausted(f"{self._num_in_flight} requests in flight; retry later")
            self._num_in_flight += count
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[PooledResult]] = loop.create_future()

        def finish(item: list[PooledResult] | BaseException) -> None:  # on the loop
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            else:
                done.set_result(item)

        ids = [self.frontend.new_request_id() for _ in inputs]
        sink = _BatchSink(loop, finish, ids)
        self._commands.put(_AddPoolingBatch(ids, inputs, params, sink))
        try:
            return await done
        finally:
            with self._lock:
                self._num_in_flight -= count
            if not done.done() or done.cancelled() or done.exception() is not None:
                for request_id, result in zip(ids, sink.results, strict=True):
                    if result is None:
                        self._commands.put(_Abort(request_id))

    async def _submit(self, job: GenerateJob) -> AsyncGenerator[GenerationDelta, None]:
        if self.dead is not None:
            raise EngineDead(f"engine is dead: {self.dead}")
        with self._lock:
            if self._num_in_flight >= self.max_pending:
                raise ResourceExhausted(f"{self._num_in_flight} requests in flight; retry later")
            self._num_in_flight += 1
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[News | BaseException] = asyncio.Queue()

        def sink(item: News | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        self._commands.put(_Add(job, sink))
        remaining = job.params.n
        try:
            while remaining:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, GenerationDelta):
                    remaining -= item.finish_reason is not None
                    yield item
        finally:
            with self._lock:
                self._num_in_flight -= 1
            if remaining:
                self._commands.put(_Abort(job.request_id))

    def _loop(self) -> None:
        try:
            while self.dead is None:
                idle = not self.frontend.has_unfinished
                if not self._drain(idle):
                    return
                if self.frontend.has_unfinished:
                    if idle:
                        self._busy_since = time.monotonic()
                    self._dispatch(self.frontend.step())
        except EngineDead as e:  # its process is gone: one line, the watchdog reports it
            logger.error("engine died: %s", e)
            self.fail(e)
            return
        except BaseException as e:  # the engine is broken: fail everyone, loudly
            logger.exception("engine loop died")
            self.fail(EngineDead(f"engine failed: {e}"))
            return
        self.frontend.shutdown()  # declared dead (stalled): stop its core (a process: killed)

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; waits for one when idle, checking the engine still lives
        (EngineDead) every LIVENESS_POLL_S. False means shut down."""
        while True:
            try:
                cmd = self._commands.get(timeout=LIVENESS_POLL_S) if block else self._commands.get_nowait()
            except queue.Empty:
                if not block or self.dead is not None:
                    return True
                self.frontend.client.check_alive()
                continue
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Abort):
                self.frontend.abort(cmd.request_id)
            elif isinstance(cmd, _KVBlocks):
                cmd.answer.set_result(self.frontend.client.kv_blocks())
            elif isinstance(cmd, _AddPoolingBatch):
                self._add_pooling(cmd)
            else:
                self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        try:
            self.frontend.add(cmd.job)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            cmd.sink(e)
            return
        self._keep({cmd.job.request_id: cmd.sink})

    def _keep(self, sinks: dict[str, Sink]) -> None:
        """Registers sinks, or fails them at once when the engine was declared dead."""
        with self._lock:
            if self.dead is None:
                self._sinks.update(sinks)
                return
        for sink in sinks.values():
            sink(EngineDead(f"engine failed: {self.dead}"))

    def _add_pooling(self, cmd: _AddPoolingBatch) -> None:
        items = [
            (rid, i.token_ids, i.token_type_ids, i.mm_inputs)
            for rid, i in zip(cmd.request_ids, cmd.inputs, strict=True)
        ]
        try:
            self.frontend.add_pooling(items, cmd.params)
        except Exception as e:  # noqa: BLE001 - a bad batch fails alone
            cmd.sink(e)
            return
        self._keep(dict.fromkeys(cmd.request_ids, cmd.sink))

    def _dispatch(self, deltas: list[News]) -> None:
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is not None:
                sink(d)
        # Only after the whole step: with n > 1, several choices of one request can finish in
        # the same step, and the engine forgets the request before any delta is dispatched.
        with self._lock:
            for d in deltas:
                if not self.frontend.is_active(d.request_id):
                    self._sinks.pop(d.request_id, None)
