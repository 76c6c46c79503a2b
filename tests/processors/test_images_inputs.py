"""Image sources: data, media-dir paths (escapes refused), client uuids; the byte-bounded LRU."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from mmserve.errors import InvalidArgument
from mmserve.processors.image_cache import ByteLRU
from mmserve.processors.images import ImageLimits, ImageRegistry, ImageSource, load_image

FIELD = "embed.inputs[2].image"
LIMITS = ImageLimits()


def png(color: tuple[int, int, int] = (10, 20, 30), size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def media(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png((1, 2, 3)))
    return root


def refused(source: ImageSource, field: str, **kwargs: object) -> str:
    with pytest.raises(InvalidArgument) as info:
        load_image(source, FIELD, LIMITS, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    return str(info.value)


def test_path_inside_media_dir(media: Path) -> None:
    by_path = load_image(ImageSource(path="sub/a.png"), FIELD, LIMITS, media_dir=media)
    by_data = load_image(ImageSource(data=png()), FIELD, LIMITS)
    assert by_path.content_hash == by_data.content_hash
    absolute = str(media / "sub" / "a.png")
    assert load_image(ImageSource(path=absolute), FIELD, LIMITS, media_dir=media).size == (8, 6)


def test_paths_are_off_by_default(media: Path) -> None:
    message = refused(ImageSource(path=str(media / "sub" / "a.png")), FIELD + ".path")
    assert "file paths are disabled" in message


@pytest.mark.parametrize("path", ["../secret.png", "sub/../../secret.png", "SECRET_ABSOLUTE"])
def test_paths_outside_media_dir_are_refused(media: Path, path: str) -> None:
    if path == "SECRET_ABSOLUTE":
        path = str(media.parent / "secret.png")
    message = refused(ImageSource(path=path), FIELD + ".path", media_dir=media)
    assert "outside the media directory" in message


def test_symlink_escape_is_refused(media: Path) -> None:
    os.symlink(media.parent / "secret.png", media / "link.png")
    os.symlink(media.parent, media / "up")
    for path in ("link.png", "up/secret.png"):
        message = refused(ImageSource(path=path), FIELD + ".path", media_dir=media)
        assert "outside the media directory" in message


def test_missing_files_directories_and_fifos_are_refused(media: Path) -> None:
    os.mkfifo(media / "pipe")
    assert "no such file" in refused(ImageSource(path="nope.png"), FIELD + ".path", media_dir=media)
    assert "not a regular file" in refused(
        ImageSource(path="sub"), FIELD + ".path", media_dir=media
    )
    assert "not a regular file" in refused(
        ImageSource(path="pipe"), FIELD + ".path", media_dir=media
    )
    small = ImageLimits(max_encoded_bytes=10)
    with pytest.raises(InvalidArgument, match="at most 10 bytes per image"):
        load_image(ImageSource(path="sub/a.png"), FIELD, small, media_dir=media)


def test_source_must_be_one_of_data_path_uuid() -> None:
    assert "not both" in refused(ImageSource(data=png(), path="a.png"), FIELD)
    assert "give data, path or a known uuid" in refused(ImageSource(), FIELD)
    assert "formats: PNG" in refused(ImageSource(data=b"nope", uuid="u"), FIELD)


def test_uuid_only_request_reuses_the_image() -> None:
    registry = ImageRegistry(max_bytes=1 << 20)
    first = load_image(ImageSource(data=png(), uuid="u1"), FIELD, LIMITS, registry=registry)
    again = load_image(ImageSource(uuid="u1"), FIELD, LIMITS, registry=registry)
    assert again is first
    # Data sent again with the same uuid replaces it; the hash always comes from the data.
    other = load_image(
        ImageSource(data=png((9, 9, 9)), uuid="u1"), FIELD, LIMITS, registry=registry
    )
    assert other.content_hash != first.content_hash
    assert load_image(ImageSource(uuid="u1"), FIELD, LIMITS, registry=registry) is other


def test_unknown_uuid_is_refused() -> None:
    registry = ImageRegistry(max_bytes=1 << 20)
    load_image(ImageSource(data=png(), uuid="u1"), FIELD, LIMITS, registry=registry)
    message = refused(ImageSource(uuid="u2"), FIELD + ".uuid", registry=registry)
    assert "unknown image uuid 'u2'" in message
    # Namespaces (cache_salt) isolate tenants.
    refused(ImageSource(uuid="u1"), FIELD + ".uuid", registry=registry, namespace="tenant-b")
    refused(ImageSource(uuid="u1"), FIELD + ".uuid")  # no registry at all
    assert "1 to 256 characters" in refused(
        ImageSource(data=png(), uuid="x" * 257), FIELD + ".uuid", registry=registry
    )


def test_registry_is_bounded_by_bytes() -> None:
    one_image = 8 * 6 * 4  # Pillow keeps RGB as 4 bytes per pixel
    registry = ImageRegistry(max_bytes=2 * one_image)
    for i in range(3):
        load_image(ImageSource(data=png((i, i, i)), uuid=f"u{i}"), FIELD, LIMITS, registry=registry)
    assert len(registry) == 2
    refused(ImageSource(uuid="u0"), FIELD + ".uuid", registry=registry)  # evicted
    load_image(ImageSource(uuid="u2"), FIELD, LIMITS, registry=registry)


def test_byte_lru_evicts_least_recently_used() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, len)
    assert cache.put("a", b"1234") and cache.put("b", b"1234")
    assert cache.get("a") == b"1234"  # now "b" is the least recently used
    cache.put("c", b"1234")
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.nbytes == 8
    assert not cache.put("big", b"x" * 11) and "big" not in cache
    cache.put("a", b"123456")  # replacing a key updates the byte count
    assert cache.nbytes == 10 and (cache.hits, cache.misses) == (1, 0)
    assert cache.get("zzz") is None and cache.misses == 1
    with pytest.raises(ValueError):
        ByteLRU(-1, len)
