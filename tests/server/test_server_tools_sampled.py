"""Forced tool_choice (required, a named function) sampled at temperature 1 on tiny random
models with real tool-calling chat templates (hermes, Qwen2.5, Mistral NeMo), as vLLM's
tests/tool_use do: random weights leave the grammar to do all the work, so every output is
checked against the reference, jsonschema, over tricky schemas and tool names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from mmserve.server.config import ModelSpec
from mmserve_client import Client, MMServeError
from tests.server.conftest import ServerThread, serve
from tests.server.test_server_tools import HERMES_TEMPLATE
from tests.utils.chat_templates import QWEN25_TEMPLATE
from tests.utils.tiny_models import make_tiny_model, make_tiny_tokenizer

MISTRAL = Path(__file__).parents[1] / "processors" / "chat_templates" / "mistral_nemo.jinja"
TEMPLATES = {"hermes": HERMES_TEMPLATE, "qwen25": QWEN25_TEMPLATE, "mistral": MISTRAL.read_text()}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"$ref": "#/$defs/flag"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any] | None] = {
    "weather.get-current": {  # enums with a quote and a newline, nested, arrays, optionals
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["c", "f", 'k"\n']},
            "where": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
                "required": ["city"],
            },
            "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["unit", "where"],
    },
    "no_params": None,  # no parameters_json at all
    "ref-tool": {
        "type": "object",
        "$defs": {"point": POINT, "flag": {"type": "boolean"}},
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "echo": {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 10},
            "opt": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
        },
        "required": ["s"],
    },
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, **({"parameters": s} if s else {})}}
    for n, s in SCHEMAS.items()
]  # fmt: skip
ASK = [{"role": "user", "content": "Do it."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    specs = []
    for seed, (name, template) in enumerate(TEMPLATES.items()):
        arch = "mistral" if name == "mistral" else "qwen2"
        root = tmp_path_factory.mktemp(name)
        path = make_tiny_model(root, arch=arch, seed=seed, name=name, max_position_embeddings=2048)
        tokenizer = make_tiny_tokenizer()
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)
        specs.append(ModelSpec(name, str(path)))
    server = serve(specs)
    yield server
    server.stop()


def _joined(chunks: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in chunk.tool_calls:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.name
            call[1] += d.arguments_delta
    return "".join(c.text for c in chunks), [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("model", sorted(TEMPLATES))
@pytest.mark.parametrize("choice", ["required", "weather.get-current", "no_params", "ref-tool"])
def test_sampled_forced_calls_validate(server: ServerThread, model: str, choice: str) -> None:
    with Client(server.target, timeout=120) as client:
        for seed in range(4):
            kw: dict[str, Any] = {"model": model, "tools": TOOLS, "tool_choice": choice}
            kw.update(temperature=1.0, max_tokens=160, seed=seed)
            result = client.chat(ASK, **kw)
            # a random model pads the JSON with whitespace, so some run out of tokens; a
            # finished output is calls only (vLLM: required's finish reason is tool_calls)
            assert result.finish_reason in ("tool_calls", "length"), result
            if result.finish_reason == "tool_calls":
                assert result.text == "" and result.tool_calls
            for call in result.tool_calls:
                assert call.name == choice or choice == "required" and call.name in SCHEMAS
                schema = SCHEMAS[call.name] or {"type": "object", "properties": {}}
                jsonschema.validate(json.loads(call.arguments), schema)
                if model == "mistral":  # Mistral's templates take 9-character ids only
                    assert len(call.id) == 9 and call.id.isalnum(), call.id
            chunks = list(client.chat_stream(ASK, **kw))
            calls = [(c.name, c.arguments) for c in result.tool_calls]
            assert _joined(chunks) == (result.text, calls)
            assert chunks[-1].finish_reason == result.finish_reason


def test_a_named_function_outside_the_tools_is_refused(server: ServerThread) -> None:
    with Client(server.target, timeout=60) as client, pytest.raises(MMServeError) as e:
        client.chat(ASK, model="hermes", tools=TOOLS, tool_choice="weather.get_current")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.tool_choice.function_name" in e.value.message
