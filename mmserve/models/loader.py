"""Builds the model for a checkpoint and streams the weights into it (quantised or prepared
for an FP8 checkpoint first); finding and reading checkpoints is mmserve.models.source.

Checkpoints: a HF folder (config.json + model.safetensors, or shards listed in
model.safetensors.index.json), a .gguf file, or a folder holding exactly one .gguf.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mmserve.attention import AttentionBackend
from mmserve.config import ModelConfig
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models import weight_only as weight_only_module
from mmserve.models.base import CausalLM, ModelBase, ModelCapabilities
from mmserve.models.fp8 import (
    check_quantization,
    checkpoint_fp8,
    dequantize_blocks,
    is_fp8,
    prepare_fp8_checkpoint,
    quantize_fp8,
)
from mmserve.models.gguf import iter_gguf_blocks, unkept_types
from mmserve.models.gguf_cache import materialize
from mmserve.models.gguf_linear import (
    SUPPORTED_TYPES,
    cpu_kernels_available,
    finish_gguf,
    prepare_gguf,
    shard_blocks,
)
from mmserve.models.int8 import checkpoint_int8, prepare_int8_checkpoint, quantize_int8
from mmserve.models.layers import ComputedBuffers, few_rows_products
from mmserve.models.parallel import TensorParallel, tensor_parallel
from mmserve.models.registry import architecture_of, get_model_class, headless_architecture
from mmserve.models.source import (
    ModelSource,
    WeightShard,
    iter_safetensors_weights,
    iter_weights,
    load_generation_config,
    load_hf_config,
    resolve_model_source,
    safetensors_names,
    shard_weights,
)
from mmserve.models.weight_only import (
    WeightOnlyCheckpoint,
    checkpoint_weight_only,
    dequantize_weight_only,
    pack_weight_only,
    packed_parts,
    quantised_part,
)

logger = logging.getLogger(__name__)

# the source names stay importable from here, as they were before source.py
__all__ = [
    "ModelSource",
    "init_dummy_weights",
    "iter_safetensors_weights",
    "iter_weights",
    "load_generation_config",
    "load_hf_config",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_source",
]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SLIDING_WINDOW_POLICIES = ("honour", "refuse")


def resolve_device(name: str | torch.device) -> torch.device:
    """Maps "auto" to cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """Maps "auto" to float32 on CPU and bfloat16 on CUDA; else float32/float16/bfloat16."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidArgument("dtype", f"{name!r} is not one of {['auto', *_DTYPES]}")
    return _DTYPES[name]


# torch's default dtype is one per process: loads on several threads at once (a process's
# tensor-parallel ranks as threads, two models loading side by side) take turns inside it, or
# one thread's restore would give the other's parameters the wrong dtype
_DEFAULT_DTYPE_LOCK = threading.RLock()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get dtype (restored after, even on error); one thread at a
    time."""
    with _DEFAULT_DTYPE_LOCK:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


