"""Images of a request: proto -> ImageSource -> DecodedImage, off the event loop (on the
threads of the model the request is for).

One ImageInputs per server: its limits, the media directory (paths outside it are refused)
and the uuid registry, scoped by the request's cache_salt so tenants never read each
other's images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.processors.images import (
    DecodedImage,
    ImageLimits,
    ImageRegistry,
    ImageSource,
    check_image_count,
    load_image,
)
from mmserve.server.config import ServerConfig
from mmserve_client.v1 import common_pb2

EMBED_BATCH_FACTOR = 16  # an Embed batch may hold 16 x max_images_per_request images


def image_source(image: common_pb2.Image) -> ImageSource:
    kind = image.WhichOneof("source")
    return ImageSource(
        data=image.data if kind == "data" else None,
        path=image.path if kind == "path" else None,
        uuid=image.uuid or None,
    )


class ImageInputs:
    def __init__(self, config: ServerConfig) -> None:
        self.limits = ImageLimits(
            max_pixels=config.max_image_pixels, max_images=config.max_images_per_request
        )
        self.media_dir = Path(config.media_dir).resolve() if config.media_dir else None
        self.registry = ImageRegistry(config.image_uuid_cache_bytes)

    async def load(
        self,
        images: Sequence[tuple[str, ImageSource]],
        list_field: str,
        engine: AsyncFrontEnd,
        namespace: str = "",
        batch: bool = False,
    ) -> list[DecodedImage]:
        """Decodes (or looks up by uuid) each (field, source), on the model's front-end threads;
        InvalidArgument names the image's field and the limit it broke. batch: an Embed
        call, whose inputs may hold EMBED_BATCH_FACTOR times the per-request image cap."""
        limits = self.limits
        if batch:
            limits = replace(limits, max_images=limits.max_images * EMBED_BATCH_FACTOR)
        check_image_count(len(images), list_field, limits)
        return await engine.run(self._load_all, images, namespace)

    def _load_all(
        self, images: Sequence[tuple[str, ImageSource]], namespace: str
    ) -> list[DecodedImage]:
        return [
            load_image(
                source, field, self.limits, media_dir=self.media_dir, registry=self.registry,
                namespace=namespace,
            )
            for field, source in images
        ]
