"""LLaVA against transformers on tiny random checkpoints (CLIP and SigLIP towers, both feature
strategies): prompts with one and two images of different sizes, run as one flat batch over
the paged KV cache with the image rows scattered into inputs_embeds, then greedy decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.attention import get_attention_backend
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.llava import LlavaForConditionalGeneration
from mmserve.models.loader import iter_safetensors_weights
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_vlm import IMAGE_SIZE, PATCH_SIZE, make_tiny_llava

ATOL = 1e-4
NUM_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
CASES: dict[str, tuple[str, Any, int | list[int]]] = {  # name -> (tower, strategy, layers)
    "clip-default": ("clip", "default", -2),
    "clip-full-two-layers": ("clip", "full", [0, -1]),
    "siglip-full": ("siglip", "full", -1),
    "siglip-default": ("siglip", "default", -2),
}


class Setup:
    """One tiny checkpoint loaded both ways, with its tokenizer and image processor."""

    def __init__(self, folder: Path) -> None:
        import transformers

        self.hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
        self.ours = LlavaForConditionalGeneration(self.hf.config, get_attention_backend("torch"))
        self.ours.load_weights(iter_safetensors_weights(folder))
        self.ours.eval()
        self.tokenizer: Any = transformers.AutoTokenizer.from_pretrained(folder)
        self.processor = transformers.AutoImageProcessor.from_pretrained(folder)

    def pixels(self, sizes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
        """Random RGB images of the given (width, height), one [1, 3, S, S] each."""
        from PIL import Image

        rng = np.random.default_rng(seed)
        images = [
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes
        ]
        return [self.processor(images=im, return_tensors="pt")["pixel_values"] for im in images]

    def prompt_ids(self, question: str, pixels: list[torch.Tensor]) -> list[int]:
        """The chat-rendered prompt with each <image> expanded to its num_image_tokens."""
        parts: list[dict[str, str]] = [{"type": "image"} for _ in pixels] + [
            {"type": "text", "text": question}
        ]
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = []
        image = iter(pixels)
        for token in self.tokenizer(text).input_ids:
            if token == self.ours.image_token_id:
                ids += [token] * self.ours.num_image_tokens({"pixel_values": next(image)})
            else:
                ids.append(token)
        return ids

    def embeds(self, prompts: list[tuple[list[int], list[torch.Tensor]]]) -> torch.Tensor:
        """inputs_embeds of the prompts back to back, image rows at the placeholders."""
        ids = torch.tensor([t for p, _ in prompts for t in p])
        with torch.no_grad():
            embeds = self.ours.embed_input_ids(ids)
            rows = self.ours.encode_images([{"pixel_values": px} for _, ps in prompts for px in ps])
        embeds[ids == self.ours.image_token_id] = torch.cat(rows)
        return embeds


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    vision, strategy, layer = CASES[request.param]
    folder = make_tiny_llava(
        tmp_path_factory.mktemp("llava"), vision, strategy=strategy, feature_layer=layer
    )
    return Setup(folder)


def test_prompt_logits_and_greedy_decode_match_transformers(setup: Setup) -> None:
    one = setup.pixels([(40, 30)], seed=1)
    two = setup.pixels([(25, 50), (60, 60)], seed=2)
    prompts = [
        (setup.prompt_ids("What is this?", one), one),
        (setup.prompt_ids("Compare them.", two), two),
    ]
    kv = PagedKV(setup.ours, num_blocks=64)
    seqs = [PagedSeq(), PagedSeq()]
    with torch.no_grad():
        logits = kv.step(
            setup.ours, [(s, p) for s, (p, _) in zip(seqs, prompts)], setup.embeds(prompts)
        )
    rows = logits.split([len(p) for p, _ in prompts])
    for (ids, pixels), ours in zip(prompts, rows, strict=True):
        with torch.no_grad():
            expected = setup.hf(torch.tensor([ids]), pixel_values=torch.cat(pixels)).logits[0]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    _check_greedy(setup, kv, seqs, prompts, [r[-1] for r in rows])


def _check_greedy(
    setup: Setup,
    kv: PagedKV,
    seqs: list[PagedSeq],
    prompts: list[tuple[list[int], list[torch.Tensor]]],
    last: list[torch.Tensor],
    steps: int = 4,
) -> None:
    """Our paged decode (both sequences in one batch) vs transformers' greedy generate."""
    ours: list[list[int]] = [[int(row.argmax())] for row in last]
    for _ in range(steps - 1):
        with torch.no_grad():
            logits = kv.step(setup.ours, [(s, [out[-1]]) for s, out in zip(seqs, ours)])
        for out, row in zip(ours, logits, strict=True):
            out.append(int(row.argmax()))
    for (ids, pixels), got in zip(prompts, ours, strict=True):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            generated = setup.hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.cat(pixels),
                max_new_tokens=steps,
                do_sample=False,
            )[0, len(ids) :].tolist()
        assert got[: len(generated)] == generated


