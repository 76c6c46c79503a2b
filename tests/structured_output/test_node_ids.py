"""Caches keyed by a node's id hold the node: CPython gives a freed object's id to the next
one made, which would get the freed node's entry. Seen as a corpus schema that compiled
strictly now and then, its `not` lost to another node's merge (JSONSchemaBench o65414,
after other schemas). Each case makes, uses and drops nodes in turn, as rewrites do, and
checks every result with jsonschema against the schemas it came from."""

from __future__ import annotations

from typing import Any

import jsonschema

from mmserve.structured_output.merge import Merger
from mmserve.structured_output.rewrites import _Simplifier
from mmserve.structured_output.schema_tree import Node, Problems, Schema, to_json

ROUNDS = 64


def same_integers(schema: Schema, reference: Any, near: int) -> None:
    """`schema` and the reference schema take the same integers around `near`."""
    got = jsonschema.Draft202012Validator(to_json(schema))
    want = jsonschema.Draft202012Validator(reference)
    for n in range(near - 3, near + 4):
        assert got.is_valid(n) == want.is_valid(n), (n, to_json(schema), reference)


def no_definitions(name: str) -> Schema | None:
    raise AssertionError(name)


def test_merges_of_new_nodes_are_their_own() -> None:
    merger = Merger(Problems(relaxed=False), no_definitions, lambda a, b: False)
    for i in range(ROUNDS):
        low = {"type": ["integer"], "minimum": i}
        high = {"type": ["integer"], "maximum": i + 1}
        merged = merger.merge(Node(dict(low)), Node(dict(high)))  # the inputs go at once
        same_integers(merged, {"allOf": [low, high]}, i)


def test_rewrites_of_new_nodes_are_their_own() -> None:
    merger = Merger(Problems(relaxed=False), no_definitions, lambda a, b: False)
    simplifier = _Simplifier({}, merger, set())
    for i in range(ROUNDS):
        # every other one accepts nothing (a rewrite to false, and the node freed)
        schema = {"type": ["integer"], "minimum": i, "maximum": i + 1 if i % 2 else i - 1}
        same_integers(simplifier.visit(Node(dict(schema))), schema, i)