DUMMY_WEIGHT_STD = 0.02  # the spread of --load-format dummy's random weights


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place, for benchmarks (speed does not depend on the values). Norm
    weights stay at one and the scale is small, so activations stay finite in bfloat16."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        param.normal_(0.0, DUMMY_WEIGHT_STD, generator=gen)  # on the weights' device: seconds on a GPU


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    dtype: str | torch.dtype,
    attention_backend: AttentionBackend,
    parallel: TensorParallel | None = None,
) -> tuple[CausalLM, Any, Any | None]:
    """Builds the model for model_config.model on device in dtype and loads its weights;
    with parallel (size > 1), this rank's shard of it, reading only that part of each tensor.

    Returns (model in eval mode, transformers config, GenerationConfig or None).
    Raises InvalidArgument for a bad path/dtype/policy, UnsupportedModel for an architecture
    or config feature we cannot serve exactly, or a checkpoint that does not fit the model.
    """
    if model_config.sliding_window_policy not in _SLIDING_WINDOW_POLICIES:
        raise InvalidArgument("sliding_window_policy", f"not one of {_SLIDING_WINDOW_POLICIES}")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    check_quantization(model_config.quantization, device)
    checkpoint, source, hf_config, model_class = _checkpoint(model_config.model)
    sharded = parallel is not None and parallel.size > 1
    if sharded and not model_class.capabilities.tensor_parallel:
        raise UnsupportedModel(f"{model_class.__name__} does not support tensor parallelism")
    blocks = _keeps_gguf_blocks(checkpoint, model_config, device, model_class.capabilities)
    if model_config.cpu_gguf_activations == "int8" and checkpoint.gguf_file and not (blocks and device.type == "cpu"):
        # (a model that is not a GGUF, e.g. the embedding model served beside one, is silent)
        logger.warning(
            "--cpu-gguf-activations int8 applies to a GGUF kept in its blocks on the CPU; this "
            "load (on %s) runs its products as without it", device.type
        )
    if not blocks:
        source = materialize(checkpoint)  # with its dequantised weights
    weight_only = checkpoint_weight_only(hf_config)
    int8_checkpoint = weight_only is None and checkpoint_int8(hf_config)
    fp8_checkpoint = None if weight_only or int8_checkpoint else checkpoint_fp8(hf_config)
    held = weight_only.scheme if weight_only is not None else "w8a8-int8" if int8_checkpoint else ""
    if held and model_config.quantization:
        raise InvalidArgument(
            "quantization", f"the checkpoint is {held} already (quantization_config)"
        )
    dummy = model_config.load_format == "dummy"
    packs = weight_only is not None and not dummy and device.type in weight_only_module.PACKED_ON
    # a load that keeps projections quantised builds the model on the meta device, so that
    # the device never holds the float model (see _load_quantised)
    on_meta = blocks or packs
    with _default_dtype(torch_dtype), torch.device("meta") if on_meta else device, tensor_parallel(parallel):
        model = model_class(hf_config, attention_backend)
    if not on_meta:
        model.to(device)  # buffers computed on the CPU (rotary frequencies) follow the weights
    windows = [w for w in model.sliding_windows if w is not None]
    if windows and model_config.sliding_window_policy == "refuse":
        raise UnsupportedModel(
            f"the model uses a sliding window ({windows[0]}) and the policy is refuse"
        )
    shard = model.weight_shard if sharded else None
    if dummy:
        init_dummy_weights(model)
    elif on_meta:
        _load_quantised(
            model, hf_config, checkpoint, source, weight_only, device, torch_dtype, shard,
            int8_activations=model_config.cpu_gguf_activations == "int8",
        )
    else:
        if fp8_checkpoint is not None and fp8_checkpoint.block is not None:
            # block scales cover 128 x 128 tiles of the whole tensor: dequantised whole, then cut
            weights = iter_weights(source, hf_config)
            weights = shard_weights(dequantize_blocks(weights, fp8_checkpoint.block), shard)
        elif weight_only is not None:
            # packed words, groups and act order's g_idx span the whole tensor: dequantised
            # whole, then cut (on the CPU, which keeps no projection packed)
            weights = dequantize_weight_only(iter_weights(source, hf_config), weight_only)
            weights = shard_weights(weights, shard)
        else:
            weights = iter_weights(source, hf_config, shard)
            if fp8_checkpoint is not None:
                check_quantization("fp8", device)  # the checkpoint's FP8 weights load as they are
                prepare_fp8_checkpoint(model, fp8_checkpoint)
        if int8_checkpoint:
            prepare_int8_checkpoint(model)  # (the checkpoint's int8 weights load as they are)
        _load(model, weights)
    if model_config.quantization == "fp8" and not is_fp8(model):
        quantize_fp8(model)
    elif model_config.quantization == "int8":
        if fp8_checkpoint is not None:
            raise InvalidArgument("quantization", "the checkpoint is FP8 already (quantization_config)")
        quantize_int8(model)
    if weight_only is not None:
        model.weight_scheme = weight_only.scheme  # (ListModels: what the checkpoint holds)
    model.requires_grad_(False)
    model.eval()
    if device.type == "cuda":
        from mmserve.kernels import dense_gemv

        if dense_gemv.ENGINE:
            few_rows_products(model)
    return model, hf_config, load_generation_config(source)


