"""What a structural tag's masks cost on the CPU (BENCHMARKS session 38): three
`<function=NAME>{...}</function>` structures in vLLM's form against the same schema alone as
json_schema, xgrammar with SmolLM2's vocabulary on one thread; one matcher fed a text token by
token, one mask filled before each. Run from the repository root:

    PYTHONPATH=. python scripts/bench_tag_masks.py
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from mmserve.processors.tokenizer import load_tokenizer
from mmserve.structured_output import StructuredOutputParams, allocate_bitmask, create_backend
from tests.structured_output.conftest import (
    PADDED_VOCAB,
    SMOLLM2_EOS,
    WEATHER_ARGUMENTS,
    _converted_folder,
    _gguf_path,
)
from tests.utils.tiny_models import smollm2_tokenizer_folder

TAGS = {
    "structures": [{"begin": f"<function={n}>", "schema": WEATHER_ARGUMENTS, "end": "</function>"}
                   for n in ("get_weather", "get_time", "search")],
    "triggers": ["<function="],
}  # fmt: skip
CALL = '{"city": "Paris", "days": 3}'
TEXT = f"Let me check the weather for you. <function=get_weather>{CALL}</function> Here it is."


def run(backend: Any, tokenizer: Any, params: StructuredOutputParams, text: str) -> str:
    start = time.perf_counter()
    matcher = backend.compile(params).matcher()
    compile_ms = (time.perf_counter() - start) * 1e3
    mask, times = allocate_bitmask(1, PADDED_VOCAB), []
    for token in tokenizer.encode(text, add_special_tokens=False):
        start = time.perf_counter()
        matcher.fill_bitmask(mask, 0)
        times.append((time.perf_counter() - start) * 1e3)
        assert matcher.accept_token(token), tokenizer.decode([token])
    return (f"{params.kind}: compile {compile_ms:.1f} ms, {len(times)} masks: median "
            f"{statistics.median(times):.3f} ms, slowest {max(times):.3f} ms")  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    folder = _converted_folder()
    tokenizer = load_tokenizer(folder or smollm2_tokenizer_folder(_gguf_path()))
    backend = create_backend("xgrammar", tokenizer, PADDED_VOCAB, SMOLLM2_EOS)
    print(run(backend, tokenizer, StructuredOutputParams("structural_tag", json.dumps(TAGS)), TEXT))
    print(run(backend, tokenizer, StructuredOutputParams("json_schema", json.dumps(WEATHER_ARGUMENTS)), CALL))


if __name__ == "__main__":
    main()
