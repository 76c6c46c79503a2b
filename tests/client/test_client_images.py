"""SDK image conversion, no server: bytes, local files (Path, or a str in an "image" part),
PIL images (lossless PNG: the server's content hash equals the offline API's for the same
pixels) and uuid-only Images, in chat parts and Embed inputs, for Client and AsyncClient."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
from fake_inference import FakeInference

from mmserve.processors.images import ImageLimits, decode_image, local_image
from mmserve_client import AsyncClient, Client, Image
from mmserve_client._chat import chat_request
from mmserve_client._requests import embed_request, image, inputs
from mmserve_client.types import pil_png
from mmserve_client.v1 import common_pb2, generate_pb2, pooling_pb2

FIELD = "chat.messages[0].content[0].image"


def noise(mode: str = "RGB", size: tuple[int, int] = (7, 5), seed: int = 0) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    rgba = PIL.Image.fromarray(rng.randint(0, 256, (size[1], size[0], 4), dtype=np.uint8))
    return rgba.convert(mode)


def png_bytes(im: PIL.Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def part_images(messages: list[dict[str, Any]]) -> list[common_pb2.Image]:
    chat = chat_request(messages)
    return [p.image for m in chat.messages for p in m.content if p.WhichOneof("part") == "image"]


def test_chat_parts_take_bytes_paths_pil_and_uuids(tmp_path: Path) -> None:
    data = png_bytes(noise())
    file = tmp_path / "cat.png"
    file.write_bytes(data)
    pil = noise(seed=1)
    content = [
        data,
        bytearray(data),
        file,  # a Path: a local file, read here
        {"type": "image", "image": str(file)},  # a str under "image": a local file too
        {"type": "image", "image": pil, "uuid": "p"},
        pil,
        Image(uuid="cat"),
        Image(path="media/cat.png"),  # server side: left for the server's media dir
        {"type": "image", "path": "media/dog.png", "uuid": "dog"},
        Image.from_file(file, uuid="f"),
        "what is this?",
    ]
    got = part_images([{"role": "user", "content": content}])
    assert [i.WhichOneof("source") for i in got] == [*["data"] * 6, None, "path", "path", "data"]
    assert [g.data for g in got[:4]] == [data] * 4
    assert got[4].data == got[5].data == pil_png(pil) and got[4].uuid == "p"
    assert got[6].uuid == "cat" and not got[6].HasField("data") and not got[6].HasField("path")
    assert (got[7].path, got[8].path, got[8].uuid) == ("media/cat.png", "media/dog.png", "dog")
    assert (got[9].data, got[9].uuid) == (data, "f")
    chat = chat_request([{"role": "user", "content": content}])
    assert chat.messages[0].content[-1].text == "what is this?"


def test_a_lone_image_is_the_whole_content(tmp_path: Path) -> None:
    file = tmp_path / "a.png"
    file.write_bytes(png_bytes(noise()))
    for content in (file, noise(), file.read_bytes(), Image(uuid="u")):
        (got,) = part_images([{"role": "user", "content": content}])
        assert got.uuid == "u" or got.data == file.read_bytes() or got.data == pil_png(noise())
    # a plain str is text, never a path
    chat = chat_request([{"role": "user", "content": str(file)}])
    assert chat.messages[0].content[0].text == str(file)


def test_embed_inputs_take_every_image_form(tmp_path: Path) -> None:
    data = png_bytes(noise())
    file = tmp_path / "a.png"
    file.write_bytes(data)
    pil = noise(seed=2)
    items = ["a photo", data, file, pil, Image(uuid="cat"), [1, 2], Image.from_pil(pil, "p")]
    got = inputs(items)
    assert [i.WhichOneof("kind") for i in got] == ["text", *["image"] * 4, "token_ids", "image"]
    assert got[1].image.data == got[2].image.data == data
    assert got[3].image.data == got[6].image.data == pil_png(pil) and got[6].image.uuid == "p"
    assert got[4].image.uuid == "cat" and got[4].image.WhichOneof("source") is None
    # one image alone is one input, whichever form
    for one in (data, file, pil, Image(uuid="x")):
        assert [i.WhichOneof("kind") for i in inputs(one)] == ["image"]
    req = embed_request([file, "b"], None, None, None, "fp32", "clip", "")
    assert req.inputs[0].image.data == data and req.inputs[1].text == "b"


def test_image_refusals_are_client_side(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="an image is"):
        image(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="an input is"):
        inputs([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="data or path"):
        image(Image(data=b"x", path="y"))
    with pytest.raises(ValueError, match="one of 'image', 'data' or 'path'"):
        part_images([{"role": "user", "content": [{"type": "image", "image": b"x", "path": "y"}]}])
    with pytest.raises(FileNotFoundError):
        inputs(tmp_path / "missing.png")


# "P-alpha-palette": a "P" image made from RGBA keeps its alpha in an RGBA palette (not in
# info["transparency"]); PNG carries it as tRNS, and both sides must composite it on white.


MODES = ["RGB", "RGBA", "L", "LA", "1", "P", "P-transparent", "I;16", "I", "F", "CMYK", "PA"]


@pytest.mark.parametrize("mode", [*MODES, "P-alpha-palette"])
def test_pil_png_gives_the_offline_content_hash(mode: str) -> None:
    """The server decodes the PNG to the pixels the offline API takes from the PIL image."""
    im = noise("RGB", (9, 6), seed=3)
    if mode == "P":
        im = im.convert("P")
    elif mode == "P-transparent":
        im = im.convert("P")
        im.info["transparency"] = 3
    elif mode == "P-alpha-palette":
        im = noise("RGBA", (9, 6), seed=3).convert("P")
    elif mode in ("I", "I;16"):
        rng = np.random.RandomState(4)
        im = PIL.Image.fromarray(rng.randint(0, 65536, (6, 9)).astype(np.int32), "I").convert(mode)
    elif mode == "F":
        im = PIL.Image.fromarray(np.random.RandomState(5).rand(6, 9).astype(np.float32), "F")
    elif mode == "PA":
        im = noise("RGBA", (9, 6), seed=3).convert("PA")
    else:
        im = noise(mode, (9, 6), seed=3)
    served = decode_image(pil_png(im), FIELD, ImageLimits())
    assert served.source_format == "PNG"
    assert served.content_hash == local_image(im, FIELD).content_hash


def test_pil_png_is_lossless_and_drops_exif() -> None:
    im = noise("RGB", (8, 4))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90": a server applying it would see other pixels
    im.info["exif"] = exif.tobytes()
    back = PIL.Image.open(io.BytesIO(pil_png(im)))
    assert back.format == "PNG" and back.size == (8, 4) and "exif" not in back.info
    assert np.array_equal(np.asarray(back.convert("RGB")), np.asarray(im))


def test_pil_stays_an_optional_import() -> None:
    code = (
        "import sys\n"
        "from mmserve_client._chat import chat_request\n"
        "from mmserve_client._requests import inputs\n"
        "chat_request([{'role': 'user', 'content': [b'\\x89PNG', 'hi']}])\n"
        "inputs(['a', b'\\x89PNG'])\n"
        "assert 'PIL' not in sys.modules, sorted(m for m in sys.modules if 'PIL' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sync_and_async_clients_send_the_same_images(
    tmp_path: Path, fake: FakeInference, target: str
) -> None:
    file = tmp_path / "a.png"
    file.write_bytes(png_bytes(noise()))
    items = [file, noise(seed=6), "text", Image(uuid="u")]
    messages = [{"role": "user", "content": [file, noise(seed=6), "what?"]}]
    with Client(target, timeout=10) as c:
        assert len(c.embed(items, encoding="float")) == 4
        c.chat(messages, max_tokens=1)

    async def run() -> None:
        async with AsyncClient(target, timeout=10) as ac:
            assert len(await ac.embed(items, encoding="float")) == 4
            await ac.chat(messages, max_tokens=1)

    asyncio.run(run())
    embeds = [r for r in fake.requests if isinstance(r, pooling_pb2.EmbedRequest)]
    chats = [r for r in fake.requests if isinstance(r, generate_pb2.GenerateRequest)]
    assert len(embeds) == len(chats) == 2
    assert embeds[0] == embeds[1] and chats[0].chat == chats[1].chat
    assert embeds[0].inputs[0].image.data == file.read_bytes()
    assert embeds[0].inputs[1].image.data == pil_png(noise(seed=6))
    assert chats[0].chat.messages[0].content[1].image.data == pil_png(noise(seed=6))
