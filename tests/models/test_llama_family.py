"""Our Llama-family decoder against transformers' own forward, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.models.loader import load_model
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_models import make_tiny_backbone, make_tiny_model

ATOL = 1e-4
PROMPT = [5, 17, 42, 99, 250, 7, 300, 12, 64, 128, 3, 77, 200, 31]  # 14 tokens

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that with head_dim 16 some frequencies are kept, some scaled, some smoothed
    "original_max_position_embeddings": 16,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-bias": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-yarn": ("llama", {"rope_parameters": YARN_ROPE}),
    "mistral-window": ("mistral", {"sliding_window": 4}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {"head_dim": 32, "num_key_value_heads": 1}),  # head_dim != 64 / 4
    "qwen3-tied-bias": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
}


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] in float32 with eager attention (applies windows)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def load_ours(path: Path) -> Any:
    model, _, _ = load_model(ModelConfig(model=str(path)), "cpu", "auto", TorchAttentionBackend())
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch, overrides = CASES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return load_ours(path), hf_logits(path, PROMPT)


@torch.no_grad()
def test_full_forward_matches_transformers(case: Any) -> None:
    model, expected = case
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunked_prefill_then_decode_matches_full_forward(case: Any) -> None:
    model, expected = case
    kv, seq = PagedKV(model, block_size=4), PagedSeq()
    chunks = [PROMPT[:5], PROMPT[5:11]] + [[t] for t in PROMPT[11:]]
    rows = [kv.step(model, [(seq, chunk)]) for chunk in chunks]
    torch.testing.assert_close(torch.cat(rows), expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_mixed_batch_of_prefill_and_decode(case: Any) -> None:
    """Two requests share each step: one decodes while the other prefills in chunks."""
    model, expected = case
    kv, a, b = PagedKV(model, block_size=4), PagedSeq(), PagedSeq()
    first = kv.step(model, [(a, PROMPT[:9])])
    mixed = kv.step(model, [(b, PROMPT[:6]), (a, PROMPT[9:10])])
    last = kv.step(model, [(a, PROMPT[10:]), (b, PROMPT[6:])])
    torch.testing.assert_close(mixed[:6], expected[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first, mixed[6:], last[:4]]), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(last[4:], expected[6:], atol=ATOL, rtol=0)


def test_transformers_applies_the_sliding_window(tmp_path: Path) -> None:
    """Guards the window tests: with eager attention transformers' logits do depend on it."""
    windowed = make_tiny_model(tmp_path, "mistral", sliding_window=4)
    full = make_tiny_model(tmp_path, "mistral", sliding_window=None)
    with_window, without = hf_logits(windowed, PROMPT), hf_logits(full, PROMPT)
    torch.testing.assert_close(with_window[:4], without[:4], atol=ATOL, rtol=0)
    assert (with_window[4:] - without[4:]).abs().max() > 1e-2


@torch.no_grad()
def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    model = load_ours(path)
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    torch.testing.assert_close(logits, hf_logits(path, PROMPT), atol=ATOL, rtol=0)


def hf_hidden(path: Path, ids: list[int]) -> torch.Tensor:
    """The bare decoder's final hidden states [T, hidden] (transformers' AutoModel)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0].float()


@torch.no_grad()
@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_bare_decoder_checkpoint_embeds(arch: str, tmp_path: Path) -> None:
    """MistralModel / Qwen3Model checkpoints (e5-mistral-7b-instruct and the like): weights
    without "model.", no LM head; the hidden states are transformers'."""
    path = make_tiny_backbone(tmp_path, arch, sliding_window=4 if arch == "mistral" else None)
    model = load_ours(path)
    assert model.capabilities.embeds_only
    kv, seq = PagedKV(model), PagedSeq()
    hidden = torch.cat([kv.hidden(model, [(seq, PROMPT[:6])]), kv.hidden(model, [(seq, PROMPT[6:])])])
    torch.testing.assert_close(hidden, hf_hidden(path, PROMPT), atol=ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="cannot generate"):
        model.compute_logits(hidden)


@torch.no_grad()
def test_causal_lm_with_bare_decoder_weight_names(tmp_path: Path) -> None:
    """Qwen3-Embedding's layout: config Qwen3ForCausalLM (tied), weights of the bare decoder."""
    import json

    path = make_tiny_backbone(tmp_path, "qwen3", tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    model = load_ours(path)
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    torch.testing.assert_close(logits, hf_logits(path, PROMPT), atol=ATOL, rtol=0)


@torch.no_grad()
def test_untied_causal_lm_without_lm_head_embeds(tmp_path: Path) -> None:
    """Qwen3-Embedding-4B/8B's layout: config Qwen3ForCausalLM, untied, and no lm_head.weight
    in the checkpoint: served as the bare decoder (an embedding model), not refused."""
    import json

    path = make_tiny_backbone(tmp_path, "qwen3", tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    model = load_ours(path)
    assert model.capabilities.embeds_only
    hidden = PagedKV(model).hidden(model, [(PagedSeq(), PROMPT)])
    torch.testing.assert_close(hidden, hf_hidden(path, PROMPT), atol=ATOL, rtol=0)
