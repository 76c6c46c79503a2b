"""A checked schema (schema_check.py) in the form outlines-core 0.2.14 translates exactly.

outlines-core turns a schema into one regex. What it gets wrong, and what is done instead:
- references: resolved only three levels deep, after which a property is silently left
  out, even a required one. They are written out here; a recursive one is unrolled
  RECURSION_DEPTH times and cut there (the cut branch, optional property or array item is
  left out: a narrowing; a schema that needs the cut is refused).
- an any-value subschema (`{}`): an ungrouped alternation (a bare `5` passes as a whole
  object) nested two levels deep (tens of seconds to compile). It becomes ANY: scalars, or
  arrays and objects of scalars (a narrowing).
- numeric bounds: ignored. A bounded number becomes a placeholder string that the backend
  replaces with a regex from numbers.py in outlines-core's output ("splices").
- patternProperties: ignored (any name, with additionalProperties' values). An object of
  one pattern becomes a placeholder too, for which the backend writes the object itself.
- `items: false`: refused by outlines-core; it is maxItems 0.
"""

from __future__ import annotations

import secrets
from typing import Any

from . import keywords as kw
from .numbers import bounds_regex
from .patterns import json_text_pattern
from .schema_tree import Node, Problems, Schema, inlined_json, map_subschemas, walk

_SCALARS = [{"type": t} for t in ("null", "boolean", "number", "string")]
ANY = {
    "anyOf": [
        *_SCALARS,
        {"type": "array", "items": {"anyOf": _SCALARS}},
        {"type": "object", "additionalProperties": {"anyOf": _SCALARS}},
    ]
}
RECURSION_DEPTH = 3  # times a definition may appear within itself before the cut
MAX_NODES = 32 * 1024  # subschemas once references are written out
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# A splice: the regex to put in place of a placeholder, or (a map's) the regex of its keys
# and the schema of its values, which the backend translates first.
Splice = str | tuple[str, Any]


def outlines_form(
    root: Schema, defs: dict[str, Schema], problems: Problems
) -> tuple[Any, dict[str, Splice]]:
    """(the schema as JSON values, {placeholder text in outlines-core's regex: splice})."""
    form = _Form(secrets.token_hex(6))
    form.splice_bounds([root, *defs.values()])
    for depth in range(RECURSION_DEPTH, 0, -1):  # shallower when the full one is too large
        try:
            out = inlined_json(root, defs, MAX_NODES, depth)
            break
        except ValueError as e:
            error = str(e)
    else:
        raise problems.error("", f"{error} (over {MAX_NODES} subschemas)")
    out = form.json(out)
    if out is False:
        raise problems.error(
            "", "the schema accepts no value (recursive references cut after "
            f"{RECURSION_DEPTH} levels leave nothing; use the xgrammar backend)",
        )  # fmt: skip
    return out, form.splices


class _Form:
    def __init__(self, token: str) -> None:
        self.token = token
        self.splices: dict[str, Splice] = {}

    def placeholder(self, splice: Splice) -> dict[str, Any]:
        name = f"mmserve{self.token}n{len(self.splices)}"
        self.splices[f'"{name}"'] = splice
        return {"enum": [name]}

    def splice_bounds(self, roots: list[Schema]) -> None:
        """Bounded numbers -> a placeholder string (an enum of one) and its regex."""
        for node in list(walk(roots)):
            k = node.keywords
            types = node.types() or frozenset()
            numeric = types & {"number", "integer"}
            if not numeric or not any(b in k for b in _BOUNDS):
                continue
            regex = bounds_regex(k, integer="number" not in numeric)
            assert regex is not None  # schema_check refused the bounds it cannot write
            placeholder = self.placeholder(regex)
            others = sorted(types - numeric)
            rest = {key: v for key, v in k.items() if key not in _BOUNDS and key != "type"}
            node.keywords, node.where, node.spelled = {}, {}, {}
            if others:
                node.put("anyOf", [Node(placeholder), Node({**rest, "type": others})])
            else:
                node.put("enum", placeholder["enum"])

    def json(self, schema: Any) -> Any:
        """Bottom-up: ANY for any-value subschemas; false where a value cannot be written;
        what can hold nothing goes (an optional property, an anyOf branch, array items)."""
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            return schema
        out = map_subschemas(schema, self.json)
        patterns = out.get("patternProperties")
        if patterns and "properties" not in out:  # schema_check allows one pattern, alone
            ((pattern, values),) = patterns.items()
            if values is False:  # no name may appear
                return {"type": ["object"], "properties": {}}
            return self.placeholder((json_text_pattern(pattern), values))
        types = out.get("type", ())
        if "array" in types and "items" not in out and "prefixItems" not in out:
            out["items"] = ANY  # not outlines-core's own, nested two levels deep
        if "object" in types and not {"properties", "additionalProperties"} & out.keys():
            out["additionalProperties"] = ANY
        return _without_false(out)


def _without_false(out: dict[str, Any]) -> Any:
    for key in kw.COMBINATORS & out.keys():
        live = [b for b in out[key] if b is not False]
        if not live:
            return False
        out[key] = live
        if len(live) == 1:
            return live[0]
    props = out.get("properties", {})
    if any(props.get(name) is False for name in out.get("required", [])):
        return False
    for name in [n for n, s in props.items() if s is False]:
        del props[name]  # outlines-core writes declared properties only
    if False in out.get("prefixItems", []):
        return False  # it writes every prefix item
    if out.get("items") is False:
        del out["items"]
        if out.get("minItems", 0) > len(out.get("prefixItems", [])):
            return False
        out["maxItems"] = len(out.get("prefixItems", []))
    if out.get("additionalProperties") is False and "properties" not in out:
        out["properties"] = {}
    return out
