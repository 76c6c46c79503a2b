"""Keywords the engines lack, said exactly with ones they have (normalize.py merges the
results into the node that had them):

- dependentRequired {a: [b]}: a is absent, or b is present - anyOf [{a: false}, {required: [b]}];
  dependentSchemas {a: S}: anyOf [{a: false}, S]. (A property whose schema is false can never
  appear; schema_check takes it out of `properties`.)
- oneOf whose branches only require names ("one of these fields"): for objects, each branch
  with, for every other branch, one of that branch's names absent.
- not {required: [a, b]}: an object lacking a or b; not {type: T}: the other types.
"""

from __future__ import annotations

from functools import reduce

from . import keywords as kw
from .merge import Merger
from .schema_tree import Node, Schema

_OBJECT = ["object"]


def expansions(node: Node, merger: Merger) -> list[Schema]:
    """Takes the keywords above out of `node`; what to merge into it instead."""
    out: list[Schema] = []
    for name, needed in node.keywords.get("dependentRequired", {}).items():
        out.append(_either(node, "dependentRequired", [_absent(node, name), _requires(node, needed)]))
    for name, schema in node.keywords.get("dependentSchemas", {}).items():
        out.append(_either(node, "dependentSchemas", [_absent(node, name), schema]))
    negated = node.keywords.get("not")
    replacement = _negation(node, negated) if isinstance(negated, Node) else None
    if replacement is not None:
        out.append(replacement)
        node.drop("not")
    node.drop("dependentRequired")
    node.drop("dependentSchemas")
    return out


def exclusive(node: Node, branches: list[Schema], merger: Merger) -> list[Schema] | None:
    """A oneOf of branches that only require names, as anyOf branches that exclude each
    other (None for any other oneOf)."""
    if len(branches) < 2 or not all(
        isinstance(b, Node) and set(b.keywords) == {"required"} for b in branches
    ):
        return None
    names = [b.keywords["required"] for b in branches if isinstance(b, Node)]
    out: list[Schema] = []
    for i, own in enumerate(names):
        others = [[n for n in other if n not in own] for j, other in enumerate(names) if j != i]
        if any(not missing for missing in others):
            continue  # another branch holds whenever this one does: never exactly one
        parts: list[Schema] = [_requires(node, own)]
        parts += [_either(node, "oneOf", [_absent(node, n) for n in missing]) for missing in others]
        out.append(reduce(merger.merge, parts))
    return out


def _either(node: Node, source: str, branches: list[Schema]) -> Node:
    """anyOf `branches`, reported (if it must be relaxed) as the keyword it stands for."""
    return Node({"anyOf": branches}, node.at(source), spelled={"anyOf": node.name_of(source)})


def _absent(node: Node, name: str) -> Node:
    return Node({"type": _OBJECT, "properties": {name: False}}, node.pointer)


def _requires(node: Node, names: list[str]) -> Node:
    return Node({"type": _OBJECT, "required": list(names)}, node.pointer)


def _negation(node: Node, negated: Node) -> Schema | None:
    keys = set(negated.keywords)
    if keys == {"required"} and negated.keywords["required"]:
        absent: list[Schema] = [_absent(node, n) for n in negated.keywords["required"]]
        return _either(node, "not", absent) if len(absent) > 1 else absent[0]
    if keys == {"type"}:
        excluded = set(negated.keywords["type"])
        if excluded & {"number", "integer"}:
            excluded |= {"number", "integer"}  # "numbers but integers" has no type: narrowed
        rest = kw.JSON_TYPES - excluded
        return Node({"type": sorted(rest - {"integer"})}, node.pointer) if rest else False
    return None
