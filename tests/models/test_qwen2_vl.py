"""Qwen2-VL and Qwen2.5-VL against transformers, on tiny random checkpoints and random images:
the vision tower, M-RoPE positions, full-prompt logits over the paged KV cache (one and two
images, two prompts in one flat batch), chunked prefill and greedy decoding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.loader import iter_weights, load_hf_config, resolve_model_source
from mmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_qwen_vl import MRopePagedKV, make_tiny_qwen2_vl

ATOL = 1e-4
# (height, width) in pixels; with patch 4 and merge 2 the grids are (1, 6, 10) and (1, 12, 4),
# so Qwen2.5-VL's 2x2-token windows are partial at the edges of the first image.
IMAGE_SIZES = ((24, 40), (50, 20))


@dataclass
class Case:
    path: Path
    hf: Any  # transformers' model, float32
    ours: Qwen2VLForConditionalGeneration
    tokenizer: Any
    images: list[Mapping[str, torch.Tensor]]  # processor output per image


@pytest.fixture(scope="module", params=["2", "2.5"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    import PIL.Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen-vl"), request.param)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(path)
    rng = np.random.RandomState(0)
    pictures = [
        PIL.Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES
    ]
    images: list[Mapping[str, torch.Tensor]] = [
        dict(processor(images=[p], return_tensors="pt")) for p in pictures
    ]
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Case(path, hf, load_ours(path), tokenizer, images)


def load_ours(path: Path, rename: Any = None) -> Qwen2VLForConditionalGeneration:
    source = resolve_model_source(path)
    hf_config = load_hf_config(source)
    model = Qwen2VLForConditionalGeneration(hf_config, TorchAttentionBackend())
    weights = iter_weights(source, hf_config)
    model.load_weights(weights if rename is None else ((rename(n), t) for n, t in weights))
    return model.eval()


def prompt_ids(case: Case, num_images: int) -> list[int]:
    """A chat prompt with text before, between and after the images, each image's
    placeholder expanded to its token count (as the engine does)."""
    parts: list[dict[str, str]] = [{"type": "text", "text": "Look at this:"}]
    for i in range(num_images):
        parts += [{"type": "image"}, {"type": "text", "text": f" and {i}"}]
    messages = [{"role": "user", "content": parts}]
    text = case.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    counts = iter(case.ours.num_image_tokens(d) for d in case.images[:num_images])
    for token in case.tokenizer(text).input_ids:
        ids += [token] * next(counts) if token == case.ours.image_token_id else [token]
    return ids


def grids(case: Case, num_images: int) -> list[tuple[int, int, int]]:
    return [tuple(d["image_grid_thw"][0].tolist()) for d in case.images[:num_images]]  # type: ignore[misc]


def hf_inputs(case: Case, ids: list[int], num_images: int) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([ids])
    inputs = {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == case.ours.image_token_id).int(),
    }
    if num_images:
        inputs["pixel_values"] = torch.cat([d["pixel_values"] for d in case.images[:num_images]])
        inputs["image_grid_thw"] = torch.cat(
            [d["image_grid_thw"] for d in case.images[:num_images]]
        )
    return inputs


def our_inputs(
    case: Case, ids: list[int], num_images: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(positions [3, n], input embeddings [n, hidden], delta), as the runner builds them."""
    model = case.ours
    input_ids = torch.tensor(ids)
    embeds = model.embed_input_ids(input_ids)
    if num_images:
        rows = torch.cat(model.encode_images(case.images[:num_images]))
        embeds[input_ids == model.image_token_id] = rows
    positions, delta = model.mrope_positions(ids, grids(case, num_images))
    return positions, embeds, delta


