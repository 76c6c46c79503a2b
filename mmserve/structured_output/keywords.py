"""Which JSON Schema keywords each backend enforces (data only; schema_check walks it).

Found by experiment (xgrammar 0.2.9, outlines-core 0.2.14): for each keyword, a schema and
an instance that violates it; a keyword is listed only if the backend's grammar rejects the
violating instance. Keywords a backend accepts but does not enforce (xgrammar: uniqueItems,
contains, if/then/else, not, dependentRequired...; outlines-core: minimum, maximum,
multipleOf, patternProperties, maxProperties...) are *not* listed, so schemas using them are
rejected instead of weakened. tests/structured_output/test_keyword_rules.py re-runs the
experiment, so a backend upgrade that changes behaviour fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})

# Keywords that never constrain a value: free for every backend.
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "deprecated",
        "readOnly", "writeOnly",
        "discriminator",  # OpenAPI / pydantic hint; the oneOf it annotates is what is checked
    }
)  # fmt: skip
ROOT_ONLY = frozenset({"$schema", "$id"})  # a nested $id would change what $ref resolves to
DEFINITIONS = frozenset({"$defs", "definitions"})

# Keywords that only constrain values of one JSON type, by that type.
TYPE_KEYWORDS = {
    "number": frozenset(
        {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    ),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "object": frozenset(
        {
            "properties", "required", "additionalProperties", "patternProperties",
            "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
        }
    ),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"}),
}  # fmt: skip
KEYWORD_TYPE = {kw: t for t, kws in TYPE_KEYWORDS.items() for kw in kws}
VALUE_KEYWORDS = frozenset({"enum", "const"})
COMBINATORS = frozenset({"anyOf", "oneOf", "allOf", "$ref"})
NUMERIC_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})

# Where subschemas sit, by the shape of the keyword's value.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
SCHEMA_VALUES = frozenset(
    {"items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
)


@dataclass(frozen=True)
class SchemaRules:
    """What one backend enforces. Anything else in a schema is rejected."""

    backend: str
    keywords: frozenset[str]  # validation keywords enforced (besides "type", $defs, annotations)
    formats: frozenset[str]  # values of "format" enforced
    # The engine matches a pattern against the raw JSON text between the quotes, so a
    # pattern that can match `"`, `\` or a control character yields invalid JSON.
    raw_json_patterns: bool = False
    # The engine enforces a recursive $ref at every depth (a context-free grammar); a regex
    # engine unrolls it a few levels and drops the rest (refs.py), so it must refuse it.
    recursive_refs: bool = True


XGRAMMAR_RULES = SchemaRules(
    backend="xgrammar",
    # oneOf only with provably disjoint branches (else xgrammar falls back to anyOf);
    # multipleOf only for integers without bounds (else ignored); see schema_check.
    keywords=frozenset(
        {
            "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
            "minLength", "maxLength", "pattern", "format",
            "properties", "required", "additionalProperties", "patternProperties",
            "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
            "items", "prefixItems", "minItems", "maxItems", "unevaluatedItems",
        }
    ),
    # Checked against jsonschema[format] on random walks. Refused because only approximated:
    # date, date-time, time (2023-02-31, a leap second at any minute), ipv4 (leading zeros),
    # hostname (labels over 63 characters); see FORMAT_HINTS.
    formats=frozenset(
        {
            "email", "ipv6", "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
            "relative-json-pointer", "duration",
        }
    ),
)  # fmt: skip

OUTLINES_RULES = SchemaRules(
    backend="outlines",
    keywords=frozenset(
        {
            "enum", "const", "anyOf", "allOf", "$ref",
            "minLength", "maxLength", "pattern", "format",
            "properties", "required", "additionalProperties",
            "items", "prefixItems", "minItems", "maxItems",
        }
    ),
    # outlines-core's other format regexes can produce invalid JSON (email, uri: raw `"`;
    # time: a raw backslash) or invalid values (date: Unicode digits; date-time: no offset).
    formats=frozenset({"uuid"}),
    raw_json_patterns=True,
    recursive_refs=False,
)  # fmt: skip

# For formats a backend only approximates: a pattern with the same approximation, which a
# schema can use instead to accept it explicitly (quoted in the rejection message).
FORMAT_HINTS = {
    "date": "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
    "time": "^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
    "ipv4": "^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$",
}
