"""The request's JSON schema -> an equivalent schema in the form the engines read exactly.

- Only validation keywords are kept (keywords.VALIDATION); annotations, vendor keywords and
  identifiers are dropped, as validators ignore them.
- The spellings of drafts 3 and 4 become those of 2020-12 (`items: [...]` -> prefixItems,
  boolean exclusiveMaximum, divisibleBy, extends, dependencies, `const` -> a one-value enum).
- allOf, and the keywords beside a `$ref`, anyOf or oneOf, are merged into one schema
  (merge.py): engines drop such siblings. Every other `$ref` points into "$defs" at the root:
  references are resolved here, against the nearest enclosing `$id` (draft 4: `id`), so
  the engines only ever see "#/$defs/<name>".
Limits: MAX_SCHEMA_DEPTH nested subschemas, MAX_SCHEMA_NODES subschemas in all.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from . import keywords as kw
from .expand import exclusive, expansions
from .merge import Merger, combined
from .refs import pointer_join, resolve_local_ref
from .schema_tree import Node, Problems, Schema, value_key

MAX_SCHEMA_DEPTH = 32  # nesting of subschemas (a $ref counts once, where it is written)
MAX_SCHEMA_NODES = 4096  # subschemas in the whole document, as written
_NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_COUNTS = frozenset(
    {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
     "minContains", "maxContains"}
)  # fmt: skip
_RAW = frozenset({"$dynamicRef", "$recursiveRef", "disallow"})  # kept to be reported


def declared_draft(schema: Any) -> int | None:
    """3, 4, 6, 7, 2019 or 2020 from the root's $schema; None when it names none."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(uri, str):
        return None
    found = re.search(r"draft-0?(\d)|(2019)-09|(2020)-12", uri)
    return int(next(g for g in found.groups() if g)) if found else None


