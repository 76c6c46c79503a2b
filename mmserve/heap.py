"""Python's garbage collector and the serving loop.

A full collection walks every container object alive. After start-up that is some 400,000
objects, nearly all of them left by importing torch, transformers and their kin, and one pass
took 0.2 s on the CPU of the development machine. The collector runs such a pass whenever the
objects that survived recent collections grow by a quarter, so during serving it struck
every few hundred engine steps, stalling each for that long. freeze_heap() moves everything
alive at the end of start-up into the collector's permanent generation: later passes walk
only the objects made since. A frozen object still dies when its last reference goes; only
cycles among frozen objects wait, until an engine's shutdown thaws the heap (thaw_heap).
MMSERVE_GC_FREEZE=0 turns it off (to measure it).
"""

from __future__ import annotations

import gc

from mmserve.envs import gc_freeze_enabled


def freeze_heap() -> bool:
    """Collects once, then freezes every object alive (a no-op when MMSERVE_GC_FREEZE=0);
    returns whether it froze. Calling it again freezes what was made since."""
    if not gc_freeze_enabled():
        return False
    gc.collect()
    gc.freeze()
    return True


def thaw_heap() -> None:
    """Returns the frozen objects to the collector (an engine shut down: cycles among its
    frozen objects, its model's among them, can be freed again). The next freeze_heap(),
    another engine's start, freezes what is still alive then."""
    gc.unfreeze()
