"""Every named mutant of the scheduler, KV cache and block hashing is killed by the fast engine
tests (tests/engine/mutants.py holds the list and runs them as a script too)."""

from __future__ import annotations

import pytest

from tests.engine.mutants import MUTANTS, Mutant, verdicts


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_snippet_found_once(mutant: Mutant) -> None:
    assert mutant.source() != mutant.path.read_text()


@pytest.mark.slow
def test_every_mutant_is_killed() -> None:
    """Nothing fails on the real code (the loading and the verdict are sound), and some test fails
    on each mutant. One forking interpreter for all of them (a fresh one each took 6-8 s)."""
    real, *judged = verdicts([None, *MUTANTS])
    assert real.killer is None, f"the real code fails {real.killer}"
    survived = [m.name for m, v in zip(MUTANTS, judged, strict=True) if v.killer is None]
    assert not survived, f"mutants survived the engine tests: {survived}"
