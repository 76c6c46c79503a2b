"""A decoder engine embeds (last token) and scores (yes-token) like transformers, and serves a
Generate stream and Embed calls at once with the same results as alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmserve.entrypoints.llm import LLM
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend import pooling_inputs
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.params import SamplingParams
from tests.pooling.conftest import load_engine

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Paris", "def main():"]
DOCS = ["The capital of France is Paris.", "hello", "Paged attention stores keys."]


def hf_final_hidden(path: Path, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden state and logits at each input's last token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    hidden, logits = [], []
    with torch.no_grad():
        for row in ids:
            out = model(torch.tensor([row]), output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0, -1])
            logits.append(out.logits[0, -1])
    return torch.stack(hidden), torch.stack(logits)


def test_decoder_tasks(tiny_llms: Callable[[str], LLM]) -> None:
    llm = tiny_llms("chat-decoder")
    assert llm.tasks == ("generate", "embed", "score", "rerank")
    assert llm.frontend.info.score_method == "yes-token"
    assert llm.frontend.core.runner.pooler is not None and llm.frontend.core.runner.pooler.config.method == "last"


def test_last_token_embeddings_match_transformers(
    tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    llm = tiny_llms("chat-decoder")
    ids = [e.token_ids for e in llm.frontend.input_encoder.encode(TEXTS, "none", "inputs")]
    hidden, _ = hf_final_hidden(tiny_models("chat-decoder"), ids)
    ours = torch.tensor(llm.embed(TEXTS))
    torch.testing.assert_close(ours, F.normalize(hidden, dim=-1), atol=1e-5, rtol=1e-4)


def test_decoder_without_lm_head_embeds_and_scores_by_cosine(
    tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    """A MistralModel checkpoint (e5-mistral-7b-instruct's layout): embed, cosine score and
    rerank, no generate; last-token embeddings as transformers' bare decoder gives them."""
    from transformers import AutoModel

    llm = tiny_llms("mistral-backbone")
    assert llm.tasks == ("embed", "score", "rerank")
    assert llm.frontend.info.score_method == "cosine"
    ids = [e.token_ids for e in llm.frontend.input_encoder.encode(TEXTS, "none", "inputs")]
    model = AutoModel.from_pretrained(str(tiny_models("mistral-backbone"))).eval()
    with torch.no_grad():
        last = torch.stack([model(torch.tensor([row])).last_hidden_state[0, -1] for row in ids])
    expected = F.normalize(last, dim=-1)
    torch.testing.assert_close(torch.tensor(llm.embed(TEXTS)), expected, atol=1e-5, rtol=1e-4)
    assert llm.score(TEXTS[0], TEXTS[1:]) == pytest.approx(
        (expected[1:] @ expected[0]).tolist(), abs=1e-5
    )


def test_yes_token_scores_match_transformers(
    tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    llm = tiny_llms("chat-decoder")
    encoder = llm.frontend.input_encoder
    prompts = [
        encoder.encode_yes_no("Where is Paris?", d, "none", "q", "d").token_ids for d in DOCS
    ]
    assert all(p[-3:] == prompts[0][-3:] for p in prompts)  # same answer cue at the end
    _, logits = hf_final_hidden(tiny_models("chat-decoder"), prompts)
    yes, no = llm.frontend.core.runner.pooler.config.yes_no_ids  # type: ignore[misc]
    expected = torch.sigmoid(logits[:, yes] - logits[:, no])
    assert llm.score("Where is Paris?", DOCS) == pytest.approx(expected.tolist(), abs=1e-5)
    ranked = llm.rerank("Where is Paris?", DOCS)
    assert [r.index for r in ranked] == expected.argsort(descending=True).tolist()


def test_yes_token_truncation_shortens_the_document_only(tiny_llms: Callable[[str], LLM]) -> None:
    encoder = tiny_llms("chat-decoder").frontend.input_encoder
    full = encoder.encode_yes_no("q", "word " * 300, "right", "q", "d").token_ids
    assert len(full) == encoder.max_len
    with pytest.raises(ValueError, match=r"^d: .*limit of 256"):
        encoder.encode_yes_no("q", "word " * 300, "none", "q", "d")


def test_yes_token_scoring_of_a_long_document_reads_a_part_of_it(
    tiny_llms: Callable[[str], LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document far past the limit is refused (none), or truncated (right, left), from the
    part of it truncation keeps, with the result of tokenising all of it."""
    encoder = tiny_llms("chat-decoder").frontend.input_encoder
    document = " ".join(f"word{i % 977}" for i in range(20_000))
    with pytest.raises(ValueError, match=r"^d: at least \d+ tokens exceed the limit of 256"):
        encoder.encode_yes_no("q", document, "none", "q", "d")
    with pytest.raises(ValueError, match=r"^q: too long: the question exceeds the limit 256"):
        encoder.encode_yes_no(document, "d", "right", "q", "d")
    got = [encoder.encode_yes_no("q", document, t, "q", "d") for t in ("right", "left")]
    monkeypatch.setattr(pooling_inputs, "find_long_text", lambda *args, **kwargs: None)
    assert got == [encoder.encode_yes_no("q", document, t, "q", "d") for t in ("right", "left")]


def test_generate_and_embed_concurrently_equal_alone(tiny_models: Callable[[str], Path]) -> None:
    engine = AsyncFrontEnd(load_engine(tiny_models("chat-decoder"), max_num_batched_tokens=64))
    prompt = engine.frontend.tokenizer.encode("The quick brown fox")
    # 200 tokens (of the model's 256 positions): the stream must outlast the embed calls'
    # tokenising and admission in wall time, on a fast machine too (24 did not always)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def generate(log: list[str] | None = None) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(engine.frontend.validate(prompt, params)):
            tokens += delta.token_ids
            if log is not None:
                log.append("token")
        return tokens

    async def embed(log: list[str] | None = None) -> torch.Tensor:
        result = await pooling_api.embed(engine, TEXTS * 3)
        if log is not None:
            log.append("embedded")
        return result.embeddings

    async def together() -> tuple[list[int], torch.Tensor, torch.Tensor, list[str]]:
        log: list[str] = []
        stream = asyncio.create_task(generate(log))
        while not log:  # the stream is running: now embed beside it
            await asyncio.sleep(0.001)
        first, second = await asyncio.gather(embed(log), embed(log))
        return await stream, first, second, log

    try:
        tokens_alone = asyncio.run(generate())
        vectors_alone = asyncio.run(embed())
        tokens, first, second, log = asyncio.run(together())
    finally:
        engine.shutdown()
    assert tokens == tokens_alone and len(tokens) == 200
    torch.testing.assert_close(first, vectors_alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, vectors_alone, atol=1e-5, rtol=1e-5)
    assert log.index("embedded") < len(log) - 2  # the embeddings came while tokens still streamed
