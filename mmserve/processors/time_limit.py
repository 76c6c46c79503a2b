"""A time limit on the Python code one thread runs: how a chat template's render is bounded.

Chat templates are arbitrary jinja from model repos. jinja's sandbox bounds what they may
touch (and caps range() at 100,000 items) but not how long they run: nested loops, or a macro
that calls itself twice, render for ever and hold their worker thread. A thread cannot be
stopped from outside, so the limit is checked inside it, through sys.settrace: at every
Python call, and at every line of template code (jinja compiles a template into Python whose
file name is "<template>"), so a template's loop stops within one iteration of the deadline
and its thread is free again, not abandoned. Only Python-level work is bounded: a single long
call into C (a huge integer power, tokenising a huge text) finishes first.

The same tracer bounds how deep template code nests (MAX_TEMPLATE_DEPTH frames of it, a macro
calling itself among them): past that it raises RecursionError, as Python's own limit would, but
sooner (a macro calling itself: at 128 levels, about 640 frames, where Python's 1,000 came
at about 200). At Python's limit every finalizer that the garbage collector runs on
that thread meanwhile (any object's, a thread pool's or a generator's) fails too, for want of
stack.

Until then the limited code also lets go of the GIL every YIELD_EVERY_S: a thread spinning in
Python keeps it for a whole switch interval (5 ms) each time another thread asks for it, and
threads that take it often (an engine thread at every torch call, the event loop) slow to a
crawl, so a stuck template would starve every model through the GIL (four stuck renders made
another model's 3-token Generate take 2 s instead of 0.05; letting go brings it to ~0.2 s).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
TEMPLATE_FILE = "<template>"  # the file name of code jinja compiles from a string
YIELD_EVERY_S = 0.0005  # how often the limited code lets other threads have the GIL
# frames of template code one render may nest (jinja's macro calls, its blocks and loops' own
# functions; real templates' recursive macros, over a tool's schema, nest tens)
MAX_TEMPLATE_DEPTH = 128
Tracer = Callable[[FrameType, str, Any], Any]


class TimeLimitExceeded(BaseException):
    """Raised inside the limited code once its time is up. A BaseException, so that no
    `except Exception` on its way out (jinja's, transformers') can swallow it: sys.settrace
    turns tracing off once a trace function raises, so a swallowed one would not come back."""


def call_with_time_limit(seconds: float, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) in this thread, raising TimeLimitExceeded inside it once `seconds`
    have passed (whatever tracer was set, a debugger's or coverage's, is put back after)."""
    previous = sys.gettrace()
    sys.settrace(_tracer(time.monotonic() + seconds))
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(previous)


def _tracer(deadline: float) -> Tracer:
    next_yield = time.monotonic() + YIELD_EVERY_S
    depth = 0  # template frames running

    def on_line(frame: FrameType, event: str, arg: Any) -> Tracer:
        nonlocal next_yield, depth
        if event == "return":  # (a template frame's: on_line traces no others; also when
            depth -= 1  # an exception leaves it)
        now = time.monotonic()
        if now > next_yield:
            if now > deadline:
                raise TimeLimitExceeded
            time.sleep(0)  # releases the GIL: a waiting thread takes it now, not in 5 ms
            next_yield = now + YIELD_EVERY_S
        return on_line

    def on_call(frame: FrameType, event: str, arg: Any) -> Tracer | None:
        nonlocal depth
        on_line(frame, event, arg)
        # line events in template code only: a loop there may make no calls, while the line
        # events of the library code around it would only slow it down
        if frame.f_code.co_filename != TEMPLATE_FILE:
            return None
        if depth >= MAX_TEMPLATE_DEPTH:
            raise RecursionError(f"template code nested deeper than {MAX_TEMPLATE_DEPTH} calls")
        depth += 1
        return on_line

    return on_call