def test_interface(setup: Setup) -> None:
    config = setup.hf.config
    ours = setup.ours
    assert ours.image_token_id == config.image_token_id and not ours.capabilities.uses_mrope
    text = config.text_config
    assert (ours.num_layers, ours.num_kv_heads, ours.vocab_size) == (
        text.num_hidden_layers,
        text.num_key_value_heads,
        text.vocab_size,
    )
    pixels = setup.pixels([(30, 40)], seed=3)[0]
    first_row = int(config.vision_config.model_type == "clip_vision_model")
    expected = NUM_PATCHES + first_row - int(config.vision_feature_select_strategy == "default")
    assert ours.num_image_tokens({"pixel_values": pixels}) == expected
    (rows,) = ours.encode_images([{"pixel_values": pixels}])
    assert rows.shape == (expected, text.hidden_size) and rows.dtype == torch.float32
    with pytest.raises(InvalidArgument, match="pixel_values"):
        ours.num_image_tokens({"pixel_values": torch.zeros(1, 3, IMAGE_SIZE + 1, IMAGE_SIZE)})


def test_tower_stops_at_the_feature_layer(setup: Setup) -> None:
    layers = setup.hf.config.vision_feature_layer
    deepest = max(i % 3 for i in ([layers] if isinstance(layers, int) else layers))  # 2 layers
    assert len(setup.ours.vision_tower.encoder.layers) == deepest
    assert not hasattr(setup.ours.vision_tower, "post_layernorm")


def test_load_weights_accepts_every_name_layout(setup: Setup) -> None:
    """transformers 5's in-memory names and the hub's vision_tower.vision_model.* names load
    the same tensors as the saved (legacy) layout."""
    expected = setup.ours.state_dict()
    v5 = list(setup.hf.state_dict().items())
    assert any(n.startswith("model.language_model.") for n, _ in v5)
    hub = [(_hub_name(n), t) for n, t in iter_safetensors_weights(_folder_of(setup))]
    for weights in (v5, hub):
        model = LlavaForConditionalGeneration(setup.hf.config, get_attention_backend("torch"))
        model.load_weights(weights)
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)


def test_load_weights_rejects_missing_and_unknown(setup: Setup) -> None:
    weights = list(iter_safetensors_weights(_folder_of(setup)))
    backend = get_attention_backend("torch")
    drop = {"multi_modal_projector.linear_1.weight", "language_model.model.norm.weight"}
    for name in drop:
        with pytest.raises(UnsupportedModel, match="lacks"):
            LlavaForConditionalGeneration(setup.hf.config, backend).load_weights(
                [w for w in weights if w[0] != name]
            )
    with pytest.raises(UnsupportedModel, match="unexpected"):
        LlavaForConditionalGeneration(setup.hf.config, backend).load_weights(
            [*weights, ("vision_tower.encoder.extra.weight", torch.zeros(1))]
        )


def _folder_of(setup: Setup) -> Path:
    return Path(setup.hf.config._name_or_path)


def _hub_name(name: str) -> str:
    if name.startswith("vision_tower."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name
