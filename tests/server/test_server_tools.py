"""Tool calling end to end, on a tiny random model whose chat template renders tools in the
hermes / Qwen style. Its free output is noise, so calls are made by the grammar: a forced
tool_choice (required, named), or under auto a `choice` constraint that spells out a call in
the model's format, which the hermes parser then reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from tokenizers import AddedToken

from mmserve import envs
from mmserve.frontend.tool_stream import tool_output
from mmserve.frontend.tools import ToolRequest, ToolSpec, forced_constraint
from mmserve.params import SamplingParams
from mmserve.processors.tool_parsers import ToolCallDelta, get_parser
from mmserve.server.cli import build_parser, server_config
from mmserve.server.config import ModelSpec, ServerConfig
from mmserve_client import Client, MMServeError, ToolCall
from tests.server.conftest import ServerThread, serve
from tests.utils.tiny_models import make_tiny_model, make_tiny_tokenizer

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_SCHEMA = {  # a $ref, so the forced schema must move the tool's references
    "type": "object",
    "$defs": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "properties": {
        "city": {"$ref": "#/$defs/city"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
OPEN_SCHEMA = {"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "is_open": OPEN_SCHEMA}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _call_text(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(
        tmp_path_factory.mktemp("tools"),
        arch="qwen2",
        seed=3,
        name="tiny-tools",
        max_position_embeddings=2048,
    )
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tools_server(tools_model: Path) -> Iterator[ServerThread]:
    server = serve([ModelSpec("tiny-tools", str(tools_model))])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_padding(tools_server: ServerThread) -> dict[int, float]:
    """logit_bias against whitespace and commas: a random model would otherwise pad the JSON
    and add calls until max_tokens. (Where the grammar needs a comma, it is still the only
    choice.)"""
    tokenizer = tools_server.handle().tokenizer
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    return {i: -100.0 for i, t in texts.items() if not t.strip() or "," in t}


@pytest.fixture
def client(tools_server: ServerThread) -> Iterator[Client]:
    with Client(tools_server.target, timeout=60) as c:
        yield c


def _joined(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(text, [(name, arguments)], ids) of a streamed choice, joined by call index."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in chunk.tool_calls:
            call = calls.setdefault(d.index, ["", "", ""])
            call[0] += d.id
            call[1] += d.name
            call[2] += d.arguments_delta
    ordered = [calls[i] for i in sorted(calls)]
    text = "".join(c.text for c in chunks)
    return text, [(n, a) for _, n, a in ordered], [i for i, _, _ in ordered]


def _named(calls: tuple[ToolCall, ...]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("tool_choice", ["required", "get_weather", "is_open"])
def test_forced_calls_validate_and_stream_like_one_shot(
    client: Client, no_padding: dict[int, float], tool_choice: str
) -> None:
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 0}
    kw.update(max_tokens=120, logit_bias=no_padding)
    result = client.chat(ASK, **kw)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert result.tool_calls
    for call in result.tool_calls:
        assert call.id.startswith("call_")
        assert tool_choice == "required" or call.name == tool_choice
        jsonschema.validate(call.parsed_arguments(), SCHEMAS[call.name])
    chunks = list(client.chat_stream(ASK, **kw))
    text, calls, ids = _joined(chunks)
    assert (text, calls) == ("", _named(result.tool_calls))
    assert all(ids) and chunks[-1].finish_reason == "tool_calls"


def test_auto_separates_text_and_calls(client: Client) -> None:
    """Under auto the model's own format is parsed: the grammar only stands in for a model
    that knows how to call."""
    output = "Let me look. " + _call_text("get_weather", {"city": "Oslo", "days": 2})
    kw: dict[str, Any] = {"tools": TOOLS, "choice": [output], "max_tokens": 200}
    result = client.chat(ASK, **kw)
    assert result.text == "Let me look."
    assert _named(result.tool_calls) == [("get_weather", '{"city":"Oslo","days":2}')]
    assert result.finish_reason == "tool_calls"
    text, calls, _ = _joined(list(client.chat_stream(ASK, **kw)))
    assert (text, calls) == (result.text, _named(result.tool_calls))


def test_tool_calls_are_parsed_on_the_models_threads(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parser runs on the model's front-end threads, never on the event loop: a
    degenerate output costs that model's threads only."""
    import threading

    from mmserve.frontend.tool_stream import ChoiceToolStream

    threads: list[str] = []
    real = ChoiceToolStream.update

    def spy(self, *args):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(ChoiceToolStream, "update", spy)
    output = _call_text("get_weather", {"city": "Oslo", "days": 2})
    client.chat(ASK, tools=TOOLS, choice=[output], max_tokens=200)
    assert threads and all(name.startswith("mmserve-frontend") for name in threads), threads


