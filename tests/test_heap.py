"""mmserve.heap: start-up objects leave the garbage collector's passes."""

from __future__ import annotations

import gc

from mmserve.heap import startup_heap_frozen


def test_start_up_objects_leave_collection_for_the_block() -> None:
    kept = [[i] for i in range(1000)]  # tracked containers alive at "start-up"
    with startup_heap_frozen("test") as frozen:
        assert frozen >= len(kept) and gc.get_freeze_count() >= len(kept)
        collectable = {id(o) for o in gc.get_objects()}  # the frozen are in none of these
        assert not any(id(x) in collectable for x in kept)
        made_later = [0]
        assert id(made_later) in {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() == 0
    assert all(id(x) in {id(o) for o in gc.get_objects()} for x in kept[:3])
