"""A stream's wait for a host thread: work enqueued on a stream after `HostGate.close(n)` runs
once some host thread has called `open(m)` with m >= n.

The grammar masks use it (mmserve/runner/mask_fill.py): a step's mask is filled on a thread of
its own while the main thread goes on enqueueing (the mask's copy, the sampling, the next step's
launch) instead of waiting for the fill; the device waits at the copy instead.

The gate is one program of one warp that reads a flag in pinned host memory (volatile loads:
system-scope, so each one sees the host's latest store) until it reaches the ticket. It gives
up after MAX_SPINS reads and marks that in the flag's second word (`gave_up`), so a lost
`open()` stalls the stream for a bounded time and is then reported, never hangs it for good.
Under the Triton interpreter (tests) the kernel runs on the calling thread: it returns once
another thread has opened the gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# reads of the host flag before the gate gives up: each crosses PCIe (about 1 us), so on the
# order of a minute, far beyond any mask fill
MAX_SPINS = 1 << 26


@triton.jit(do_not_specialize=["ticket"])
def _wait_kernel(flag_ptr, ticket, MAX: tl.constexpr):
    seen = tl.load(flag_ptr, volatile=True)
    spins = 0
    while (seen < ticket) & (spins < MAX):
        seen = tl.load(flag_ptr, volatile=True)
        spins += 1
    late = (seen < ticket).to(tl.int64)
    gave_up = tl.load(flag_ptr + 1, volatile=True)
    tl.store(flag_ptr + 1, gave_up + late)


class HostGate:
    """Tickets count up from 1: close(n) enqueues a wait for ticket n on the current stream (of
    `device`); open(n), from any thread, lets the waits for n and every earlier ticket through.
    On the CPU the flag is ordinary memory (for the interpreter's tests)."""

    def __init__(self, device: torch.device, max_spins: int = MAX_SPINS) -> None:
        # [0]: the highest ticket opened; [1]: the waits that gave up
        self._flag = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._words = self._flag.numpy()  # stores without torch's dispatch
        self._max_spins = max_spins

    def close(self, ticket: int) -> None:
        """Enqueues, on the current stream, a wait for `ticket`."""
        _wait_kernel[(1,)](self._flag, ticket, MAX=self._max_spins, num_warps=1)

    def open(self, ticket: int) -> None:
        """Lets the waits for tickets up to `ticket` through (any thread; stores are ordered on
        the host's side after whatever it wrote before, e.g. the mask)."""
        self._words[0] = ticket

    @property
    def gave_up(self) -> int:
        """How many waits gave up before their ticket was opened (read it after the stream
        has passed them, e.g. once the step's tokens reached the host)."""
        return int(self._words[1])
