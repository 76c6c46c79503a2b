"""A bounded, thread-safe cache of compiled grammars, compiling each key once, time-limited.

- Requests for a key that is being compiled wait for that compile: the first request after
  a miss pays the compile time once.
- Compile errors are cached too: the same bad schema fails fast the next time.
- A compile that runs past `timeout_s` is reported as InvalidArgument ("took too long") and
  that verdict is cached. The worker thread cannot be stopped (the engines are native code)
  and finishes in the background; `max_workers` bounds how many such threads exist.
- A request whose compile never got a worker within `timeout_s` (all busy) gets
  ResourceExhausted: that is load, not the request's fault, so nothing is cached.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from mmserve.errors import InvalidArgument, ResourceExhausted

from .backend import CompiledGrammar

DEFAULT_CACHE_ENTRIES = 512
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILE_WORKERS = 2
MAX_TIMES = 4096  # compile durations kept for metrics between two scrapes


@dataclass
class _Entry:
    future: Future[CompiledGrammar]
    request_field: str  # the request field a timeout error names
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # set by the worker thread when the compile begins


class GrammarCache:
    def __init__(
        self,
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_workers: int = DEFAULT_COMPILE_WORKERS,
    ) -> None:
        if max_entries < 1 or timeout_s <= 0 or max_workers < 1:
            raise ValueError("max_entries, timeout_s and max_workers must be positive")
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # LRU order
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        # for metrics: lookups answered from the cache, compiles started, and the seconds of
        # compiles finished since the last take_compile_times() (at most MAX_TIMES kept)
        self.hits = 0
        self.compiles = 0
        self._compile_times: list[float] = []

    def take_compile_times(self) -> list[float]:
        """The durations (s) of the compiles that ended since the last call (metrics)."""
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, key: Hashable, compile_fn: Callable[[], CompiledGrammar], field: str = "structured",
        counted: bool = True,
    ) -> CompiledGrammar:
        """The compiled grammar for `key`, compiling it with `compile_fn` on a miss. counted:
        the lookup counts in `hits` / `compiles` (False: the engine's second lookup of a
        constraint its front end compiled already).

        Blocks up to about `timeout_s`. Raises what compile_fn raises, InvalidArgument
        naming `field` on a timeout, or ResourceExhausted when no worker was free.
        """
        entry = self._lookup(key, compile_fn, field, counted)
        while True:
            try:
                return entry.future.result(timeout=self._wait_s(entry))
            except FutureTimeout:
                self._expire(key, entry)  # raises once a deadline has passed
            except CancelledError:
                raise self._busy() from None
            except InvalidArgument:
                raise
            except BaseException:
                self._forget(key, entry)  # a bug, not a verdict on the input
                raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _lookup(
        self, key: Hashable, compile_fn: Callable[[], CompiledGrammar], field: str, counted: bool
    ) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += counted
                return entry
            self.compiles += counted
            entry = _Entry(Future(), field)
            entry.future = self._pool.submit(self._run, entry, compile_fn)
            self._entries[key] = entry
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # waiters keep their own reference
            return entry

    def _run(self, entry: _Entry, compile_fn: Callable[[], CompiledGrammar]) -> CompiledGrammar:
        entry.started = started = time.monotonic()
        try:
            return compile_fn()
        finally:
            with self._lock:
                if len(self._compile_times) < MAX_TIMES:  # nobody takes them: metrics are off
                    self._compile_times.append(time.monotonic() - started)

    def _wait_s(self, entry: _Entry) -> float:
        start = entry.started if entry.started is not None else entry.submitted
        return max(0.0, start + self.timeout_s - time.monotonic())

    def _expire(self, key: Hashable, entry: _Entry) -> None:
        now = time.monotonic()
        if entry.started is None:
            if now - entry.submitted >= self.timeout_s and entry.future.cancel():
                self._forget(key, entry)
                raise self._busy()
            return  # it has just started (or not yet waited long enough): wait on
        if now - entry.started < self.timeout_s:
            return
        error = InvalidArgument(
            entry.request_field,
            f"took too long to compile (over {self.timeout_s:g} s); simplify it",
        )
        failed: Future[CompiledGrammar] = Future()
        failed.set_exception(error)
        with self._lock:
            if self._entries.get(key) is entry:
                self._entries[key] = _Entry(failed, entry.request_field)
        raise error

    def _forget(self, key: Hashable, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def _busy(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"no grammar compiler was free within {self.timeout_s:g} s; retry later"
        )
