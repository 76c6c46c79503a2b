"""`mmserve bench soak` on the embedded defaults, briefly: every kind of call is made, the
invalid ones are refused INVALID_ARGUMENT (counted OK), the canaries stay exact, and no KV
block is held once the traffic stops."""

from __future__ import annotations

import json

import pytest

from mmserve.bench import soak
from tests.bench.conftest import bench_args


@pytest.mark.slow
def test_a_short_soak_reports(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_args(
        "soak", "--duration-s", "4", "--report-every-s", "2", "--soak-concurrency", "3",
        "--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "16",
    )  # fmt: skip
    soak.run(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    reports, summary = lines[:-1], lines[-1]
    assert reports and all(r["canary_exact"] for r in reports)
    assert summary["bench"] == "soak-summary" and summary["canaries_exact"]
    assert summary["kv_blocks_in_use_idle"] == {"chat": 0, "embed": 0}
    outcomes = summary["calls_by_outcome"]
    assert set(outcomes) == {"OK"}, outcomes  # invalid requests were refused as they must be
    assert summary["rss_last_mb"] > 0

