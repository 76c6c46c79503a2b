"""A JSON schema as normalize.py rewrites it: nodes that remember where each keyword was
written, so that a problem found after rewriting is still reported at its place in the
request's schema (an RFC 6901 JSON pointer).

Values of a Node's keywords: a subschema (Node or bool) for SCHEMA_VALUES, a dict of them for
SCHEMA_MAPS, a list of them for SCHEMA_LISTS, the name of a definition for "$ref", the JSON
value as written otherwise ("const" is kept as a one-value "enum").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidArgument

from . import keywords as kw
from .refs import pointer_join

FIELD = "structured.json_schema"


class SchemaError(InvalidArgument):
    """A schema problem at `pointer` (RFC 6901 JSON pointer, "" = the root)."""

    def __init__(self, pointer: str, message: str, field: str = FIELD) -> None:
        super().__init__(field, f"at {pointer or '/'}: {message}")
        self.pointer = pointer
        self.detail = message  # without the field and the pointer


@dataclass(frozen=True)
class RelaxedKeyword:
    """A keyword compiled around under `relaxed`: the output may not satisfy it."""

    pointer: str  # JSON pointer of the schema object that holds it ("" = the root)
    keyword: str


@dataclass(eq=False)
class Node:
    """One subschema. Nodes may be shared (a merge reuses its inputs' children); every
    rewrite of a node is the same wherever the node is used."""

    keywords: dict[str, Any] = field(default_factory=dict)
    pointer: str = ""  # where the node was written (for a merged node, its first part)
    where: dict[str, str] = field(default_factory=dict)  # keyword -> pointer, when not `pointer`
    spelled: dict[str, str] = field(default_factory=dict)  # keyword -> as written, if not so
    inferred_type: bool = False  # "type" was added by narrowing, not written

    def at(self, key: str) -> str:
        """The object in which keyword `key` was written."""
        return self.where.get(key, self.pointer)

    def name_of(self, key: str) -> str:
        """Keyword `key` as the request wrote it (e.g. "dependencies", not "dependentRequired")."""
        return self.spelled.get(key, key)

    def pointer_of(self, key: str) -> str:
        return pointer_join(self.at(key), self.name_of(key))

    def put(self, key: str, value: Any, at: str | None = None, spelled: str | None = None) -> None:
        self.keywords[key] = value
        if at is not None and at != self.pointer:
            self.where[key] = at
        if spelled is not None and spelled != key:
            self.spelled[key] = spelled

    def take(self, other: Node, key: str, value: Any) -> None:
        """Keyword `key` of `other`, with the value given, remembering where it was written."""
        self.put(key, value, other.at(key), other.spelled.get(key))

    def drop(self, key: str) -> None:
        self.keywords.pop(key, None)
        self.where.pop(key, None)
        self.spelled.pop(key, None)

    def types(self) -> frozenset[str] | None:
        """The "type" as a set, None if there is none."""
        t = self.keywords.get("type")
        return None if t is None else frozenset(t)

    def combinator(self) -> str | None:
        return next((k for k in kw.COMBINATORS if k in self.keywords), None)


Schema = Node | bool


def children(node: Node) -> Iterator[tuple[str, Schema]]:
    """(keyword, subschema) for every direct subschema of `node`."""
    for key, value in node.keywords.items():
        if key in kw.SCHEMA_VALUES:
            yield key, value
        elif key in kw.SCHEMA_MAPS:
            yield from ((key, sub) for sub in value.values())
        elif key in kw.SCHEMA_LISTS:
            yield from ((key, sub) for sub in value)


def walk(roots: list[Schema]) -> Iterator[Node]:
    """Every node reachable from `roots`, once each (parents before children)."""
    seen: set[int] = set()
    stack = [r for r in reversed(roots) if isinstance(r, Node)]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(sub for _, sub in reversed(list(children(node))) if isinstance(sub, Node))


def to_json(schema: Schema, defs: dict[str, Schema] | None = None) -> Any:
    """The schema as JSON values (definitions under "$defs" at the root)."""
    out = _Json().value(schema)
    if defs:
        out = {"anyOf": [out]} if isinstance(out, bool) else out
        out["$defs"] = {name: _Json().value(sub) for name, sub in defs.items()}
    return out


def inlined_json(schema: Schema, defs: dict[str, Schema], max_nodes: int, depth: int) -> Any:
    """The schema as JSON values with every $ref replaced by its definition (for engines
    that resolve references only a few levels deep). A definition inside itself `depth`
    times is `false` there. ValueError past `max_nodes` subschemas."""
    return _Json(defs, max_nodes, depth, schema).value(schema)


class _Json:
    def __init__(
        self,
        defs: dict[str, Schema] | None = None,
        max_nodes: int = 0,
        depth: int = 0,
        root: Schema = True,
    ) -> None:
        self.defs, self.budget, self.depth, self.root = defs, max_nodes, depth, root
        self.stack: list[str] = [""]  # definitions being written out, the root first

    def value(self, schema: Schema) -> Any:
        if isinstance(schema, bool):
            return schema
        if self.defs is not None:
            self.budget -= 1
            if self.budget < 0:
                raise ValueError("too large with its references written out")
            name = schema.keywords.get("$ref")
            if name is not None:
                if self.stack.count(name) >= self.depth:
                    return False
                self.stack.append(name)
                try:
                    return self.value(self.root if name == "" else self.defs[name])
                finally:
                    self.stack.pop()
        out = map_subschemas(schema.keywords, self.value)
        if "$ref" in out:
            out["$ref"] = ref_text(out["$ref"])
        return out


def map_subschemas(keywords: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of a schema object (its keywords) with `fn` applied to each subschema: the
    values of SCHEMA_VALUES, the entries of SCHEMA_MAPS, the items of SCHEMA_LISTS."""
    out: dict[str, Any] = {}
    for key, value in keywords.items():
        if key in kw.SCHEMA_VALUES:
            out[key] = fn(value)
        elif key in kw.SCHEMA_MAPS:
            out[key] = {name: fn(sub) for name, sub in value.items()}
        elif key in kw.SCHEMA_LISTS:
            out[key] = [fn(sub) for sub in value]
        else:
            out[key] = value
    return out


def ref_text(name: str) -> str:
    return "#" if name == "" else f"#/$defs/{name}"


def value_key(value: Any) -> str:
    """A key equal for equal JSON values (1 and 1.0 are the same number)."""
    return json.dumps(_canonical(value), sort_keys=True)


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


class Problems:
    """Keywords the backend would not enforce: refused (the default), or under `relaxed`
    dropped and recorded. Malformed schemas are always refused."""

    def __init__(self, relaxed: bool, field: str = FIELD) -> None:
        self.relaxed = relaxed
        self.field = field
        self._dropped: dict[RelaxedKeyword, None] = {}  # ordered set

    def error(self, pointer: str, message: str) -> SchemaError:
        return SchemaError(pointer, message, self.field)

    def relax(self, at: str, key: str, message: str) -> None:
        """Keyword `key` of the object at pointer `at` cannot be enforced: raise, or
        (relaxed) record it; the caller compiles around it."""
        if not self.relaxed:
            raise self.error(pointer_join(at, key), message)
        self._dropped[RelaxedKeyword(at, key)] = None

    def unenforced(self, node: Node, key: str, message: str) -> None:
        """`node[key]` cannot be enforced: raise, or (relaxed) drop it and record it."""
        self.relax(node.at(key), node.name_of(key), message)
        node.drop(key)

    @property
    def dropped(self) -> tuple[RelaxedKeyword, ...]:
        return tuple(self._dropped)
