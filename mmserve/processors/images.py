"""Safe image inputs: encoded bytes or a media-dir path -> an RGB PIL image and its hash.

Every refusal is `InvalidArgument(field, message)` naming the caller's field (e.g.
"chat.messages[0].content[1].image") and the limit. Decoding is CPU work: these are plain
sync functions and the server calls them through `asyncio.to_thread`, never on the loop.

Safety, in order: the encoded size is capped before anything is parsed; only the formats in
ALLOWED_FORMATS are even tried (Pillow's other plugins never see the bytes); width x height
is read from the header and checked against max_pixels *before* pixel data is decoded, so a
decompression bomb never allocates; truncated files fail (ImageFile.LOAD_TRUNCATED_IMAGES is
never set); only the first frame of an animation is decoded, and frame counts are
checked only where the header declares them.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmserve.errors import InvalidArgument
from mmserve.processors.image_cache import ByteLRU, check_uuid

MAX_ENCODED_BYTES = 20 << 20  # 20 MiB of PNG/JPEG/... per image
MAX_PIXELS = 25_000_000  # 25 MP: 100 MB decoded (RGBX); Pillow warns at ~89 MP, raises at ~179
MIN_SIDE = 2  # a side of 1 pixel is refused: nothing a model could read (processors would take it)
MAX_SIDE = 16_384  # also bounds the aspect ratio a thin strip can reach within MAX_PIXELS
MAX_FRAMES = 1_000  # frames an APNG/WebP may declare; only the first is ever decoded
MAX_IMAGES_PER_REQUEST = 16

# Pillow format names tried, in order. TIFF, ICO, PSD, SVG, ... are never parsed.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# Formats whose header states the number of frames (checked against max_frames).
_DECLARED_FRAMES = ("PNG", "WEBP")

# Prefix of the content hash input; bump when the hashed representation changes.
_HASH_VERSION = b"mmserve-image-rgb8-v1"


@dataclass(frozen=True)
class ImageLimits:
    """Per-image and per-request limits; a server builds one from its config."""

    max_encoded_bytes: int = MAX_ENCODED_BYTES  # size of the encoded file
    max_pixels: int = MAX_PIXELS  # width * height, checked from the header
    min_side: int = MIN_SIDE  # smallest accepted width and height
    max_side: int = MAX_SIDE  # largest accepted width and height
    max_frames: int = MAX_FRAMES  # frames an APNG/WebP animation may declare
    max_images: int = MAX_IMAGES_PER_REQUEST  # images in one request


@dataclass(frozen=True)
class ImageSource:
    """One image input as the client sent it (the proto's `Image`)."""

    data: bytes | None = None  # encoded bytes (oneof source)
    path: str | None = None  # server-side path under the media dir (oneof source)
    uuid: str | None = None  # client content id; alone, it names an earlier image


@dataclass(frozen=True)
class DecodedImage:
    """A decoded, oriented RGB image; treat `image` as read-only (it may be shared)."""

    image: Image.Image  # mode "RGB", EXIF orientation applied
    content_hash: str  # sha256 hex of the RGB pixels and size (see content_hash)
    source_format: str  # Pillow format name of the encoded input, e.g. "PNG"

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size  # (width, height)

    @property
    def nbytes(self) -> int:
        """Memory held, for cache bounds: Pillow stores RGB as 4 bytes per pixel."""
        width, height = self.image.size
        return width * height * 4


class ImageRegistry:
    """Client uuid -> decoded image, so a later request may send only the uuid.

    Keys are (namespace, uuid): pass the request's cache_salt as namespace so that one
    tenant cannot read another's image by guessing its uuid. Data sent with a uuid always
    wins over what the uuid held before (the content hash comes from the data, never from
    the uuid, so a reused uuid cannot poison the prefix or encoder caches).
    """

    def __init__(self, max_bytes: int) -> None:
        self._images: ByteLRU[tuple[str, str], DecodedImage] = ByteLRU(
            max_bytes, lambda image: image.nbytes
        )

    def remember(self, uuid: str, image: DecodedImage, field: str, namespace: str = "") -> None:
        check_uuid(uuid, field)
        self._images.put((namespace, uuid), image)

    def lookup(self, uuid: str, field: str, namespace: str = "") -> DecodedImage:
        """The image last sent with this uuid; InvalidArgument if unknown (or evicted)."""
        check_uuid(uuid, field)
        image = self._images.get((namespace, uuid))
        if image is None:
            raise InvalidArgument(
                field,
                f"unknown image uuid {uuid!r} and no image data: send the data with the uuid "
                "(the server keeps recent uuids only, within its image cache bound)",
            )
        return image

    def __len__(self) -> int:
        return len(self._images)


def check_image_count(count: int, field: str, limits: ImageLimits) -> None:
    """Refuse a request with more images than limits.max_images (field: the list's name)."""
    if count > limits.max_images:
        raise InvalidArgument(
            field, f"{count} images; at most {limits.max_images} images per request"
        )


def load_image(
    source: ImageSource,
    field: str,
    limits: ImageLimits,
    *,
    media_dir: Path | None = None,
    registry: ImageRegistry | None = None,
    namespace: str = "",
) -> DecodedImage:
    """Decode one input, or look up its uuid; remember data sent with a uuid.

    `media_dir` None refuses every path; `namespace` (the request's cache_salt) scopes uuids.
    """
    if source.data is not None and source.path is not None:
        raise InvalidArgument(field, "give either data or path, not both")
    if source.data is None and source.path is None:
        if not source.uuid:
            raise InvalidArgument(field, "empty image: give data, path or a known uuid")
        if registry is None:
            raise InvalidArgument(f"{field}.uuid", "this server does not keep image uuids")
        return registry.lookup(source.uuid, f"{field}.uuid", namespace)
    if source.data is not None:
        data = source.data
    else:
        data = read_media_file(str(source.path), media_dir, f"{field}.path", limits)
    decoded = decode_image(data, field, limits)
    if source.uuid and registry is not None:
        registry.remember(source.uuid, decoded, f"{field}.uuid", namespace)
    return decoded


def decode_image(data: bytes, field: str, limits: ImageLimits) -> DecodedImage:
    """Encoded bytes -> DecodedImage, or InvalidArgument naming `field` and the limit."""
    if len(data) > limits.max_encoded_bytes:
        raise InvalidArgument(
            field, f"{len(data)} bytes; at most {limits.max_encoded_bytes} bytes per image"
        )
    source_format = "image"
    try:
        # Pillow warns (above ~89 MP) or raises (above ~179 MP) in open(); our max_pixels is
        # lower and checked right after, before any pixel is decoded. warnings filters are
        # process-global (not thread-safe), so the warning is left alone, not escalated.
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as im:
            source_format = str(im.format)
            _check_header(im, field, limits)
            im.seek(0)
            im.load()
            rgb = to_rgb(_oriented(im))
    except InvalidArgument:
        raise
    except UnidentifiedImageError:
        raise InvalidArgument(
            field, f"not a supported image; formats: {', '.join(ALLOWED_FORMATS)}"
        ) from None
    except Image.DecompressionBombError:
        raise InvalidArgument(
            field, f"image too large; at most {limits.max_pixels} pixels"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as e:
        raise InvalidArgument(field, f"corrupt or truncated {source_format}: {e}") from None
    _check_size(rgb.size, field, limits)  # orientation swaps sides; frames may differ
    return DecodedImage(image=rgb, content_hash=content_hash(rgb), source_format=source_format)


def _check_header(im: Image.Image, field: str, limits: ImageLimits) -> None:
    _check_size(im.size, field, limits)
    # APNG (acTL) and WebP (ANIM) declare their frame count up front. A GIF does not, and
    # counting means parsing the whole file (seconds for 20 MiB of tiny frames), so GIF
    # frames past the first are never read at all: they cost nothing.
    frames = int(getattr(im, "n_frames", 1)) if im.format in _DECLARED_FRAMES else 1
    if frames > limits.max_frames:
        raise InvalidArgument(
            field, f"animation has {frames} frames; at most {limits.max_frames} frames"
        )


def _check_size(size: tuple[int, int], field: str, limits: ImageLimits) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise InvalidArgument(
            field, f"{width}x{height} is {width * height} pixels; at most {limits.max_pixels}"
        )
    if min(width, height) < limits.min_side:
        raise InvalidArgument(
            field, f"{width}x{height} is too small; each side at least {limits.min_side}"
        )
    if max(width, height) > limits.max_side:
        raise InvalidArgument(
            field, f"{width}x{height} is too large; each side at most {limits.max_side}"
        )


def _oriented(im: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag; a broken EXIF block is ignored, not fatal."""
    try:
        return ImageOps.exif_transpose(im)
    except (SyntaxError, ValueError, KeyError, TypeError, struct.error):
        return im


def to_rgb(im: Image.Image) -> Image.Image:
    """Any decoded mode -> 8-bit RGB; transparency is composited on white."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit grayscale (PNG, BMP): scale to 8 bits instead of clipping at 255.
        pixels = np.asarray(im, dtype=np.float64)
        scale = 255.0 / 65535.0 if im.mode != "F" else 255.0
        im = Image.fromarray(np.clip(pixels * scale + 0.5, 0, 255).astype(np.uint8), "L")
    if im.mode == "P" and im.has_transparency_data:  # tRNS or an RGBA palette
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or im.has_transparency_data:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB") if im.mode != "RGB" else im.copy()


def content_hash(rgb: Image.Image) -> str:
    """sha256 of the decoded RGB pixels and size: the same pixels in PNG, WebP-lossless or
    BMP share one hash (and one cache entry); a lossy re-encode differs in pixels and so
    in hash. Preprocessing caches combine it with the processor's identity."""
    if rgb.mode != "RGB":
        raise ValueError(f"content_hash needs an RGB image, got mode {rgb.mode}")
    digest = hashlib.sha256(_HASH_VERSION)
    digest.update(f"{rgb.width}x{rgb.height}".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def read_media_file(path: str, media_dir: Path | None, field: str, limits: ImageLimits) -> bytes:
    """Bytes of a regular file inside media_dir (symlinks resolved first), size-capped."""
    if media_dir is None:
        raise InvalidArgument(field, "file paths are disabled (the server has no media dir)")
    if not path or "\x00" in path:
        raise InvalidArgument(field, "empty path or NUL byte in path")
    base = media_dir.resolve(strict=True)
    try:
        real = (base / path).resolve()  # an absolute `path` replaces base, then is checked
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        raise InvalidArgument(field, "no such file in the media directory") from None
    if not real.is_relative_to(base):
        raise InvalidArgument(field, "path is outside the media directory")
    try:
        # O_NOFOLLOW: the last component cannot be swapped for a symlink after resolve();
        # O_NONBLOCK: a FIFO cannot hang the worker before fstat refuses it.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise InvalidArgument(field, "no such file in the media directory") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(field, "not a regular file")
        if info.st_size > limits.max_encoded_bytes:
            raise InvalidArgument(
                field, f"{info.st_size} bytes; at most {limits.max_encoded_bytes} bytes per image"
            )
        with open(fd, "rb", closefd=False) as f:
            return f.read(limits.max_encoded_bytes + 1)  # decode_image refuses a grown file
    finally:
        os.close(fd)


def local_image(image: object, field: str, limits: ImageLimits = ImageLimits()) -> DecodedImage:
    """An image handed to the offline API: a DecodedImage, a PIL image, encoded bytes or a
    local file path (the caller's own files: no media-dir rule); same checks as the server."""
    if isinstance(image, DecodedImage):
        return image
    if isinstance(image, Image.Image):
        _check_size(image.size, field, limits)
        rgb = to_rgb(image)
        return DecodedImage(image=rgb, content_hash=content_hash(rgb), source_format="PIL")
    if isinstance(image, (bytes, bytearray)):
        return decode_image(bytes(image), field, limits)
    if isinstance(image, (str, Path)):
        return decode_image(Path(image).read_bytes(), field, limits)
    raise InvalidArgument(field, f"an image is a PIL image, bytes or a path; got {type(image).__name__}")
