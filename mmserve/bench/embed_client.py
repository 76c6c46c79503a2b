"""`bench embed`'s client process: the SDK's Embed calls, timed there. A module of its own that
imports neither torch nor the engine, so the spawned process starts in a fraction of a second
(through mmserve.bench.embed it imported torch, transformers and the front end: 8 s on 2 cores)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

SERVED_NAME = "bench-embedder"

_client: Any = None  # the client process's SDK client
_callers: ThreadPoolExecutor | None = None  # its threads, one per call in flight


def client_start(target: str, concurrency: int) -> None:
    from mmserve_client import Client

    global _client, _callers
    _client = Client(target, timeout=600)
    _callers = ThreadPoolExecutor(concurrency, thread_name_prefix="caller")


def client_embed(calls: list[list[str]]) -> tuple[np.ndarray, float]:
    """In the client process: the Embed calls through the SDK from as many threads as
    --concurrency (each sends its next call when its last returns), timed there; the first
    call's vectors."""
    assert _callers is not None
    embed = partial(_client.embed, model=SERVED_NAME, truncate="right")
    start = time.perf_counter()
    results = list(_callers.map(embed, calls))
    seconds = time.perf_counter() - start
    return np.stack(results[0]), seconds
