"""Tool calling, the request side: a chat's tools and tool_choice, the parser that reads a
model's calls, and the constraint that enforces a forced tool_choice. (server/convert.py
turns the Chat proto into these; tool_stream.py reads the output.)

- auto (the default when there are tools): the tools are rendered into the prompt and the
  model decides. Its output is read by the model's tool-call parser (found from its chat
  template or architecture, or the server's --tool-parser) into content and calls; an
  output that is only a call object naming one of the tools, without the format's markers
  (as small models write them), is a call too (tool_parsers/untagged.py).
- none: the tools are not rendered, so the model does not know them, and nothing is parsed.
- required / a named function: the tools are rendered, and the output is constrained by a
  JSON schema built from the tools' parameter schemas (either grammar backend):
  required: `[{"name": ..., "arguments": {...}}, ...]` (one call or more);
  named: `{"name": "f", "arguments": {...}}`. This shape is the same for every model (not
  the model's own markup, which the grammar makes unnecessary); tool_stream.py parses it.
- strict: enforced by the grammar under required / named. Under auto, where the model's
  format has a marker to trigger on (hermes' `<tool_call>`, written as text), a structural tag
  does it (strict_call_tags, as SGLang does): text is free, but a call, once its marker is
  out, can only name an offered tool and end with arguments a strict tool's schema validates.
  Elsewhere (other formats, the outlines backend), and for a strict schema xgrammar cannot
  enforce whole, no grammar applies: a call whose arguments do not validate stays content, as
  does a call to a tool the request did not offer (the parser's `accept` hook, always on).
A request's own `structured` constraint applies under auto (calls are parsed from what it
lets through; no tag is added); with a forced tool_choice, which is a constraint itself, it
is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.processors.tool_parsers import Accept, ToolParser, get_parser, parser_for_model
from mmserve.structured_output.keywords import OUTLINES_RULES, XGRAMMAR_RULES
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.structured_output.prepare import check_schema
from mmserve.structured_output.vocab import special_token_ids

_RULES = {rules.backend: rules for rules in (XGRAMMAR_RULES, OUTLINES_RULES)}
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
# Schema keywords whose values are data, not subschemas: a "$ref" in there is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


@dataclass(frozen=True)
class ToolSpec:
    """One tool of a request, as the server checks calls against it."""

    name: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    strict: bool  # the arguments must validate against `parameters`
    field: str  # the request field it came from, e.g. "chat.tools[0]"
    description: str = ""  # for the model

    def template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's function-tool shape)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tool calling (absent when no tool may be called)."""

    tools: tuple[ToolSpec, ...]
    mode: str  # "auto" | "required" | "function"
    function: str = ""  # mode "function": the tool that must be called

    @property
    def forced(self) -> bool:
        return self.mode != "auto"

    def accept(self) -> Accept:
        """Whether a parsed call is a call: a tool of the request, with valid arguments
        where the tool is strict (else the parser keeps the call's text as content)."""
        validators = {t.name: _validator(t) if t.strict else None for t in self.tools}

        def accept(name: str, arguments: str) -> bool:
            if name not in validators:
                return False
            validator = validators[name]
            if validator is None:
                return True
            try:
                value = json.loads(arguments)
            except ValueError:  # an int past Python's digit limit: it cannot be checked
                return False
            return bool(validator.is_valid(value))

        return accept


def tool_request(specs: Sequence[ToolSpec], mode: str, function: str = "") -> ToolRequest | None:
    """What a chat asks of tool calling; None when no tool can be called (no tools, or mode
    "none"). mode: "auto" | "none" | "required" | "function" (then `function` names the tool
    that must be called). InvalidArgument names the field (`chat.tool_choice.*`, a tool's)."""
    names = [s.name for s in specs]
    counts = Counter(names)  # names.count() per tool was quadratic: 20,000 tools held the loop 3 s
    for spec in specs:
        if counts[spec.name] > 1:
            raise InvalidArgument(f"{spec.field}.name", f"{spec.name!r} is repeated")
    if mode == "function" and function not in names:
        raise InvalidArgument(
            "chat.tool_choice.function_name", f"{function!r} is not one of chat.tools {names}"
        )
    if mode == "required" and not names:
        raise InvalidArgument("chat.tool_choice.mode", "MODE_REQUIRED needs chat.tools")
    if mode == "none" or not specs:
        return None
    return ToolRequest(tuple(specs), mode, function if mode == "function" else "")