class Normalizer:
    def __init__(self, root: Any, problems: Problems) -> None:
        self.root = root
        self.problems = problems
        draft = declared_draft(root)
        # draft 4 and before identify a resource with `id`, later drafts with `$id`
        self.id_keyword = "id" if draft is not None and draft <= 4 else "$id"
        self.root_id = root.get(self.id_keyword) if isinstance(root, dict) else None
        self.nodes = 0
        self.targets: dict[str, str] = {"": ""}  # definition name -> pointer of its target
        self.names: dict[str, str] = {"": ""}  # pointer of a target -> definition name
        self.defs: dict[str, Schema] = {}
        self.building: set[str] = set()
        self.pairs: dict[tuple[str, str], str] = {}  # two definitions -> one for both
        self.merger = Merger(problems, self.definition, self.pair)
        self.readers = self._readers()

    def run(self) -> tuple[Schema, dict[str, Schema]]:
        """(the root, the definitions it and they refer to, by name)."""
        self.building.add("")
        self.defs[""] = root = self.build(self.root, "", 0, "")
        self.building.discard("")
        while (todo := [n for n in self.targets if n not in self.defs]) or self.build_pairs():
            for name in todo:
                self.definition(name)
        del self.defs[""]
        return root, self.defs

    def definition(self, name: str) -> Schema | None:
        """The normalized target of a reference; None while it is being built."""
        if name in self.defs:
            return self.defs[name]
        if name in self.building:
            return None
        pointer = self.targets[name]
        self.building.add(name)
        value = resolve_local_ref(self.root, "#" + pointer)
        assert value is not None  # checked when the reference was read
        self.defs[name] = schema = self.build(value[1], pointer, 0, self.base_of(pointer))
        self.building.discard(name)
        return schema

    def pair(self, first: str, second: str) -> Schema:
        """Two definitions merged, as a definition of their own (a reference to it), so
        that merging recursive ones ends: within it, the same pair refers to it. Made now
        if both are built (false if they have no value in common), else by run()."""
        if (first, second) not in self.pairs:
            taken = {**self.targets, **{n: "" for n in self.pairs.values()}}
            self.pairs[first, second] = _def_name(f"{first}-and-{second}", taken)
        name = self.pairs[first, second]
        ready = not {first, second} & self.building
        if name not in self.defs and name not in self.building and ready:
            self.build_pair(first, second, name)
        return False if self.defs.get(name) is False else Node({"$ref": name})

    def build_pair(self, first: str, second: str, name: str) -> None:
        self.building.add(name)
        a, b = self.definition(first), self.definition(second)
        assert a is not None and b is not None  # neither is being built
        self.defs[name] = self.merger.merge(a, b)
        self.building.discard(name)

    def build_pairs(self) -> bool:
        """Builds the pair definitions put off so far; False if there were none."""
        todo = [(key, name) for key, name in self.pairs.items() if name not in self.defs]
        for (first, second), name in todo:
            self.build_pair(first, second, name)
        return bool(todo)

    # -- one subschema ---------------------------------------------------------------------

    def build(self, value: Any, ptr: str, depth: int, base: str) -> Schema:
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise self.problems.error(ptr, f"more than {MAX_SCHEMA_NODES} subschemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise self.problems.error(ptr, f"subschemas nested deeper than {MAX_SCHEMA_DEPTH}")
        if isinstance(value, bool):
            return value
        if not isinstance(value, dict):
            raise self.problems.error(ptr, "a schema must be a JSON object or a boolean")
        base = ptr if self.starts_resource(value, ptr) else base
        node = Node(pointer=ptr)
        for key, v in value.items():
            reader = self.readers.get(key)
            if reader is not None:
                reader(node, key, v, _Here(ptr, depth, base))
        _old_spellings(node)
        return self.combine(node)

    def combine(self, node: Node) -> Schema:
        """The node with its allOf, $ref, anyOf and oneOf merged in (merge.py), and what
        expand.py says instead of dependencies and some oneOf / not."""
        extra = expansions(node, self.merger)
        parts = [(k, node.keywords.pop(k)) for k in ("allOf", "$ref", "anyOf", "oneOf")
                 if k in node.keywords]  # fmt: skip
        result: Schema = node
        for key, value in parts:
            if key == "allOf":
                for sub in value:
                    result = self.merger.merge(result, sub)
            elif key == "$ref":
                result = self.merger.merge(result, Node({"$ref": value}, node.pointer))
            else:
                branches = exclusive(node, value, self.merger) if key == "oneOf" else None
                if branches is not None:
                    key, value = "anyOf", branches
                result = self.merger.merge(result, combined(node, key, value))
        for sub in extra:
            result = self.merger.merge(result, sub)
        return result

    def starts_resource(self, value: dict[str, Any], ptr: str) -> bool:
        """A nested identifier other than a fragment changes what "#/..." resolves to."""
        ident = value.get(self.id_keyword)
        return bool(ptr) and isinstance(ident, str) and not ident.startswith("#") and (
            ident != self.root_id
        )

    def base_of(self, pointer: str) -> str:
        """The pointer of the resource (the root or a nested $id) that contains `pointer`."""
        base, node, here = "", self.root, ""
        for token in pointer.split("/")[1:]:
            key = token.replace("~1", "/").replace("~0", "~")
            node = node[int(key)] if isinstance(node, list) else node[key]
            here = pointer_join(here, key)
            if isinstance(node, dict) and self.starts_resource(node, here):
                base = here
        return base

    # -- keyword readers: check the value's shape, build subschemas ------------------------

    def _readers(self) -> dict[str, Callable[[Node, str, Any, _Here], None]]:
        readers: dict[str, Callable[[Node, str, Any, _Here], None]] = {
            "type": self._type, "enum": self._enum, "const": self._enum,
            "required": self._required, "$ref": self._ref, "items": self._items,
            "dependencies": self._dependencies, "dependentRequired": self._dependent_required,
            "extends": self._extends, "uniqueItems": self._bool, "pattern": self._string,
            "format": self._format, "multipleOf": self._multiple_of,
            "divisibleBy": self._multiple_of,
        }  # fmt: skip
        readers.update({k: self._number for k in _NUMBERS})
        readers.update({k: self._count for k in _COUNTS})
        readers.update({k: self._list for k in kw.SCHEMA_LISTS})
        readers.update({k: self._sub for k in kw.SCHEMA_VALUES if k != "items"})
        readers.update({k: self._map for k in kw.SCHEMA_MAPS - kw.DEFINITIONS})
        readers.update({k: self._raw for k in _RAW})
        return readers

    def _type(self, node: Node, key: str, value: Any, here: _Here) -> None:
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(
            isinstance(n, str) and n in kw.JSON_TYPES for n in names
        ):
            raise self.fail(here, key, f"must be one of {sorted(kw.JSON_TYPES)}, or a list of them")
        node.put(key, sorted(set(names)))

    def _enum(self, node: Node, key: str, value: Any, here: _Here) -> None:
        values = [value] if key == "const" else value
        if not isinstance(values, list) or not values:
            raise self.fail(here, key, "must be a non-empty array")
        if "enum" in node.keywords:  # both enum and const: the values in both
            keys = {value_key(v) for v in values}
            values = [v for v in node.keywords["enum"] if value_key(v) in keys]
        node.put("enum", list(values), spelled=key)

    def _required(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if isinstance(value, bool):  # draft 3: on the property itself (see _map)
            return
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise self.fail(here, key, "must be an array of strings")
        old = node.keywords.get(key, [])
        node.put(key, old + [n for n in dict.fromkeys(value) if n not in old])

    def _ref(self, node: Node, key: str, value: Any, here: _Here) -> None:
        node.put(key, self.reference(value, pointer_join(here.ptr, key), here.base))

    def reference(self, ref: Any, ptr: str, base: str) -> str:
        """The definition name of a local reference ("#", "#/...", or the root's $id
        followed by one of them), resolved against the resource at `base`."""
        if not isinstance(ref, str):
            raise self.problems.error(ptr, "must be a string")
        text = unquote(ref)
        if isinstance(self.root_id, str) and text.startswith(self.root_id.rstrip("#") + "#"):
            text = text[len(self.root_id.rstrip("#")) :]
        resource = resolve_local_ref(self.root, "#" + base)
        target = resolve_local_ref(resource[1], text) if resource else None
        if target is None:
            if not (text == "#" or text.startswith("#/")):
                raise self.problems.error(ptr, 'only local references ("#" or "#/...") are supported')
            raise self.problems.error(ptr, f"reference {ref!r} does not resolve")
        pointer = base + target[0]
        if pointer not in self.names:
            name = _def_name(pointer, self.targets)
            self.names[pointer], self.targets[name] = name, pointer
        return self.names[pointer]

    def _items(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if isinstance(value, list):  # drafts before 2020-12: a tuple
            self._list(node, "prefixItems", value, here, source=key)
            node.put("prefixItems", node.keywords["prefixItems"], spelled=key)
            node.put("additionalItems?", True)  # marks where additionalItems applies
        else:
            self._sub(node, key, value, here)

    def _dependencies(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if not isinstance(value, dict):
            raise self.fail(here, key, "must be an object")
        for name, dep in value.items():
            sub = _Here(pointer_join(here.ptr, key), here.depth, here.base)
            if isinstance(dep, list):
                self._dependent_required(node, "dependentRequired", {name: dep}, here, key)
            else:
                schemas = node.keywords.get("dependentSchemas", {})
                schemas[name] = self.build(dep, pointer_join(sub.ptr, name), here.depth + 1, here.base)
                node.put("dependentSchemas", schemas, spelled=key)

    def _dependent_required(
        self, node: Node, key: str, value: Any, here: _Here, source: str | None = None
    ) -> None:
        if not isinstance(value, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value.values()
        ):
            raise self.fail(here, source or key, "must map names to arrays of names")
        node.put("dependentRequired", {**node.keywords.get("dependentRequired", {}), **value},
                 spelled=source or key)  # fmt: skip

    def _extends(self, node: Node, key: str, value: Any, here: _Here) -> None:
        self._list(node, "allOf", value if isinstance(value, list) else [value], here, source=key)

    def _bool(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if not isinstance(value, bool):
            raise self.fail(here, key, "must be a boolean")
        if value:
            node.put(key, value)

    def _string(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if not isinstance(value, str):
            raise self.fail(here, key, "must be a string")
        node.put(key, value)

    def _format(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if isinstance(value, str) and value in kw.KNOWN_FORMATS:  # others are annotations
            node.put(key, kw.FORMAT_ALIASES.get(value, value))

    def _number(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if isinstance(value, bool) and key.startswith("exclusive"):  # draft 4
            node.put(key, value)
        elif not _is_number(value):
            raise self.fail(here, key, "must be a number")
        else:
            node.put(key, value)

    def _multiple_of(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if not _is_number(value) or value <= 0:
            raise self.fail(here, key, "must be a number greater than 0")
        node.put("multipleOf", value, spelled=key)

    def _count(self, node: Node, key: str, value: Any, here: _Here) -> None:
        if not _is_number(value) or value < 0 or value != int(value):
            raise self.fail(here, key, "must be a non-negative integer")
        node.put(key, int(value))

    def _raw(self, node: Node, key: str, value: Any, here: _Here) -> None:
        node.put(key, value)

    def _sub(self, node: Node, key: str, value: Any, here: _Here) -> None:
        # Property names are strings whether or not the subschema says so.
        sub = self.build(value, pointer_join(here.ptr, key), here.depth + 1, here.base)
        if key == "propertyNames" and isinstance(sub, Node) and "type" not in sub.keywords:
            sub.put("type", ["string"])
        node.put(key, sub)

    def _list(
        self, node: Node, key: str, value: Any, here: _Here, source: str | None = None
    ) -> None:
        at = pointer_join(here.ptr, source or key)
        if not isinstance(value, list) or (not value and key != "prefixItems"):
            raise self.problems.error(at, "must be a non-empty array of schemas")
        subs = [self.build(v, pointer_join(at, i), here.depth + 1, here.base) for i, v in enumerate(value)]
        node.put(key, node.keywords.get(key, []) + subs)

    def _map(self, node: Node, key: str, value: Any, here: _Here) -> None:
        at = pointer_join(here.ptr, key)
        if not isinstance(value, dict):
            raise self.problems.error(at, "must be an object of schemas")
        subs = {
            name: self.build(v, pointer_join(at, name), here.depth + 1, here.base)
            for name, v in value.items()
        }
        node.put(key, subs)
        if key == "properties":  # draft 3: `"required": true` on a property
            names = [n for n, v in value.items() if isinstance(v, dict) and v.get("required") is True]
            if names:
                self._required(node, "required", names, here)

    def fail(self, here: _Here, key: str, message: str) -> Exception:
        return self.problems.error(pointer_join(here.ptr, key), message)


class _Here:
    """Where a keyword is read: its object's pointer, nesting depth, resource."""

    __slots__ = ("base", "depth", "ptr")

    def __init__(self, ptr: str, depth: int, base: str) -> None:
        self.ptr, self.depth, self.base = ptr, depth, base


def _old_spellings(node: Node) -> None:
    """Draft 4's boolean exclusiveMaximum / exclusiveMinimum, and additionalItems."""
    k = node.keywords
    for bound, strict in (("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")):
        if isinstance(k.get(strict), bool):
            flag = k.pop(strict)
            if flag and bound in k:
                node.put(strict, k.pop(bound), node.at(bound), spelled=bound)
    tuple_items = k.pop("additionalItems?", False)
    extra = k.pop("additionalItems", None)
    if tuple_items and extra is not None:
        node.put("items", extra, node.at("additionalItems"), spelled="additionalItems")


def _def_name(pointer: str, taken: dict[str, str]) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", pointer.rsplit("/", 1)[-1])[:60] or "d"
    name, i = stem, 1
    while name in taken:
        i += 1
        name = f"{stem}_{i}"
    return name


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
