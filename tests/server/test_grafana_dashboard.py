"""examples/grafana/mmserve.json reads only metrics the server exports, and has the panels
the operators asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mmserve.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "mmserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Every sample name the server's registry can expose (labelled families included)."""
    names = set()
    for family in Metrics([]).registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_metric_in_the_dashboard_exists() -> None:
    exported = exported_names()
    used = {name for e in expressions() for name in re.findall(r"mmserve:[A-Za-z0-9_:]+", e)}
    assert used and used <= exported, sorted(used - exported)


def test_the_dashboard_has_the_panels() -> None:
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for topic in ("throughput", "time to first token", "inter-token", "kv cache", "queue",
                  "prefix cache hit rate", "errors by code"):  # fmt: skip
        assert topic in titles, topic
    text = " ".join(expressions())
    assert "histogram_quantile(0.99" in text and 'code!="OK"' in text