def test_auto_reads_calls_without_their_tags(client: Client) -> None:
    """Small models answer with the call object alone, fenced or bare (issue 17): under auto
    that is a call when it names a tool and is the whole output; other JSON stays text."""
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}})
    for output in [f"```json\n{call}\n```", call]:
        kw: dict[str, Any] = {"tools": TOOLS, "choice": [output], "max_tokens": 200}
        result = client.chat(ASK, **kw)
        assert result.text == "" and result.finish_reason == "tool_calls"
        assert _named(result.tool_calls) == [("get_weather", '{"city":"Oslo","days":2}')]
        text, calls, _ = _joined(list(client.chat_stream(ASK, **kw)))
        assert (text, calls) == ("", _named(result.tool_calls))
    answer = json.dumps({"city": "Oslo", "days": 2})
    result = client.chat(ASK, tools=TOOLS, choice=[answer], max_tokens=200)
    assert (result.text, result.tool_calls, result.finish_reason) == (answer, (), "stop")


def test_calls_outside_the_request_stay_text(client: Client) -> None:
    unknown = _call_text("launch", {"target": "moon"})
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    bad_days = _call_text("get_weather", {"city": "Paris", "days": 9})
    for tools, output in [(TOOLS, unknown), (strict, bad_days)]:
        result = client.chat(ASK, tools=tools, choice=[output], max_tokens=200)
        assert (result.text, result.tool_calls) == (output, ())
        assert result.finish_reason == "stop"
    good = _call_text("get_weather", {"city": "Paris", "days": 3})
    result = client.chat(ASK, tools=strict, choice=[good], max_tokens=200)
    assert _named(result.tool_calls) == [("get_weather", '{"city":"Paris","days":3}')]


def _prompt(server: ServerThread, ids: tuple[int, ...]) -> str:
    return str(server.handle().tokenizer.decode(list(ids)))


def test_tool_choice_none_shows_no_tools_and_parses_nothing(
    client: Client, tools_server: ServerThread
) -> None:
    output = _call_text("get_weather", {"city": "Oslo", "days": 2})
    result = client.chat(ASK, tools=TOOLS, tool_choice="none", choice=[output], max_tokens=200)
    assert (result.text, result.tool_calls, result.finish_reason) == (output, (), "stop")
    prompt = _prompt(tools_server, client.tokenize(ASK, tools=TOOLS, tool_choice="none").token_ids)
    assert "get_weather" not in prompt


def test_multi_turn_renders_calls_and_results(
    client: Client, tools_server: ServerThread, no_padding: dict[int, float]
) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And is it open?"},
    ]  # fmt: skip
    prompt = _prompt(tools_server, client.tokenize(history, tools=TOOLS).token_ids)
    assert _call_text("get_weather", {"city": "Paris", "days": 2}) in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    result = client.chat(
        history,
        tools=TOOLS,
        tool_choice="is_open",
        temperature=0,
        max_tokens=60,
        logit_bias=no_padding,
    )
    assert [c.name for c in result.tool_calls] == ["is_open"]
    assert result.finish_reason == "tool_calls"


# (uniqueItems over objects: a validation keyword no backend enforces; an annotation such as
# contentMediaType is ignored, as validators ignore it)
UNSUPPORTED = {
    "type": "object",
    "properties": {"x": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}},
}
BROKEN = {"type": "object", "properties": {"x": {"type": 5}}}
BAD_PATTERN = {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}


