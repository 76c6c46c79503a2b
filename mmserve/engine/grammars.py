"""Requests whose output constraint is being compiled: they join the scheduler once their
grammar is ready, and no step waits for a compile.

A matcher is a live object that cannot cross processes, so the engine compiles each request's
constraint itself. The front end compiled it already, to refuse a bad one with its field named:
in one process both use the same StructuredOutputManager, whose cache answers at once; in the
engine process the core compiles it again (cached) on a worker thread of its own."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from mmserve.engine.messages import EngineRequest
from mmserve.structured_output.backend import CompiledGrammar
from mmserve.structured_output.manager import StructuredOutputManager

COMPILE_THREADS = 2  # compiles run beside the steps


class PendingGrammars:
    """Compiles on a pool; ready() hands back each request with its compiled grammar, or the
    error that fails it. Not thread-safe: the engine's thread drives it."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="engine-grammar")
        self._pending: list[tuple[Future[CompiledGrammar], EngineRequest]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request: EngineRequest) -> None:
        structured = request.params.structured
        if structured is None:
            raise ValueError(f"request {request.request_id!r} has no constraint to compile")
        # counted=False: the front end's compile of it is the one metrics count
        compiled = self._pool.submit(self.manager.compile, structured, False)
        self._pending.append((compiled, request))

    def drop(self, request_ids: list[str]) -> list[EngineRequest]:
        """Aborted while compiling: they never join. Returns those it held."""
        gone = set(request_ids)
        dropped = [r for _, r in self._pending if r.request_id in gone]
        self._pending = [(f, r) for f, r in self._pending if r.request_id not in gone]
        return dropped

    def ready(
        self, admit: Callable[[EngineRequest, CompiledGrammar], None],
        fail: Callable[[EngineRequest, Exception], None],
    ) -> None:
        """Calls admit (or fail) for each request whose compile has finished, in order."""
        still = []
        for future, request in self._pending:
            if not future.done():
                still.append((future, request))
                continue
            try:
                admit(request, future.result())
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                fail(request, e)
        self._pending = still

    def wait(self, timeout: float) -> None:
        """Up to `timeout` seconds for any compile to finish (an engine with nothing else
        to do waits here rather than spinning)."""
        if self._pending:
            wait([f for f, _ in self._pending], timeout, FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
