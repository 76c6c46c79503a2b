"""Which JSON Schema keywords exist, and which each backend enforces (data only).

A schema keyword is one of three kinds:
- a validation keyword of some draft (VALIDATION): it constrains values, so a backend that
  does not enforce it must refuse the schema (or, under `relaxed`, drop it and say so);
- an identifier ($id, draft-04 `id`, $schema, $anchor, ...) or the definitions container;
- anything else: annotations (title, description, examples, readOnly, ...), vendor
  extensions (x-..., javaType, _format) and typos. Validators ignore these, and so do we.

The backends' lists were found by experiment (xgrammar 0.2.9, outlines-core 0.2.14): for each
keyword a schema and an instance that violates it; a keyword is listed only if the grammar
rejects the violating instance, on the schemas as normalize.py hands them over (combinators
alone, types explicit). tests/structured_output/test_keyword_rules.py re-runs the experiment,
and the random walks of test_real_schemas.py check whole real-world schemas.
"""

from __future__ import annotations

from dataclasses import dataclass

JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})

# Keywords that only constrain values of one JSON type, by that type ("number" covers
# integers). A node without "type" is narrowed to the types its keywords constrain.
TYPE_KEYWORDS = {
    "number": frozenset(
        {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    ),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),  # known formats
    "object": frozenset(
        {
            "properties", "required", "additionalProperties", "patternProperties",
            "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
            "dependentRequired", "dependentSchemas", "dependencies",
        }
    ),
    "array": frozenset(
        {
            "items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems",
            "contains", "minContains", "maxContains",
        }
    ),
}  # fmt: skip
KEYWORD_TYPE = {kw: t for t, kws in TYPE_KEYWORDS.items() for kw in kws}

# Every validation keyword of drafts 3 to 2020-12 (normalize.py rewrites the old spellings).
VALIDATION = frozenset(
    {
        "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
        "$ref", "$dynamicRef", "$recursiveRef", "format",
        "additionalItems", "disallow", "extends", "divisibleBy",  # drafts 3 and 4
        *KEYWORD_TYPE,
    }
)  # fmt: skip
IDENTIFIERS = frozenset(
    {"$id", "id", "$schema", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary"}
)
DEFINITIONS = frozenset({"$defs", "definitions"})

# The formats the drafts define. Any other "format" value is an annotation (validators
# ignore it: "int32", "double", "url", ...), so it is accepted and ignored.
KNOWN_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference",
        "uuid", "uri-template", "json-pointer", "relative-json-pointer", "regex",
        "color", "host-name", "ip-address", "utc-millisec",  # draft 3
    }
)  # fmt: skip
# Formats enforced as another one whose values are all valid for them: a URI is an IRI, an
# email address an internationalised one; and the draft 3 spellings.
FORMAT_ALIASES = {
    "iri": "uri", "iri-reference": "uri-reference", "idn-email": "email",
    "host-name": "hostname", "ip-address": "ipv4",
}  # fmt: skip

# Where subschemas sit, by the shape of the keyword's value.
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
SCHEMA_VALUES = frozenset(
    {
        "items", "additionalProperties", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "not", "if", "then", "else", "contains", "additionalItems",
    }
)  # fmt: skip
COMBINATORS = frozenset({"anyOf", "oneOf"})


@dataclass(frozen=True)
class SchemaRules:
    """What one backend enforces (of VALIDATION; anything else in a normalized schema is
    refused, or dropped and reported under `relaxed`)."""

    backend: str
    keywords: frozenset[str]  # validation keywords enforced (besides "type")
    formats: frozenset[str]  # "format" values the engine enforces itself
    # formats enforced as a pattern from formats.py instead (exact where the engine's own
    # regex is not)
    pattern_formats: frozenset[str]
    # The engine matches a pattern against the raw JSON text between the quotes, so
    # patterns are translated to the JSON text (patterns.py) before it sees them.
    raw_json_patterns: bool = False
    # The engine resolves references itself, recursive ones at every depth (a context-free
    # grammar). A regex engine gets them written out, recursion cut (outlines_schema.py).
    recursive_refs: bool = True
    # Numeric bounds next to multipleOf are enforced (xgrammar ignores multipleOf then).
    bounded_multiple_of: bool = False
    # min/maxProperties, and items/min/maxItems next to prefixItems, are enforced.
    counts_members: bool = True
    # Numeric bounds are enforced by a regex from numbers.py (whole-number bounds only).
    bounds_as_regex: bool = False
    # The largest minLength / maxLength / minItems / maxItems enforced (a regex automaton
    # grows with the count: maxLength 32767 took outlines-core six minutes); None: any.
    max_count: int | None = None
    # An enum's object and array values take the whitespace allowed between JSON tokens
    # elsewhere. False (xgrammar): the engine writes them as fixed compact text, so they
    # are spelled out as schemas (literals.py).
    spaced_literals: bool = True


_SHARED = frozenset(
    {
        "enum", "const", "anyOf", "oneOf", "$ref",
        "minLength", "maxLength", "pattern", "format",
        "properties", "required", "additionalProperties",
        "items", "prefixItems", "minItems", "maxItems",
    }
)  # fmt: skip

# oneOf only with provably disjoint branches (else xgrammar falls back to anyOf);
# multipleOf only for integers without bounds (else ignored); see schema_check.
_XGRAMMAR_KEYWORDS = _SHARED | frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "patternProperties", "propertyNames", "minProperties", "maxProperties",
        "unevaluatedProperties", "unevaluatedItems",
    }
)  # fmt: skip
# Checked against jsonschema[format] on random walks. xgrammar's date, date-time and time
# allow 2023-02-31 and a leap second at any minute, its ipv4 leading zeros, its hostname
# labels over 63 characters: those come from formats.py instead.
_XGRAMMAR_FORMATS = frozenset(
    {
        "email", "ipv6", "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
        "relative-json-pointer", "duration",
    }
)  # fmt: skip

XGRAMMAR_RULES = SchemaRules(
    backend="xgrammar",
    keywords=_XGRAMMAR_KEYWORDS,
    formats=_XGRAMMAR_FORMATS,
    pattern_formats=frozenset({"date", "time", "date-time", "ipv4", "hostname"}),
    spaced_literals=False,
)

OUTLINES_RULES = SchemaRules(
    backend="outlines",
    keywords=_SHARED
    | frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "patternProperties"}),
    # outlines-core's own format regexes can produce invalid JSON (email, uri: raw `"`;
    # time: a raw backslash) or invalid values (date: Unicode digits; date-time: no offset).
    formats=frozenset(),
    pattern_formats=frozenset(
        {"date", "time", "date-time", "ipv4", "hostname", "uuid", "email", "uri", "uri-reference"}
    ),
    raw_json_patterns=True,
    recursive_refs=False,
    counts_members=False,
    bounds_as_regex=True,
    max_count=256,
)
