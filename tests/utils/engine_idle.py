"""Waiting for an AsyncFrontEnd to empty after a call was cancelled or failed."""

from __future__ import annotations

import asyncio

from mmserve.frontend.async_frontend import AsyncFrontEnd


def is_idle(engine: AsyncFrontEnd) -> bool:
    """No call holds requests, and the engine has nothing left to run."""
    return engine.num_in_flight == 0 and not engine.frontend.has_unfinished


async def wait_until_idle(engine: AsyncFrontEnd, timeout_s: float = 2.0) -> None:
    """Polls until is_idle (aborts reach the engine thread asynchronously) or the timeout
    passes; the caller asserts is_idle after."""
    for _ in range(int(timeout_s / 0.01)):
        if is_idle(engine):
            return
        await asyncio.sleep(0.01)