def _checkpoint(model: str) -> tuple[ModelSource, ModelSource, Any, type[ModelBase]]:
    """A model path's checkpoint, the folder of its config and tokenizer (a GGUF's converted
    folder, weights not yet written), its transformers config and the model class serving it."""
    checkpoint = resolve_model_source(model)
    source = materialize(checkpoint, weights=False)
    hf_config = load_hf_config(source)
    return checkpoint, source, hf_config, get_model_class(_architecture(hf_config, checkpoint))


def _architecture(hf_config: Any, source: ModelSource) -> str:
    """The config's architecture, except that a causal LM with untied embeddings whose
    safetensors hold no LM head is its bare decoder, an embedding model (Qwen3-Embedding-4B
    and -8B name Qwen3ForCausalLM and ship no lm_head.weight)."""
    architecture = architecture_of(hf_config)
    bare = headless_architecture(architecture)
    if bare is None or source.gguf_file is not None:
        return architecture
    if getattr(hf_config, "tie_word_embeddings", False):
        return architecture
    names = safetensors_names(source.folder)
    if names is None or "lm_head.weight" in names:
        return architecture
    return bare


def _load(model: ModelBase, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The checkpoint's tensors into the model, an FP8 KV cache's scales into its layers."""
    kv_scales: dict[tuple[int, str], float] = {}
    model.load_weights(take_kv_scales(weights, kv_scales))
    set_kv_scales(model, kv_scales)


def _load_quantised(
    model: ModelBase,
    hf_config: Any,
    checkpoint: ModelSource,
    source: ModelSource,
    weight_only: WeightOnlyCheckpoint | None,
    device: torch.device,
    dtype: torch.dtype,
    shard: WeightShard | None = None,
    int8_activations: bool = False,
) -> None:
    """Loads a model built on the meta device whose projections stay quantised: a
    weight-only checkpoint's packed weights (from source), else the GGUF file's blocks. The quantised layers are
    put in first, holding the checkpoint's packed tensors on device; only then does the rest
    get storage, and the float tensors load. No float copy of a quantised projection is made,
    so the device's peak is about the quantised model's size. shard: a tensor-parallel
    rank's parts (each projection cut before it is repacked; a GGUF's blocks cut where whole
    blocks). int8_activations: a GGUF's projections on the CPU that the C library multiplies
    with int8 activations are repacked for it (--cpu-gguf-activations int8)."""
    if weight_only is None:
        prepare_gguf(model, device)
        float_names = {name for name, _ in model.named_parameters()}
        gguf_path = checkpoint.folder / str(checkpoint.gguf_file)
        weights = iter_gguf_blocks(gguf_path, hf_config, float_names, SUPPORTED_TYPES)
        if shard is not None:
            weights = shard_blocks(weights, shard)
    else:
        c = weight_only

        def quantised(name: str) -> bool:
            return quantised_part(name, c) is not None

        parts = packed_parts(iter_weights(source, hf_config, only=quantised), c)
        packed = pack_weight_only(model, parts, c, dtype, device, shard)
        logger.info("%s: %d projections kept packed", c.scheme, len(packed))
        del parts  # (the parts of projections left float are read again, to dequantise)

        def left(name: str) -> bool:
            where = quantised_part(name, c)
            return where is None or where[0] not in packed

        # (dequantised whole, then cut, as the float path's weight-only checkpoints)
        weights = shard_weights(dequantize_weight_only(iter_weights(source, hf_config, only=left), c), shard)
    with _default_dtype(dtype), device:
        materialize_meta(model, device)
    _load(model, weights)
    finish_gguf(model, int8_activations)


@torch.no_grad()
def materialize_meta(model: torch.nn.Module, device: torch.device) -> None:
    """A model built on the meta device, onto device: each parameter still on meta gets
    uninitialised storage there (every one is loaded next; a tied one stays tied), each
    ComputedBuffers module computes its buffers again (on the default device: call it inside
    the model's default device and dtype, as the model was built), and what is elsewhere
    moves to device. A meta tensor left over (a buffer computed at construction by a module
    that is no ComputedBuffers) raises, rather than holding garbage."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(
                        torch.empty_like(param, device=device), param.requires_grad
                    )
                module.register_parameter(name, made[id(param)])
        if isinstance(module, ComputedBuffers):
            module.compute_buffers()
    left = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if left:
        raise RuntimeError(f"{left[:4]} hold no values after the meta build: not ComputedBuffers?")
    model.to(device)


