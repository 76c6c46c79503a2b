"""allowed_token_ids, bad_words and truncate_prompt_tokens over gRPC, through the SDK: the
fields reach the engine (the output is the offline API's, checked against transformers in
tests/entrypoints/test_llm_sampling_masks.py) and usage counts the cut prompt."""

from __future__ import annotations

from pathlib import Path

from mmserve import LLM, SamplingParams
from mmserve_client import Client
from tests.server.conftest import ServerThread

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def test_the_fields_reach_the_engine(tiny_server: ServerThread, tiny_models: dict[str, Path]) -> None:
    offline = LLM(str(tiny_models["tiny-b"]), kv_cache_memory=16 << 20)
    ids = offline.tokenizer.encode("Hello world, this is a test of a tiny tokenizer for mmserve.")
    base = offline.generate([ids], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    word = offline.tokenizer.decode(base.token_ids[2:3])
    cases = [
        {"allowed_token_ids": [5, 17, 40, 41]},
        {"bad_words": [word]},
        {"bad_words": word},  # the SDK takes one word as a str
        {"truncate_prompt_tokens": 4},
    ]
    with Client(tiny_server.target, timeout=60) as c:
        for kw in cases:
            got = c.generate(ids, model="tiny-b", **GREEDY, **kw)  # type: ignore[arg-type]
            if isinstance(kw.get("bad_words"), str):
                kw = {"bad_words": [kw["bad_words"]]}
            want = offline.generate([ids], SamplingParams(**GREEDY, **kw), use_tqdm=False)[0]  # type: ignore[arg-type]
            assert list(got.token_ids) == want.outputs[0].token_ids, kw
            assert got.usage.prompt_tokens == len(want.prompt_token_ids), kw
            assert list(got.token_ids) != base.token_ids, kw  # (each case changes the output)
            assert list(c.generate(ids, model="tiny-b", **GREEDY).token_ids) == base.token_ids
        cut = c.generate("Hello world, this is a test", model="tiny-b", truncate_prompt_tokens=3, max_tokens=2)
        assert cut.usage.prompt_tokens == 3
        chat = c.chat([{"role": "user", "content": "Hi there"}], model="tiny-b", truncate_prompt_tokens=3, max_tokens=2)
        assert chat.usage.prompt_tokens == 3