@torch.no_grad()
def test_vision_tower_matches_transformers(case: Case) -> None:
    pixels = torch.cat([d["pixel_values"] for d in case.images])
    grid_thw = torch.cat([d["image_grid_thw"] for d in case.images])
    expected = case.hf.model.visual(pixels, grid_thw=grid_thw).pooler_output
    ours = case.ours.encode_images(case.images)
    assert [t.shape[0] for t in ours] == [case.ours.num_image_tokens(d) for d in case.images]
    torch.testing.assert_close(torch.cat(ours), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_mrope_positions_match_get_rope_index(case: Case, num_images: int) -> None:
    ids = prompt_ids(case, num_images)
    inputs = hf_inputs(case, ids, num_images)
    expected, expected_delta = case.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw")
    )
    positions, delta = case.ours.mrope_positions(ids, grids(case, num_images))
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)


def test_mrope_positions_reject_mismatched_images(case: Case) -> None:
    ids = prompt_ids(case, 1)
    with pytest.raises(InvalidArgument):
        case.ours.mrope_positions(ids, [])
    with pytest.raises(InvalidArgument):
        case.ours.mrope_positions(ids, grids(case, 2))


@torch.no_grad()
def test_prompt_logits_match_transformers(case: Case) -> None:
    """The one-image and two-image prompts as one flat batch over the paged cache."""
    batch, expected = [], []
    for num_images in (1, 2):
        ids = prompt_ids(case, num_images)
        positions, embeds, _ = our_inputs(case, ids, num_images)
        batch.append((PagedSeq(), positions, embeds))
        expected.append(case.hf(**hf_inputs(case, ids, num_images)).logits[0])
    logits = MRopePagedKV(case.ours).step_embeds(case.ours, batch)
    torch.testing.assert_close(logits, torch.cat(expected), atol=ATOL, rtol=0)


def test_mrope_with_1d_positions_is_three_equal_rows(case: Case) -> None:
    rotary = case.ours.language_model.model.rotary_emb
    positions = torch.tensor([0, 3, 7, 200])
    plain, rows = rotary(positions, torch.float32), rotary(positions.expand(3, -1), torch.float32)
    assert torch.equal(plain.cos, rows.cos) and torch.equal(plain.sin, rows.sin)


