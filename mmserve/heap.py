"""Keeping Python's cyclic garbage collector's full passes short in a serving process.

After start-up a process holds several hundred thousand long-lived objects (torch,
transformers, tokenizers, the model's modules). A full collection walks every one of them:
about 360 ms for ~440k objects on the 2-core development machine. Full collections run
whenever enough objects have survived younger ones, so under load one lands in the middle of
serving and stalls a step or a reply for that long. `freeze_startup_heap` moves what is alive
when start-up ends into the permanent generation (gc.freeze): later collections walk only the
objects made since, and still free their cycles as before. Leaving the block unfreezes them,
so what is left is freed at exit as usual (xgrammar's bindings report objects never freed).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def startup_heap_frozen(what: str) -> Iterator[int]:
    """Collects once, then freezes everything alive for the block (enter it once start-up is
    over, models loaded, around the serving); yields the number of frozen objects."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of the garbage collector's passes", what, frozen)
    try:
        yield frozen
    finally:
        gc.unfreeze()
