"""Exact rewrites of a normalized schema (normalize.py), so that fewer keywords reach an
engine that would drop them: what an enum's values leave, what a "type" rules out, what a
keyword already implies.

- enum next to other keywords: the values that validate against them (jsonschema) - engines
  enforce an enum alone. uniqueItems over a small finite set of items: the arrays of
  distinct items, in the enum's order, as an enum.
- keywords of a type that "type" excludes: dropped (they constrain nothing).
- integer bounds: whole numbers (minimum 1.5 -> 2); multipleOf an integer on a number: an
  integer; a required or declared property: its schema includes the patternProperties that
  match its name (or additionalProperties, for an undeclared required name).
- minLength / maxLength implied by a pattern's length (every engine matches the whole
  string), min/maxProperties implied by required and declared names (engines never add
  undeclared names unless additionalProperties or patternProperties allow them).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

from . import keywords as kw
from .merge import Merger, combined
from .patterns import length_range, whole_string, with_length
from .regex_check import RegexProblem
from .schema_tree import Node, Schema, children, map_subschemas, to_json

MAX_UNIQUE_ARRAYS = 64  # arrays a uniqueItems enum may list
_JSON_TYPES_OF = {bool: "boolean", str: "string", list: "array", dict: "object"}


def simplify(root: Schema, defs: dict[str, Schema], merger: Merger) -> tuple[Schema, dict[str, Schema]]:
    """The rewritten root and definitions (nodes are rewritten in place where they stay
    nodes; a node that can match nothing becomes False, and so does a reference to it).
    `defs` may grow meanwhile (merges make definitions for pairs of them)."""
    empty: set[str] = set()
    while True:
        s = _Simplifier(defs, merger, empty)
        root = s.visit(root)
        out: dict[str, Schema] = {}
        if isinstance(root, Node) and root.keywords.get("$ref") in empty:
            root = False
        while pending := [name for name in list(defs) if name not in out]:
            out.update((name, s.visit(defs[name])) for name in pending)
        defs.update(out)
        found = {name for name, sub in out.items() if sub is False}
        if found <= empty:
            return root, out
        empty |= found  # references to them are false too: once more


class _Simplifier:
    def __init__(self, defs: dict[str, Schema], merger: Merger, empty: set[str]) -> None:
        self.merger = merger
        self.defs = defs
        self.empty = empty  # definitions that match nothing
        self.done: dict[int, Schema] = {}  # node id -> its rewrite
        # every node whose id is in `done`, held: a freed node's id goes to a new one (the
        # merges of members() make nodes), which would pass for done
        self.held: list[Node] = []
        self._defs_json: Any = None

    def visit(self, schema: Schema) -> Schema:
        """The rewritten schema; children first (iteratively: merged definitions nest
        deeply)."""
        if isinstance(schema, bool) or id(schema) in self.done:
            return schema if isinstance(schema, bool) else self.done[id(schema)]
        stack: list[tuple[Node, bool]] = [(schema, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                self._replace_children(node)
                self.done[id(node)] = self.node(node)
                continue
            if id(node) in self.done:
                continue
            self.done[id(node)] = node  # provisional: a node is never its own descendant
            self.held.append(node)
            stack.append((node, True))
            stack.extend((sub, False) for _, sub in children(node)
                         if isinstance(sub, Node) and id(sub) not in self.done)  # fmt: skip
        return self.done[id(schema)]

    def _replace_children(self, node: Node) -> None:
        done = self.done

        def new(sub: Schema) -> Schema:
            if isinstance(sub, bool) or sub.keywords.get("$ref") in self.empty:
                return sub if isinstance(sub, bool) else False
            return done.get(id(sub), sub)

        node.keywords = map_subschemas(node.keywords, new)

    def node(self, node: Node) -> Schema:
        combinator = node.combinator()
        if combinator is not None:
            return combined(node, combinator, node.keywords[combinator])
        negated = node.keywords.get("not")
        if negated is True or (isinstance(negated, Node) and not negated.keywords):
            return False
        if negated is False:
            node.drop("not")
        _drop_other_types(node)
        self.members(node)
        if _integers(node) is False or _unsatisfiable(node):
            return False
        _unique_items(node)
        if "enum" in node.keywords and self.filter_enum(node) is False:
            return False
        _implied_counts(node)
        _implied_lengths(node)
        return node

    def members(self, node: Node) -> None:
        """Required and declared properties: their schema includes what else applies to
        their name (patternProperties, or additionalProperties for an undeclared one)."""
        k = node.keywords
        declared = k.get("properties", {})
        names = list(declared) + [n for n in k.get("required", []) if n not in declared]
        if not names or not (k.get("patternProperties") or len(names) > len(declared)):
            return
        members = {n: self.visit(self.merger.member(node, n)) for n in names}
        node.put("properties", members, node.at("properties") if declared else node.at("required"))

    def filter_enum(self, node: Node) -> Schema:
        """Keeps the enum values that validate against the node's other keywords, which
        then go (the values say it all)."""
        values = node.keywords["enum"]
        rest = {k: v for k, v in node.keywords.items() if k != "enum"}
        if set(rest) <= {"type"}:
            types = node.types()
            kept = [v for v in values if types is None or _json_types(v) & types]
        else:
            kept = self.validating(values, Node(rest, node.pointer, node.where))
        if not kept:
            return False
        keep_only(node, "enum", kept)
        return node

    def validating(self, values: list[Any], rest: Node) -> list[Any]:
        import jsonschema

        schema = to_json(rest)
        text = repr(schema)
        if "'#'" in text:  # a reference to the root: keep them all, the check decides
            return values
        if "#/$defs/" in text:
            if self._defs_json is None:
                self._defs_json = {name: to_json(sub) for name, sub in self.defs.items()}
            schema = {**schema, "$defs": self._defs_json}
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        return [v for v in values if validator.is_valid(v)]


def keep_only(node: Node, key: str, value: Any) -> None:
    """The node as just `key` (with its place and spelling), set to `value`."""
    at, spelled = node.at(key), node.spelled.get(key)
    node.keywords, node.where, node.spelled = {}, {}, {}
    node.put(key, value, at, spelled)


def _unsatisfiable(node: Node) -> bool:
    """Bounds no value meets, and required properties no value can have."""
    k = node.keywords
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"),
                      ("minProperties", "maxProperties"), ("minimum", "maximum")):  # fmt: skip
        if low in k and high in k and k[low] > k[high]:
            return True
    if k.get("items") is False and k.get("minItems", 0) > len(k.get("prefixItems", [])):
        return True
    props = k.get("properties", {})
    return any(props.get(name) is False for name in k.get("required", []))


def _drop_other_types(node: Node) -> None:
    types = node.types()
    if types is None:
        return
    families = {"number" if t == "integer" else t for t in types}
    for key in [k for k in node.keywords if kw.KEYWORD_TYPE.get(k, "") not in families | {""}]:
        node.drop(key)


def _integers(node: Node) -> bool | None:
    """Whole-number bounds for integers; False when no integer is in range."""
    k = node.keywords
    if node.types() == frozenset({"number"}) and _whole(k.get("multipleOf")):
        k["type"] = ["integer"]
    if node.types() != frozenset({"integer"}):
        return None
    low = _bound(k, "minimum", "exclusiveMinimum", math.ceil, 1)
    high = _bound(k, "maximum", "exclusiveMaximum", math.floor, -1)
    for key, value in (("minimum", low), ("maximum", high)):
        if value is not None:
            at = node.at(key) if key in k else node.at("exclusive" + key.capitalize())
            node.drop("exclusive" + key.capitalize())
            node.put(key, value, at)
    return False if low is not None and high is not None and low > high else None


def _bound(k: dict[str, Any], inclusive: str, exclusive: str, rounding: Any, step: int) -> int | None:
    found = []
    if inclusive in k:
        found.append(int(rounding(k[inclusive])))
    if exclusive in k:
        x = k[exclusive]
        found.append(int(x) + step if float(x).is_integer() else int(rounding(x)))
    if not found:
        return None
    return max(found) if step > 0 else min(found)


def _whole(value: Any) -> bool:
    return isinstance(value, (int, float)) and float(value).is_integer()


def _unique_items(node: Node) -> None:
    k = node.keywords
    if not k.get("uniqueItems"):
        return
    if k.get("maxItems", 2) <= 1:
        node.drop("uniqueItems")
        return
    items = k.get("items", True)
    values = _finite_values(items)
    if values is None or "prefixItems" in k:
        return
    low, high = k.get("minItems", 0), min(k.get("maxItems", len(values)), len(values))
    sizes = range(low, high + 1)
    if sum(math.comb(len(values), n) for n in sizes) > MAX_UNIQUE_ARRAYS:
        return
    arrays = [list(c) for n in sizes for c in itertools.combinations(values, n)]
    node.put("enum", arrays, node.at("uniqueItems"))


def _finite_values(items: Schema) -> list[Any] | None:
    if not isinstance(items, Node):
        return None
    if set(items.keywords) == {"enum"}:
        return list(items.keywords["enum"])
    types = items.types()
    if types is not None and set(items.keywords) == {"type"} and types <= {"boolean", "null"}:
        return ([False, True] if "boolean" in types else []) + ([None] if "null" in types else [])
    return None


def _implied_counts(node: Node) -> None:
    k = node.keywords
    # the engines write no undeclared name next to declared ones unless allowed explicitly
    closed = "properties" in k and not k.get("patternProperties") and not _allows(
        k.get("additionalProperties", False)
    )
    if "minProperties" in k and k["minProperties"] <= len(set(k.get("required", []))):
        node.drop("minProperties")
    if "maxProperties" in k and closed and k["maxProperties"] >= len(k.get("properties", {})):
        node.drop("maxProperties")
    prefix, rest = k.get("prefixItems"), k.get("items", True)
    if prefix is not None and rest is False:
        if k.get("minItems", 0) <= len(prefix):
            node.drop("minItems")
        if k.get("maxItems", len(prefix)) >= len(prefix):
            node.drop("maxItems")


def _allows(schema: Schema) -> bool:
    return schema is not False


def _implied_lengths(node: Node) -> None:
    k = node.keywords
    pattern = k.get("pattern")
    if not isinstance(pattern, str) or not ({"minLength", "maxLength"} & k.keys()):
        return
    low, high = k.get("minLength", 0), k.get("maxLength")
    try:  # the pattern as JSON Schema reads it, else narrowed to its whole-string matches
        forms = [pattern, whole_string(pattern)]
    except RegexProblem:
        return  # the checker names the problem
    for form in forms:
        width = length_range(form)
        if width is not None and low <= width[0] and (high is None or (width[1] is not None and width[1] <= high)):
            if form != pattern:
                node.put("pattern", form, node.at("pattern"))
            node.drop("minLength")
            node.drop("maxLength")
            return
        narrowed = with_length(form, low, high)
        if narrowed is not None:
            node.put("pattern", narrowed, node.at("pattern"))
            node.drop("minLength")
            node.drop("maxLength")
            return


def _json_types(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number", "integer"} if value.is_integer() else {"number"})
    return frozenset({_JSON_TYPES_OF.get(type(value), "object")})


def narrow_types(nodes: Iterable[Node]) -> None:
    """A node without "type" gets the types its keywords constrain: {"minLength": 1} is
    {"type": "string", "minLength": 1}. A narrowing (it accepts fewer values), so sound - but
    not inside oneOf branches before their disjointness is proven (disjoint.py ignores types
    set here) nor inside "not" (never enforced)."""
    for node in nodes:
        k = node.keywords
        if "type" in k or "enum" in k or "$ref" in k or node.combinator() is not None:
            continue
        families = {kw.KEYWORD_TYPE[key] for key in k if key in kw.KEYWORD_TYPE}
        if not families:
            continue
        if families == {"number"} and _whole(k.get("multipleOf")):
            families = {"integer"}  # the multiples of a whole number are integers
        node.put("type", sorted(families))
        node.inferred_type = True
