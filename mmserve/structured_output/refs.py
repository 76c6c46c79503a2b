"""Local `$ref`s: where one points, and whether a schema refers to itself (recursion).

A regex engine (outlines-core) cannot express recursion: it unrolls a recursive `$ref` a few
levels and then drops it, so the deepest level is not enforced (a required property goes
missing, even invalid JSON such as `{"v": 1,}` is allowed). Such a backend must refuse it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from . import keywords as kw

_Edge = tuple[str, Any, str | None]  # (pointer, subschema, the $ref's pointer if through one)
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")  # RFC 6901: no leading zeros
_EXPANDING, _DONE = 1, 2  # states in find_recursive_ref's depth-first search


def pointer_join(pointer: str, token: str | int) -> str:
    """RFC 6901: `pointer` extended by one reference token."""
    return f"{pointer}/{str(token).replace('~', '~0').replace('/', '~1')}"


def resolve_local_ref(root: Any, ref: Any) -> tuple[str, Any] | None:
    """A local reference ("#" or "#/...") -> (the JSON pointer it names, escaped as
    pointer_join does, and the value there); None if it is not local or does not resolve."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target, pointer = root, ""
    for token in ref[2:].split("/") if ref != "#" else ():
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and key in target:
            target, pointer = target[key], pointer_join(pointer, key)
        elif isinstance(target, list) and _ARRAY_INDEX.fullmatch(key) and int(key) < len(target):
            target, pointer = target[int(key)], pointer_join(pointer, key)
        else:
            return None
    return pointer, target


def find_recursive_ref(root: Any) -> str | None:
    """The JSON pointer of a `$ref` through which the schema, expanded from its root, would
    contain itself (directly or through other references); None if there is none.

    Subschemas are expanded where they are used: `$defs` only through the references that
    reach them, so an unused recursive definition is no recursion. Unresolvable references
    are skipped (schema_check reports them).
    """
    # Depth-first over the expansion, iteratively (a chain of references can be long).
    # Each frame: (pointer, the $ref it was entered through or None, its remaining edges).
    state = {"": _EXPANDING}
    stack: list[tuple[str, str | None, Iterator[_Edge]]] = [("", None, _edges(root, "", root))]
    while stack:
        pointer, _, edges = stack[-1]
        edge = next(edges, None)
        if edge is None:
            state[pointer] = _DONE
            stack.pop()
            continue
        child, schema, via_ref = edge
        if state.get(child) == _EXPANDING:  # a cycle; containment alone never makes one
            return via_ref or next(ref for _, ref, _ in reversed(stack) if ref is not None)
        if child not in state:
            state[child] = _EXPANDING
            stack.append((child, via_ref, _edges(root, child, schema)))
    return None


def _edges(root: Any, pointer: str, schema: Any) -> Iterator[_Edge]:
    """What expanding `schema` (at `pointer`) expands next: its subschemas, but not those
    in $defs, and the target of its $ref."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        here = pointer_join(pointer, key)
        if key in kw.SCHEMA_MAPS and key not in kw.DEFINITIONS and isinstance(value, dict):
            yield from ((pointer_join(here, name), sub, None) for name, sub in value.items())
        elif key in kw.SCHEMA_LISTS and isinstance(value, list):
            yield from ((pointer_join(here, i), sub, None) for i, sub in enumerate(value))
        elif key in kw.SCHEMA_VALUES:
            yield here, value, None
        elif key == "$ref":
            target = resolve_local_ref(root, value)
            if target is not None:
                yield target[0], target[1], here
