"""When the branches of a oneOf provably never match the same value.

xgrammar represents oneOf exactly only for branches it can prove disjoint, and otherwise
falls back to anyOf semantics (with a log line, not an error). Disjoint branches make oneOf
and anyOf the same, so a oneOf is accepted only when this (sound, incomplete) check proves it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import combinations
from typing import Any


def branches_disjoint(branches: Sequence[Any]) -> bool:
    """True only if no value can match two of the (already $ref-resolved) branches."""
    return all(_pair_disjoint(a, b) for a, b in combinations(branches, 2))


def _schema_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a schema can accept, or None if unknown."""
    t = schema.get("type") if isinstance(schema, dict) else None
    if not (isinstance(t, str) or (isinstance(t, list) and all(isinstance(n, str) for n in t))):
        return None
    names = frozenset([t] if isinstance(t, str) else t)
    return names | {"integer"} if "number" in names else names


def _pair_disjoint(a: Any, b: Any) -> bool:
    ta, tb = _schema_types(a), _schema_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    return _discriminated(a, b)


def _discriminated(a: Any, b: Any) -> bool:
    """Both objects, with a required property whose const values differ."""
    if not all(isinstance(s, dict) and s.get("type") == "object" for s in (a, b)):
        return False
    required = [s.get("required") for s in (a, b)]
    if not all(isinstance(r, list) and all(isinstance(n, str) for n in r) for r in required):
        return False
    for name in set(required[0]) & set(required[1]):
        ca, cb = _const_of(a, name), _const_of(b, name)
        if ca is not None and cb is not None and ca != cb:
            return True
    return False


def _const_of(schema: dict[str, Any], name: str) -> tuple[str] | None:
    properties = schema.get("properties")
    prop = properties.get(name) if isinstance(properties, dict) else None
    if not isinstance(prop, dict):
        return None
    if "const" in prop:
        return (json.dumps(prop["const"], sort_keys=True),)
    enum = prop.get("enum")
    if isinstance(enum, list) and len(enum) == 1:
        return (json.dumps(enum[0], sort_keys=True),)
    return None
