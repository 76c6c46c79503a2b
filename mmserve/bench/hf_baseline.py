"""transformers' own `generate` on the same config, measured in the same run as mmserve."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class HFResult:
    batch_size: int
    input_len: int
    output_len: int
    seconds: float  # the whole generate call: prefill and output_len tokens
    first_token_seconds: float  # generate of the same prompts for one token (the prefill)

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch_size * self.output_len / self.seconds

    @property
    def decode_ms_per_step(self) -> float:
        """A decode step, the prefill taken out: (whole - first token) / (output_len - 1)."""
        return 1e3 * (self.seconds - self.first_token_seconds) / max(1, self.output_len - 1)


def load_hf_model(folder: Path, device: str, dtype: torch.dtype, dummy: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    else:
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
        model = loaded.to(device)
    return model.eval()


@torch.inference_mode()
def hf_generate(model: Any, batch_size: int, input_len: int, output_len: int, vocab: int) -> HFResult:
    device = next(model.parameters()).device
    ids = torch.randint(100, vocab - 100, (batch_size, input_len), device=device)
    kwargs = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False, "pad_token_id": 0}
    model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = _timed_generate(model, ids, {**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
    whole = _timed_generate(model, ids, kwargs)
    return HFResult(batch_size, input_len, output_len, whole, first)


def _timed_generate(model: Any, ids: torch.Tensor, kwargs: dict[str, Any]) -> float:
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
