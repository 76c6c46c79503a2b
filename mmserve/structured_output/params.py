"""What a request asks the grammar engine for, validated at the edge (no model needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
BACKEND_NAMES = ("auto", "xgrammar", "outlines")

# Size limits on what a request may ask to compile. Compile time and memory grow with the
# constraint; these bound the work one request can cause before the compile time limit.
MAX_SCHEMA_BYTES = 512 * 1024  # JSON schema text, UTF-8 (Kubernetes' run to 300 KiB)
MAX_REGEX_CHARS = 8 * 1024
MAX_GRAMMAR_BYTES = 128 * 1024  # EBNF text, UTF-8
MAX_STRUCTURAL_TAG_BYTES = MAX_SCHEMA_BYTES  # JSON text, UTF-8 (its tags' schemas inside)
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024  # per choice


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint on a Generate request's output (API.md `StructuredOutput`)."""

    kind: str  # one of KINDS
    # json_schema: the schema as JSON text; regex / grammar: the pattern / EBNF text;
    # structural_tag: its JSON text (structural_tag.py); choice: the allowed outputs (a list
    # is accepted and kept as a tuple); json_object: "".
    value: str | Sequence[str] = ""
    # one of BACKEND_NAMES; auto = the server's default backend, unless it cannot compile this
    # (registry.auto_backend: then xgrammar)
    backend: str = "auto"
    # json_schema and structural_tag (its schemas) only: compile around the keywords the
    # backend cannot enforce (reported as CompiledGrammar.relaxed) instead of refusing the
    # schema. Ignored for other kinds.
    relaxed: bool = False
    # json_schema and json_object only (vLLM's disable_any_whitespace): no whitespace but one
    # space after each "," and ":" (`{"a": 1, "b": [1, 2]}`). Ignored for other kinds.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # Choices may come in as a list; a tuple keeps the params hashable (cache keys).
        if not isinstance(self.value, (str, tuple)):
            object.__setattr__(self, "value", tuple(self.value))

    @property
    def field(self) -> str:
        """The request field this constraint came from, for error messages."""
        return f"structured.{self.kind}"

    @property
    def cache_value(self) -> str | tuple[str, ...]:
        """`value` normalised for cache keys: json_object ignores its value."""
        if self.kind == "json_object":
            return ""
        return self.value if isinstance(self.value, str) else tuple(self.value)

    @property
    def compact(self) -> bool:
        """Whether the JSON is written without free whitespace (disable_any_whitespace, where
        it applies)."""
        return self.disable_any_whitespace and self.kind in JSON_KINDS

    @property
    def needs(self) -> frozenset[str]:
        """What a backend must support to compile this: its kind, and disable_any_whitespace
        where it applies."""
        return frozenset({self.kind, "disable_any_whitespace"} if self.compact else {self.kind})

    @property
    def cache_key(self) -> tuple[str, str | tuple[str, ...], bool, bool]:
        """What the compiled grammar depends on, besides the backend."""
        return self.kind, self.cache_value, self.relaxed and self.kind in _SCHEMA_KINDS, self.compact

    def validate(self) -> None:
        """Checks that need no backend. Raises InvalidArgument naming the field."""
        if self.kind not in KINDS:
            raise InvalidArgument("structured", f"unknown constraint {self.kind!r}; one of {KINDS}")
        if self.backend not in BACKEND_NAMES:
            raise InvalidArgument(
                "structured.backend", f"unknown backend {self.backend!r}; one of {BACKEND_NAMES}"
            )
        if self.kind == "choice":
            self._validate_choices()
        elif self.kind != "json_object":
            self._validate_text()

    def _validate_text(self) -> None:
        value = self.value
        if not isinstance(value, str) or not value:
            raise InvalidArgument(self.field, "must be a non-empty string")
        size, limit = _TEXT_LIMITS[self.kind]
        if size(value) > limit:
            raise InvalidArgument(self.field, f"longer than the limit of {limit}")

    def _validate_choices(self) -> None:
        choices = self.value
        if isinstance(choices, str) or not choices:
            raise InvalidArgument(self.field, "must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidArgument(self.field, f"at most {MAX_CHOICES} choices")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise InvalidArgument(f"{self.field}[{i}]", "must be a non-empty string")
            if len(choice) > MAX_CHOICE_CHARS:
                raise InvalidArgument(f"{self.field}[{i}]", f"longer than {MAX_CHOICE_CHARS} chars")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


# kind -> (how its size is measured, the limit)
_TEXT_LIMITS = {
    "json_schema": (_utf8_len, MAX_SCHEMA_BYTES),
    "regex": (len, MAX_REGEX_CHARS),
    "grammar": (_utf8_len, MAX_GRAMMAR_BYTES),
    "structural_tag": (_utf8_len, MAX_STRUCTURAL_TAG_BYTES),
}
_SCHEMA_KINDS = ("json_schema", "structural_tag")  # the kinds `relaxed` applies to
JSON_KINDS = ("json_schema", "json_object")  # the kinds disable_any_whitespace applies to
