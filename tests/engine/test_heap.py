"""The start-up heap frozen out of the garbage collector (mmserve.heap): an engine's start
freezes it, its shutdown thaws it, MMSERVE_GC_FREEZE=0 leaves it alone, and a frozen engine
generates what transformers does."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mmserve.config import CacheConfig, EngineConfig, ModelConfig
from mmserve.frontend.frontend import FrontEnd
from mmserve.heap import freeze_heap, thaw_heap
from mmserve.params import SamplingParams
from tests.utils.tiny_models import make_tiny_model

PROMPT = [5, 9, 13, 2, 7, 11]


@pytest.fixture
def thawed() -> Iterator[None]:
    """Leaves the worker's collector as it found it (nothing frozen), whatever the test did."""
    thaw_heap()
    try:
        yield
    finally:
        thaw_heap()


def test_freeze_heap_follows_the_switch(thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_GC_FREEZE", "0")
    assert freeze_heap() is False
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv("MMSERVE_GC_FREEZE", "1")
    alive = len(gc.get_objects())
    assert freeze_heap() is True
    # a full collection now walks only what was made since: a few objects, not the heap
    assert gc.get_freeze_count() > 0.9 * alive - 1000
    assert len(gc.get_objects()) < 1000
    thaw_heap()
    assert gc.get_freeze_count() == 0


def test_frozen_objects_still_die_by_reference_count(
    thawed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freezing keeps objects out of the collector's passes, not alive: one that loses its
    last reference is freed as before (the engine's requests come and go this way)."""
    monkeypatch.setenv("MMSERVE_GC_FREEZE", "1")

    class Box:
        pass

    box = Box()
    ref = weakref.ref(box)
    freeze_heap()
    del box
    assert ref() is None


def _engine(path: Path) -> FrontEnd:
    return FrontEnd.start(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
            cache=CacheConfig(block_size=4, num_blocks=64),
        )
    )


def test_an_engine_freezes_at_start_and_thaws_at_shutdown(
    thawed: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = make_tiny_model(tmp_path)
    monkeypatch.setenv("MMSERVE_GC_FREEZE", "1")
    engine = _engine(path)
    try:
        assert gc.get_freeze_count() > 10_000  # torch, transformers and the engine's objects
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add_request("frozen", PROMPT, params)
        tokens: list[int] = []
        while engine.has_unfinished:
            for delta in engine.step_deltas():
                tokens += delta.token_ids
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # ignore_eos: all 12, an end token among them
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
    assert tokens == ids[0, len(PROMPT) :].tolist()


def test_the_switch_off_leaves_the_heap_alone(
    thawed: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MMSERVE_GC_FREEZE", "0")
    engine = _engine(make_tiny_model(tmp_path))
    try:
        assert gc.get_freeze_count() == 0
    finally:
        engine.shutdown()


def test_the_server_freezes_what_its_start_made(
    thawed: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The gRPC server's own objects (made after its engines froze theirs) are frozen once it
    listens: a later full collection no longer walks them."""
    from mmserve.server.config import ModelSpec
    from tests.server.conftest import ServerThread, load_registry

    monkeypatch.setenv("MMSERVE_GC_FREEZE", "1")
    registry = load_registry([ModelSpec("tiny", str(make_tiny_model(tmp_path)))])
    thread = ServerThread(registry)
    assert any(o is thread.server for o in gc.get_objects())  # made after the engine froze
    thread.start()
    try:
        assert not any(o is thread.server for o in gc.get_objects())
    finally:
        thread.stop()
        registry.shutdown()
