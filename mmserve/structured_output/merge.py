"""Two subschemas as one that accepts exactly what both accept (allOf, and the keywords
beside a `$ref` or a combinator), so that engines, which drop such siblings, see one schema.

Pairs that cannot be merged exactly (two different patterns, unevaluatedProperties next to
other object keywords, ...) are a conflict: refused, or under `relaxed` the second keyword
is dropped and reported. A merged combinator distributes: {A, anyOf: [B, C]} is
{anyOf: [A & B, A & C]}; two combinators multiply out (up to MAX_BRANCHES branches).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from .schema_tree import Node, Problems, Schema, value_key

MAX_BRANCHES = 64  # branches of a combinator made by multiplying out two of them
_OBJECT_GROUP = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")
_ARRAY_GROUP = ("prefixItems", "items", "unevaluatedItems")
_LOWER = frozenset(
    {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
)
_UPPER = frozenset(
    {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
)
_EQUAL_ONLY = frozenset(
    {"pattern", "format", "contains", "if", "then", "else", "$dynamicRef", "$recursiveRef",
     "disallow"}
)  # fmt: skip

Definition = Callable[[str], Schema | None]  # a definition's schema; None inside its own
Pair = Callable[[str, str], Schema]  # two definitions -> a reference to one for both (or false)


def is_true(schema: Schema) -> bool:
    return schema is True or (isinstance(schema, Node) and not schema.keywords)


class Merger:
    def __init__(self, problems: Problems, definition: Definition, pair: Pair) -> None:
        self.problems = problems
        self.definition = definition
        self.pair = pair
        # merges made, by their inputs' ids, with the inputs: held, so that no other node
        # takes a freed input's id and gets its merge
        self.done: dict[tuple[int, int], tuple[Schema, Node, Node]] = {}
        self.active: set[tuple[int, int]] = set()  # merges in progress

    def merge(self, a: Schema, b: Schema) -> Schema:
        """A schema accepting exactly the values both accept."""
        if is_true(a) or a is b:
            return b
        if is_true(b) or a is False:
            return a
        if b is False:
            return False
        assert isinstance(a, Node) and isinstance(b, Node)
        ref, other = a.keywords.get("$ref"), b.keywords.get("$ref")
        if ref is not None and other == ref:
            return a
        if ref is not None and other is not None:  # both may be recursive: a definition
            return self.pair(ref, other)
        pair = (id(a), id(b))
        if pair in self.done:
            return self.done[pair][0]
        if pair in self.active:
            raise self.problems.error(
                b.pointer, "recursive schemas combined (allOf, or keywords beside a $ref) "
                "would never end; only one side of the combination may be recursive",
            )  # fmt: skip
        self.active.add(pair)
        try:
            merged = self.merge_nodes(a, b)
        finally:
            self.active.discard(pair)
        self.done[pair] = (merged, a, b)
        return merged

    def merge_nodes(self, a_ref: Node, b_ref: Node) -> Schema:
        a, b = self.inline(a_ref), self.inline(b_ref)
        if isinstance(a, bool) or isinstance(b, bool):
            return self.merge(a, b)
        ca, cb = a.combinator(), b.combinator()
        if ca and cb:
            return self.product(a, ca, b, cb)
        if ca or cb:
            return self.distribute(a, ca, b) if ca else self.distribute(b, cb or "", a)
        return self.simple(a, b)

    def inline(self, node: Node) -> Schema:
        if "$ref" not in node.keywords:
            return node
        target = self.definition(node.keywords["$ref"])
        if target is None:
            raise self.problems.error(
                node.pointer_of("$ref"),
                "a recursive reference cannot be combined with other keywords (allOf, or "
                "keywords beside it)",
            )
        return target

    def distribute(self, node: Node, key: str, other: Node) -> Schema:
        branches = [self.merge(branch, other) for branch in node.keywords[key]]
        return combined(node, key, branches)

    def product(self, a: Node, ca: str, b: Node, cb: str) -> Schema:
        """Two combinators: every pair of branches (those that can hold, at most
        MAX_BRANCHES; pairs of disjoint enums, say, cannot)."""
        tried = len(a.keywords[ca]) * len(b.keywords[cb])
        out: Schema = False
        if tried <= MAX_BRANCHES**2:
            if ca == cb:
                pairs = [self.merge(x, y) for x in a.keywords[ca] for y in b.keywords[cb]]
                out = combined(a, ca, pairs)
            else:
                any_side, one_side = (a, b) if ca == "anyOf" else (b, a)
                out = self.distribute(any_side, "anyOf", one_side)
        kept = out.combinator() if isinstance(out, Node) else None
        many = isinstance(out, Node) and kept is not None and len(out.keywords[kept]) > MAX_BRANCHES
        if tried > MAX_BRANCHES**2 or many:
            self.problems.relax(
                b.at(cb), b.name_of(cb), f"combined with the {a.name_of(ca)!r} at "
                f"{a.pointer_of(ca)} it would make more than {MAX_BRANCHES} branches",
            )
            return a
        return out

    def simple(self, a: Node, b: Node) -> Schema:
        out = Node(dict(a.keywords), a.pointer, dict(a.where), dict(a.spelled))
        grouped: set[str] = set()
        for group, combine in ((_OBJECT_GROUP, self.objects), (_ARRAY_GROUP, self.arrays)):
            if any(k in b.keywords for k in group) and any(k in a.keywords for k in group):
                combine(out, a, b)
                grouped.update(group)
        for key, value in b.keywords.items():
            if key in grouped:
                continue
            if key not in out.keywords:
                out.take(b, key, value)
                continue
            merged = self.keyword(key, out.keywords[key], value, a, b)
            if merged is False:
                return False
            if merged is not None:
                out.keywords[key] = merged
        return out

    def keyword(self, key: str, x: Any, y: Any, a: Node, b: Node) -> Any:
        """The merged value of keyword `key` (x from a, y from b); False: nothing can match;
        None: keep x (a conflict, relaxed)."""
        if key == "type":
            return _intersect_types(x, y)
        if key == "enum":
            keys = {value_key(v) for v in y}
            return [v for v in x if value_key(v) in keys] or False
        if key in _LOWER:
            return max(x, y)
        if key in _UPPER:
            return min(x, y)
        if key == "required":
            return x + [n for n in y if n not in x]
        if key == "uniqueItems":
            return x or y
        if key == "multipleOf":
            return self.multiple_of(x, y, a, b)
        if key in ("propertyNames", "additionalProperties", "items"):
            return self.merge(x, y)
        if key == "not":
            return Node({"anyOf": [x, y]}, b.pointer)
        if key == "dependentRequired":
            return {n: x.get(n, []) + [m for m in y.get(n, []) if m not in x.get(n, [])]
                    for n in {**x, **y}}  # fmt: skip
        if key == "dependentSchemas":
            return {n: self.merge(x.get(n, True), y.get(n, True)) for n in {**x, **y}}
        if key in _EQUAL_ONLY and (x is y or value_key_safe(x) == value_key_safe(y)):
            return x
        return self.conflict(a, b, key)

    def multiple_of(self, x: Any, y: Any, a: Node, b: Node) -> Any:
        fx, fy = Fraction(str(x)), Fraction(str(y))
        if (fy / fx).denominator == 1:
            return y
        if (fx / fy).denominator == 1:
            return x
        if fx.denominator == fy.denominator == 1:
            return math.lcm(int(fx), int(fy))
        return self.conflict(a, b, "multipleOf")

    def conflict(self, a: Node, b: Node, key: str) -> None:
        self.problems.relax(
            b.at(key), b.name_of(key),
            f"cannot be combined with the {a.name_of(key)!r} at {a.pointer_of(key)} (allOf, and the "
            "keywords beside a $ref or anyOf/oneOf, are merged into one schema)",
        )

    def objects(self, out: Node, a: Node, b: Node) -> None:
        if "unevaluatedProperties" in a.keywords or "unevaluatedProperties" in b.keywords:
            key = next(k for k in _OBJECT_GROUP if k in b.keywords)
            self.conflict(a, b, key)
            for k in _OBJECT_GROUP:
                out.drop(k)
                if k in a.keywords:
                    out.take(a, k, a.keywords[k])
            return
        pa, pb = (x.keywords.get("patternProperties", {}) for x in (a, b))
        apa, apb = (x.keywords.get("additionalProperties", True) for x in (a, b))
        if pa and pb and not (is_true(apa) and is_true(apb)):
            self.conflict(a, b, "patternProperties")
            pb = {}
        names = list(a.keywords.get("properties", {}))
        names += [n for n in b.keywords.get("properties", {}) if n not in names]
        props = {n: self.merge(self.member(a, n), self.member(b, n)) for n in names}
        patterns = {p: self.merge(s, apb) for p, s in pa.items()}
        for p, s in pb.items():
            patterns[p] = self.merge(patterns.get(p, True), s if pa else self.merge(s, apa))
        rest = self.merge(apa, apb)
        maps: list[tuple[str, Any]] = [("properties", props), ("patternProperties", patterns)]
        for key, value in [*maps, ("additionalProperties", rest)]:
            owner = a if key in a.keywords else b
            out.drop(key)
            if value != {} and value is not True and not (isinstance(value, Node) and is_true(value)):
                out.take(owner, key, value)

    def member(self, node: Node, name: str) -> Schema:
        """What `node` requires of the value of property `name`, if present."""
        props = node.keywords.get("properties", {})
        patterns = node.keywords.get("patternProperties", {})
        out: Schema = props.get(name, True)
        matching = [s for p, s in patterns.items() if matches(p, name)]
        if name not in props and not matching:
            return node.keywords.get("additionalProperties", True)
        for schema in matching:
            out = self.merge(out, schema)
        return out

    def arrays(self, out: Node, a: Node, b: Node) -> None:
        if "unevaluatedItems" in a.keywords or "unevaluatedItems" in b.keywords:
            self.conflict(a, b, next(k for k in _ARRAY_GROUP if k in b.keywords))
            return
        pa, pb = (x.keywords.get("prefixItems", []) for x in (a, b))
        ia, ib = (x.keywords.get("items", True) for x in (a, b))
        prefix = [
            self.merge(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib)
            for i in range(max(len(pa), len(pb)))
        ]
        rest = self.merge(ia, ib)
        for key, value in (("prefixItems", prefix), ("items", rest)):
            owner = a if key in a.keywords else b
            out.drop(key)
            if value != [] and value is not True and not (isinstance(value, Node) and is_true(value)):
                out.take(owner, key, value)


def matches(pattern: str, name: str) -> bool:
    """Whether a patternProperties pattern matches a property name (search semantics, as
    ECMA-262 and Python agree on for the patterns schemas use; a pattern Python cannot read
    counts as matching, which can only over-constrain)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True


def combined(node: Node, key: str, branches: list[Schema]) -> Schema:
    """A combinator over `branches`, without those that match nothing."""
    live: list[Schema] = [b for b in branches if b is not False]
    if key == "anyOf":  # an anyOf branch that is an anyOf: its branches
        live = [x for b in live for x in (_branches(b) or [b])]
    if not live:
        return False
    if len(live) == 1:
        return live[0]
    if key == "anyOf" and any(is_true(b) for b in live):
        return True
    return Node({key: live}, node.pointer, {key: node.at(key)} if node.at(key) != node.pointer else {})


def _branches(schema: Schema) -> list[Schema] | None:
    if isinstance(schema, Node) and set(schema.keywords) == {"anyOf"}:
        return list(schema.keywords["anyOf"])
    return None


def _intersect_types(x: list[str], y: list[str]) -> list[str] | bool:
    def expand(types: list[str]) -> set[str]:
        return set(types) | ({"integer"} if "number" in types else set())

    both = expand(x) & expand(y)
    if "number" in both:
        both.discard("integer")
    return sorted(both) or False


def value_key_safe(value: Any) -> str:
    try:
        return value_key(value)
    except (TypeError, ValueError):
        return repr(id(value))
