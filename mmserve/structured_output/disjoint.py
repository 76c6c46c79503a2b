"""When the branches of a oneOf provably never match the same value.

Engines represent oneOf as anyOf (xgrammar says so in a log line; outlines-core builds an
alternation). For branches that cannot both match a value, the two are the same, so a oneOf
is accepted only when this (sound, incomplete) check proves it. Proofs, on normalized
schemas (normalize.py): different written types; disjoint enum values; objects where one
branch requires a property the other forbids (additionalProperties: false), or a required
property whose schemas are disjoint (a discriminator). Types added by narrowing do not count:
narrowing is sound only once oneOf's branches are known to be disjoint as written.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations

from .merge import matches
from .schema_tree import Node, Schema, value_key

Resolve = Callable[[Schema], Schema]  # follows a plain $ref to its definition
MAX_DEPTH = 6


def branches_disjoint(branches: list[Schema], resolve: Resolve) -> bool:
    """True only if no value can match two of the branches."""
    return all(disjoint(a, b, resolve) for a, b in combinations(branches, 2))


def disjoint(a: Schema, b: Schema, resolve: Resolve, depth: int = 0) -> bool:
    a, b = resolve(a), resolve(b)
    if a is False or b is False:
        return True
    if not isinstance(a, Node) or not isinstance(b, Node) or depth > MAX_DEPTH:
        return False
    for x, y in ((a, b), (b, a)):
        key = x.combinator()
        if key is not None:
            return all(disjoint(branch, y, resolve, depth + 1) for branch in x.keywords[key])
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    if _values_disjoint(a, b) or _values_disjoint(b, a):
        return True
    return _objects_disjoint(a, b, resolve, depth) or _objects_disjoint(b, a, resolve, depth)


def _types(node: Node) -> frozenset[str] | None:
    types = None if node.inferred_type else node.types()
    if types is None:
        return None
    return types | {"integer"} if "number" in types else types


def _values_disjoint(a: Node, b: Node) -> bool:
    values = a.keywords.get("enum")
    if values is None:
        return False
    other = b.keywords.get("enum")
    if other is not None:
        return not {value_key(v) for v in values} & {value_key(v) for v in other}
    types = _types(b)
    return types is not None and all(not _value_types(v) & types for v in values)


def _value_types(value: object) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, (int, float)):
        whole = isinstance(value, int) or value.is_integer()
        return frozenset({"number", "integer"} if whole else {"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array"} if isinstance(value, list) else {"object"})


def _objects_disjoint(a: Node, b: Node, resolve: Resolve, depth: int) -> bool:
    """Objects only (a value matching both is an object) where `a` requires a name that `b`
    forbids, or a required name's schemas are disjoint."""
    if frozenset({"object"}) not in (_types(a), _types(b)):
        return False
    props_a, props_b = (x.keywords.get("properties", {}) for x in (a, b))
    required_a = a.keywords.get("required", [])
    required_b = b.keywords.get("required", [])
    for name in required_a:
        if name not in props_b and not _allows_name(b, name):
            return True
    return any(
        (name in required_a or name in required_b)
        and disjoint(props_a[name], props_b[name], resolve, depth + 1)
        for name in props_a.keys() & props_b.keys()
    )


def _allows_name(node: Node, name: str) -> bool:
    if node.keywords.get("additionalProperties", True) is not False:
        return True
    return any(matches(p, name) for p in node.keywords.get("patternProperties", {}))
