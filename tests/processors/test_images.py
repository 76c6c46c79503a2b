"""Safe image decoding: formats, limits, orientation, modes and content hashes."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmserve.errors import InvalidArgument
from mmserve.processors.images import (
    ImageLimits,
    check_image_count,
    decode_image,
    to_rgb,
)

FIELD = "chat.messages[0].content[1].image"
LIMITS = ImageLimits()


def encode(im: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def noise(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def blocks(width: int = 32, height: int = 24) -> Image.Image:
    """Few flat colours: exact through GIF's palette, near-exact through JPEG."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (255, 0, 0)
    pixels[:, width // 2 :] = (0, 0, 255)
    pixels[: height // 2, :, 1] = 128
    return Image.fromarray(pixels, "RGB")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height with a few bytes of IDAT: a cheap bomb."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def refused(data: bytes, limits: ImageLimits = LIMITS) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        decode_image(data, FIELD, limits)
    assert info.value.field == FIELD
    assert str(info.value).startswith(FIELD + ": ")
    return info.value


@pytest.mark.parametrize("fmt,kwargs", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True})])
def test_lossless_formats_round_trip_with_one_hash(fmt: str, kwargs: dict[str, Any]) -> None:
    original = noise()
    decoded = decode_image(encode(original, fmt, **kwargs), FIELD, LIMITS)
    assert decoded.source_format == fmt
    assert decoded.image.mode == "RGB" and decoded.size == (64, 48)
    assert np.array_equal(np.asarray(decoded.image), np.asarray(original))
    # The same pixels in another encoding share the hash (and so every cache entry).
    assert decoded.content_hash == decode_image(encode(original, "PNG"), FIELD, LIMITS).content_hash


def test_jpeg_round_trips_approximately() -> None:
    original = blocks()
    decoded = decode_image(encode(original, "JPEG", quality=95, subsampling=0), FIELD, LIMITS)
    assert decoded.source_format == "JPEG" and decoded.size == original.size
    diff = np.abs(np.asarray(decoded.image, np.int16) - np.asarray(original, np.int16))
    assert diff.mean() < 4


def gif_with_frames(count: int) -> bytes:
    """A GIF of `count` 2x2 frames, made by repeating one encoded frame (cheap for 10^5)."""
    frames = [Image.new("RGB", (2, 2), (i * 60, 0, 0)) for i in range(3)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=10)
    starts = [i for i in range(len(data) - 1) if data[i : i + 2] == b"\x21\xf9"]
    second, third = starts[1], starts[2]
    return data[:second] + data[second:third] * (count - 2) + data[third:]


def test_gif_first_frame_only() -> None:
    first, second = blocks(), Image.new("RGB", (32, 24), (0, 255, 0))
    data = encode(first, "GIF", save_all=True, append_images=[second], duration=10, loop=0)
    decoded = decode_image(data, FIELD, LIMITS)
    assert decoded.source_format == "GIF"
    assert np.array_equal(np.asarray(decoded.image), np.asarray(first))
    # Frames past the first are never parsed, so 10^5 of them cost nothing.
    many = gif_with_frames(100_000)
    assert decode_image(many, FIELD, LIMITS).image.getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_declared_frame_count_is_limited(fmt: str) -> None:
    frames = [blocks(), Image.new("RGB", (32, 24), (0, 255, 0))]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=10)
    assert decode_image(data, FIELD, LIMITS).size == (32, 24)
    err = refused(data, ImageLimits(max_frames=1))
    assert "2 frames" in str(err) and "at most 1 frames" in str(err)


