"""Constrained decoding: JSON schema, JSON object, regex, choice and EBNF constraints.

One interface (backend.py), two engines behind a lazy registry (registry.py): xgrammar (the
default) and outlines-core. Per model, a StructuredOutputManager compiles constraints
(cached, time-limited, off the event loop); per request, `CompiledGrammar.matcher()` tracks
the output; per step, `fill_bitmasks` fills the token bitmask rows of all constrained
requests on the CPU (xgrammar's in parallel), and `apply_bitmask` masks the logits.

Nothing is weakened silently: a schema is first rewritten into the form the engines read
exactly (normalize.py, merge.py, rewrites.py), then a validation keyword, format or regex
feature an engine would still ignore is rejected with InvalidArgument and a JSON pointer
(schema_check.py, keywords.py) - or, when the request sets `relaxed`, compiled around and
reported (CompiledGrammar.relaxed). Annotations and unknown keywords are ignored, as by
validators. prepare.py runs the steps.

This package imports neither engine until a backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import (
    MAX_ROLLBACK_TOKENS,
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    default_fill_threads,
    fill_bitmasks,
    unpack_bitmask,
)
from .normalize import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES
from .params import BACKEND_NAMES, KINDS, StructuredOutputParams
from .registry import DEFAULT_BACKEND, backend_names, create_backend, get_backend_class
from .schema_tree import RelaxedKeyword, SchemaError

if TYPE_CHECKING:
    from .manager import StructuredOutputManager

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "KINDS",
    "MAX_ROLLBACK_TOKENS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "CompiledGrammar",
    "GrammarMatcher",
    "RelaxedKeyword",
    "SchemaError",
    "StructuredOutputBackend",
    "StructuredOutputManager",
    "StructuredOutputParams",
    "allocate_bitmask",
    "apply_bitmask",
    "backend_names",
    "bitmask_width",
    "create_backend",
    "default_fill_threads",
    "fill_bitmasks",
    "get_backend_class",
    "unpack_bitmask",
]


def __getattr__(name: str) -> object:  # the manager pulls in transformers: load it on demand
    if name == "StructuredOutputManager":
        from .manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(name)
