"""`mmserve bench vlm`: time to first token of a chat that reuses images (issue 7, item 8).

Each of --num-images random images (distinct, so no cache holds one before its turn) is
asked about three times, one request at a time on an otherwise idle engine, max_tokens 1:

- cold: the first request with the image: image processor, vision encoder and the whole
  prompt's prefill all run.
- encoder-warm: the same image after a text that no earlier prompt had, so the prefix cache
  misses from that text on; the encoder cache still holds the image's encoder output.
- prefix-hit: the cold conversation again: the prefix cache serves every full block,
  the image's included.

One JSON line per phase (median and p90 over images), with what the caches did: the prefix
cache's num_cached_tokens per request, and how many requests ran the encoder (read from the
runner's encoder-output cache before each request). A vlm-encoder line times the vision
tower alone on each image, and --baseline adds transformers' forward of the cold prompts
(one forward = its TTFT), run before the engine is built so that both never share the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import PIL.Image
import torch

from mmserve.bench.prefix import first_token
from mmserve.bench.structured import percentile
from mmserve.frontend.frontend import FrontEnd
from mmserve.frontend.images import expand_placeholders
from mmserve.inputs import MMInput
from mmserve.processors.chat_template import render_and_tokenize
from mmserve.processors.images import local_image

if TYPE_CHECKING:
    from mmserve.models.base import MultiModalCausalLM

PHASES = ("cold", "encoder-warm", "prefix-hit")
QUESTION = "Describe this picture in detail: the colours, the objects and where they are."
WARMUP_SEED = 10_000  # the warm-up image's seed, apart from the measured images' 0..N-1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only `bench vlm` reads (--model, --baseline and the engine flags are shared)."""
    p.add_argument(
        "--num-images",
        type=int,
        default=8,
        help="vlm: distinct images, each asked cold, encoder-warm and prefix-hit",
    )
    p.add_argument("--image-size", default="448x448", help="vlm: WIDTHxHEIGHT of the images")


@dataclass(frozen=True)
class Sample:
    """One timed request."""

    phase: str
    ttft_ms: float  # conversation in -> first token on the CPU: preprocess_ms + engine_ms
    preprocess_ms: float  # image hash, chat template, tokenisation, image processor (cached)
    engine_ms: float  # add_request -> first token: encoder (unless cached), prefill, sampling
    prompt_tokens: int  # placeholders expanded
    image_start: int  # position of the image's first token
    image_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served
    encoder_cached: bool  # the runner held the image's encoder output before the request

    @property
    def as_expected(self) -> bool:
        """The caches did what the phase is for."""
        if self.phase == "prefix-hit":
            return self.num_cached_tokens >= self.image_start + self.image_tokens
        stops_before_image = self.num_cached_tokens <= self.image_start
        return stops_before_image and self.encoder_cached == (self.phase == "encoder-warm")


def parse_image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        width = height = 0
    if width < 1 or height < 1:
        raise ValueError(f"--image-size: give WIDTHxHEIGHT in pixels, got {text!r}")
    return width, height


