"""Images through the engine core: placeholder rows from the encoder, chunked prefill across
images, the encoder cache and image-aware prefix caching, against a no-cache recomputation."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from mmserve.engine import messages as m
from mmserve.engine.encoder_cache import EncoderCacheManager
from mmserve.errors import InvalidArgument
from mmserve.frontend.images import check_placeholders, expand_placeholders
from mmserve.inputs import MMInput, MMPlaceholder
from mmserve.kernels.paged_ref import attend
from mmserve.models.base import ModelCapabilities
from mmserve.params import SamplingParams
from tests.engine.conftest import assert_all_blocks_free, make_core, make_request, run_all
from tests.fake_model import FakeModel

IMAGE = 63  # placeholder token id


class FakeVisionModel(FakeModel):
    """FakeModel whose image placeholder rows come from a linear 'encoder' of pixel rows."""

    capabilities = ModelCapabilities(reads_images=True)
    image_token_id = IMAGE
    image_tokens = None  # the front end's rule; these tests build prompts with the rows' count

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Linear(5, self.embed.embedding_dim)
        nn.init.normal_(self.vision.weight, std=1.0)
        self.encoded: list[int] = []  # rows encoded per call, to watch the encoder cache

    def num_image_tokens(self, data: dict) -> int:
        return int(data["pixel_values"].shape[0])

    def encode_images(self, data: list[dict]) -> list[torch.Tensor]:
        self.encoded += [int(d["pixel_values"].shape[0]) for d in data]
        return [self.vision(d["pixel_values"]) for d in data]

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):  # type: ignore[no-untyped-def]
        x = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds) + self.pos(positions)
        q = self.q(x).view(-1, 2 * self.num_kv_heads, self.head_dim)
        k, v = self.kv(x).view(-1, 2, self.num_kv_heads, self.head_dim).unbind(1)
        return x + self.backend.forward(q, k, v, kv_caches[0], meta, scale=0.3).flatten(1)

    @torch.inference_mode()
    def reference_greedy_mm(self, prompt: list[int], images: list[MMInput], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_tokens):
            x = self.embed(torch.tensor(ids))
            for mm in images:
                x[mm.start : mm.end] = self.vision(mm.data["pixel_values"])
            x = x + self.pos(torch.arange(len(ids)))
            q = self.q(x).view(-1, 2 * self.num_kv_heads, self.head_dim)
            k, v = self.kv(x).view(-1, 2, self.num_kv_heads, self.head_dim).unbind(1)
            o = attend(q, k, v, 0.3, causal=True, sliding_window=None)
            ids.append(int(self.compute_logits((x + o.flatten(1))[-1:]).argmax()))
        return ids[len(prompt) :]


def image(rows: int, seed: int, key: str | None = None) -> tuple[str, dict]:
    pixels = torch.randn(rows, 5, generator=torch.Generator().manual_seed(seed))
    return key or f"img{seed}", {"pixel_values": pixels}


def mm_prompt(text: list[list[int]], images: list[tuple[str, dict]]) -> tuple[list[int], tuple[MMInput, ...]]:
    """text[0] <image> text[1] <image> ... expanded."""
    ids: list[int] = []
    for i, t in enumerate(text):
        ids += t
        if i < len(images):
            ids.append(IMAGE)
    lengths = [int(d["pixel_values"].shape[0]) for _, d in images]
    ids, spans = expand_placeholders(ids, IMAGE, lengths, "prompt")
    return ids, tuple(MMInput(MMPlaceholder(key, o, n), d) for (key, d), (o, n) in zip(images, spans))


def mm_request(rid: str, ids: list[int], inputs: tuple[MMInput, ...], max_tokens: int = 6):  # type: ignore[no-untyped-def]
    r = make_request(rid, ids, max_tokens=max_tokens)
    r.mm_inputs = inputs
    return r


def text(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 60) for _ in range(n)]


@pytest.mark.parametrize("budget", [256, 7, 3])
def test_images_match_recomputation_under_chunking(budget: int) -> None:
    model = FakeVisionModel()
    core = make_core(model, budget=budget)
    cases = [
        mm_prompt([text(5, 1), text(3, 2)], [image(6, 1)]),
        mm_prompt([text(2, 3), text(4, 4), text(1, 5)], [image(4, 2), image(9, 3)]),
        mm_prompt([text(7, 6)], []),
    ]
    reqs = [mm_request(f"r{i}", ids, inputs) for i, (ids, inputs) in enumerate(cases)]
    out = run_all(core, reqs)
    for i, (ids, inputs) in enumerate(cases):
        assert out[f"r{i}"] == model.reference_greedy_mm(ids, list(inputs), 6)
    assert sorted(model.encoded) == [4, 6, 9]  # each image encoded once, even when chunked
    assert_all_blocks_free(core)


def test_repeated_image_hits_prefix_and_encoder_caches() -> None:
    model = FakeVisionModel()
    core = make_core(model)
    ids, inputs = mm_prompt([text(6, 1), text(5, 2)], [image(12, 1)])
    run_all(core, [mm_request("a", ids, inputs)])
    again = mm_request("b", ids, inputs)
    out = run_all(core, [again])
    assert again.num_cached_tokens == 20  # 5 full blocks of 4 of 23: the image included
    assert out["b"] == model.reference_greedy_mm(ids, list(inputs), 6)
    # same size and placeholder tokens, different content: no prefix hit past the image start
    other_ids, other_inputs = mm_prompt([text(6, 1), text(5, 2)], [image(12, 7)])
    assert other_ids == ids
    other = mm_request("c", other_ids, other_inputs)
    out = run_all(core, [other])
    assert other.num_cached_tokens == 4  # only the block before the image
    assert out["c"] == model.reference_greedy_mm(other_ids, list(other_inputs), 6)
    assert model.encoded == [12, 12]  # "b" needed no encoder run (full prefix hit on the image)


def test_encoder_budget_cuts_chunk_before_an_image() -> None:
    model = FakeVisionModel()
    core = make_core(model, budget=64)
    core.scheduler.encoder.rows_per_step = 8
    ids, inputs = mm_prompt([text(3, 1), text(2, 2), text(2, 3)], [image(6, 1), image(6, 2)])
    r = mm_request("a", ids, inputs)
    core.add(r)
    plan = core.scheduler.schedule()
    assert len(plan.scheduled[0].token_ids) == inputs[1].start  # stops before the 2nd image
    core.scheduler.update(plan, core.runner.execute(plan))
    while core.has_unfinished:
        core.step()
    assert r.output_token_ids == model.reference_greedy_mm(ids, list(inputs), 6)


def test_encoder_cache_manager_lru_and_pinning() -> None:
    m = EncoderCacheManager(capacity_rows=10, rows_per_step=100)
    a, b, c = (MMInput(MMPlaceholder(k, 0, 4), {}) for k in "abc")
    m.begin_step()
    assert m.plan([a]) == [a] and m.plan([a]) == [] and m.plan([b]) == [b]
    assert m.plan([c]) is None  # a and b are pinned this step: no room
    assert m.end_step() == []
    m.begin_step()
    m.plan([b])  # b is now the most recent
    assert m.plan([c]) == [c]
    assert m.end_step() == ["a"] and "a" not in m and "b" in m
    big = MMInput(MMPlaceholder("big", 0, 30), {})
    m.begin_step()
    assert m.plan([big]) == [big]  # larger than the cache: runs alone, evicting the rest
    assert sorted(m.end_step()) == ["b", "c"]


def test_placeholder_checks_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="2 images but the prompt has 1"):
        expand_placeholders([1, IMAGE, 2], IMAGE, [3, 3], "chat.messages")
    _, inputs = mm_prompt([[1], [2]], [image(3, 1)])
    with pytest.raises(InvalidArgument, match="appears where no image is"):
        check_placeholders([1, IMAGE, 2], IMAGE, (), "prompt")
    check_placeholders([1, IMAGE, IMAGE, IMAGE, 2], IMAGE, inputs, "prompt")


def test_a_placeholder_mismatch_names_the_messages_not_the_first() -> None:
    """The images of a chat may lie in any of its messages: a count mismatch in the rendered
    prompt names chat.messages, not chat.messages[0]."""
    from types import SimpleNamespace

    from mmserve.frontend.images import ImagePrompts

    info = SimpleNamespace(image_token_id=IMAGE, image_tokens=SimpleNamespace(count=lambda d: 2))
    preprocessor = SimpleNamespace(preprocess=lambda im, f: SimpleNamespace(tensors={}))
    prompts = ImagePrompts(info, preprocessor)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as e:
        prompts.process([1, 2], [object()], ["chat.messages[3].content[1].image"])  # type: ignore[list-item]
    assert e.value.field == "chat.messages"


def test_images_cross_the_process_boundary() -> None:
    ids, inputs = mm_prompt([text(2, 1), text(1, 2)], [image(3, 1)])
    r = m.EngineRequest("a", ids, SamplingParams(max_tokens=4), frozenset({2}), 4, mm_inputs=inputs)
    back = m.to_core_decoder.decode(m.encoder.encode(m.AddRequests([r]))).requests[0]
    assert (back.request_id, back.prompt_token_ids, back.params, back.eos_token_ids) == (
        r.request_id, r.prompt_token_ids, r.params, r.eos_token_ids
    )
    assert back.mm_inputs[0].placeholder == inputs[0].placeholder
    assert torch.equal(back.mm_inputs[0].data["pixel_values"], inputs[0].data["pixel_values"])
