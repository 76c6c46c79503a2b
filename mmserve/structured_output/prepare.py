"""A request's JSON schema -> the schema one backend compiles, and what was relaxed.

parse -> normalize (normalize.py, merge.py: one spelling, siblings merged, references into
$defs) -> exact rewrites (rewrites.py) -> narrowing of untyped nodes -> the backend's rules
(schema_check.py: refused, or under `relaxed` dropped and reported) -> the engine's form
(outlines: outlines_schema.py; xgrammar: enum objects and arrays as schemas, literals.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from . import keywords as kw
from .finite import has_finite_value
from .literals import spelled_out
from .normalize import Normalizer
from .outlines_schema import Splice, outlines_form
from .rewrites import narrow_types, simplify
from .schema_check import Checker
from .schema_tree import FIELD, Problems, RelaxedKeyword, Schema, to_json, walk


@dataclass(frozen=True)
class PreparedSchema:
    schema: Any  # what the engine compiles (JSON values)
    relaxed: tuple[RelaxedKeyword, ...]  # what it does not enforce (only under `relaxed`)
    # outlines: placeholder text in outlines-core's regex -> what to put there
    splices: dict[str, Splice] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return json.dumps(self.schema, ensure_ascii=False)


def prepare_schema(
    schema: Any, rules: kw.SchemaRules, relaxed: bool = False, field: str = FIELD
) -> PreparedSchema:
    """Raises SchemaError (InvalidArgument) at the first problem it cannot compile around
    (every unenforced keyword, unless `relaxed`)."""
    problems = Problems(relaxed, field)
    normalizer = Normalizer(schema, problems)
    root, defs = normalizer.run()
    root, defs = simplify(root, defs, normalizer.merger)
    if root is False:
        raise problems.error("", "the schema accepts no value (its constraints contradict)")
    defs = _reachable(root, defs)
    narrow_types(walk([root, *defs.values()]))
    Checker(rules, problems, root, defs).run()
    if not has_finite_value(root, defs):
        raise problems.error(
            "", "the schema accepts no finite value (a required property or item refers back "
            "to its own schema without end)",
        )  # fmt: skip
    splices: dict[str, Splice] = {}
    if rules.recursive_refs:
        schema = to_json(root, defs)
    else:
        schema, splices = outlines_form(root, defs, problems)
    if not rules.spaced_literals:
        schema = spelled_out(schema)
    return PreparedSchema(schema, problems.dropped, splices)


def _reachable(root: Schema, defs: dict[str, Schema]) -> dict[str, Schema]:
    """The definitions the root refers to, directly or through others."""
    seen: dict[str, None] = {}
    todo = [root]
    while todo:
        found = []
        for node in walk(todo):
            name = node.keywords.get("$ref")
            if name and name not in seen:
                seen[name] = None
                found.append(defs[name])
        todo = found
    return {n: defs[n] for n in seen}


def check_schema(schema: Any, rules: kw.SchemaRules, field: str = FIELD) -> None:
    """Raise SchemaError at the first part of `schema` that `rules` does not enforce."""
    prepare_schema(schema, rules, relaxed=False, field=field)
