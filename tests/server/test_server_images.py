"""Images end to end over gRPC through the SDK: a tiny Qwen2-VL chats about images (streamed,
prefix cache keyed on image content, uuids scoped by cache_salt, media-dir paths), a tiny CLIP
embeds texts and images as the offline API does, and every bad image is INVALID_ARGUMENT
naming its field while the server goes on serving. One server for the module, float32 on CPU."""

from __future__ import annotations

import asyncio
import io
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import PIL.Image
import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.params import SamplingParams
from mmserve.server import cli
from mmserve.server.config import ModelSpec, ServerConfig
from mmserve_client import AsyncClient, Client, GenerateResult, Image, MMServeError
from tests.server.conftest import ServerThread, serve
from tests.utils.tiny_models import make_tiny_model
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl
from tests.utils.tiny_vlm import make_tiny_clip

MAX_TOKENS = 4
MAX_IMAGES = 3  # the server's max_images_per_request
BLOCK = 4  # KV block size of the test servers (tests/server/conftest.py)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
QUESTION = "what is in the picture?"


def picture(height: int, width: int, seed: int) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def encode(im: PIL.Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def png(height: int, width: int, seed: int) -> bytes:
    return encode(picture(height, width, seed))


def bilevel_png(width: int, height: int) -> bytes:
    """A complete, valid 1-bit PNG of zeros: a few KiB that decode to width x height pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    row = bytes(1 + (width + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images-server")
    return {
        "vl": make_tiny_qwen2_vl(root / "vl", "2"),
        "clip": make_tiny_clip(root / "clip"),
        "text": make_tiny_model(root, arch="llama", seed=0, name="text"),
    }


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "pets").mkdir()
    (root / "pets" / "cat.png").write_bytes(png(24, 32, 40))
    (root.parent / "outside.png").write_bytes(png(24, 32, 41))  # next to, not inside
    (root / "pets" / "link.png").symlink_to(root.parent / "outside.png")
    return root


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], media: Path) -> Iterator[ServerThread]:
    specs = [ModelSpec(name, str(path)) for name, path in folders.items()]
    server = serve(specs, media_dir=str(media), max_images_per_request=MAX_IMAGES)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=60) as c:
        yield c


def messages(*images: Any, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*images, text]}]


def ask(client: Client, *images: Any, **kw: Any) -> GenerateResult:
    kw = {"model": "vl", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    return client.chat(messages(*images), **kw)


def refused(call: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(MMServeError) as e:
        call(*args, **kw)
    assert e.value.code == INVALID, e.value.message
    return e.value.message


def image_span(client: Client, *images: Any) -> tuple[int, int]:
    """[first, last] prompt positions of the image tokens, from Tokenize."""
    ids = client.tokenize(messages(*images), model="vl").token_ids
    pad = image_token_id(client)
    at = [i for i, t in enumerate(ids) if t == pad]
    return at[0], at[-1]


def image_token_id(client: Client) -> int:
    return client.tokenize("<|image_pad|>", model="vl", add_special_tokens=False).token_ids[0]


def test_list_models_reports_images(client: Client) -> None:
    flags = {m.name: m.supports_images for m in client.list_models()}
    assert flags == {"vl": True, "clip": True, "text": False}


def test_one_and_two_images_stream_as_offline(client: Client, folders: dict[str, Path]) -> None:
    one = [picture(24, 40, 0)]
    two = [picture(24, 40, 1), picture(50, 20, 2)]  # of different sizes
    llm = LLM(
        str(folders["vl"]), block_size=BLOCK, num_kv_blocks=256, dtype="float32", device="cpu"
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for images in (one, two):
        kw = {"model": "vl", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        chunks = list(client.chat_stream(messages(*images), **kw))
        streamed = [t for c in chunks for t in c.token_ids]
        parts = [
            *({"type": "image", "image": im} for im in images),
            {"type": "text", "text": QUESTION},
        ]
        offline = llm.chat([[{"role": "user", "content": parts}]], greedy, use_tqdm=False)[0]
        assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
        assert streamed == list(offline.outputs[0].token_ids)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == len(offline.prompt_token_ids)


def test_same_image_twice_hits_the_prefix_cache(client: Client) -> None:
    image = png(24, 40, 10)
    salt = {"cache_salt": "twice"}  # a prefix cache of its own: nothing cached before
    first, last = image_span(client, image)
    cold = ask(client, image, **salt)
    warm = ask(client, image, **salt)
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens > last  # every image token was served from the cache
    assert warm.token_ids == cold.token_ids
    # the same pixels as a PIL image (the SDK sends lossless PNG): the same content, a hit
    pil = ask(client, PIL.Image.open(io.BytesIO(image)), **salt)
    assert pil.usage is not None and pil.usage.cached_tokens > last
    assert pil.token_ids == cold.token_ids
    # a different picture of the same size: the same placeholder tokens, but no hit on them
    other = ask(client, png(24, 40, 11), **salt)
    assert other.usage is not None
    assert other.usage.prompt_tokens == cold.usage.prompt_tokens
    assert other.usage.cached_tokens <= first  # at most the template before the image


def test_uuid_alone_names_the_image_sent_before(client: Client) -> None:
    salt = {"cache_salt": "uuids"}
    sent = ask(client, Image(data=png(24, 40, 20), uuid="cat"), **salt)
    again = ask(client, Image(uuid="cat"), **salt)
    assert again.token_ids == sent.token_ids
    _, last = image_span(client, png(24, 40, 20))
    assert again.usage is not None and again.usage.cached_tokens > last
    field = "chat.messages[0].content[0].image.uuid"
    message = refused(ask, client, Image(uuid="no-such-cat"), **salt)
    assert message.startswith(f"{field}: unknown image uuid 'no-such-cat'")
    # another tenant (cache_salt) does not see "cat"; the first still does
    assert refused(ask, client, Image(uuid="cat"), cache_salt="other").startswith(field)
    assert refused(ask, client, Image(uuid="cat")).startswith(field)  # nor the default one
    assert ask(client, Image(uuid="cat"), **salt).token_ids == sent.token_ids


IMAGE = "chat.messages[0].content[1].image"  # after the text part "look:"
PATH = IMAGE + ".path"

# content parts after the text "look:" (made when the case runs: bombs take a moment), the
# field the error names, and text its message holds
BAD_CHATS: dict[str, tuple[Callable[[], list[Any]], str, str]] = {
    "truncated": (lambda: [png(24, 40, 0)[:200]], IMAGE, "corrupt or truncated PNG"),
    "1x1": (lambda: [png(1, 1, 0)], IMAGE, "1x1 is too small"),
    "bomb": (lambda: [bilevel_png(20_000, 20_000)], IMAGE, "at most 25000000 pixels"),
    "bomb-36mp": (lambda: [bilevel_png(6_000, 6_000)], IMAGE, "36000000 pixels"),
    "text-bytes": (lambda: [b"hello, I am not an image"], IMAGE, "not a supported image"),
    "tiff": (lambda: [encode(picture(24, 24, 0), "TIFF")], IMAGE, "formats: PNG, JPEG, WEBP"),
    "too-many": (
        lambda: [png(16, 16, i) for i in range(MAX_IMAGES + 1)],
        "chat.messages",
        f"{MAX_IMAGES + 1} images; at most {MAX_IMAGES} images per request",
    ),
    "parent-dir": (lambda: [Image(path="../outside.png")], PATH, "outside the media"),
    "etc-passwd": (lambda: [Image(path="../etc/passwd")], PATH, "outside the media"),
    "absolute": (lambda: [Image(path="/etc/passwd")], PATH, "outside the media"),
    "symlink-out": (lambda: [Image(path="pets/link.png")], PATH, "outside the media"),
    "no-such-file": (lambda: [Image(path="pets/dog.png")], PATH, "no such file"),
}


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_images_are_refused_naming_the_field(client: Client, case: str, media: Path) -> None:
    parts, field, says = BAD_CHATS[case]
    conv = [{"role": "user", "content": ["look:", *parts()]}]
    message = refused(client.chat, conv, model="vl", max_tokens=MAX_TOKENS)
    assert message.startswith(f"{field}: "), message
    assert says in message
    assert str(media.parent) not in message  # never a server path
    assert ask(client, png(24, 40, 0)).finish_reason == "length"  # serving normally


def test_fields_count_every_message_and_part(client: Client) -> None:
    conv = [
        {"role": "user", "content": [png(24, 40, 0), "first"]},
        {"role": "assistant", "content": "a picture"},
        {"role": "user", "content": ["and this?", png(24, 40, 1), png(1, 1, 0)]},
    ]
    message = refused(client.chat, conv, model="vl", max_tokens=MAX_TOKENS)
    assert message.startswith("chat.messages[2].content[2].image: 1x1 is too small")


def test_images_to_a_text_model_are_refused(client: Client) -> None:
    conv = messages("a", png(24, 40, 0))  # the image is the second part
    message = refused(client.chat, conv, model="text", max_tokens=MAX_TOKENS)
    assert message.startswith("chat.messages[0].content[1].image: model 'text'")
    refused(client.tokenize, conv, model="text")
    assert client.chat(messages(), model="text", max_tokens=2).finish_reason is not None


def test_placeholder_ids_name_the_token_ids_field(client: Client) -> None:
    message = refused(client.generate, [5, image_token_id(client), 6], model="vl", max_tokens=2)
    assert message.startswith("token_ids: image placeholder token"), message


def test_bad_requests_leave_a_concurrent_batch_alone(server: ServerThread, client: Client) -> None:
    kw: dict[str, Any] = {"model": "vl", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = [ask(client, png(24, 40, 60 + s), **kw).token_ids for s in range(3)]

    async def run() -> list[Any]:
        async with AsyncClient(server.target, timeout=60) as ac:
            good = [ac.chat(messages(png(24, 40, 60 + s)), **kw) for s in range(3)]
            bad = [
                ac.chat(messages(b"not an image"), model="vl", max_tokens=2),
                ac.generate([5, image_token_id(client), 6], model="vl", max_tokens=2),
                ac.chat(messages(png(24, 40, 0)), model="text", max_tokens=2),
                ac.chat(messages(*[png(16, 16, i) for i in range(MAX_IMAGES + 1)]), model="vl"),
            ]
            return await asyncio.gather(*good, *bad, return_exceptions=True)

    results = asyncio.run(run())
    assert [r.token_ids for r in results[:3]] == alone
    assert all(isinstance(r, MMServeError) and r.code == INVALID for r in results[3:]), results


def test_media_dir_paths(client: Client, media: Path) -> None:
    salt = {"cache_salt": "media"}
    data = ask(client, (media / "pets" / "cat.png").read_bytes(), **salt)
    by_path = ask(client, Image(path="pets/cat.png"), **salt)  # server side, under media_dir
    by_local = ask(client, media / "pets" / "cat.png", **salt)  # a Path: read client side
    assert by_path.token_ids == by_local.token_ids == data.token_ids
    _, last = image_span(client, Image(path="pets/cat.png"))
    assert by_path.usage is not None and by_path.usage.cached_tokens > last


def test_async_client_sends_images_too(server: ServerThread, client: Client) -> None:
    image = picture(24, 40, 50)
    expected = ask(client, image).token_ids

    async def run() -> tuple[int, ...]:
        async with AsyncClient(server.target, timeout=60) as ac:
            kw = {"model": "vl", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            return (await ac.chat(messages(image), **kw)).token_ids

    assert asyncio.run(run()) == expected


def test_paths_are_refused_without_a_media_dir(folders: dict[str, Path], media: Path) -> None:
    bare = serve([ModelSpec("vl", str(folders["vl"]))])  # media_dir unset: paths are off
    try:
        with Client(bare.target, timeout=60) as c:
            message = refused(ask, c, Image(path=str(media / "pets" / "cat.png")))
            assert message.startswith("chat.messages[0].content[0].image.path: file paths are")
            assert ask(c, png(24, 40, 0)).finish_reason == "length"
    finally:
        bare.stop()


def test_a_missing_media_dir_is_refused_at_startup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="media_dir"):
        ServerConfig(media_dir=str(tmp_path / "missing"))


def test_embed_mixes_texts_and_images_as_offline(
    client: Client, folders: dict[str, Path], media: Path
) -> None:
    cat, dog = picture(40, 30, 30), picture(28, 28, 31)
    file = media / "pets" / "cat.png"
    ours = client.embed(
        ["a photo of a cat", encode(cat), "two dogs", dog, file, Image(path="pets/cat.png")],
        model="clip",
    )
    offline = LLM(str(folders["clip"]), dtype="float32", device="cpu").embed(
        ["a photo of a cat", cat, "two dogs", dog, PIL.Image.open(file), file.read_bytes()]
    )
    ours_m, offline_m = np.stack(ours), np.asarray(offline, dtype=np.float32)
    cos = (ours_m * offline_m).sum(-1) / (
        np.linalg.norm(ours_m, axis=-1) * np.linalg.norm(offline_m, axis=-1)
    )
    assert ours_m.shape == offline_m.shape and cos.min() > 0.9999
    # a uuid works for Embed too
    sent = client.embed(Image(data=encode(dog), uuid="dog"), model="clip")
    np.testing.assert_allclose(client.embed(Image(uuid="dog"), model="clip")[0], sent[0], atol=1e-6)
    message = refused(client.embed, ["a", "b", png(1, 1, 0)], model="clip")
    assert message.startswith("inputs[2].image: 1x1 is too small")
    message = refused(client.embed, ["a", encode(cat)], model="text")
    assert message.startswith("inputs[1].image: ")
    assert len(client.embed(["a"], model="text")) == 1


def test_tokenize_expands_each_image(client: Client, folders: dict[str, Path]) -> None:
    from transformers import AutoImageProcessor

    images = [picture(24, 40, 0), picture(50, 20, 1)]
    processor = AutoImageProcessor.from_pretrained(folders["vl"])
    grids = processor(images=images, return_tensors="pt")["image_grid_thw"]
    expected = [int(g.prod()) // processor.merge_size**2 for g in grids]
    ids = client.tokenize(messages(*images), model="vl").token_ids
    pad = image_token_id(client)
    runs = [len(r) for r in "".join("x" if t == pad else " " for t in ids).split()]
    assert runs == expected and expected[0] != expected[1]
    result = ask(client, *images)
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)


def test_tokenize_with_special_tokens_keeps_images_expanded(client: Client) -> None:
    image = picture(24, 40, 0)
    plain = client.tokenize(messages(image), model="vl").token_ids
    special = client.tokenize(messages(image), model="vl", add_special_tokens=True).token_ids
    pad = image_token_id(client)
    assert special.count(pad) == plain.count(pad)


def test_cli_flags_reach_the_server_config(tmp_path: Path) -> None:
    flags = ["--media-dir", str(tmp_path), "--max-image-pixels", "1000000"]
    args = cli.build_parser().parse_args(["serve", *flags, "--max-images-per-request", "2"])
    config = cli.server_config(args)
    assert config.media_dir == str(tmp_path)
    assert (config.max_image_pixels, config.max_images_per_request) == (1_000_000, 2)
    defaults = cli.server_config(cli.build_parser().parse_args(["serve"]))
    assert defaults.media_dir is None
    assert defaults.max_image_pixels == ServerConfig.max_image_pixels


def test_image_settings_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMSERVE_MEDIA_DIR", str(tmp_path))
    monkeypatch.setenv("MMSERVE_MAX_IMAGE_PIXELS", "4096")
    monkeypatch.setenv("MMSERVE_MAX_IMAGES_PER_REQUEST", "5")
    args = cli.build_parser().parse_args(["serve", "--max-images-per-request", "6"])
    config = cli.server_config(args)
    assert config.media_dir == str(tmp_path)
    # the command line beats the environment
    assert (config.max_image_pixels, config.max_images_per_request) == (4096, 6)


def test_score_texts_against_images(client: Client, folders: dict[str, Path]) -> None:
    cat, dog = picture(40, 30, 40), picture(28, 28, 41)
    scores = client.score("a photo of a cat", [encode(cat), dog], model="clip")
    offline = LLM(str(folders["clip"]), dtype="float32", device="cpu")
    assert scores == pytest.approx(offline.score("a photo of a cat", [cat, dog]), abs=1e-4)
    message = refused(client.score, "a", ["b", png(1, 1, 0)], model="clip")
    assert message.startswith("second[1].image: 1x1 is too small")
    text_tasks = next(m.tasks for m in client.list_models() if m.name == "text")
    if "score" in text_tasks:  # a model that scores text only refuses the image by name
        message = refused(client.score, [encode(cat)], ["b"], model="text")
        assert message.startswith("first[0].image: ")
