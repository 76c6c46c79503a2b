"""Every named mutant of the scheduler, KV cache and block hashing is killed by the fast engine
tests (tests/engine/mutants.py holds the list and runs them as a script too)."""

from __future__ import annotations

import pytest

from tests.engine.mutants import MUTANTS, Mutant, verdict


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_snippet_found_once(mutant: Mutant) -> None:
    assert mutant.source() != mutant.path.read_text()


@pytest.mark.slow
def test_real_code_survives() -> None:
    """The loading and the verdict are sound: nothing fails without a mutant."""
    assert verdict(None).killer is None


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_killed(mutant: Mutant) -> None:
    assert verdict(mutant).killer is not None, f"mutant {mutant.name} survived the engine tests"
