"""Check a normalized schema (normalize.py, rewrites.py) against what one backend enforces.

Engines drop keywords they do not implement, which silently weakens the constraint. This
walk refuses every validation keyword a backend would not enforce (keywords.py), and the
combinations the engines handle only in part (each found by experiment, see the rule's
comment) - or, under `relaxed`, drops it and reports it. Annotations, unknown keywords and
unknown formats are not validation keywords: they never reach here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import keywords as kw
from .disjoint import branches_disjoint
from .formats import FORMAT_PATTERNS
from .numbers import bounds_regex
from .patterns import full_match, json_text_pattern, length_range, xgrammar_pattern
from .regex_check import RegexProblem, json_special_literal
from .rewrites import keep_only
from .schema_tree import FIELD, Node, Problems, Schema, SchemaError, to_json, walk

__all__ = ["FIELD", "SchemaError", "parse_schema"]
MAX_ENUM_RANGE = 64  # a bounded integer the engine cannot bound: its values as an enum
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_ ]*")
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def parse_schema(text: str, field: str = FIELD) -> Any:
    """JSON text -> schema (an object or a boolean)."""
    from mmserve.errors import InvalidArgument

    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, "nested too deeply") from None
    except ValueError as e:
        raise InvalidArgument(field, f"not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError("", "a schema must be a JSON object or a boolean", field)
    return schema


class Checker:
    """One pass over every node; rewrites what it can enforce another way in place."""

    def __init__(
        self, rules: kw.SchemaRules, problems: Problems, root: Schema, defs: dict[str, Schema]
    ) -> None:
        self.rules, self.problems = rules, problems
        self.root, self.defs = root, defs

    def run(self) -> None:
        for node in walk([self.root, *self.defs.values()]):
            self.node(node)

    def node(self, node: Node) -> None:
        if "oneOf" in node.keywords:
            self.one_of(node)
        self.numbers(node)
        self.counts(node)
        self.strings(node)
        self.objects(node)
        self.arrays(node)
        for key in [k for k in node.keywords if k != "type" and k not in self.rules.keywords]:
            if key in ("then", "else", "minContains", "maxContains"):
                node.drop(key)  # inert without "if" / "contains", which are reported
                continue
            self.problems.unenforced(
                node, key,
                f"keyword {node.name_of(key)!r} is not supported by the {self.rules.backend} backend (it "
                "would be ignored, not enforced); supported: " + ", ".join(sorted(self.rules.keywords)),
            )  # fmt: skip

    def resolve(self, schema: Schema) -> Schema:
        for _ in range(8):  # a chain of references, not a cycle
            if not (isinstance(schema, Node) and "$ref" in schema.keywords):
                break
            name = schema.keywords["$ref"]
            schema = self.root if name == "" else self.defs[name]
        return schema

    def one_of(self, node: Node) -> None:
        if branches_disjoint(node.keywords["oneOf"], self.resolve):
            return
        self.problems.relax(
            node.at("oneOf"), "oneOf",
            "branches must be provably disjoint (different types, different enum values, or "
            "objects that one branch's required property or a discriminator tells apart); "
            "otherwise use anyOf",
        )  # fmt: skip
        node.put("anyOf", node.keywords.pop("oneOf"), node.at("oneOf"))
        node.where.pop("oneOf", None)

    def numbers(self, node: Node) -> None:
        k = node.keywords
        present = [key for key in _NUMERIC if key in k]
        if not present:
            return
        unsupported = any(key not in self.rules.keywords for key in present)
        # xgrammar: "range + multipleOf combination not yet supported; ignoring multipleOf"
        mixed = "multipleOf" in k and len(present) > 1 and not self.rules.bounded_multiple_of
        if (unsupported or mixed) and _as_enum(node):
            return
        if self.rules.bounds_as_regex:
            self.bounds_as_regex(node)
        if "multipleOf" not in k or "multipleOf" not in self.rules.keywords:
            return  # unsupported keywords are reported with the others
        if node.types() != frozenset({"integer"}):
            # xgrammar: "multipleOf is not supported for type:number"
            self.problems.unenforced(node, "multipleOf", "only supported for integers")
        elif mixed:
            self.problems.unenforced(
                node, "multipleOf", "cannot be combined with minimum/maximum (unless they "
                f"leave at most {MAX_ENUM_RANGE} values)",
            )  # fmt: skip

    def bounds_as_regex(self, node: Node) -> None:
        types = node.types() or frozenset()
        bounds = [key for key in _NUMERIC[:4] if key in node.keywords]
        if not bounds or bounds_regex(node.keywords, "number" not in types) is not None:
            return
        for key in bounds:
            self.problems.unenforced(
                node, key, f"bounds that leave only fractions are not enforced by the "
                f"{self.rules.backend} backend (it writes numbers between whole bounds)",
            )  # fmt: skip

    def counts(self, node: Node) -> None:
        limit = self.rules.max_count
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            if limit is not None and node.keywords.get(key, 0) > limit:
                self.problems.unenforced(
                    node, key, f"over {limit} is not enforced by the {self.rules.backend} backend "
                    "(its automaton grows with the count); use the xgrammar backend",
                )  # fmt: skip

    def strings(self, node: Node) -> None:
        k = node.keywords
        fmt = k.get("format")
        # next to a pattern the engine enforces one of the two (xgrammar: the format)
        if fmt is not None and (fmt not in self.rules.formats or "pattern" in k):
            if fmt not in self.rules.pattern_formats or "pattern" in k:
                self.problems.unenforced(node, "format", self.format_message(fmt))
            else:
                whole = f"^(?:{FORMAT_PATTERNS[fmt]})$"  # the format's strings, not a search
                node.put("pattern", whole, node.at("format"))
                node.drop("format")
                self.lengths(node, whole, "format")
        if "pattern" in k:
            self.pattern(node)
        elif "format" in k and {"minLength", "maxLength"} & k.keys():
            for key in ("minLength", "maxLength"):  # xgrammar drops them next to a format
                if key in k:
                    self.problems.unenforced(node, key, "cannot be combined with 'format'")

    def format_message(self, fmt: str) -> str:
        supported = sorted(self.rules.formats | self.rules.pattern_formats)
        return (
            f"format {fmt!r} is not enforced by the {self.rules.backend} backend (or not next "
            f"to a pattern); supported: {', '.join(supported)}"
        )

    def pattern(self, node: Node) -> None:
        pattern = node.keywords["pattern"]
        try:
            body = full_match(pattern)
            text = json_text_pattern(pattern) if self.rules.raw_json_patterns else xgrammar_pattern(body)
        except RegexProblem as e:
            raise self.problems.error(node.pointer_of("pattern"), str(e)) from None
        special = None if self.rules.raw_json_patterns else json_special_literal(body)
        if special is not None:
            self.problems.unenforced(
                node, "pattern", f"it has {special!r} as a literal or class member, which the "
                f"{self.rules.backend} backend would write into the JSON text unescaped (invalid "
                "JSON); the outlines backend escapes it",
            )  # fmt: skip
            return
        self.lengths(node, pattern, "pattern")
        node.put("pattern", text, node.at("pattern"))

    def lengths(self, node: Node, pattern: str, source: str) -> None:
        """Engines enforce either a pattern or length bounds (xgrammar drops the bounds,
        outlines-core the pattern): the bounds must follow from the pattern."""
        width = length_range(pattern)
        for key in ("minLength", "maxLength"):
            if key not in node.keywords:
                continue
            bound = node.keywords[key]
            implied = width is not None and (
                width[0] >= bound if key == "minLength" else width[1] is not None and width[1] <= bound
            )
            if implied:
                node.drop(key)
            else:
                self.problems.unenforced(node, key, f"cannot be combined with {source!r}")

    def objects(self, node: Node) -> None:
        k = node.keywords
        if not self.rules.counts_members:
            self.outlines_objects(node)
        self.never_present(node)
        if "patternProperties" in k and "properties" in k:
            self.declared_patterns(node)
        if "propertyNames" in k and "properties" in k:
            self.declared_names(node)
        free = bool(k.get("patternProperties")) or k.get("additionalProperties", False) is not False
        if "minProperties" in k and free and k["minProperties"] > len(set(k.get("required", []))):
            self.problems.unenforced(
                node, "minProperties",
                "cannot be enforced when undeclared names are allowed (a repeated name would "
                "count twice); declare the properties and use required",
            )  # fmt: skip

    def outlines_objects(self, node: Node) -> None:
        k = node.keywords
        if "properties" in k:
            # outlines-core writes the declared properties only, whatever else is allowed
            for key in ("patternProperties", "additionalProperties", "propertyNames",
                        "unevaluatedProperties"):  # fmt: skip
                node.drop(key)
        elif k.get("patternProperties"):
            # written as an object of keys matching the pattern (outlines_schema.py): no
            # other names (a narrowing), one pattern (a name matching two would need both)
            node.drop("additionalProperties")
            try:
                ok = len(k["patternProperties"]) == 1 and bool(
                    [json_text_pattern(p) for p in k["patternProperties"]]
                )
            except RegexProblem:
                ok = False
            if not ok or {"minProperties", "maxProperties"} & k.keys():
                self.problems.unenforced(
                    node, "patternProperties", "only one pattern, without min/maxProperties, "
                    f"is enforced by the {self.rules.backend} backend",
                )  # fmt: skip
        elif k.get("additionalProperties") is False:
            node.drop("additionalProperties")
            node.put("properties", {})

    def never_present(self, node: Node) -> None:
        """Properties and patterns whose schema is false (the engines refuse `false`): such
        names must not appear. Undeclared, they do not, once nothing else lets them in: the
        engines write no undeclared name without additionalProperties or a matching
        pattern, so dropping those is a narrowing."""
        from .merge import matches

        k = node.keywords
        patterns = k.get("patternProperties", {})
        banned = [n for n, s in k.get("properties", {}).items() if s is False]
        if banned and k.get("additionalProperties", False) is not False:
            node.drop("additionalProperties")
        for pattern in list(patterns):
            if patterns[pattern] is False or any(matches(pattern, n) for n in banned):
                del patterns[pattern]
        for name in banned:
            del k["properties"][name]

    def declared_patterns(self, node: Node) -> None:
        """xgrammar checks a declared name against "properties" only, and may also write
        it as a name matching a pattern, with a value of the pattern's schema: fine when
        that schema is the property's own (rewrites.py merged the pattern's into it)."""
        from .merge import matches

        props, patterns = node.keywords["properties"], node.keywords["patternProperties"]
        for pattern, schema in list(patterns.items()):
            clash = [n for n in props if matches(pattern, n) and _json(props[n]) != _json(schema)]
            if not clash:
                continue
            if node.keywords.get("additionalProperties", False) is False:
                del patterns[pattern]  # a narrowing: no further names matching it
                continue
            self.problems.unenforced(
                node, "patternProperties",
                f"pattern {pattern!r} matches the declared property {clash[0]!r}, whose schema "
                "differs; it would not be enforced on it",
            )  # fmt: skip
            return

    def declared_names(self, node: Node) -> None:
        """xgrammar applies propertyNames to undeclared names only: a declared name it
        rules out can never be present."""
        import jsonschema

        schema = to_json(node.keywords["propertyNames"], self.defs)
        validator = jsonschema.Draft202012Validator(schema)
        props = node.keywords["properties"]
        for name in [n for n in props if not validator.is_valid(n)]:
            if name in node.keywords.get("required", []):
                raise self.problems.error(
                    node.pointer_of("required"),
                    f"required property {name!r} is ruled out by propertyNames",
                )
            del props[name]

    def arrays(self, node: Node) -> None:
        k = node.keywords
        if self.rules.raw_json_patterns and "enum" in k and not _plain_keys(k["enum"]):
            # outlines-core writes an object's keys into its regex unescaped
            self.problems.unenforced(node, "enum", "object keys must be letters, digits, _ or spaces")
        if self.rules.counts_members or "prefixItems" not in k:
            return
        # outlines-core writes exactly the prefixItems, ignoring items, minItems, maxItems
        size = len(k["prefixItems"])
        for key in ("minItems", "maxItems"):
            if key in k and (k[key] > size if key == "minItems" else k[key] < size):
                self.problems.unenforced(node, key, "with prefixItems, only their number of items")
        for key in ("items", "minItems", "maxItems", "unevaluatedItems"):
            node.drop(key)


def _as_enum(node: Node) -> bool:
    """A bounded integer with few values: those values, as an enum (exact)."""
    k = node.keywords
    low, high = k.get("minimum"), k.get("maximum")
    if node.types() != frozenset({"integer"}) or low is None or high is None:
        return False
    step = k.get("multipleOf", 1)
    if not float(step).is_integer() or high - low > MAX_ENUM_RANGE * step:
        return False
    step = int(step)
    values = [v for v in range(int(low), int(high) + 1) if v % step == 0]
    node.put("enum", values, node.at("minimum"), node.name_of("minimum"))
    keep_only(node, "enum", values)
    return True


def _plain_keys(value: Any) -> bool:
    if isinstance(value, list):
        return all(_plain_keys(v) for v in value)
    if isinstance(value, dict):
        return all(_PLAIN_KEY.fullmatch(k) and _plain_keys(v) for k, v in value.items())
    return True


def _json(schema: Schema) -> str:
    return json.dumps(to_json(schema), sort_keys=True)