def test_different_images_different_hashes() -> None:
    hashes = {
        decode_image(encode(im, "PNG"), FIELD, LIMITS).content_hash
        for im in (noise(seed=0), noise(seed=1), noise(48, 64, seed=0), blocks())
    }
    assert len(hashes) == 4
    # Same bytes, different shape: the size is part of the hash.
    flat = noise(64, 48)
    reshaped = Image.frombytes("RGB", (48, 64), flat.tobytes())
    assert (
        decode_image(encode(flat, "PNG"), FIELD, LIMITS).content_hash
        != decode_image(encode(reshaped, "PNG"), FIELD, LIMITS).content_hash
    )


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    data = encode(blocks(40, 20), "JPEG", quality=95, exif=exif.tobytes())
    decoded = decode_image(data, FIELD, LIMITS)
    assert decoded.size == (20, 40)
    top, bottom = decoded.image.getpixel((10, 2)), decoded.image.getpixel((10, 37))
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    decoded = decode_image(encode(rgba, "PNG"), FIELD, LIMITS).image
    assert decoded.getpixel((0, 0)) == (255, 0, 0)
    assert decoded.getpixel((1, 1)) == (255, 255, 255)
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    palette.putpixel((0, 0), 0)
    decoded = decode_image(encode(palette, "PNG", transparency=0), FIELD, LIMITS).image
    assert decoded.getpixel((0, 0)) == (255, 255, 255)
    assert decoded.getpixel((1, 1)) == (10, 20, 30)


def test_other_modes_become_8bit_rgb() -> None:
    gray16 = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16)).convert("I;16")
    decoded = decode_image(encode(gray16, "PNG"), FIELD, LIMITS).image
    assert decoded.getpixel((0, 0)) == (255, 255, 255)  # scaled, not clipped garbage
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    r, g, b = decode_image(encode(cmyk, "JPEG"), FIELD, LIMITS).image.getpixel((4, 4))
    assert r > 200 and g < 40 and b < 40
    assert to_rgb(Image.new("1", (2, 2), 1)).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("LA", (2, 2), (0, 0))).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files_are_refused(fmt: str) -> None:
    data = encode(noise(), fmt)
    err = refused(data[: len(data) // 2])
    assert "truncated" in str(err) or "corrupt" in str(err)


def test_one_pixel_image_is_refused() -> None:
    err = refused(encode(Image.new("RGB", (1, 1)), "PNG"))
    assert "each side at least 2" in str(err)
    refused(encode(Image.new("RGB", (1, 300)), "PNG"))


def test_decompression_bombs_are_refused_before_decoding() -> None:
    # 10^10 pixels: Pillow's own DecompressionBombError, reported as our limit.
    err = refused(png_header_only(100_000, 100_000))
    assert f"at most {LIMITS.max_pixels}" in str(err)
    # 36 MP: under Pillow's threshold but over ours; refused from the header (the IDAT is
    # 1 KiB, so decoding would have failed as truncated instead).
    err = refused(png_header_only(6000, 6000))
    assert "36000000 pixels" in str(err) and f"at most {LIMITS.max_pixels}" in str(err)
    err = refused(png_header_only(20_000, 2), ImageLimits())
    assert "each side at most 16384" in str(err)


def test_encoded_size_limit() -> None:
    data = encode(noise(), "PNG")
    err = refused(data, ImageLimits(max_encoded_bytes=len(data) - 1))
    assert f"at most {len(data) - 1} bytes" in str(err)


@pytest.mark.parametrize(
    "data",
    [
        encode(noise(16, 16), "TIFF"),
        encode(noise(16, 16), "ICO"),
        b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>',
        b"",
        b"not an image at all",
    ],
    ids=["tiff", "ico", "svg", "empty", "garbage"],
)
def test_unsupported_formats_are_refused(data: bytes) -> None:
    err = refused(data)
    assert "formats: PNG, JPEG, WEBP, GIF, BMP" in str(err)


def test_too_many_images() -> None:
    check_image_count(LIMITS.max_images, "chat.messages", LIMITS)
    with pytest.raises(InvalidArgument) as info:
        check_image_count(LIMITS.max_images + 1, "chat.messages", LIMITS)
    assert info.value.field == "chat.messages"
    assert f"at most {LIMITS.max_images} images per request" in str(info.value)