def random_image(size: tuple[int, int], seed: int) -> PIL.Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def conversation(prefix: str | None) -> list[dict[str, Any]]:
    """One user turn: [prefix text,] the image, the question."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": prefix}] if prefix else []
    parts += [{"type": "image"}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def phase_prefix(phase: str, index: int) -> str | None:
    """The encoder-warm text before the image, new to each image (no earlier prompt has it)."""
    return f"Photo {index} again, seen from another question." if phase == "encoder-warm" else None


def encode_prompt(
    engine: FrontEnd, image: PIL.Image.Image, prefix: str | None
) -> tuple[list[int], tuple[MMInput, ...]]:
    """What LLM.chat does before enqueueing: placeholder-expanded ids and the image input."""
    assert engine.images is not None  # checked in run()
    field = f"messages[0].content[{int(prefix is not None)}].image"
    decoded = local_image(image, field)
    _, ids = render_and_tokenize(engine.tokenizer, conversation(prefix), allow_images=True)
    return engine.images.process(ids, [decoded], [field])


def timed_request(engine: FrontEnd, image: PIL.Image.Image, phase: str, index: int) -> Sample:
    start = time.perf_counter()
    ids, mm = encode_prompt(engine, image, phase_prefix(phase, index))
    enqueued = time.perf_counter()
    encoder_cached = mm[0].key in engine.core.runner.encoder_outputs
    first, cached = first_token(engine, f"{phase}-{index}", ids, mm_inputs=mm)
    return Sample(
        phase=phase,
        ttft_ms=1e3 * (first - start),
        preprocess_ms=1e3 * (enqueued - start),
        engine_ms=1e3 * (first - enqueued),
        prompt_tokens=len(ids),
        image_start=mm[0].start,
        image_tokens=mm[0].placeholder.length,
        num_cached_tokens=cached,
        encoder_cached=encoder_cached,
    )


def run_phases(engine: FrontEnd, images: list[PIL.Image.Image]) -> list[Sample]:
    """cold, encoder-warm, prefix-hit for each image in turn, after one unrecorded round on
    a warm-up image (kernel compilation, allocator growth)."""
    for phase in PHASES:
        timed_request(engine, random_image(images[0].size, WARMUP_SEED), phase, -1)
    return [
        timed_request(engine, image, phase, i) for i, image in enumerate(images) for phase in PHASES
    ]


def phase_figures(samples: list[Sample], phase: str, cold_median: float) -> dict[str, Any]:
    mine = [s for s in samples if s.phase == phase]
    ttft = [s.ttft_ms for s in mine]
    return {
        "phase": phase,
        "image_tokens": mine[0].image_tokens,
        "prompt_tokens": mine[0].prompt_tokens,
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_p90": percentile(ttft, 0.9),
        "engine_ms_median": statistics.median(s.engine_ms for s in mine),
        "engine_ms_p90": percentile([s.engine_ms for s in mine], 0.9),
        "preprocess_ms_median": statistics.median(s.preprocess_ms for s in mine),
        "speedup_vs_cold": cold_median / statistics.median(ttft),
        "num_cached_tokens": [s.num_cached_tokens for s in mine],
        "encoder_runs": sum(not s.encoder_cached for s in mine),
        "cache_as_expected": all(s.as_expected for s in mine),
    }


@torch.inference_mode()
def encoder_ms(engine: FrontEnd, images: list[PIL.Image.Image]) -> list[float]:
    """The vision tower alone on each image (its outputs are not cached)."""
    model = cast("MultiModalCausalLM", engine.core.runner.model)  # run() checked engine.images
    times = []
    for image in [images[0], *images]:  # the first call warms up
        _, (mm,) = encode_prompt(engine, image, None)
        _sync()
        start = time.perf_counter()
        model.encode_images([mm.data])
        _sync()
        times.append(1e3 * (time.perf_counter() - start))
    return times[1:]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> None:
    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import model_folder
    from mmserve.models.loader import resolve_device, resolve_dtype

    if args.num_images < 1:
        raise ValueError("--num-images must be >= 1")
    size = parse_image_size(args.image_size)
    images = [random_image(size, seed) for seed in range(args.num_images)]
    model = args.model or "shape:qwen2-vl-7b"
    folder, dummy = model_folder(model, args.load_format)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    common = {
        "model": model,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "image_size": f"{size[0]}x{size[1]}",
        "num_images": args.num_images,
    }
    if args.baseline:
        times, prompt_tokens = hf_forward_ms(folder, device, dtype, dummy, images)
        _emit(
            bench="vlm-transformers-forward",
            **common,
            prompt_tokens=prompt_tokens,
            forward_ms_median=statistics.median(times),
            forward_ms_p90=percentile(times, 0.9),
        )
    engine = FrontEnd.start(engine_config(args, str(folder), dummy))
    if engine.images is None:
        raise ValueError(f"--model: {model} does not read images")
    samples = run_phases(engine, images)
    cold = statistics.median(s.ttft_ms for s in samples if s.phase == "cold")
    for phase in PHASES:
        figures = phase_figures(samples, phase, cold)
        _emit(bench="vlm-ttft", **common, block_size=engine.core.kv.block_size, **figures)
    times = encoder_ms(engine, images)
    _emit(
        bench="vlm-encoder",
        **common,
        image_tokens=samples[0].image_tokens,
        encoder_ms_median=statistics.median(times),
        encoder_ms_p90=percentile(times, 0.9),
    )


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def hf_forward_ms(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    dummy: bool,
    images: list[PIL.Image.Image],
) -> tuple[list[float], int]:
    """transformers' Qwen2-VL forward (image tower + prefill + last logits) on each cold
    prompt, after one warm-up; returns (ms per image, prompt tokens). Frees the GPU after."""
    import gc
    import inspect

    from transformers import AutoConfig, AutoModelForImageTextToText

    from mmserve.models.loader import init_dummy_weights
    from mmserve.processors.image_processing import ImagePreprocessor
    from mmserve.processors.tokenizer import load_tokenizer

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if dummy:
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        init_dummy_weights(model)
    else:
        model = AutoModelForImageTextToText.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True
        )
    model = model.to(device).eval()
    accepts = inspect.signature(model.forward).parameters
    tokenizer, preprocessor = load_tokenizer(folder), ImagePreprocessor.from_pretrained(folder)
    _, ids = render_and_tokenize(tokenizer, conversation(None), allow_images=True)
    times, prompt_tokens = [], 0
    for image in [images[0], *images]:  # the first forward warms up
        data = preprocessor.preprocess(local_image(image, "image"), "image").tensors
        prompt = expanded_prompt(
            ids, config.image_token_id, data, preprocessor.processor.merge_size
        )
        inputs = hf_inputs(prompt, data, config.image_token_id, accepts, device, dtype)
        _sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model(**inputs)
        _sync()
        times.append(1e3 * (time.perf_counter() - start))
        prompt_tokens = len(prompt)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times[1:], prompt_tokens


def expanded_prompt(
    ids: list[int], image_token_id: int, data: Mapping[str, torch.Tensor], merge_size: int
) -> list[int]:
    """The prompt with its one image placeholder expanded as Qwen2-VL's processor does."""
    tokens = int(data["image_grid_thw"].prod()) // merge_size**2
    return expand_placeholders(ids, image_token_id, [tokens], "prompt")[0]


def hf_inputs(
    prompt: list[int],
    data: Mapping[str, torch.Tensor],
    image_token_id: int,
    accepts: Mapping[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Qwen2VLForConditionalGeneration.forward's inputs for one prompt and its image; newer
    transformers want mm_token_type_ids for M-RoPE, and need only the last logits."""
    input_ids = torch.tensor([prompt], device=device)
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": data["pixel_values"].to(device, dtype),
        "image_grid_thw": data["image_grid_thw"].to(device),
    }
    if "mm_token_type_ids" in accepts:
        inputs["mm_token_type_ids"] = (input_ids == image_token_id).int()
    if "logits_to_keep" in accepts:
        inputs["logits_to_keep"] = 1
    return inputs
