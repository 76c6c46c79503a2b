"""all-MiniLM-L6-v2 through our engine equals sentence-transformers (mean pooling, normalise,
truncation at max_seq_length 256), offline and through the AsyncFrontEnd."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mmserve.entrypoints.llm import LLM
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.async_frontend import AsyncFrontEnd
from tests.utils.engine_idle import is_idle, wait_until_idle

TEXTS = [
    "Hello world, this is a test.",
    "",  # empty-ish: [CLS] [SEP] only
    " ",
    "  padded with spaces  ",
    "Ça coûte 10 € — naïve façade, Straße, ½ résumé.",
    "日本語のテキストと中文文本，还有 emoji 🙂🚀.",
    "Привет, мир! مرحبا بالعالم",
    "The quick brown fox jumps over the lazy dog. " * 60,  # ~600 tokens: truncated at 256
    "A short one.",
]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def reference(sentence_transformer: Any) -> torch.Tensor:
    return sentence_transformer.encode(TEXTS, convert_to_tensor=True, batch_size=4).float()


def assert_matches(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min().item() > MIN_COSINE, cosine
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)


def test_setup_reads_sentence_transformers_files(minilm_llm: LLM) -> None:
    info = minilm_llm.frontend.info
    assert minilm_llm.tasks == ("embed", "score", "rerank")
    pooler = minilm_llm.frontend.core.runner.pooler
    assert pooler is not None and pooler.config.method == "mean"  # type: ignore[attr-defined]
    assert info.max_input_len == 256
    assert info.score_method == "cosine" and info.embedding_size == 384
    assert minilm_llm.frontend.info.max_pooling_len == 256


def test_offline_embeddings_match_sentence_transformers(
    minilm_llm: LLM, reference: torch.Tensor
) -> None:
    ours = torch.tensor(minilm_llm.embed(TEXTS, truncate="right"))
    assert_matches(ours, reference)


def test_async_embeddings_match_sentence_transformers(
    minilm_async: AsyncFrontEnd, reference: torch.Tensor
) -> None:
    async def both() -> tuple[pooling_api.EmbedResult, pooling_api.EmbedResult]:
        # two calls at once: their inputs share engine steps
        return await asyncio.gather(
            pooling_api.embed(minilm_async, TEXTS[:5], truncate="right"),
            pooling_api.embed(minilm_async, TEXTS[5:], truncate="right"),
        )

    first, second = asyncio.run(both())
    assert_matches(torch.cat([first.embeddings, second.embeddings]), reference)
    assert first.prompt_tokens > 5 * 2 and second.prompt_tokens > 256


def test_a_call_larger_than_its_window_is_split(
    minilm_async: AsyncFrontEnd, reference: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pooling_api, "MAX_IN_FLIGHT_PER_CALL", 2)
    result = asyncio.run(pooling_api.embed(minilm_async, TEXTS, truncate="right"))
    assert_matches(result.embeddings, reference)


def test_matryoshka_dimensions_truncate_then_normalise(minilm_llm: LLM) -> None:
    full = torch.tensor(minilm_llm.embed(TEXTS[:3], normalize=False))
    cut = torch.tensor(minilm_llm.embed(TEXTS[:3], dimensions=64))
    assert cut.shape == (3, 64)
    torch.testing.assert_close(cut, F.normalize(full[:, :64], dim=-1), atol=1e-5, rtol=1e-5)


def test_cosine_score_and_rerank(minilm_llm: LLM, sentence_transformer: Any) -> None:
    query, docs = (
        "A cat sits on the mat.",
        ["Stock prices fell.", "A kitten rests on a rug.", "Dogs bark."],
    )
    vectors = sentence_transformer.encode([query, *docs], convert_to_tensor=True).float()
    expected = (vectors[1:] @ vectors[0]).tolist()
    assert minilm_llm.score(query, docs) == pytest.approx(expected, abs=1e-4)
    pairwise = minilm_llm.score([query, docs[0], query], [docs[1], docs[0], docs[2]])
    assert pairwise == pytest.approx([expected[1], 1.0, expected[2]], abs=1e-4)
    ranked = minilm_llm.rerank(query, docs, top_n=2)
    assert [r.index for r in ranked] == sorted(range(3), key=lambda i: -expected[i])[:2]
    assert ranked[0].document == docs[ranked[0].index]


def test_a_cancelled_call_aborts_its_batch(minilm_async: AsyncFrontEnd, reference: torch.Tensor) -> None:
    """Cancelling a call aborts the inputs it sent as one batch; the engine empties and the
    next call gets correct results."""

    async def cancel_then_embed() -> pooling_api.EmbedResult:
        task = asyncio.create_task(pooling_api.embed(minilm_async, TEXTS * 40, truncate="right"))
        while minilm_async.num_in_flight == 0:  # its first batches are in the engine
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(minilm_async)  # the aborts reach the engine thread
        return await pooling_api.embed(minilm_async, TEXTS, truncate="right")

    result = asyncio.run(cancel_then_embed())
    assert is_idle(minilm_async)
    assert_matches(result.embeddings, reference)
