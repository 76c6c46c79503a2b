"""The random walks of mmserve.bench.grammar_walk, as the tests import them."""

from mmserve.bench.grammar_walk import Vocab, WalkError, walk

__all__ = ["Vocab", "WalkError", "walk"]
