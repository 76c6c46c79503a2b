"""Grammar-constrained generation on the GPU: the masks reach CUDA logits through their own copy
stream and two device buffers taken in turn (model_runner._MaskCopies), so a mask applied
before its copy landed, or from the other step's buffer, would let an ungrammatical token
through. A tiny random model sampled at temperature 1 writes whatever the mask leaves it; every
output must validate, in batches whose constrained rows change from step to step (requests
finish at different lengths, unconstrained rows sit between them), with speculative guesses
too.

Skipped without CUDA; run on the GPU machine with `python -m pytest tests/gpu`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.structured_output import StructuredOutputParams
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SCHEMA = {
    "type": "object",
    "properties": {
        # ASCII: the tiny model's byte-level tokens could write a surrogate's three bytes,
        # which xgrammar's string takes as one character and Python decodes as three U+FFFD
        "name": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
PATTERN = r"[a-c]{2,9}-[0-9]{1,4}(x|yy)?"


def _check(outputs: list, kinds: list[str | None]) -> None:  # type: ignore[type-arg]
    for result, kind in zip(outputs, kinds, strict=True):
        for out in result.outputs:
            if kind == "json":
                assert out.finish_reason == "stop", out.text
                jsonschema.validate(json.loads(out.text), SCHEMA)
            elif kind == "regex":
                assert out.finish_reason == "stop", out.text
                assert re.fullmatch(PATTERN, out.text), out.text


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_gpu_constrained_outputs_validate(tmp_path, speculative: str | None) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_model(tmp_path, arch="llama"))
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=512, speculative=speculative)
    json_c = StructuredOutputParams("json_schema", json.dumps(SCHEMA))
    regex_c = StructuredOutputParams("regex", PATTERN)
    kinds: list[str | None] = []
    params: list[SamplingParams] = []
    for i in range(40):  # constrained and free rows interleaved, seeds apart
        kind = ("json", "regex", None, "json", "regex")[i % 5]
        structured = {"json": json_c, "regex": regex_c, None: None}[kind]
        kinds.append(kind)
        params.append(
            SamplingParams(temperature=1.0, seed=i, max_tokens=200, n=2 if i % 7 == 0 else 1, structured=structured)
        )
    prompts = [f"item {i}: " + "abc " * (i % 9) for i in range(len(params))]
    for _ in range(2):  # the second round reuses both device buffers
        _check(llm.generate(prompts, params, use_tqdm=False), kinds)
    pool = llm.frontend.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_gpu_constrained_with_host_reads_while_the_mask_fills(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """top_p and logprobs read the device on the host inside the step's sampling, while the
    mask's fill (model_runner.MASK_FILL_THREAD, on by default on CUDA) may still run on its
    thread and the device waits for it: those reads must not hold the fill up (a wait that
    gave up raises), and every output still validates."""
    path = str(make_tiny_model(tmp_path, arch="llama"))
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=512)
    assert llm.frontend.core.runner._filler is not None
    json_c = StructuredOutputParams("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=200, structured=json_c,
                       logprobs=2 if i % 2 else 0)
        for i in range(16)
    ]  # fmt: skip
    outputs = llm.generate([f"item {i}: " for i in range(16)], params, use_tqdm=False)
    _check(outputs, ["json"] * 16)
    assert all(o.outputs[0].logprobs for o in outputs[1::2])