def tool_spec(
    field: str, name: str, parameters_json: str = "", strict: bool = False, description: str = ""
) -> ToolSpec:
    """One tool from its parts (parameters as JSON text; empty: no arguments)."""
    if not name:
        raise InvalidArgument(f"{field}.name", "must not be empty")
    parameters = _NO_ARGUMENTS
    if parameters_json:
        try:
            parameters = json.loads(parameters_json)
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"{field}.parameters_json", f"invalid JSON: {e}") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"{field}.parameters_json", "must be a JSON Schema object")
    return ToolSpec(name, parameters, strict, field, description)


def _validator(tool: ToolSpec) -> Any:
    """A jsonschema validator of a strict tool's arguments; a broken schema is the request's
    fault (INVALID_ARGUMENT with a JSON pointer)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(tool.parameters)
    try:
        cls.check_schema(tool.parameters)
    except RecursionError:  # nested deeper than jsonschema's recursion can follow
        raise InvalidArgument(f"{tool.field}.parameters_json", "nested too deeply") from None
    except jsonschema.SchemaError as e:
        pointer = "".join(f"/{p}" for p in e.path) or "/"
        raise InvalidArgument(
            f"{tool.field}.parameters_json", f"at {pointer}: {e.message}"
        ) from None
    return cls(tool.parameters, format_checker=cls.FORMAT_CHECKER)


def find_tool_parser(chat_template: Any, architecture: str, forced: str | None) -> ToolParser | None:
    """The parser of a model's tool-call format: `forced` (the server's --tool-parser), else
    the one its chat template or architecture names; None if neither tells."""
    if isinstance(chat_template, dict):  # several named templates
        chat_template = "\n".join(str(t) for t in chat_template.values())
    name = forced or parser_for_model(chat_template, architecture)
    return get_parser(name) if name else None


def forced_constraint(request: ToolRequest, backend: str) -> StructuredOutputParams:
    """The JSON-schema constraint of a forced tool_choice (module doc). Each tool's schema is
    checked first, so that a problem is reported at its own field with a pointer into it."""
    named = [t for t in request.tools if t.name == request.function]
    for tool in named or request.tools:  # the tools the constraint includes
        check_schema(tool.parameters, _RULES[backend], f"{tool.field}.parameters_json")
    schema: dict[str, Any]
    if named:
        schema = _call_schema(named[0], "/properties/arguments")
    else:
        calls = [
            _call_schema(t, f"/items/anyOf/{i}/properties/arguments")
            for i, t in enumerate(request.tools)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return StructuredOutputParams("json_schema", json.dumps(schema), backend)


def strict_call_tags(
    request: ToolRequest, parser: ToolParser | None, tokenizer: Any, backend: str
) -> StructuredOutputParams | None:
    """Under auto with a strict tool, the structural tag that enforces calls (module doc):
    a strict tool's arguments against its schema, the others' as any object. None where it
    cannot: no strict tool, a forced tool_choice, the outlines backend, a format with no tag
    (ToolParser.call_tags), or a marker the tokenizer keeps as a special token (no constraint
    writes those)."""
    if request.forced or parser is None or backend == "outlines":
        return None
    if not any(t.strict for t in request.tools):
        return None
    if special_markers(parser, tokenizer, special_token_ids(tokenizer)):
        return None
    fmt = parser.call_tags([(t.name, _enforced_arguments(t)) for t in request.tools])
    if fmt is None:
        return None
    tag = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    return StructuredOutputParams("structural_tag", tag, "xgrammar")


def special_markers(parser: ToolParser, tokenizer: Any, special: frozenset[int]) -> set[int]:
    """The ids of the parser's markers that the tokenizer keeps as special tokens (`special`:
    its special ids; special tokens are added tokens)."""
    added = tokenizer.added_tokens_encoder  # content -> id
    return {added[m] for m in parser.markers if m in added} & special


def _enforced_arguments(tool: ToolSpec) -> dict[str, Any]:
    """What a call's arguments are held to in strict_call_tags: a strict tool's schema if
    xgrammar enforces all of it, else any object (then checked after, by `accept`)."""
    if tool.strict:
        try:
            check_schema(tool.parameters, XGRAMMAR_RULES, f"{tool.field}.parameters_json")
        except InvalidArgument:
            return {"type": "object"}
        return tool.parameters
    return {"type": "object"}


def _call_schema(tool: ToolSpec, at: str) -> dict[str, Any]:
    """One call's schema; the tool's schema is placed at JSON pointer `at` of the whole
    schema, so its local references ("#/$defs/x") are moved there."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _relocate(tool.parameters, at)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _relocate(schema: Any, at: str) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> subschema
                out[key] = {name: walk(sub) for name, sub in value.items()}
            else:
                out[key] = value if key in _DATA_KEYWORDS else walk(value)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = "#" + at + ref[1:]
        return out

    return walk(schema)
