"""A step's grammar-mask fill on a thread of its own (issue 23, target 6).

With async scheduling a constrained step's mask can be filled only once the step before's tokens
reached the host and its matchers took them. Filled on the main thread, the fill (about 3 ms at
64 rows of Llama 3's vocabulary on an H200's host) and then the next step's schedule and launch
ran one after the other, and the device waited for both. Here the fill runs on the filler's
thread (xgrammar fills without holding the GIL) while the main thread enqueues the mask's copy,
the sampling and the next step's launch; on CUDA the copy waits on the device for the fill
(mmserve.kernels.host_gate), so the host never waits for it. On the CPU the logits are already
there: `wait()` joins the fill before the mask is applied.

The matchers are the fill's until `finish()`: the runner calls it before it hands the step's
tokens over (resolve), which is before anything else changes a matcher.

A fill may first run the accept of the step before's tokens (`start`'s `first`, from the
runner's `start_grammars`): the filler's thread waits for those tokens on the host, puts them
into their matchers and fills at once, so the fill no longer waits for the main thread's
update of the step before. Then resolve() waits only for that accept (the future `start`
returns), not the fill: the scheduler's update reads the refusals, and the matchers'
`is_terminated`, while the fill goes on (the fill only reads the matchers too); finish() comes
with the next start() or resolve().
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from mmserve.structured_output.backend import GrammarMatcher, fill_bitmasks

T = TypeVar("T")


class MaskFiller:
    """One fill at a time, on one thread; device: where the logits are (CUDA: a HostGate)."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mmserve-mask-fill")
        self._gate = None
        if device.type == "cuda":
            from mmserve.kernels.host_gate import HostGate  # (Triton: CUDA only here)

            self._gate = HostGate(device)
            self._gate.close(0)  # (open from the start: compiles the kernel now, not while serving)
        self._pending: Future[None] | None = None
        self._ticket = 0

    def start(
        self,
        matchers: Sequence[GrammarMatcher],
        mask: torch.Tensor,
        rows: Sequence[int],
        first: Callable[[], T] | None = None,
    ) -> Future[T]:
        """Starts filling mask[rows[i]] for matchers[i] (fill_bitmasks), the fill before ended;
        `first` (if any) runs on the fill's thread before it. Returns first's future, which is
        done before the fill ends (its result None without one); when first raises, nothing
        is filled and finish() raises it too."""
        self.finish()
        self._ticket += 1
        gate, ticket = self._gate, self._ticket
        before: Future[T] = Future()
        before.set_running_or_notify_cancel()

        def fill() -> None:
            try:
                try:
                    before.set_result(first() if first is not None else None)  # type: ignore[arg-type]
                except BaseException as error:
                    before.set_exception(error)
                    raise
                with torch.inference_mode():  # (thread-local: the mask is the runner's, made in it)
                    fill_bitmasks(matchers, mask, rows)
            finally:  # (a fill that raised still opens the gate: the error comes at finish())
                if gate is not None:
                    gate.open(ticket)

        self._pending = self._pool.submit(fill)
        return before

    def wait(self) -> None:
        """Makes what is enqueued next wait for the fill: on CUDA on the current stream (a
        gate for the fill's ticket), elsewhere on the host (finish())."""
        if self._gate is None:
            self.finish()
            return
        self._gate.close(self._ticket)

    def finish(self) -> None:
        """Waits for the fill under way (if any); raises what it raised, or RuntimeError when
        a device wait gave up before the fill ended (its mask was not whole)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if self._gate is not None and self._gate.gave_up:
            raise RuntimeError("a grammar mask's fill outlasted the device's wait for it")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