def _tool(schema: dict[str, Any], strict: bool = False) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}}]


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"tools": TOOLS, "tool_choice": "nope"}, "chat.tool_choice.function_name"),
        ({"tools": _tool(UNSUPPORTED), "tool_choice": "required"},
         "chat.tools[0].parameters_json: at /properties/x/uniqueItems"),
        ({"tools": _tool(BROKEN, strict=True)}, "chat.tools[0].parameters_json: at /properties/x/type"),
        ({"tools": _tool(BAD_PATTERN), "tool_choice": "required"},
         "chat.tools[0].parameters_json: at /properties/x/pattern"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "structured.regex"),
        ({"tool_choice": "required"}, "chat.tool_choice.mode"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_named_then_served(
    client: Client, kw: dict[str, Any], named: str
) -> None:
    with pytest.raises(MMServeError) as e:
        client.chat(ASK, max_tokens=4, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.message
    assert client.chat(ASK, tools=TOOLS, max_tokens=2).finish_reason == "length"


def test_forced_schemas_keep_each_tools_references() -> None:
    specs = tuple(
        ToolSpec(n, s, False, f"chat.tools[{i}]") for i, (n, s) in enumerate(SCHEMAS.items())
    )
    required = json.loads(str(forced_constraint(ToolRequest(specs, "required"), "xgrammar").value))
    named_request = ToolRequest(specs, "function", "get_weather")
    named = json.loads(str(forced_constraint(named_request, "xgrammar").value))
    # outlines enforces `minimum` too (a regex over the number's text): it compiles alike
    assert json.loads(str(forced_constraint(named_request, "outlines").value)) == named
    good = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    bad = {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}  # not in the $ref
    jsonschema.validate([good, {"name": "is_open", "arguments": {"open": True}}], required)
    jsonschema.validate(good, named)
    wrong = [(required, [bad]), (required, []), (named, bad), (named, {**good, "name": "is_open"})]
    for schema, instance in wrong:
        assert not jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_markers_that_are_special_tokens_reach_the_parser() -> None:
    """Where the format's markers are special tokens, skip_special_tokens would drop them
    from the engine's text: the choice is detokenised again keeping only the markers."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(m, special=True) for m in ("<tool_call>", "</tool_call>")])
    request = ToolRequest((ToolSpec("f", {"type": "object"}, False, "chat.tools[0]"),), "auto")
    reading = tool_output(request, get_parser("hermes"), tokenizer, [1, 2], SamplingParams())
    assert reading.retext is not None  # the markers are special: a second detokenisation
    output = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><|im_end|>'
    ids = tokenizer.encode(output, add_special_tokens=False)
    stream, text, calls = reading.stream(), "", list[ToolCallDelta]()
    for i, token in enumerate(ids):  # the engine's text (no markers) is not what is parsed
        content, new = stream.update("?", [token], done=i == len(ids) - 1)
        text, calls = text + content, calls + new
    assert text == "Hi" and [(c.name, c.arguments_delta) for c in calls] == [("f", '{"a":1}')]
    assert stream.num_calls == 1


def test_second_detokenisation_hides_the_stop_token_as_the_engines_text_does() -> None:
    """The stop token id that ended the choice shows no text (vLLM) unless asked for, in
    the text the markers are read from too."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(m, special=True) for m in ("<tool_call>", "</tool_call>")])
    request = ToolRequest((ToolSpec("f", {"type": "object"}, False, "chat.tools[0]"),), "auto")
    bang = tokenizer.convert_tokens_to_ids("!")
    ids = tokenizer.encode('Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>!')
    assert ids.count(bang) == 1 and ids[-1] == bang
    for include in (False, True):
        params = SamplingParams(stop_token_ids=[bang], include_stop_str_in_output=include)
        reading = tool_output(request, get_parser("hermes"), tokenizer, [1, 2], params)
        stream, text, calls = reading.stream(), "", list[ToolCallDelta]()
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            content, new = stream.update("?", [token], last, on_stop_token=last)
            text, calls = text + content, calls + new
        assert text.endswith("!") == include
        assert [(c.name, c.arguments_delta) for c in calls] == [("f", "{}")]


def test_server_flags_pick_the_backend_and_the_parser(tools_model: Path) -> None:
    flags = ["serve", "--structured-output-backend", "outlines", "--tool-parser", "mistral"]
    config = server_config(build_parser().parse_args(flags))
    assert (config.structured_output_backend, config.tool_parser) == ("outlines", "mistral")
    env = envs.serve_env({"MMSERVE_STRUCTURED_OUTPUT_BACKEND": "outlines"})
    assert env["structured_output_backend"] == "outlines"
    with pytest.raises(ValueError, match="structured_output_backend"):
        ServerConfig(structured_output_backend="auto")
    with pytest.raises(ValueError, match="valid: hermes, llama3_json, mistral, pythonic"):
        ServerConfig(tool_parser="nope")
    server = serve(
        [ModelSpec("tiny-tools", str(tools_model))],
        structured_output_backend="outlines",
        tool_parser="llama3_json",
    )
    try:
        with Client(server.target, timeout=60) as c:
            with pytest.raises(MMServeError, match="the outlines backend cannot write NUL"):
                c.chat(ASK, choice=["a\x00"], max_tokens=2)  # (the default: outlines)
            # what outlines cannot compile goes to xgrammar under auto; named, it is refused
            assert c.chat(ASK, grammar='root ::= "a"', max_tokens=2).text == "a"
            with pytest.raises(MMServeError, match="outlines backend does not support EBNF"):
                c.chat(ASK, grammar='root ::= "a"', structured_backend="outlines", max_tokens=2)
            # Read as llama3_json, not hermes: the call is found, the tags are prose around it.
            output = _call_text("get_weather", {"city": "Oslo", "days": 2})
            result = c.chat(ASK, tools=TOOLS, choice=[output], max_tokens=200)
            assert result.text == "<tool_call>\n\n</tool_call>"
            assert _named(result.tool_calls) == [("get_weather", '{"city":"Oslo","days":2}')]
    finally:
        server.stop()
