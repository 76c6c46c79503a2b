"""An enum's (or const's) object and array values, spelled out as the schemas that accept
exactly them, for an engine that writes such values as fixed text.

xgrammar 0.2.9 writes `{"const": {"a": [1, 2]}}` as the text `{"a":[1,2]}` alone, while the
same shape elsewhere takes the whitespace the grammar allows: a model that pretty-prints is
cut off inside the value. As `{"type": "object", "properties": {"a": <[1, 2]>}, "required":
["a"], "additionalProperties": false}` (an array: its items as prefixItems, exactly that
many) the engine's whitespace applies. Every output still parses to a value equal to one
of the enum's (JSON equality: key order does not matter); scalars stay as they are.
"""

from __future__ import annotations

from typing import Any

from .schema_tree import map_subschemas, value_key

MAX_DEPTH = 32  # nesting spelled out; deeper parts of a value stay fixed text
# Subschemas written for one schema's values, past which values stay text: xgrammar's
# compile time grows faster than their number (1,000: 0.1 s; 4,000: 1-2 s).
MAX_NODES = 1024


def spelled_out(schema: Any) -> Any:
    """`schema` (JSON values, enums alone in their object as rewrites.py leaves them) with
    every enum that holds an object or an array spelled out (anyOf for several values)."""
    return _Speller().schema(schema)


class _Speller:
    def __init__(self) -> None:
        self.budget = MAX_NODES

    def schema(self, schema: Any) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = map_subschemas(schema, self.schema)
        values = out.get("enum")
        if values is None or len(out) > 1 or not any(_composite(v) for v in values):
            return out
        distinct = list({value_key(v): v for v in values}.values())
        scalars = [v for v in distinct if not _composite(v)]
        branches = [self.top(v) for v in distinct if _composite(v)]
        branches += [{"enum": scalars}] if scalars else []
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def top(self, value: Any) -> dict[str, Any]:
        size = _size(value, self.budget)
        if size > self.budget:
            return {"enum": [value]}
        self.budget -= size
        return _exactly(value, 0)


def _exactly(value: Any, depth: int) -> dict[str, Any]:
    """The schema of exactly `value`."""
    if not _composite(value) or depth >= MAX_DEPTH:
        return {"enum": [value]}
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: _exactly(v, depth + 1) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    items = [_exactly(v, depth + 1) for v in value]
    return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items)}


def _composite(value: Any) -> bool:
    return isinstance(value, (dict, list))


def _size(value: Any, limit: int) -> int:
    """The members and items of `value` down to MAX_DEPTH (counting stops past `limit`)."""
    size, todo = 0, [(value, 0)]
    while todo and size <= limit:
        value, depth = todo.pop()
        if _composite(value) and depth < MAX_DEPTH:
            members = list(value.values() if isinstance(value, dict) else value)
            size += len(members)
            todo.extend((v, depth + 1) for v in members)
    return size
