"""Whether a schema has a value at all once references are followed: a required property or
item that refers back to its own schema without end (`{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}`) leaves only infinite values. xgrammar compiles such a grammar, and a
model then writes until max_tokens; prepare.py refuses it instead.

A least fixpoint over the nodes: a node has a value once what every value of it must contain
does. Conservative: a scalar type, an enum or any keyword not looked at is taken to leave one.
"""

from __future__ import annotations

from collections.abc import Callable

from .schema_tree import Node, Schema, walk

_SCALARS = frozenset({"null", "boolean", "number", "integer", "string"})


def has_finite_value(root: Schema, defs: dict[str, Schema]) -> bool:
    nodes = list(walk([root, *defs.values()]))
    known: set[int] = set()  # ids of the nodes proven to have a finite value

    def holds(schema: Schema) -> bool:
        if isinstance(schema, bool):
            return schema
        name = schema.keywords.get("$ref")
        if name is not None:
            target = root if name == "" else defs.get(name, True)
            return target is True or (isinstance(target, Node) and id(target) in known)
        return id(schema) in known

    grown = True
    while grown:
        found = [n for n in nodes if id(n) not in known and _has_value(n, holds)]
        known.update(id(n) for n in found)
        grown = bool(found)
    return holds(root)


def _has_value(node: Node, holds: Callable[[Schema], bool]) -> bool:
    k = node.keywords
    if "$ref" in k:
        return holds(node)
    combinator = node.combinator()
    if combinator is not None:  # merge.py moved the other keywords into the branches
        return any(holds(branch) for branch in k[combinator])
    types = node.types()
    if "enum" in k or types is None or types & _SCALARS:
        return True
    if "object" in types:
        props, rest = k.get("properties", {}), k.get("additionalProperties", True)
        if all(holds(props.get(name, rest)) for name in k.get("required", [])):
            return True
    if "array" in types:
        count, prefix = k.get("minItems", 0), k.get("prefixItems", [])
        if all(holds(item) for item in prefix[:count]) and (
            count <= len(prefix) or holds(k.get("items", True))
        ):
            return True
    return False