@torch.no_grad()
def test_text_only_prompt_with_1d_positions(case: Case) -> None:
    ids = prompt_ids(case, 0)
    expected = case.hf(input_ids=torch.tensor([ids])).logits[0]
    logits = PagedKV(case.ours).step(case.ours, [(PagedSeq(), ids)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunked_prefill_split_inside_image(case: Case) -> None:
    ids = prompt_ids(case, 2)
    positions, embeds, _ = our_inputs(case, ids, 2)
    whole = MRopePagedKV(case.ours).step_embeds(case.ours, [(PagedSeq(), positions, embeds)])
    split = ids.index(case.ours.image_token_id) + 5  # inside the first image's run
    kv, seq = MRopePagedKV(case.ours), PagedSeq()
    first = kv.step_embeds(case.ours, [(seq, positions[:, :split], embeds[:split])])
    second = kv.step_embeds(case.ours, [(seq, positions[:, split:], embeds[split:])])
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL, rtol=0)


@torch.no_grad()
def test_greedy_decode_matches_generate(case: Case) -> None:
    ids = prompt_ids(case, 2)
    out = case.hf.generate(**hf_inputs(case, ids, 2), max_new_tokens=5, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    positions, embeds, delta = our_inputs(case, ids, 2)
    kv, seq = MRopePagedKV(case.ours), PagedSeq()
    logits = kv.step_embeds(case.ours, [(seq, positions, embeds)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < len(expected):
        position = torch.full((3, 1), len(ids) + len(generated) - 1 + delta)
        token_embeds = case.ours.embed_input_ids(torch.tensor(generated[-1:]))
        logits = kv.step_embeds(case.ours, [(seq, position, token_embeds)])
        generated.append(int(logits[-1].argmax()))
    assert generated == expected


@torch.no_grad()
def test_loads_transformers_5_module_names(case: Case) -> None:
    """Checkpoints named as transformers 5 names the modules in memory load the same."""

    def v5(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1)

    renamed = load_ours(case.path, v5)
    for (name, ours), (_, theirs) in zip(
        case.ours.state_dict().items(), renamed.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_unknown_or_missing_weight_raises(case: Case) -> None:
    with pytest.raises(UnsupportedModel, match="unexpected"):
        load_ours(case.path, lambda n: n.replace("visual.merger", "visual.mergerX"))
    source = resolve_model_source(case.path)
    model = Qwen2VLForConditionalGeneration(load_hf_config(source), TorchAttentionBackend())
    weights = ((n, t) for n, t in iter_weights(source, None) if "patch_embed" not in n)
    with pytest.raises(UnsupportedModel, match="lacks"):
        model.load_weights(weights)


@torch.no_grad()
def test_tied_word_embeddings(tmp_path: Path) -> None:
    """Qwen2-VL-2B ties lm_head to the embedding; its checkpoint has no lm_head.weight."""
    from transformers import AutoModelForImageTextToText

    path = make_tiny_qwen2_vl(tmp_path, "2", tie_word_embeddings=True)
    ours = load_ours(path)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = [5, 17, 42, 99, 250, 7, 300]
    expected = hf(input_ids=torch.tensor([ids])).logits[0]
    logits = PagedKV(ours).step(ours, [(PagedSeq(), ids)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_tower_plan_serves_every_image_of_its_sizes(case: Case) -> None:
    """The tower's plan (what the grids alone decide) made once gives other images of the
    same sizes their forward's tokens: what a CUDA graph of the tower replays."""
    tower = case.ours.visual
    pixels = torch.cat([d["pixel_values"] for d in case.images])
    sizes = grids(case, len(case.images))
    plan = tower.plan(sizes)
    other = torch.randn_like(pixels)
    torch.testing.assert_close(tower.run(other, plan), tower(other, sizes), atol=0, rtol=0)
    torch.testing.assert_close(tower.run(pixels, plan), tower(pixels, sizes), atol=0, rtol=0)


def test_vision_graphs_capture_once_per_sizes_and_keep_the_latest(case: Case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """VisionGraphs (runner/cuda_graphs.py) on the CPU, the capture replaced by a replay that
    runs the tower: one capture per list of sizes, replays reading the new patches, the
    least recently used list dropped past the limit, outputs the tower's."""
    from mmserve.runner import cuda_graphs

    class Replay:  # what a captured graph does: the tower's run on the static inputs
        def __init__(self, static: torch.Tensor, plan: object, out: torch.Tensor) -> None:
            self.static, self.plan, self.out = static, plan, out

        def replay(self) -> None:
            self.out.copy_(case.ours.visual.run(self.static, self.plan))

    captured: list[tuple[tuple[int, int, int], ...]] = []

    def capture(self, patches, sizes):  # type: ignore[no-untyped-def]
        captured.append(tuple(sizes))
        plan = self.tower.plan(sizes)
        static = patches.clone()
        out = self.tower.run(static, plan)
        return static, Replay(static, plan, out), out, plan

    monkeypatch.setattr(cuda_graphs.VisionGraphs, "_capture", capture)
    graphs = cuda_graphs.VisionGraphs(case.ours.visual, limit=1)
    first, second = ([d] for d in case.images)
    with torch.no_grad():
        for image in (first, first, second, first):
            pixels = image[0]["pixel_values"] + torch.rand(1).item()  # new values, same size
            sizes = grids(Case(case.path, None, case.ours, None, image), 1)
            got = graphs(pixels, sizes)
            torch.testing.assert_close(got, case.ours.visual(pixels, sizes), atol=1e-6, rtol=0)
    assert [len(c) for c in captured] == [1, 1, 1] and captured[0] == captured[2] != captured[1]


def test_vision_graphs_that_fail_to_capture_stay_eager(case: Case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mmserve.runner import cuda_graphs

    tries = []

    def fail(self, patches, sizes):  # type: ignore[no-untyped-def]
        tries.append(sizes)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.VisionGraphs, "_capture", fail)
    graphs = cuda_graphs.VisionGraphs(case.ours.visual)
    pixels, sizes = case.images[0]["pixel_values"], grids(case, 1)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(graphs(pixels, sizes), case.ours.visual(pixels, sizes), atol=0, rtol=0)
    assert len(tries) == 1  # not tried again for those sizes
