"""The metrics of `mmserve bench serve`, as vLLM's serving benchmark defines them: pure
functions of per-request timings, testable without a server.

TTFT: send to the first chunk carrying tokens. TPOT: (latency - TTFT) / (output tokens - 1) of
each request with more than one output token (counted as 0 when checking the TPOT SLO).
ITL: the gaps between successive token-carrying chunks, over all requests. Goodput: requests/s
that meet every SLO given (with none given, it equals the request throughput).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """How one Generate call went, as the client saw it."""

    ok: bool  # the stream ended normally with at least one token
    ttft: float = 0.0  # seconds from sending to the first chunk carrying tokens
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between token-carrying chunks
    prompt_tokens: int = 0  # as the server counted them (usage)
    output_tokens: int = 0  # tokens received over the stream
    error: str = ""  # why it failed (status code and message); "" when ok


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean/median/p99 in ms (None when there is nothing to measure: JSON has no NaN)."""
    import numpy as np

    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    empty = ms.size == 0
    return {
        f"mean_{name}_ms": None if empty else float(ms.mean()),
        f"median_{name}_ms": None if empty else float(np.median(ms)),
        f"p99_{name}_ms": None if empty else float(np.percentile(ms, 99)),
    }


SLOWEST = 5  # the slowest first tokens listed by request number


def summarize(
    results: list[RequestResult],
    duration: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict[str, Any]:
    """vLLM's serving metrics of one rate (failed requests count in no figure but `failed`)."""
    done = [r for r in results if r.ok]
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in done
    ]
    good = sum(
        (slo_ttft_ms is None or 1e3 * r.ttft <= slo_ttft_ms)
        and (slo_tpot_ms is None or 1e3 * t <= slo_tpot_ms)
        for r, t in zip(done, tpot, strict=True)
    )
    inputs, outputs = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(done) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "goodput": good / duration,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        **_stats("ttft", [r.ttft for r in done]),
        **_stats("tpot", [t for r, t in zip(done, tpot, strict=True) if r.output_tokens > 1]),
        **_stats("itl", [gap for r in done for gap in r.itl]),
        **_stats("e2el", [r.latency for r in done]),
        # (request number in arrival order, TTFT ms) of the slowest first tokens: a cold start's
        # waits come first, a load's anywhere
        "slowest_ttft_ms": sorted(
            ((i, 1e3 * r.ttft) for i, r in enumerate(results) if r.ok), key=lambda p: -p[1]
        )[:SLOWEST],
        "errors": errors[:5],
    }
