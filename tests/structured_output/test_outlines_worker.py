"""outlines-core builds run in worker processes: one past its time limit is stopped (its
process killed), refused with a clear error, and the next build gets a fresh worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import StructuredOutputParams
from mmserve.structured_output.outlines_backend import OutlinesBackend, _vocabulary
from mmserve.structured_output.outlines_worker import BuildTimeout, IndexBuilder
from tests.structured_output.conftest import PADDED_VOCAB, SMOLLM2_EOS, get_backend

SLOW_REGEX = '"[a-z ]{0,3000}"'  # minutes for outlines-core: every count is a state


def test_a_build_past_its_limit_is_stopped(tokenizer: Any) -> None:
    builder = IndexBuilder(_vocabulary(tokenizer, PADDED_VOCAB, SMOLLM2_EOS), timeout_s=0.5)
    try:
        with pytest.raises(BuildTimeout, match="over 0.5 s"):
            builder.build(SLOW_REGEX)
        assert builder._idle == []  # the worker was killed, not kept
        assert builder.build("(yes|no)") is not None  # a fresh one
        with pytest.raises(ValueError):
            builder.build("(unclosed")  # outlines-core's own error comes back
    finally:
        builder.close()


def test_the_backend_refuses_a_schema_that_builds_too_long(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(tokenizer, "outlines")
    assert isinstance(backend, OutlinesBackend)
    monkeypatch.setattr(backend._builder, "timeout_s", 0.5)
    schema = {"type": "string", "maxLength": 250}  # allowed, but slow to build
    with pytest.raises(InvalidArgument, match="took too long to compile with the outlines backend"):
        backend.compile(StructuredOutputParams("json_schema", json.dumps(schema)))
