"""Admission control of the front end: a bound on calls in flight per model, and draining.

Used from the event loop only (no locks). Health checks never pass through here, so a server
at its limit still answers them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from mmserve.errors import ResourceExhausted
from mmserve.server.errors import Draining


class Admission:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight  # per model
        self.draining = False  # set on SIGTERM: new calls are refused, running ones finish
        self._in_flight: Counter[str] = Counter()

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def in_flight_of(self, model: str) -> int:
        """Calls of one model holding a slot now."""
        return self._in_flight[model]

    def check_open(self) -> None:
        if self.draining:
            raise Draining("the server is shutting down; retry on another replica")

    @contextmanager
    def slot(self, model: str) -> Iterator[None]:
        """Holds one of the model's places for the duration of a call."""
        self.check_open()
        if self._in_flight[model] >= self.max_in_flight:
            raise ResourceExhausted(
                f"model {model!r} has {self.max_in_flight} calls in flight (the server's "
                "max_pending); retry later"
            )
        self._in_flight[model] += 1
        try:
            yield
        finally:
            self._in_flight[model] -= 1

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no call is in flight; False if `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while self.in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True
