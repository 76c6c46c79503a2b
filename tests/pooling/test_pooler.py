"""Pooling methods, normalisation, Matryoshka, activations, and how a model's tasks and
pooling are decided from its class, config and sentence-transformers files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mmserve.engine.pooling_setup import label_names, pooling_setup, read_sentence_transformers
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.base import ModelCapabilities
from mmserve.params import PoolingParams
from mmserve.runner.pooler import (
    POOLING_METHODS,
    ModelPooler,
    PoolerConfig,
    activate,
    finish_embedding,
    pool_tokens,
)

HIDDEN = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))


def test_pool_tokens() -> None:
    torch.testing.assert_close(pool_tokens(HIDDEN, "cls"), HIDDEN[0])
    torch.testing.assert_close(pool_tokens(HIDDEN, "last"), HIDDEN[-1])
    torch.testing.assert_close(pool_tokens(HIDDEN, "mean"), HIDDEN.mean(0))
    torch.testing.assert_close(pool_tokens(HIDDEN, "max"), HIDDEN.max(0).values)
    with pytest.raises(ValueError, match="unknown pooling method"):
        pool_tokens(HIDDEN, "median")


def test_finish_embedding_cuts_before_normalising() -> None:
    vector = HIDDEN[0]
    out = finish_embedding(vector, PoolingParams(dimensions=3))
    torch.testing.assert_close(out, F.normalize(vector[:3], dim=-1))
    torch.testing.assert_close(finish_embedding(vector, PoolingParams(normalize=False)), vector)


def test_activations() -> None:
    logits = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(activate(logits, "softmax", True), logits.softmax(-1))
    torch.testing.assert_close(activate(logits, "sigmoid", True), logits.sigmoid())
    torch.testing.assert_close(activate(logits, "softmax", False), logits)
    torch.testing.assert_close(activate(logits, "tanh", True), logits.tanh())
    torch.testing.assert_close(activate(logits, "identity", True), logits)


class FakeClassifier:
    num_labels = 1
    default_pooling = "cls"

    def compute_class_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled[:, :1] * 2  # [N, 1]


def test_cross_encoder_pooler_reads_the_first_token() -> None:
    pooler = ModelPooler(FakeClassifier(), PoolerConfig("cls", "sigmoid", score="cross-encoder"))
    expected = torch.sigmoid(HIDDEN[0, :1] * 2)
    torch.testing.assert_close(pooler(HIDDEN, PoolingParams("score")), expected)
    torch.testing.assert_close(
        pooler(HIDDEN, PoolingParams("score", activation=False)), HIDDEN[0, :1] * 2
    )


def write_st_folder(folder: Path, pooling: dict[str, Any], extra: tuple[str, ...] = ()) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ] + [
        {"idx": 2 + i, "name": k, "path": k, "type": f"sentence_transformers.models.{k}"}
        for i, k in enumerate(extra)
    ]
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return folder


def test_read_sentence_transformers(tmp_path: Path) -> None:
    assert read_sentence_transformers(tmp_path) is None
    info = read_sentence_transformers(
        write_st_folder(tmp_path / "a", {"pooling_mode_lasttoken": True}, ("Normalize",))
    )
    assert info is not None and (info.method, info.normalize, info.max_seq_length) == (
        "last",
        True,
        128,
    )
    with pytest.raises(UnsupportedModel, match="LayerNorm"):
        read_sentence_transformers(
            write_st_folder(tmp_path / "b", {"pooling_mode_cls_token": True}, ("LayerNorm",))
        )
    dense = read_sentence_transformers(
        write_st_folder(tmp_path / "d", {"pooling_mode_cls_token": True}, ("Dense", "Normalize"))
    )
    assert dense is not None and dense.dense == (tmp_path / "d" / "Dense",) and dense.normalize
    both = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    with pytest.raises(UnsupportedModel, match="only one of"):
        read_sentence_transformers(write_st_folder(tmp_path / "c", both))


@pytest.mark.parametrize(
    ("pooling", "method"),
    [
        ({"pooling_mode": "lasttoken", "include_prompt": True}, "last"),
        ({"pooling_mode": "cls"}, "cls"),
        ({"pooling_mode": ["mean"]}, "mean"),
        ({"pooling_mode": ["cls", "mean"]}, "only one of"),
        ({"pooling_mode": "weightedmean"}, "only one of"),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt"),
        ({"pooling_mode_weightedmean_tokens": True}, "only one of"),
    ],
)
def test_sentence_transformers_6_pooling_modes(
    pooling: dict[str, Any], method: str, tmp_path: Path
) -> None:
    """sentence-transformers 6 writes one "pooling_mode" (its names: "lasttoken", ...)
    instead of the pooling_mode_* switches; what we cannot reproduce is still refused."""
    folder = write_st_folder(tmp_path, pooling)
    if method in POOLING_METHODS:
        info = read_sentence_transformers(folder)
        assert info is not None and info.method == method
    else:
        with pytest.raises(UnsupportedModel, match=method):
            read_sentence_transformers(folder)


def model(hidden_size: int = 8, **attrs: Any) -> SimpleNamespace:
    """A model as pooling_setup reads it: its capabilities, hidden_size, num_labels."""
    return SimpleNamespace(capabilities=ModelCapabilities(**attrs), hidden_size=hidden_size)


def classifier(num_labels: int) -> SimpleNamespace:
    fake = model(classifier=True, default_pooling="cls")
    fake.num_labels = num_labels
    return fake


HF = SimpleNamespace(hidden_size=8, id2label={"0": "no", "1": "yes"}, problem_type=None)


def test_setup_for_an_encoder_prefers_flag_then_st_then_architecture(tmp_path: Path) -> None:
    encoder = model(causal=False, uses_kv_cache=False, default_pooling="cls")
    plain = pooling_setup(encoder, HF, tmp_path, None)
    assert plain.tasks == ("embed", "score", "rerank") and plain.score_method == "cosine"
    assert plain.pooler is not None and plain.pooler.config.method == "cls"
    folder = write_st_folder(tmp_path / "st", {"pooling_mode_mean_tokens": True})
    from_st = pooling_setup(encoder, HF, folder, None)
    assert from_st.pooler is not None and from_st.pooler.config.method == "mean"
    assert from_st.max_input_len == 128
    flagged = pooling_setup(encoder, HF, folder, None, "max")
    assert flagged.pooler is not None and flagged.pooler.config.method == "max"
    with pytest.raises(InvalidArgument, match="^pooling: "):
        pooling_setup(encoder, HF, folder, None, "median")


def test_setup_for_a_decoder_without_chat_template_cannot_score(tmp_path: Path) -> None:
    setup = pooling_setup(
        model(default_pooling="last"), HF, tmp_path, SimpleNamespace(chat_template=None)
    )
    assert setup.tasks == ("generate", "embed") and setup.score_method is None
    assert setup.pooler_tasks == {"embed"}


def test_setup_for_classifiers() -> None:
    two = pooling_setup(classifier(2), HF, None, None)
    assert two.tasks == ("classify",) and two.labels == ("no", "yes")
    assert two.pooler is not None and two.pooler.config.activation == "softmax"
    one = pooling_setup(classifier(1), HF, None, None)
    assert one.tasks == ("classify", "score", "rerank") and one.score_method == "cross-encoder"
    assert one.pooler is not None and one.pooler.config.activation == "sigmoid"
    multi = SimpleNamespace(**{**vars(HF), "problem_type": "multi_label_classification"})
    setup = pooling_setup(classifier(2), multi, None, None)
    assert setup.pooler is not None and setup.pooler.config.activation == "sigmoid"
    assert label_names(SimpleNamespace(id2label={0: "a"}), 2) == ("a", "LABEL_1")
