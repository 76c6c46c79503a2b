"""`mmserve bench structured --schemas FILE.json`: do real-world JSON schemas compile, and
does what their grammars accept validate (issue 17)?

FILE is a corpus in JSONSchemaBench's shape: {"schemas": [{"source", "name", "schema"}, ...]}.
Each schema is compiled by each backend as a request would be: strictly, and if refused,
with `relaxed`; and by xgrammar called directly (what it would compile if nothing were
checked). Each compiled grammar is then walked (grammar_walk.py: random allowed tokens until
it ends) --walks times, and every finished text validated with jsonschema (formats
asserted) against the schema - less the relaxed keywords, for relaxed compiles. One JSON
line per backend and source, then one per backend for the whole corpus; the worst walk
failures are listed with their text.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from mmserve.bench.grammar_walk import Vocab, WalkError, walk
from mmserve.errors import InvalidArgument
from mmserve.structured_output import (
    RelaxedKeyword,
    SchemaError,
    StructuredOutputBackend,
    StructuredOutputParams,
)

WALK_STEPS = 20_000  # tokens a walk may take before it counts as endless


@dataclass(frozen=True)
class CorpusSchema:
    source: str  # JSONSchemaBench's folder, e.g. "Kubernetes"
    name: str
    schema: Any


@dataclass
class Outcome:
    """One schema on one backend."""

    status: str  # "strict", "relaxed" or "refused"
    compile_ms: float = 0.0  # of the compile that succeeded (or the last refusal)
    relaxed: tuple[RelaxedKeyword, ...] = ()
    valid: int = 0  # walks whose text validates
    invalid: list[str] = field(default_factory=list)  # what failed to validate, and why
    endless: int = 0  # walks that found no end within WALK_STEPS
    message: str = ""  # the refusal


def load_corpus(path: Path) -> list[CorpusSchema]:
    data = json.loads(path.read_text())
    entries = data["schemas"] if isinstance(data, dict) else data
    return [CorpusSchema(e["source"], e["name"], e["schema"]) for e in entries]


def effective_schema(schema: Any, relaxed: Iterable[RelaxedKeyword]) -> Any:
    """`schema` without the keywords a relaxed compile left out (a oneOf became anyOf;
    "if" takes its "then" and "else" along), deepest first."""
    out = copy.deepcopy(schema)
    for r in sorted(relaxed, key=lambda r: -len(r.pointer)):
        node = out
        for token in r.pointer.split("/")[1:]:
            key = token.replace("~1", "/").replace("~0", "~")
            node = node[int(key)] if isinstance(node, list) else node[key]
        if r.keyword == "oneOf":
            node["anyOf"] = node.pop("oneOf")
        for key in ("if", "then", "else") if r.keyword == "if" else (r.keyword,):
            node.pop(key, None)
    return out


def validators(schema: Any) -> list[Validator]:
    """The declared draft's validator; without $schema, Draft 7's and 2020-12's (those whose
    metaschema accepts the schema): the output must satisfy every reading."""
    declared = isinstance(schema, dict) and "$schema" in schema
    classes: list[Any] = [jsonschema.validators.validator_for(schema)] if declared else []
    if not declared:
        for cls in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator):
            try:
                cls.check_schema(schema)
                classes.append(cls)
            except jsonschema.SchemaError:
                pass
    return [cls(schema, format_checker=cls.FORMAT_CHECKER) for cls in classes or [jsonschema.Draft7Validator]]


def compile_schema(backend: StructuredOutputBackend, entry: CorpusSchema) -> tuple[Any, Outcome]:
    """(the compiled grammar or None, the outcome so far): strict first, then relaxed."""
    text = json.dumps(entry.schema)
    outcome = Outcome("refused")
    for status, relaxed in (("strict", False), ("relaxed", True)):
        start = time.perf_counter()
        try:
            grammar = backend.compile(StructuredOutputParams("json_schema", text, relaxed=relaxed))
        except SchemaError as e:  # a keyword: relaxed may compile around it
            outcome.message, outcome.compile_ms = str(e), 1e3 * (time.perf_counter() - start)
            continue
        except InvalidArgument as e:  # the engine's limits (time, size): relaxed would not help
            outcome.message, outcome.compile_ms = str(e), 1e3 * (time.perf_counter() - start)
            break
        outcome = Outcome(status, 1e3 * (time.perf_counter() - start), grammar.relaxed)
        return grammar, outcome
    return None, outcome


def measure(
    backend: StructuredOutputBackend, vocab: Vocab, entry: CorpusSchema, walks: int
) -> Outcome:
    grammar, outcome = compile_schema(backend, entry)
    if grammar is None:
        return outcome
    checks = validators(effective_schema(entry.schema, outcome.relaxed))
    for seed in range(walks):
        try:
            text = vocab.text(walk(grammar.matcher(), vocab, seed, max_steps=WALK_STEPS))
        except WalkError:
            outcome.endless += 1
            continue
        problem = _problem(text, checks)
        if problem is None:
            outcome.valid += 1
        else:
            outcome.invalid.append(f"{problem} in {text[:300]!r}")
    return outcome


def _problem(text: str, checks: list[Validator]) -> str | None:
    try:
        instance = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    for check in checks:
        error = next(iter(check.iter_errors(instance)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_schema_path)
            return f"{error.message[:160]} (schema at /{where})"
    return None


def raw_xgrammar_compiles(compiler: Any, entry: CorpusSchema) -> bool:
    """Whether xgrammar, called directly with nothing checked, compiles the schema."""
    try:
        compiler.compile_json_schema(json.dumps(entry.schema), any_whitespace=True)
    except (RuntimeError, ValueError):
        return False
    return True


def summary(outcomes: list[Outcome], raw: list[bool] | None) -> dict[str, Any]:
    """The figures of one table row."""
    times = sorted(o.compile_ms for o in outcomes if o.status != "refused")
    return {
        "schemas": len(outcomes),
        "strict": sum(o.status == "strict" for o in outcomes),
        "relaxed": sum(o.status == "relaxed" for o in outcomes),
        "refused": sum(o.status == "refused" for o in outcomes),
        "raw_xgrammar": sum(raw) if raw is not None else None,
        "walks_valid": sum(o.valid for o in outcomes),
        "walks_invalid": sum(len(o.invalid) for o in outcomes),
        "walks_endless": sum(o.endless for o in outcomes),
        "compile_ms_p50": _quantile(times, 0.5),
        "compile_ms_p99": _quantile(times, 0.99),
    }


def _quantile(ordered: list[float], q: float) -> float | None:
    return round(ordered[int(q * (len(ordered) - 1))], 1) if ordered else None


def run_corpus(
    backends: dict[str, StructuredOutputBackend], vocab: Vocab, corpus: list[CorpusSchema],
    walks: int, raw_compiler: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per backend and source, then one per backend for the whole corpus."""
    raw = [raw_xgrammar_compiles(raw_compiler, e) for e in corpus]
    rows = []
    for name, backend in backends.items():
        outcomes = []
        for i, entry in enumerate(corpus):
            outcomes.append(measure(backend, vocab, entry, walks))
            o = outcomes[-1]
            print(f"{name} {i + 1}/{len(corpus)} {entry.source}/{entry.name}: {o.status} "
                  f"{o.compile_ms:.0f} ms, {o.valid} valid, {len(o.invalid)} invalid",
                  file=sys.stderr, flush=True)  # fmt: skip
        for source in sorted({e.source for e in corpus}):
            picked = [i for i, e in enumerate(corpus) if e.source == source]
            row = summary([outcomes[i] for i in picked], [raw[i] for i in picked])
            rows.append({"backend": name, "source": source, **row})
        failures = [f"{e.name}: {m}" for e, o in zip(corpus, outcomes) for m in o.invalid]
        refused = {e.name: o.message[:200] for e, o in zip(corpus, outcomes) if o.status == "refused"}
        total = summary(outcomes, raw)
        total["mean_relaxed_keywords"] = statistics.fmean(
            [len(o.relaxed) for o in outcomes if o.status == "relaxed"] or [0]
        )
        rows.append({"backend": name, "source": "all", **total, "invalid": failures[:20],
                     "refused_schemas": refused})  # fmt: skip
    return rows
