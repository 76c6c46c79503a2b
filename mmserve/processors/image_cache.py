"""A thread-safe LRU map bounded by bytes (images.ImageRegistry, the client-`uuid` registry,
and the image processors' caches are built on it).

Decoding and preprocessing run in worker threads (asyncio.to_thread), so every cache here
takes a lock around each operation; values are shared, never copied, and must be treated as
read-only by callers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from mmserve.errors import InvalidArgument

K = TypeVar("K")
V = TypeVar("V")

# A client uuid is an opaque id; bounded so that keys cannot be used to store data.
MAX_UUID_CHARS = 256


class ByteLRU(Generic[K, V]):
    """Least-recently-used map whose total size (by `size_of(value)`) stays <= max_bytes.

    A value larger than max_bytes on its own is not stored (put returns False); a bound of
    0 disables the cache. Invariant: `nbytes == sum(size_of(v) for v in values)`.
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: K, value: V) -> bool:
        size = self._size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size > self.max_bytes:
                return False
            self._items[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self.nbytes -= evicted
            return True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


def check_uuid(uuid: str, field: str) -> None:
    if not uuid or len(uuid) > MAX_UUID_CHARS:
        raise InvalidArgument(field, f"uuid must be 1 to {MAX_UUID_CHARS} characters")
