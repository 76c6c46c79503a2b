"""What the benchmark checkpoint writers share: a Llama config's tensors by name and shape, and
a seeded source of random values (drawn on the GPU when there is one: the 8B shape's
gigabytes take seconds there, minutes on a few CPU cores).

Speed does not depend on weight values, so packed integers and block bytes are drawn directly
(nothing is quantised); the float scales are chosen so that the weights they give have about
the dummy load's spread (0.02), which keeps activations finite through 32 layers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.models.loader import DUMMY_WEIGHT_STD as WEIGHT_STD  # as init_dummy_weights draws them

# a merged projection of the engine -> the checkpoint's projections, here as their HF names
PROJECTIONS = (
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
)  # fmt: skip
LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class Projection:
    """One decoder projection of a checkpoint: its HF name prefix and weight shape."""

    layer: int
    name: str  # "q_proj", ..., "down_proj"
    prefix: str  # "model.layers.3.self_attn.q_proj"
    out_features: int
    in_features: int


@dataclass(frozen=True)
class LlamaLayout:
    """The tensors of a Llama-architecture config (a config.json as a dict)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: dict) -> LlamaLayout:
        if config.get("architectures") and config["architectures"][0] not in LLAMA_ARCHITECTURES:
            raise ValueError(
                f"--checkpoint-format writes {LLAMA_ARCHITECTURES} checkpoints, not "
                f"{config['architectures'][0]}"
            )
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def projections(self) -> Iterator[Projection]:
        """Layer by layer, in PROJECTIONS order."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                  "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip
        for layer in range(self.layers):
            for block, name in PROJECTIONS:
                out, inp = shapes[name]
                yield Projection(layer, name, f"model.layers.{layer}.{block}.{name}", out, inp)

    def norms(self) -> list[str]:
        """The RMSNorm weights' HF names (each [hidden])."""
        per_layer = [
            f"model.layers.{n}.{kind}.weight"
            for n in range(self.layers)
            for kind in ("input_layernorm", "post_attention_layernorm")
        ]
        return [*per_layer, "model.norm.weight"]


class Draw:
    """Seeded random tensors, drawn on `device` and returned on the CPU."""

    def __init__(self, seed: int = 0, device: str | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """N(0, WEIGHT_STD) in dtype (embeddings, an unquantised LM head)."""
        x = torch.empty(shape, device=self.device, dtype=dtype)
        return x.normal_(0.0, WEIGHT_STD, generator=self.gen).cpu()

    def ints(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Every bit pattern of an integer dtype equally likely (packed values, int8 weights).
        Drawn as int32 words (a draw per element costs the same whatever its size: on the CPU
        bytes come four times faster so)."""
        count = math.prod(shape)
        size = torch.empty((), dtype=dtype).element_size()
        words = torch.empty((-(-count * size // 4),), device=self.device, dtype=torch.int32)
        words.random_(-(1 << 31), 1 << 31, generator=self.gen)
        return words.view(dtype)[:count].view(shape).cpu()

    def bytes(self, shape: tuple[int, ...]) -> np.ndarray:
        """uint8 (GGUF blocks), as a writable numpy array."""
        return self.ints(shape, torch.uint8).numpy()

    def release(self) -> None:
        """Gives the GPU memory drawn through back (before an engine sizes its KV cache)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
