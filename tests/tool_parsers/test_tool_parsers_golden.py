"""Golden outputs per format: several calls in one chunk, calls split inside a JSON string,
text before/after calls, malformed calls (which stay content)."""

from __future__ import annotations

import re

import pytest

from mmserve.errors import InvalidArgument
from mmserve.processors.tool_parsers import (
    ContentDelta,
    ToolCallDelta,
    get_parser,
    parser_for_model,
    parser_names,
)

# (format, model output, expected content, expected [(name, arguments)])
GOLDEN = [
    # hermes / Qwen
    ("hermes", "Just text, no calls. ", "Just text, no calls. ", []),
    (
        "hermes",
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
            "\n</tool_call>"
        ),
        "Let me check.",
        [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", "{}")],
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b \\"q\\" \\u00e9"}}'
            "</tool_call> Done."
        ),
        "Done.",
        [("echo", '{"text":"a </tool_call> b \\"q\\" é"}')],
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> then '
            '<tool_call>{"name": "g", "arguments": {"b": [1, 2.5, null]}}</tool_call>'
        ),
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> then',
        [("g", '{"b":[1,2.5,null]}')],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>{"name": "f"}', "", [("f", "{}")]),  # end tag cut by eos
    ("hermes", '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    ("hermes", "a < b and <tool_cal", "a < b and <tool_cal", []),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        "",
        [("f", '{"x":1}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    # Llama 3 JSON
    (
        "llama3_json",
        (
            '<|python_tag|>{"name": "search", "parameters": {"q": "a;b"}}; {"name": "open", '
            '"parameters": {"id": 3}}'
        ),
        "",
        [("search", '{"q":"a;b"}'), ("open", '{"id":3}')],
    ),
    (
        "llama3_json",
        '\n{"name": "f", "parameters": {"x": {"y": [true]}}}',
        "",
        [("f", '{"x":{"y":[true]}}')],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", 'The call is {"name": "f", "parameters": {}}', "The call is", [("f", "{}")]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}\nHope that helps!',
        "Hope that helps!",
        [("f", "{}")],
    ),
    ("llama3_json", '{"name": "f", "parameters": {}; ', '{"name": "f", "parameters": {}; ', []),
    # Mistral
    (
        "mistral",
        (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", '
            '"arguments": {"x": "[TOOL_CALLS]"}}]'
        ),
        "",
        [("add", '{"a":1,"b":2}'), ("neg", '{"x":"[TOOL_CALLS]"}')],
    ),
    (
        "mistral",
        'I will call it. [TOOL_CALLS] [{"name": "f", "arguments": {}}]\nok',
        "I will call it. \nok",
        [("f", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"nom": "g"}]',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"nom": "g"}]',
        [],
    ),
    ("mistral", "[TOOL_CALLS", "[TOOL_CALLS", []),
    # pythonic
    (
        "pythonic",
        '[get_weather(city="San Francisco, CA", unit=\'celsius\'), find(q="f(x)]", n=2)]',
        "",
        [
            ("get_weather", '{"city":"San Francisco, CA","unit":"celsius"}'),
            ("find", '{"q":"f(x)]","n":2}'),
        ],
    ),
    (
        "pythonic",
        "<|python_start|>[f(a=[1, (2, 3)], b={'k': None})]<|python_end|>",
        "",
        [("f", '{"a":[1,[2,3]],"b":{"k":null}}')],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "[f(os.system('x'))]", "[f(os.system('x'))]", []),  # positional, not literal
    ("pythonic", "[f(a=__import__('os'))]", "[f(a=__import__('os'))]", []),
    ("pythonic", "[f(a=1), g(b=2", "[f(a=1), g(b=2", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), GOLDEN)
def test_golden(fmt: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = get_parser(fmt).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    ids = [c.id for c in got_calls]
    assert all(ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), GOLDEN)
def test_golden_streamed_char_by_char(fmt: str, text: str, content: str, calls: list) -> None:
    stream = get_parser(fmt).stream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == content
    tool_deltas = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [(d.name, d.arguments_delta) for d in tool_deltas] == calls
    assert [d.index for d in tool_deltas] == list(range(len(calls)))


def test_content_streams_before_the_output_ends() -> None:
    stream = get_parser("hermes").stream()
    assert stream.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert stream.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" may start a call
    (call,) = stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    assert isinstance(call, ToolCallDelta) and (call.index, call.name) == (0, "f")


def test_mistral_ids_fit_its_templates() -> None:
    _, calls = get_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)
    _, calls = get_parser("hermes", new_id=lambda: "call_x").parse(
        '<tool_call>{"name": "f"}</tool_call>'
    )
    assert calls[0].id == "call_x"


def test_registry() -> None:
    assert parser_names() == ("hermes", "llama3_json", "mistral", "pythonic")
    with pytest.raises(InvalidArgument, match="valid: hermes, llama3_json, mistral, pythonic"):
        get_parser("qwen9")


@pytest.mark.parametrize(
    ("template", "model_type", "expected"),
    [
        ("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}", None, "hermes"),
        ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "llama", "mistral"),
        (
            'Respond as {"name": function name, "parameters": dictionary of args}',
            None,
            "llama3_json",
        ),
        ("{{- '<|python_tag|>' + tool_call.name }}", None, "llama3_json"),
        ("format [func_name1(params_name1=params_value1)]", None, "pythonic"),
        (None, "qwen3", "hermes"),
        ("{{ messages }}", "Qwen2ForCausalLM", "hermes"),
        (None, "MistralForCausalLM", "mistral"),
        (None, "llama", "llama3_json"),
        (None, "llama4", "pythonic"),
        (None, "gpt2", None),
        (None, None, None),
    ],
)
def test_parser_for_model(
    template: str | None, model_type: str | None, expected: str | None
) -> None:
    assert parser_for_model(template, model_type) == expected
