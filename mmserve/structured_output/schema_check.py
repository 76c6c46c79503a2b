"""Walk a JSON schema and reject what a backend would not enforce, with a JSON pointer.

Grammar engines drop schema keywords they do not implement, which silently weakens the
constraint. This walk is an allow-list (keywords.py), plus the combinations that xgrammar
accepts but handles only in part (each found by experiment, see the rule's comment).
Limits: MAX_SCHEMA_DEPTH nested subschemas, MAX_SCHEMA_NODES subschemas in all; the text
size is bounded by params.MAX_SCHEMA_BYTES before parsing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mmserve.errors import InvalidArgument

from . import keywords as kw
from .disjoint import branches_disjoint
from .refs import find_recursive_ref, pointer_join, resolve_local_ref
from .regex_check import RegexProblem, check_json_string_pattern, strip_anchors

MAX_SCHEMA_DEPTH = 32  # nesting of subschemas (a $ref counts once, where it is written)
MAX_SCHEMA_NODES = 4096  # subschemas in the whole document, $defs included
FIELD = "structured.json_schema"


class SchemaError(InvalidArgument):
    """A schema problem at `pointer` (RFC 6901 JSON pointer, "" = the root)."""

    def __init__(self, pointer: str, message: str, field: str = FIELD) -> None:
        super().__init__(field, f"at {pointer or '/'}: {message}")
        self.pointer = pointer


def parse_schema(text: str, field: str = FIELD) -> Any:
    """JSON text -> schema (an object or a boolean)."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, "nested too deeply") from None
    except ValueError as e:
        raise InvalidArgument(field, f"not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError("", "a schema must be a JSON object or a boolean", field)
    return schema


def check_schema(schema: Any, rules: kw.SchemaRules, field: str = FIELD) -> None:
    """Raise SchemaError at the first part of `schema` that `rules` does not enforce."""
    _Walk(schema, rules, field).node(schema, "", 0)
    recursive = None if rules.recursive_refs else find_recursive_ref(schema)
    if recursive is not None:
        raise SchemaError(
            recursive,
            f"a recursive reference; the {rules.backend} backend would unroll it only a few "
            "levels and not enforce the schema below them; use the xgrammar backend",
            field,
        )


class _Walk:
    def __init__(self, root: Any, rules: kw.SchemaRules, field: str) -> None:
        self.root, self.rules, self.field = root, rules, field
        self.nodes = 0

    def fail(self, pointer: str, message: str) -> SchemaError:
        return SchemaError(pointer, message, self.field)

    def node(
        self, schema: Any, ptr: str, depth: int, implied: frozenset[str] = frozenset()
    ) -> None:
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise self.fail(ptr, f"more than {MAX_SCHEMA_NODES} subschemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise self.fail(ptr, f"subschemas nested deeper than {MAX_SCHEMA_DEPTH}")
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            raise self.fail(ptr, "a schema must be a JSON object or a boolean")
        for key in schema:
            self.keyword_allowed(key, ptr)
        types = self.types(schema, ptr) or implied
        self.check_siblings(schema, ptr, types)
        self.check_values(schema, ptr, types)
        self.check_combinators(schema, ptr)
        self.check_strings(schema, ptr)
        self.check_numbers(schema, ptr, types)
        self.check_objects(schema, ptr)
        self.check_property_sets(schema, ptr)
        self.children(schema, ptr, depth)

    def keyword_allowed(self, key: str, ptr: str) -> None:
        if key in kw.ANNOTATIONS or key.startswith("x-") or key in kw.DEFINITIONS:
            return
        if key in kw.ROOT_ONLY:
            if ptr:
                raise self.fail(pointer_join(ptr, key), f"{key!r} is only allowed at the root")
            return
        if key != "type" and key not in self.rules.keywords:
            raise self.fail(
                pointer_join(ptr, key),
                f"keyword {key!r} is not supported by the {self.rules.backend} backend "
                "(it would be ignored, not enforced); supported: "
                + ", ".join(sorted(self.rules.keywords)),
            )

    def types(self, schema: dict[str, Any], ptr: str) -> frozenset[str]:
        t = schema.get("type")
        names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        valid = names and all(isinstance(n, str) and n in kw.JSON_TYPES for n in names)
        if t is not None and not valid:
            raise self.fail(pointer_join(ptr, "type"), f"must be one of {sorted(kw.JSON_TYPES)}")
        return frozenset(names or ())

    def check_siblings(self, schema: dict[str, Any], ptr: str, types: frozenset[str]) -> None:
        # xgrammar enforces enum/const alone (keywords beside them but "type" are dropped) and
        # a combinator alone (keywords beside anyOf/oneOf/allOf/$ref, "type" included, are
        # dropped): refuse both.
        validating = [k for k in schema if _validates(k) or k == "type"]
        for lead in ("enum", "const", "anyOf", "oneOf", "allOf", "$ref"):
            if lead in schema:
                allowed = {lead, "type"} if lead in kw.VALUE_KEYWORDS else {lead}
                extra = next((k for k in validating if k not in allowed), None)
                if extra is not None:
                    raise self.fail(
                        pointer_join(ptr, extra),
                        f"{extra!r} next to {lead!r} is not enforced; move it into the "
                        f"{lead!r} branches or drop it",
                    )
        untyped = [k for k in validating if k in kw.KEYWORD_TYPE] if not types else []
        if untyped:
            needed = kw.KEYWORD_TYPE[untyped[0]]
            raise self.fail(
                pointer_join(ptr, untyped[0]),
                f'{untyped[0]!r} needs "type": {json.dumps(needed)} beside it',
            )

    def check_values(self, schema: dict[str, Any], ptr: str, types: frozenset[str]) -> None:
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.fail(pointer_join(ptr, "enum"), "must be a non-empty array")
            for i, value in enumerate(values):
                self.value_has_type(value, types, pointer_join(pointer_join(ptr, "enum"), i))
        if "const" in schema:
            self.value_has_type(schema["const"], types, pointer_join(ptr, "const"))

    def value_has_type(self, value: Any, types: frozenset[str], ptr: str) -> None:
        # xgrammar would generate an enum value of the wrong type: refuse instead.
        if types and not types & _json_types(value):
            raise self.fail(ptr, f"{json.dumps(value)} is not of type {sorted(types)}")

    def check_combinators(self, schema: dict[str, Any], ptr: str) -> None:
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema and (not isinstance(schema[key], list) or not schema[key]):
                raise self.fail(pointer_join(ptr, key), "must be a non-empty array")
        if len(schema.get("allOf", ())) > 1:  # xgrammar: "support ... is still ongoing"
            raise self.fail(pointer_join(ptr, "allOf"), "only one subschema is supported")
        if "oneOf" in schema and not self.disjoint(schema["oneOf"]):
            raise self.fail(
                pointer_join(ptr, "oneOf"),
                "branches must be provably disjoint (different types, or objects with a "
                "required property whose const values differ); otherwise use anyOf",
            )
        if "$ref" in schema:
            self.resolve(schema["$ref"], pointer_join(ptr, "$ref"))

    def check_strings(self, schema: dict[str, Any], ptr: str) -> None:
        # xgrammar drops minLength/maxLength next to pattern or format, and pattern next to
        # format.
        shaped = [k for k in ("format", "pattern") if k in schema]
        for key in ("pattern", "minLength", "maxLength"):
            if key in schema and shaped and shaped[0] != key:
                raise self.fail(pointer_join(ptr, key), f"cannot be combined with {shaped[0]!r}")
        fmt = schema.get("format")
        if fmt is not None and fmt not in self.rules.formats:
            hint = kw.FORMAT_HINTS.get(fmt) if isinstance(fmt, str) else None
            raise self.fail(
                pointer_join(ptr, "format"),
                f"format {fmt!r} is not enforced exactly by the {self.rules.backend} backend; "
                f"supported: {', '.join(sorted(self.rules.formats))}"
                + (
                    f'; an approximation you may use instead: "pattern": {json.dumps(hint)}'
                    if hint
                    else ""
                ),
            )
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise self.fail(pointer_join(ptr, "pattern"), "must be a string")
            try:
                strip_anchors(pattern)
                if self.rules.raw_json_patterns:
                    check_json_string_pattern(pattern)
            except RegexProblem as e:
                raise self.fail(pointer_join(ptr, "pattern"), str(e)) from None

    def check_numbers(self, schema: dict[str, Any], ptr: str, types: frozenset[str]) -> None:
        if "multipleOf" not in schema:
            return
        # xgrammar: "multipleOf is not supported for type:number", and "range + multipleOf
        # combination not yet supported; ignoring multipleOf".
        if "number" in types:
            raise self.fail(pointer_join(ptr, "multipleOf"), "only supported for integers")
        if kw.NUMERIC_BOUNDS & schema.keys():
            raise self.fail(
                pointer_join(ptr, "multipleOf"), "cannot be combined with minimum/maximum"
            )

    def check_objects(self, schema: dict[str, Any], ptr: str) -> None:
        if isinstance(schema.get("items"), list):
            raise self.fail(pointer_join(ptr, "items"), "an array of schemas: use prefixItems")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(pointer_join(ptr, "required"), "must be an array of strings")
        # Both engines enforce "required" only for names declared in "properties" (a name
        # left to additionalProperties / patternProperties may be missing, or worse).
        properties = schema.get("properties", {})
        for i, name in enumerate(required):
            if not isinstance(properties, dict) or name not in properties:
                raise self.fail(
                    pointer_join(pointer_join(ptr, "required"), i),
                    f"required property {name!r} must be declared in properties",
                )

    def check_property_sets(self, schema: dict[str, Any], ptr: str) -> None:
        # Found by experiment with xgrammar 0.2.9 (outlines-core has none of these keywords):
        # a declared property is checked against "properties" only, never against a
        # matching patternProperties pattern or propertyNames; and a repeated key (which
        # the grammar cannot rule out among free-form names) counts twice for minProperties.
        properties, patterns = schema.get("properties"), schema.get("patternProperties")
        names = list(properties) if isinstance(properties, dict) else []
        for pattern in patterns if isinstance(patterns, dict) and names else ():
            if any(_may_match(pattern, name) for name in names):
                raise self.fail(
                    pointer_join(pointer_join(ptr, "patternProperties"), pattern),
                    "matches a name declared in properties, where it would not be enforced",
                )
        if names and "propertyNames" in schema:
            raise self.fail(
                pointer_join(ptr, "propertyNames"),
                "is not enforced for the names declared in properties; use it without them",
            )
        extra = [schema.get(k, False) for k in ("additionalProperties", "unevaluatedProperties")]
        if "minProperties" in schema and (
            any(e is not False for e in extra) or "patternProperties" in schema
        ):
            raise self.fail(
                pointer_join(ptr, "minProperties"),
                "cannot be enforced when undeclared names are allowed (a repeated name would "
                "count twice); declare the properties and use required",
            )

    def children(self, schema: dict[str, Any], ptr: str, depth: int) -> None:
        for key, value in schema.items():
            here = pointer_join(ptr, key)
            if key in kw.SCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise self.fail(here, "must be an object of schemas")
                for name, sub in value.items():
                    self.node(sub, pointer_join(here, name), depth + 1)
            elif key in kw.SCHEMA_LISTS:
                if not isinstance(value, list):
                    raise self.fail(here, "must be an array of schemas")
                for i, sub in enumerate(value):
                    self.node(sub, pointer_join(here, i), depth + 1)
            elif key in kw.SCHEMA_VALUES:
                # Property names are strings whether or not the subschema says so.
                implied = frozenset({"string"}) if key == "propertyNames" else frozenset()
                self.node(value, here, depth + 1, implied)

    def resolve(self, ref: Any, ptr: str) -> Any:
        """The schema a local $ref points to (only "#" and "#/..." are supported)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.fail(ptr, 'only local references ("#" or "#/...") are supported')
        resolved = resolve_local_ref(self.root, ref)
        if resolved is None:
            raise self.fail(ptr, f"reference {ref!r} does not resolve")
        return resolved[1]

    def disjoint(self, branches: Any) -> bool:
        if not isinstance(branches, list):
            return True  # reported by check_combinators
        resolved = [self.follow_refs(b) for b in branches]
        return branches_disjoint(resolved)

    def follow_refs(self, schema: Any) -> Any:
        for _ in range(8):  # a chain of references, not a cycle
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                break
            schema = self.resolve(schema["$ref"], "")
        return schema


def _validates(key: str) -> bool:
    return not (
        key in kw.ANNOTATIONS or key in kw.ROOT_ONLY or key in kw.DEFINITIONS
        or key.startswith("x-") or key == "type"
    )  # fmt: skip


def _may_match(pattern: str, name: str) -> bool:
    """Whether an ECMA-262 pattern may match `name` (Python's re is close enough; a pattern
    it cannot read counts as a match, which errs on the side of refusing)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True


def _json_types(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number", "integer"} if value.is_integer() else {"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array"} if isinstance(value, list) else {"object"})
