"""The one contract between the front end and an engine, with two implementations: the core
in this process, or in a process of its own (core_proc.py). `start_engine` picks one."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from mmserve.config import EngineConfig
from mmserve.engine.core_proc import ProcessClient
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.loading import LoadedEngine, load_engine
from mmserve.engine.messages import EngineInfo, EngineOutput, EngineRequest, EngineStats


class EngineClient(Protocol):
    """An engine that runs validated requests and hands back their outputs.

    The caller guarantees: requests are validated (the engine trusts every field), ids are
    unique among the requests in flight, and one thread drives the client (it is not
    thread-safe). The engine guarantees: each added request gets outputs until one carries a
    finish_reason ("abort" with `error` set when it failed inside the engine), except one
    ended by stop(), which gets no more; abort() frees a request's KV blocks at once and
    answers it with finish_reason "abort".
    """

    info: EngineInfo  # the model and the engine, as they were when it started

    def add(self, requests: Sequence[EngineRequest]) -> None:
        """Queues requests; they reach the engine together (they may share one step)."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def stop(self, request_id: str) -> None:
        """Ends a request as stopped (the front end saw a stop string); no more outputs."""
        ...

    @property
    def has_unfinished(self) -> bool:
        """Whether any added request still owes outputs."""
        ...

    def outputs(self) -> list[EngineOutput]:
        """The news since the last call: runs one engine step (in process), or returns what
        arrived, waiting a moment for some while requests run (engine process). Raises
        mmserve.errors.EngineDead when the engine can serve nothing more."""
        ...

    @property
    def last_progress(self) -> float:
        """time.monotonic() of the engine's latest sign of progress: a step that ended (in
        process), a message from the core (engine process; a busy core reports at least
        every core_proc.HEARTBEAT_S, outputs or not). Read from other threads (watchdogs)."""
        ...

    def check_alive(self) -> None:
        """Raises mmserve.errors.EngineDead when the engine can serve nothing more (its
        process is gone), even with nothing in flight; cheap, called about once a second."""
        ...

    def kv_blocks(self) -> tuple[int, int]:
        """(KV blocks in all, blocks free: empty or only cached) of the engine's cache."""
        ...

    @property
    def latest_stats(self) -> EngineStats:
        """The engine's load and counters as of its latest step that reached this side
        (metrics, load reports). Never waits: safe to read from any thread."""
        ...

    def shutdown(self) -> None: ...


class InProcessClient:
    """The engine core in the caller's process: outputs() runs one step on the caller's
    thread."""

    def __init__(self, loaded: LoadedEngine) -> None:
        self.core: EngineCore = loaded.core  # for tests and benchmarks that look inside
        self.info = loaded.info
        self._last_progress = time.monotonic()
        self._stats = self.core.stats()

    def add(self, requests: Sequence[EngineRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort(self, request_ids: Sequence[str]) -> None:
        self.core.abort(list(request_ids))

    def stop(self, request_id: str) -> None:
        self.core.stop(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def outputs(self) -> list[EngineOutput]:
        out = self.core.step()
        self._stats = self.core.stats()  # replaced whole: readers on other threads see one
        self._last_progress = time.monotonic()
        return out

    @property
    def latest_stats(self) -> EngineStats:
        return self._stats

    @property
    def last_progress(self) -> float:
        return self._last_progress

    def check_alive(self) -> None:
        # it lives as long as this process (a step that raises fails the caller's loop), and
        # so do the other ranks of a tensor-parallel model, which it checks
        self.core.check_alive()

    def kv_blocks(self) -> tuple[int, int]:
        pool = self.core.kv.pool
        return pool.num_blocks, pool.num_free_blocks

    def shutdown(self) -> None:
        self.core.shutdown()


def start_engine(config: EngineConfig) -> tuple[EngineClient, LoadedEngine | None]:
    """The engine of config.model: in its own process when config.multiprocess, else here.
    The second value is the in-process engine's parts (its tokenizer and grammar compiler,
    which the front end shares), None for an engine process."""
    if config.multiprocess:
        return ProcessClient(config), None
    loaded = load_engine(config)
    return InProcessClient(loaded), loaded
