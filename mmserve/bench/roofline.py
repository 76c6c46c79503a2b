"""The limits the offline benchmarks are measured against: the bytes of weights one decode step
must read (counted on the loaded model, so every format is right by construction) and the
matmul FLOPs of a prefill or a whole throughput run (counted from the config)."""

from __future__ import annotations

from typing import Any

from torch import nn

from mmserve.models.gguf_linear import GgufEmbedding
from mmserve.models.parallel import VocabParallelEmbedding

EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding, GgufEmbedding)  # lookup tables


def step_weight_bytes(model: Any) -> int:  # an nn.Module (the engine holds a CausalLM)
    """Bytes of weights one decode step reads: every tensor of the loaded model's state dict
    once (packed weights with their scales, zero points and permutations, norms, the LM head
    in whatever form it holds), except the token embedding's table, of which a step reads one
    row per token; a head tied to the embedding multiplies by that table, so the table counts
    once, as the head's. Recomputed buffers (rotary frequencies) are not in the state dict."""
    embeddings = {name for name, m in model.named_modules() if isinstance(m, EMBEDDINGS)}
    counted: dict[int, int] = {}  # a tensor under several names (tied) counts once
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.rpartition(".")[0] not in embeddings:
            counted[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(counted.values())


def matmul_parameters(config: dict) -> int:
    """Weights that take part in a token's matmuls, from a Llama-shaped config: the decoder
    layers' projections and norms, the final norm and the LM head (tied or not); not the
    embedding, which a token looks up."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    projections = layers * (h * h * 2 + 2 * h * kv + 3 * h * i)
    return projections + layers * 2 * h + h + config["vocab_size"] * h


def prefill_flops(config: dict, batch: int, input_len: int) -> float:
    """Matmul FLOPs of a prefill: 2 * params * tokens plus causal attention (QK^T and PV)."""
    tokens = batch * input_len
    attn = 2 * 2 * config["num_hidden_layers"] * config["hidden_size"] * batch * input_len * input_len / 2
    return 2 * matmul_parameters(config) * tokens + attn


def throughput_flops(config: dict, requests: int, input_len: int, output_len: int) -> float:
    """Matmul FLOPs of `requests` sequences of input_len + output_len tokens: every token
    through the decoder layers, causal attention over its prefix, and the LM head only where a
    token is sampled (output_len per request)."""
    tokens = input_len + output_len
    head = config["vocab_size"] * config["hidden_size"]
    layers_only = prefill_flops(config, requests, tokens) - 2 * head * requests * tokens
    return layers_only + 2 * head * requests * output_len



def decode_kv_read_bytes(kv_bytes_per_token: int, requests: int, input_len: int, output_len: int) -> int:
    """Bytes of KV cache the decode steps of `requests` sequences must read: output token j
    (1 <= j < output_len; the first comes from the prompt's step) is sampled from a step whose
    attention reads the K and V rows of its input_len + j positions (kv_bytes_per_token each:
    every layer's), once. In this engine that attention is a kernel of its own between the
    products, bound by memory, so its time adds to theirs: flop_bound_s + these bytes /
    bandwidth is the floor of a run whose attention and products take turns (attention beside
    the products would lower it)."""
    steps = max(output_len - 1, 0)
    positions = steps * input_len + steps * (steps + 1) // 2  # sum of input_len + j, j = 1..steps
    return requests * positions * kv_bytes_per_token
