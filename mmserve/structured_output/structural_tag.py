"""vLLM's `structural_tag` constraint: free text in which tagged regions must hold what their
tag says, most often JSON of a schema (`<function=get_weather>{"city": "Paris"}</function>`),
as xgrammar compiles it (Grammar.from_structural_tag). Both of vLLM's spellings are taken:

- "structures" (vLLM's first): {"type": "structural_tag", "structures": [{"begin": ...,
  "schema": {...}, "end": ...}], "triggers": [...]}: any text until a trigger, then one of the
  structures whose begin starts with it, then any text again;
- "format" (xgrammar's): {"type": "structural_tag", "format": {...}}, with xgrammar's formats
  (triggered_tags, tag, sequence, or, json_schema, regex, grammar, any_text, const_string, ...).

The first is rewritten as the second: a triggered_tags format of tags with json_schema contents
(the same grammar). Every schema inside (json_schema formats, and the deprecated
qwen_xml_parameter's) is prepared as a json_schema constraint's is (prepare.py): a keyword
xgrammar would not enforce is refused, or under `relaxed` dropped and reported, with JSON
pointers into the structural tag's JSON; a JSON-style schema's whitespace is bounded as a
json_schema constraint's is, unless the format sets max_whitespace_cnt itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import keywords as kw
from .prepare import prepare_schema
from .refs import pointer_join
from .schema_tree import RelaxedKeyword, SchemaError

FIELD = "structured.structural_tag"
# formats whose "json_schema" member is a JSON schema
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")
# formats that name tokens: xgrammar resolves them with the compiler's vocabulary
TOKEN_FORMATS = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")


@dataclass(frozen=True)
class PreparedTag:
    text: str  # xgrammar's form, {"type": "structural_tag", "format": ...}, schemas prepared
    relaxed: tuple[RelaxedKeyword, ...]  # what is not enforced (only under `relaxed`)
    names_tokens: bool  # a format names tokens (TOKEN_FORMATS)


def prepare_structural_tag(
    text: str, rules: kw.SchemaRules, relaxed: bool, max_whitespace: int
) -> PreparedTag:
    """Raises SchemaError (InvalidArgument, field structured.structural_tag) for a tag that is
    not JSON, a "structures" tag of the wrong shape, or a schema inside that cannot be enforced
    (unless relaxed); xgrammar checks the rest of the format when it compiles it."""
    try:
        tag = json.loads(text)
    except RecursionError:
        raise SchemaError("", "nested too deeply", FIELD) from None
    except ValueError as e:
        raise SchemaError("", f"not valid JSON: {e}", FIELD) from None
    if not isinstance(tag, dict):
        raise SchemaError("", "a structural tag must be a JSON object", FIELD)
    if tag.get("type", "structural_tag") != "structural_tag":
        raise SchemaError("/type", 'must be "structural_tag" (or left out)', FIELD)
    walk = _Walk(rules, relaxed, max_whitespace)
    try:
        if "structures" in tag:
            fmt = walk.structures(tag)
        elif isinstance(tag.get("format"), dict):
            fmt = walk.format(tag["format"], "/format")
        else:
            raise SchemaError(
                "", 'needs "format" (an xgrammar format object) or "structures" and "triggers"', FIELD
            )
    except RecursionError:
        raise SchemaError("", "nested too deeply", FIELD) from None
    out = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    return PreparedTag(out, tuple(dict.fromkeys(walk.dropped)), walk.names_tokens)


class _Walk:
    """One structural tag's formats, copied with their schemas prepared."""

    def __init__(self, rules: kw.SchemaRules, relaxed: bool, max_whitespace: int) -> None:
        self.rules, self.relaxed, self.max_whitespace = rules, relaxed, max_whitespace
        self.dropped: list[RelaxedKeyword] = []
        self.names_tokens = False

    def schema(self, value: Any, at: str) -> Any:
        """A schema at pointer `at` of the request's tag, prepared."""
        if not isinstance(value, (dict, bool)):
            raise SchemaError(at, "a schema must be a JSON object or a boolean", FIELD)
        try:
            prepared = prepare_schema(value, self.rules, self.relaxed, FIELD)
        except SchemaError as e:
            raise SchemaError(at + e.pointer, e.detail, FIELD) from None
        self.dropped += [RelaxedKeyword(at + k.pointer, k.keyword) for k in prepared.relaxed]
        return prepared.schema

    def json_content(self, schema: Any, at: str) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": self.schema(schema, at),
                "max_whitespace_cnt": self.max_whitespace}  # fmt: skip

    def structures(self, tag: dict[str, Any]) -> dict[str, Any]:
        """vLLM's first spelling as a triggered_tags format."""
        structures, triggers = tag["structures"], tag.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise SchemaError("/structures", "must be a non-empty list of {begin, schema, end}", FIELD)
        if not isinstance(triggers, list) or not triggers:
            raise SchemaError("/triggers", "must be a non-empty list of strings", FIELD)
        for i, trigger in enumerate(triggers):
            if not isinstance(trigger, str) or not trigger:
                raise SchemaError(f"/triggers/{i}", "must be a non-empty string", FIELD)
        tags = []
        for i, s in enumerate(structures):
            at = f"/structures/{i}"
            if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
                raise SchemaError(at, "must be an object with begin, schema and end", FIELD)
            for key in ("begin", "end"):
                if not isinstance(s[key], str) or (key == "begin" and not s[key]):
                    raise SchemaError(f"{at}/{key}", "must be a string (begin: not empty)", FIELD)
            content = self.json_content(s["schema"], f"{at}/schema")
            tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
        return {"type": "triggered_tags", "triggers": triggers, "tags": tags}

    def format(self, node: Any, at: str) -> Any:
        """A format (or any value inside one) at pointer `at`, copied."""
        if isinstance(node, list):
            return [self.format(x, pointer_join(at, i)) for i, x in enumerate(node)]
        if not isinstance(node, dict):
            return node
        # (xgrammar infers a format's type left out from its members: "json_schema" makes
        # one a json_schema format)
        kind = node.get("type", "json_schema" if "json_schema" in node else None)
        self.names_tokens |= kind in TOKEN_FORMATS
        if kind not in _SCHEMA_FORMATS or "json_schema" not in node:
            return {k: self.format(v, pointer_join(at, k)) for k, v in node.items()}
        out = dict(node)
        out["json_schema"] = self.schema(node["json_schema"], pointer_join(at, "json_schema"))
        json_style = kind == "json_schema" and node.get("style", "json") == "json"
        if json_style and node.get("max_whitespace_cnt") is None:
            out["max_whitespace_cnt"] = self.max_whitespace
        return out
