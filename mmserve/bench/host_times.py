"""Where an in-process engine's host thread spends a run: the seconds inside each part of a
step, and inside Python's garbage collector. `wait` is the time resolve() blocks on a step's
tokens: near zero when the host is the bottleneck, most of the step when the device is."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mmserve.engine.engine_core import EngineCore

# part name -> (the object's attribute holding it, the method's name)
PARTS = {
    "schedule": ("scheduler", "schedule"),
    "launch": ("runner", "launch"),
    "wait": ("runner", "resolve"),
    "sample": ("runner", "sample"),
    "update": ("scheduler", "update"),
}


class HostTimes:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys([*PARTS, "gc"], 0.0)
        self.steps = 0  # schedule() calls
        self.wall_s = 0.0  # the wall time of the timed blocks: what the parts are shares of
        self._gc_start = 0.0

    def per_step_ms(self) -> dict[str, float]:
        return {k: round(1e3 * v / max(self.steps, 1), 3) for k, v in self.seconds.items()}

    def wall_ms_per_step(self) -> float:
        """The timed blocks' wall ms per step, over the same steps as per_step_ms (prefill
        steps included): the parts, gc aside, sum to at most this."""
        return round(1e3 * self.wall_s / max(self.steps, 1), 3)

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.steps += name == "schedule"

        return timed

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.seconds["gc"] += time.perf_counter() - self._gc_start


@contextmanager
def host_times(core: EngineCore, into: HostTimes) -> Iterator[HostTimes]:
    """Times the core's step parts into `into` while the block runs (instance attributes
    wrap the methods; removed after, so the class's methods serve again)."""
    patched = []
    for name, (owner_attr, method_name) in PARTS.items():
        owner = getattr(core, owner_attr)
        setattr(owner, method_name, into._timed(name, getattr(owner, method_name)))
        patched.append((owner, method_name))
    gc.callbacks.append(into._on_gc)
    start = time.perf_counter()
    try:
        yield into
    finally:
        into.wall_s += time.perf_counter() - start
        gc.callbacks.remove(into._on_gc)
        for owner, method_name in patched:
            delattr(owner, method_name)