def tp_model_path(config: ModelConfig) -> str:
    """The model path a tensor-parallel launch gives its ranks: a GGUF checkpoint that keeps
    its blocks (see _keeps_gguf_blocks) as it is, each rank cutting its blocks from the file;
    any other GGUF its converted folder with the dequantised weights (converted here, once,
    before the ranks start; each reads its slices of it); anything else as it is."""
    checkpoint, _, _, model_class = _checkpoint(config.model)
    if checkpoint.gguf_file is None:
        return config.model
    if _keeps_gguf_blocks(checkpoint, config, resolve_device(config.device), model_class.capabilities):
        return config.model
    return str(materialize(checkpoint).folder)


def _keeps_gguf_blocks(
    source: ModelSource, config: ModelConfig, device: torch.device, caps: ModelCapabilities
) -> bool:
    """A GGUF checkpoint keeps its quantised blocks (mmserve.models.gguf_linear) when its
    model's projections can be swapped (caps.supports_fp8: the Llama family), unless it is
    loaded with dummy weights or quantised (from its floats): on CUDA, and on the CPU where
    the C kernels built and read every type of the file; else it is dequantised once, at
    conversion (on CUDA a type without kernels is refused, naming it: see iter_gguf_blocks)."""
    keeps = (
        source.gguf_file is not None
        and (device.type == "cuda" or (device.type == "cpu" and cpu_kernels_available()))
        and caps.supports_fp8
        and config.load_format != "dummy"
        and config.quantization is None
    )
    if keeps and device.type == "cpu" and source.gguf_file is not None:
        unkept = unkept_types(source.folder / source.gguf_file, SUPPORTED_TYPES)
        if unkept:
            logger.info("GGUF types %s have no CPU kernels: the file is dequantised at load", unkept)
            return False
    return keeps


# an FP8 KV cache's per-tensor scales in a checkpoint (llm-compressor, vLLM's FP8 formats):
# model.layers.N.self_attn.k_scale / .v_scale, or one .kv_scale for both
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


def take_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[tuple[int, str], float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights without the KV cache scales, which go into found[(layer, "k" or "v")]."""
    for name, tensor in weights:
        match = _KV_SCALE.search(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise UnsupportedModel(f"{name}: a KV cache scale per channel or head is not supported")
        layer, kind = int(match.group(1)), match.group(2)
        for which in ("k", "v") if kind == "kv_scale" else (kind[0],):
            found[(layer, which)] = float(tensor.float())


def set_kv_scales(model: torch.nn.Module, found: dict[tuple[int, str], float]) -> None:
    """Gives each attention layer (a module with kv_scales) its checkpoint's scales."""
    if not found:
        return
    for name, module in model.named_modules():
        index = re.search(r"layers\.(\d+)\.self_attn$", name)
        if index is not None and hasattr(module, "kv_scales"):
            layer = int(index.group(1))
            module.kv_scales = (found.get((layer, "k"), 1.0), found.get((layer, "v"), 1.0))
