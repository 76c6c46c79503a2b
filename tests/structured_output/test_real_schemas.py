"""Real-world schemas compile on both backends (strictly, or with `relaxed` reporting what it
left out), and every string the grammar accepts validates against the schema - less the
relaxed keywords - under jsonschema with formats asserted (random walks through the grammar,
mmserve/bench/schema_corpus.py).

CI runs 20 schemas of JSONSchemaBench (data/jsonschemabench_subset.json, 2 per source) with
2 walks each. MMSERVE_SCHEMA_CORPUS=path/to/jsonschemabench-sample.json runs a whole corpus
(minutes; `mmserve bench structured --schemas FILE` prints the same figures as a table).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mmserve.bench.schema_corpus import CorpusSchema, load_corpus, measure
from mmserve.structured_output import StructuredOutputBackend
from tests.structured_output.conftest import get_backend
from tests.structured_output.walk import Vocab

SUBSET = Path(__file__).with_name("data") / "jsonschemabench_subset.json"
CORPUS = os.environ.get("MMSERVE_SCHEMA_CORPUS")
SCHEMAS = load_corpus(Path(CORPUS) if CORPUS else SUBSET)
WALKS = 2


@pytest.fixture(params=["xgrammar", "outlines"])
def real_backend(request: pytest.FixtureRequest, tokenizer: Any) -> StructuredOutputBackend:
    return get_backend(tokenizer, request.param)


@pytest.mark.parametrize("entry", SCHEMAS, ids=[f"{e.source}/{e.name}" for e in SCHEMAS])
def test_real_schema_compiles_and_walks_validate(
    real_backend: StructuredOutputBackend, vocab: Vocab, entry: CorpusSchema
) -> None:
    outcome = measure(real_backend, vocab, entry, WALKS)
    if CORPUS and outcome.status == "refused":
        pytest.skip(outcome.message)  # the full corpus has schemas no backend takes
    assert outcome.status != "refused", outcome.message
    assert not outcome.invalid, outcome.invalid
    assert outcome.valid + outcome.endless == WALKS and outcome.valid, outcome
