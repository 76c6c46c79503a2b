"""The model outputs of vLLM's and SGLang's tool-parser unit tests, ported to our parsers:
tool names, arguments (compared as JSON objects), and the content around the calls, one-shot
and under every chunking (whole, char by char, 3- and 7-char pieces, split at each position),
with and without the request's tools.

Where a peer expects something else by design, the expectation is ours and a comment says
why. The differences that recur (base.py's contract):
- CONTENT: vLLM drops or keeps text around calls as its parsers happen to (`content=None`
  with prose before and after a Llama 3 call; a leading "\\n" kept after a Mistral array).
  We keep text outside calls verbatim, except whitespace between a call and the content's
  start or end.
- VERBATIM: a marker followed by no complete, valid call stays content exactly (vLLM and
  SGLang drop the marker, emit the fragment of a cut-off call, or drop the text).
- ONE_LIST: pythonic calls are one list at the start of the output (or after
  `<|python_start|>`, which Llama 4's template puts first); SGLang also reads lists after
  prose, which risks reading prose about code as calls.

Sources (stored snapshots of the peers' repositories):
- VLLM_HERMES = vllm tests/tool_parsers/test_hermes_tool_parser.py (and its older copy
  tests/entrypoints/openai/tool_parsers/test_hermes_tool_parser.py)
- VLLM_LLAMA3 = vllm tests/tool_parsers/test_llama3_json_tool_parser.py
- VLLM_PYTHONIC = vllm tests/tool_parsers/test_pythonic_tool_parser.py
- VLLM_LLAMA4 = vllm tests/tool_parsers/test_llama4_pythonic_tool_parser.py
- VLLM_MISTRAL = vllm tests/tool_parsers/test_mistral_tool_parser.py
- SGL_QWEN25 = sglang test/registered/unit/function_call/test_qwen25_detector.py
- SGL_LLAMA32 = sglang test/registered/unit/function_call/test_llama32_detector.py
- SGL_MISTRAL = sglang test/registered/unit/function_call/test_mistral_detector.py (and the
  TestMistralDetector class of test/srt/test_function_call_parser.py)
- SGL_PYTHONIC = sglang test/srt/test_function_call_parser.py, class TestPythonicDetector
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmserve.processors.tool_parsers import ContentDelta, ToolCallDelta, get_parser
from tests.tool_parsers.test_tool_parsers_models import run

Calls = list[tuple[str, dict[str, Any]]]

WEATHER_SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}
DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
BASH = {"command": "print(\"hello world!\")\nre.compile(r'{}')"}
BASH_OUT = 'bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')'

# vllm tests/entrypoints/openai/tool_parsers/test_hermes_tool_parser.py: a QwQ-32B output,
# its thought (no reasoning parser here, so it is content) then a call after `</think>`.
QWQ_THOUGHT = (
    "好的，用户现在要研发一个5MW的燃气轮机，需要确定总体参数。\n\n首先，燃气轮机的功率主要由"
    "热力学循环参数决定。\n\n总结下来，给出一个范例参数。\n"
)
QWQ_CALL = (
    '<tool_call>\n{"name": "internet_search", "arguments": {"question": "5MW燃气轮机设计参数 '
    '空气流量 压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"}}\n</tool_call>\n\n '
)
QWQ_ARGS = {
    "question": "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"
}

# (format, model output, expected content, expected [(name, arguments object)])
HERMES: list[tuple[str, str, str, Calls]] = [
    # VLLM_HERMES test_tool_call_no_stream / test_tool_call_stream (QwQ-32B output)
    ("hermes", QWQ_THOUGHT + "</think>\n\n" + QWQ_CALL, QWQ_THOUGHT + "</think>",
     [("internet_search", QWQ_ARGS)]),
    ("hermes", QWQ_CALL, "", [("internet_search", QWQ_ARGS)]),
    # VLLM_HERMES test_hermes_parser_streaming_just_forward_text (+ _with_stream_interval)
    ("hermes", "This is some prior text that has nothing to do with tool calling.",
     "This is some prior text that has nothing to do with tool calling.", []),
    ("hermes", "This is plain text with no tool calling involved.",
     "This is plain text with no tool calling involved.", []),
    # VLLM_HERMES test_hermes_parser_non_streaming_no_tool_call
    ("hermes", "This is not a tool call.", "This is not a tool call.", []),
    # VLLM_HERMES test_hermes_parser_streaming_failure_case_bug_19056,
    # test_hermes_parser_non_streaming_tool_call_between_tags, ..._boolean_args_...
    ("hermes", ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n'
     "</tool_call>"), "", [("final_answer", {"trigger": True})]),
    # VLLM_HERMES test_hermes_parser_non_streaming_tool_call_until_eos
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}', "",
     [("final_answer", {"trigger": True})]),
    # VLLM_HERMES test_hermes_parser_non_streaming_tool_call_invalid_json: no call. VERBATIM:
    # the cut-off call is content.
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
     '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}', []),
    # VLLM_HERMES test_hermes_parser_streaming (line continuations: no whitespace between)
    ("hermes", ('<tool_call>{"name": "get_current_temperature","arguments": {"location":'
     '"San Francisco, California, United States", "unit": "celsius"}}</tool_call>'), "",
     [("get_current_temperature",
       {"location": "San Francisco, California, United States", "unit": "celsius"})]),
    # VLLM_HERMES test_hermes_streaming_tool_call_with_stream_interval
    ("hermes", ('<tool_call>{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco", "unit": "celsius"}}</tool_call>'), "",
     [("get_current_temperature", {"location": "San Francisco", "unit": "celsius"})]),
    # VLLM_HERMES test_hermes_streaming_content_then_tool_call_with_stream_interval
    ("hermes", ('Sure, let me check the weather.<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "NYC"}}</tool_call>'), "Sure, let me check the weather.",
     [("get_weather", {"city": "NYC"})]),
    # VLLM_HERMES test_hermes_streaming_multiple_tool_calls_with_stream_interval
    ("hermes", ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
     '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>'), "",
     [("search", {"q": "cats"}), ("search", {"q": "dogs"})]),
    # VLLM_HERMES test_hermes_streaming_content_and_tool_call_in_single_chunk
    ("hermes", 'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Hi!",
     [("f", {"x": 1})]),
    # VLLM_HERMES test_hermes_parser_*_end_tag_inside_string (vllm issue 45167)
    ("hermes", ('<tool_call>\n{"name": "edit_file", "arguments": {"content": "예시 태그: '
     '</tool_call> 포함 한국어 본문"}}\n</tool_call>'), "",
     [("edit_file", {"content": "예시 태그: </tool_call> 포함 한국어 본문"})]),
    # VLLM_HERMES test_hermes_parser_non_streaming_end_tag_inside_first_of_two_calls
    ("hermes", ('<tool_call>{"name": "first", "arguments": {"q": "a </tool_call> b"}}</tool_call>'
     '<tool_call>{"name": "second", "arguments": {"q": "c"}}</tool_call>'), "",
     [("first", {"q": "a </tool_call> b"}), ("second", {"q": "c"})]),
    # VLLM_HERMES test_hermes_parser_non_streaming_escaped_quote_before_end_tag
    ("hermes", ('<tool_call>{"name": "say", "arguments": {"text": "say \\"hi\\" </tool_call> '
     'done"}}</tool_call>'), "", [("say", {"text": 'say "hi" </tool_call> done'})]),
    # VLLM_HERMES test_hermes_parser_streaming_start_tag_inside_string
    ("hermes", ('<tool_call>{"name": "edit_file", "arguments": {"content": "opens <tool_call> '
     'and closes </tool_call>"}}</tool_call>'), "",
     [("edit_file", {"content": "opens <tool_call> and closes </tool_call>"})]),
    # SGL_QWEN25 test_single_tool_call, test_tool_call_with_multiple_arguments
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n'
     "</tool_call>"), "", [("get_weather", {"city": "Beijing"})]),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "London", "unit": '
     '"celsius"}}\n</tool_call>'), "", [("get_weather", {"city": "London", "unit": "celsius"})]),
    # SGL_QWEN25 test_normal_text_before_tool_call, test_streaming_text_then_tool_call
    ("hermes", ('Let me check the weather. <tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Tokyo"}}\n</tool_call>'), "Let me check the weather.",
     [("get_weather", {"city": "Tokyo"})]),
    ("hermes", ("I'll look that up. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     '{"city": "Tokyo", "unit": "celsius"}}\n</tool_call>'), "I'll look that up.",
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    # SGL_QWEN25 test_no_tool_call
    ("hermes", "The weather is nice today.", "The weather is nice today.", []),
    # SGL_QWEN25 test_parallel_tool_calls
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "restaurants"}}\n'
     "</tool_call>"), "",
     [("get_weather", {"city": "Beijing"}), ("search", {"query": "restaurants"})]),
    # SGL_QWEN25 test_malformed_json_is_skipped: the good call after a broken one is read.
    # VERBATIM: SGLang drops the broken block; it is content here.
    ("hermes", ("<tool_call>\n{not valid json}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", "
     '"arguments": {"query": "books"}}\n</tool_call>'),
     "<tool_call>\n{not valid json}\n</tool_call>",
     [("search", {"query": "books"})]),
    # SGL_QWEN25 test_streaming_arguments_emitted_after_name, test_streaming_partial_bot_token_*
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>', "",
     [("search", {"query": "x"})]),
    ("hermes", 'hello <tool_call>\n{"name": "search", "arguments": {"query": "hi"}}\n</tool_call>',
     "hello", [("search", {"query": "hi"})]),
    ("hermes", "I think <tool", "I think <tool", []),
]  # fmt: skip

LLAMA3: list[tuple[str, str, str, Calls]] = [
    # VLLM_LLAMA3 test_extract_tool_calls_simple. CONTENT: vLLM returns content None; the text
    # around the call is kept (the space before the call and the one after it both).
    ("llama3_json", ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
     "Would you like to know more?"), "Here is the result:  Would you like to know more?",
     [("getOpenIncidentsTool", {})]),
    # VLLM_LLAMA3 test_extract_tool_calls_with_arguments
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
     "", [("searchTool", {"query": "test query", "limit": 10})]),
    # VLLM_LLAMA3 test_extract_tool_calls_no_json
    ("llama3_json", "This is just some text without any tool calls",
     "This is just some text without any tool calls", []),
    # VLLM_LLAMA3 test_extract_tool_calls_invalid_json
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}',
     '{"name": "invalidTool", "parameters": {invalid json}', []),
    # VLLM_LLAMA3 test_extract_tool_calls_with_arguments_key
    ("llama3_json", '{"name": "searchTool", "arguments": {"query": "test"}}', "",
     [("searchTool", {"query": "test"})]),
    # VLLM_LLAMA3 test_extract_tool_calls_multiple_json
    ("llama3_json", ('{"name": "searchTool", "parameters": {"query": "test1"}}; '
     '{"name": "getOpenIncidentsTool", "parameters": {}}; '
     '{"name": "searchTool", "parameters": {"query": "test2"}}'), "",
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
      ("searchTool", {"query": "test2"})]),
    # VLLM_LLAMA3 test_extract_tool_calls_multiple_json_with_whitespace
    ("llama3_json", ('{"name": "searchTool", "parameters": {"query": "test1"}} ; '
     '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
     '{"name": "searchTool", "parameters": {"query": "test2"}}'), "",
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
      ("searchTool", {"query": "test2"})]),
    # VLLM_LLAMA3 test_extract_tool_calls_multiple_json_with_surrounding_text. CONTENT.
    ("llama3_json", ('Here are the results: {"name": "searchTool", "parameters": {"query": '
     '"test1"}}; {"name": "getOpenIncidentsTool", "parameters": {}}; {"name": "searchTool", '
     '"parameters": {"query": "test2"}} Would you like to know more?'),
     "Here are the results:  Would you like to know more?",
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
      ("searchTool", {"query": "test2"})]),
    # VLLM_LLAMA3 test_extract_tool_calls_deeply_nested_json
    ("llama3_json", ('{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": '
     '{"level4": {"value": "deep"}}}}}}'), "",
     [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]),
    # VLLM_LLAMA3 test_extract_tool_calls_multiple_with_deep_nesting
    ("llama3_json", ('{"name": "simpleTool", "parameters": {"value": "test"}}; {"name": '
     '"complexTool", "parameters": {"config": {"database": {"connection": {"pool": {"size": '
     "10}}}}}}"), "",
     [("simpleTool", {"value": "test"}),
      ("complexTool", {"config": {"database": {"connection": {"pool": {"size": 10}}}}})]),
    # VLLM_LLAMA3 test_extract_tool_calls_with_quotes_and_brackets_in_string
    ("llama3_json", ('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
     '"nested": {"inner": "more {brackets}"}}}'), "",
     [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]),
    # VLLM_LLAMA3 test_extract_tool_calls_with_escaped_quotes_in_nested_json
    ("llama3_json", '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
     "", [("parserTool", {"text": 'He said "Hello {world}"'})]),
    # VLLM_LLAMA3 test_extract_tool_calls_missing_name_key, ..._missing_parameters_and_arguments_key
    ("llama3_json", '{"parameters": {}}', '{"parameters": {}}', []),
    ("llama3_json", '{"name": "toolWithoutParams"}', '{"name": "toolWithoutParams"}', []),
    # VLLM_LLAMA3 test_regex_timeout_handling (its input; no regex to time out here)
    ("llama3_json", "{hello world[A(A=" + "\t)A(A=,\t" * 2, "{hello world[A(A=" + "\t)A(A=,\t" * 2,
     []),
    # SGL_LLAMA32 test_single_tool_call_with_python_tag, ..._without_python_tag
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Beijing"}}', "",
     [("get_weather", {"city": "Beijing"})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Beijing"}}', "",
     [("get_weather", {"city": "Beijing"})]),
    # SGL_LLAMA32 test_normal_text_before_python_tag (SGLang keeps the trailing space)
    ("llama3_json", ('Let me check. <|python_tag|>{"name": "get_weather", "arguments": '
     '{"city": "Tokyo"}}'), "Let me check.", [("get_weather", {"city": "Tokyo"})]),
    # SGL_LLAMA32 test_multiple_json_objects
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Beijing"}};'
     '{"name": "search", "arguments": {"query": "restaurants"}}'), "",
     [("get_weather", {"city": "Beijing"}), ("search", {"query": "restaurants"})]),
    # SGL_LLAMA32 test_streaming_text_then_tool_call
    ("llama3_json", ("I'll look that up. <|python_tag|>{\"name\": \"get_weather\", \"arguments\": "
     '{"city": "Tokyo", "unit": "celsius"}}'), "I'll look that up.",
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    # SGL_LLAMA32 test_streaming_preserves_non_tool_json: JSON that is not a call, verbatim
    ("llama3_json", "{}", "{}", []),
    ("llama3_json", '{"a": 1} is a dict', '{"a": 1} is a dict', []),
    ("llama3_json", '{"nested": {"name": "get_weather"}, "items": [1, 2]}',
     '{"nested": {"name": "get_weather"}, "items": [1, 2]}', []),
    ("llama3_json", "{\"text\": \"你好 — 'key': 'value'\"}  trailing: 'text'\n",
     "{\"text\": \"你好 — 'key': 'value'\"}  trailing: 'text'\n", []),
    ("llama3_json", "{'text': '你好', 'number': 1} is a Python dict",
     "{'text': '你好', 'number': 1} is a Python dict", []),
    # SGL_LLAMA32 test_streaming_tool_arguments_before_name (the JSON ones; a Python-dict
    # call with single quotes is not JSON, so it stays content here)
    ("llama3_json", '{"arguments": {"city": "Tokyo"}, "name": "get_weather"}', "",
     [("get_weather", {"city": "Tokyo"})]),
    ("llama3_json", '<|python_tag|>{"arguments": {"city": "Tokyo"}, "name": "get_weather"}', "",
     [("get_weather", {"city": "Tokyo"})]),
    ("llama3_json", "{'arguments': {'city': 'Tokyo'}, 'name': 'get_weather'}",
     "{'arguments': {'city': 'Tokyo'}, 'name': 'get_weather'}", []),
    # SGL_LLAMA32 test_streaming_json_before_split_tool_marker
    ("llama3_json", '{}<|python_tag|>{"name": "get_weather", "arguments": {"city": "Tokyo"}}',
     "{}", [("get_weather", {"city": "Tokyo"})]),
    ("llama3_json", ('{"a": 1} <|python_tag|>{"name": "get_weather", "arguments": {"city": '
     '"Tokyo"}}'), '{"a": 1}', [("get_weather", {"city": "Tokyo"})]),
    # SGL_LLAMA32 test_streaming_does_not_echo_explicit_or_unknown_tools. VERBATIM: SGLang
    # swallows a tagged value that is not a call; it is content here.
    ("llama3_json", '<|python_tag|>{"a": 1}', '<|python_tag|>{"a": 1}', []),
]  # fmt: skip

MISTRAL: list[tuple[str, str, str, Calls]] = [
    # VLLM_MISTRAL test_extract_tool_calls_no_tools, ..._streaming_v11_no_tools
    ("mistral", "This is a test", "This is a test", []),
    # VLLM_MISTRAL test_extract_tool_calls_pre_v11_tokenizer (+ _streaming_, _one_chunk)
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', "",
     [("add", {"a": 3.5, "b": 4})]),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San '
     'Francisco", "state": "CA", "unit": "celsius"}}]'), "", [("get_current_weather", WEATHER_SF)]),
    ("mistral", ('[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": '
     '"celsius"}, "name": "get_current_weather"}]'), "", [("get_current_weather", WEATHER_SF)]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', "",
     [("get_age", {"name": "John Doe"})]),
    ("mistral", ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
     '"get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": '
     '"celsius"}}]'), "", [("add", {"a": 3.5, "b": 4}), ("get_current_weather", WEATHER_SF)]),
    ("mistral", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', "",
     [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]', "",
     [("add", {"a": "3", "b": "4"})]),
    ("mistral", ('[TOOL_CALLS] [{"arguments": {"a": 3.5, "b": 4}, "name": "add"}, {"arguments":'
     '{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": '
     '"get_current_weather"}]'), "",
     [("add", {"a": 3.5, "b": 4}), ("get_current_weather", WEATHER_SF)]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello",
     [("add", {"a": 1, "b": 2})]),
    ("mistral", 'Some text[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
     "Some text", [("add", {"a": 1, "b": 2})]),
    # VLLM_MISTRAL trailing_data_after_json: vLLM's one-shot parse drops the text (None), its
    # streaming keeps "\nextra trailing data". CONTENT: kept, its leading newline dropped.
    ("mistral", ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", '
     '"state": "TX", "unit": "fahrenheit"}}]\nextra trailing data'), "extra trailing data",
     [("get_current_weather", DALLAS)]),
    # VLLM_MISTRAL test_extract_tool_calls_pre_v11_multiple_bot_tokens_raises: vLLM refuses
    # two markers of the old format; both calls are read here.
    ("mistral", ('[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}][TOOL_CALLS] [{"name": '
     '"sub", "arguments":{"b": 2}}]'), "", [("add", {"a": 1}), ("sub", {"b": 2})]),
    # VLLM_MISTRAL test_extract_tool_calls_pre_v11_regex_fallback: vLLM searches past junk
    # after the marker. VERBATIM: neither format (an array, or `name{...}`) follows the
    # marker, so it is content.
    ("mistral", '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail',
     '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail', []),
    # VLLM_MISTRAL ..._regex_fallback_fails (vLLM: content "not json at all"). VERBATIM.
    ("mistral", "[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", []),
    # VLLM_MISTRAL test_extract_tool_calls (v11 `[TOOL_CALLS]name{...}`, + _streaming_one_chunk)
    ("mistral", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "",
     [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", ('[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", '
     '"unit": "celsius"}'), "", [("get_current_weather", WEATHER_SF)]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", 'bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "bla",
     [("add_this_and_that", {"a": 3.5, "b": 4})]),
    # VLLM_MISTRAL "wrong_json" / "v11-complex": prose with a brace before the marker
    ("mistral", "hi{hi[TOOL_CALLS]" + BASH_OUT + '"}', "hi{hi", [("bash", BASH)]),
    # VLLM_MISTRAL "complex": the output ends inside the arguments; vLLM emits the cut-off
    # arguments `{"command": "...` (not JSON). VERBATIM: no call, the text is content.
    ("mistral", "hi{hi[TOOL_CALLS]" + BASH_OUT, "hi{hi[TOOL_CALLS]" + BASH_OUT, []),
    # VLLM_MISTRAL test_extract_tool_calls_v11_without_args_skipped (vLLM: tools_called with
    # no call and no content). VERBATIM.
    ("mistral", "[TOOL_CALLS]toolname_no_args", "[TOOL_CALLS]toolname_no_args", []),
    # VLLM_MISTRAL test_extract_tool_calls_streaming (v11 token streams of these calls)
    ("mistral", '[TOOL_CALLS]add{"a": 3, "b": 4}', "", [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS]add_two_strings{"a": "3", "b": "4"}', "",
     [("add_two_strings", {"a": "3", "b": "4"})]),
    ("mistral", ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]get_current_weather{"city": '
     '"San Francisco", "state": "CA", "unit": "celsius"}'), "",
     [("add", {"a": 3.5, "b": 4}), ("get_current_weather", WEATHER_SF)]),
    # SGL_MISTRAL test_detect_and_parse_with_nested_brackets_in_content
    ("mistral", ('[TOOL_CALLS] [{"name":"make_next_step_decision", "arguments":{"decision":"",'
     '"content":"```\\nTOOL: Access a weather API\\nANSWER: [City Name] - [Weather Conditions] - '
     '[Temperature]\\n```"}}]'), "",
     [("make_next_step_decision", {"decision": "", "content": "```\nTOOL: Access a weather API\n"
       "ANSWER: [City Name] - [Weather Conditions] - [Temperature]\n```"})]),
    # SGL_MISTRAL test_detect_and_parse_with_text_before_tool_call, ..._json_array_with_leading_text
    ("mistral", ('Here is some text before the tool call: [TOOL_CALLS] [{"name":'
     '"make_next_step_decision", "arguments":{"decision":"ANSWER", '
     '"content":"The answer is 42"}}]'),
     "Here is some text before the tool call:",
     [("make_next_step_decision", {"decision": "ANSWER", "content": "The answer is 42"})]),
    ("mistral", ('I will check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
     '"Tokyo"}}]'), "I will check.", [("get_weather", {"city": "Tokyo"})]),
    # SGL_MISTRAL test_json_array_multiple_tool_calls, test_tool_call_with_nested_json
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Beijing"}}, '
     '{"name": "search", "arguments": {"query": "restaurants"}}]'), "",
     [("get_weather", {"city": "Beijing"}), ("search", {"query": "restaurants"})]),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Beijing", '
     '"options": {"detailed": true}}}]'), "",
     [("get_weather", {"city": "Beijing", "options": {"detailed": True}})]),
    # SGL_MISTRAL test_compact_format_* (v11 with [ARGS]), test_streaming_text_then_tool_call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Beijing"}', "",
     [("get_weather", {"city": "Beijing"})]),
    ("mistral", 'Let me help. [TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}', "Let me help.",
     [("get_weather", {"city": "Tokyo"})]),
    ("mistral", 'Sure! [TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}', "Sure!",
     [("get_weather", {"city": "Tokyo"})]),
    # SGL_MISTRAL test_json_array_with_invalid_json (SGLang: no content at all). VERBATIM.
    ("mistral", "[TOOL_CALLS] [not valid json]", "[TOOL_CALLS] [not valid json]", []),
]  # fmt: skip

SIMPLE = "get_weather(city='San Francisco', metric='celsius')"
SIMPLE_ARGS = {"city": "San Francisco", "metric": "celsius"}
MORE_TYPES = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
    "role=None, passed_test=True, aliases=['John', 'Johnny'])"
)
MORE_TYPES_ARGS = {
    "name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
    "role": None, "passed_test": True, "aliases": ["John", "Johnny"],
}  # fmt: skip
ESCAPED = r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')"
ESCAPED_ARGS = {"city": "Martha's Vineyard", "metric": '"cool units"'}
LA = ("get_weather", {"city": "LA", "metric": "C"})
DOE = ("register_user", {"name": "Doe", "age": 9})

PYTHONIC: list[tuple[str, str, str, Calls]] = [
    # VLLM_PYTHONIC test_no_tool_call (and VLLM_LLAMA4's)
    ("pythonic", "How can I help you today?", "How can I help you today?", []),
    # VLLM_PYTHONIC test_tool_call (each case streamed and not)
    ("pythonic", f"[{SIMPLE}]", "", [("get_weather", SIMPLE_ARGS)]),
    ("pythonic", f"[{MORE_TYPES}]", "", [("register_user", MORE_TYPES_ARGS)]),
    ("pythonic", "[get_weather()]", "", [("get_weather", {})]),
    ("pythonic", "[do_something_cool(additional_data={})]", "",
     [("do_something_cool", {"additional_data": {}})]),
    ("pythonic", "[do_something_cool(steps=[])]", "", [("do_something_cool", {"steps": []})]),
    ("pythonic", f"[{ESCAPED}]", "", [("get_weather", ESCAPED_ARGS)]),
    ("pythonic", f"[{SIMPLE}, {MORE_TYPES}]", "",
     [("get_weather", SIMPLE_ARGS), ("register_user", MORE_TYPES_ARGS)]),
    # VLLM_PYTHONIC test_streaming_tool_call_with_large_steps
    ("pythonic", f"[{SIMPLE}, get_weather(), do_something_cool(steps=[])]", "",
     [("get_weather", SIMPLE_ARGS), ("get_weather", {}), ("do_something_cool", {"steps": []})]),
    # VLLM_PYTHONIC / VLLM_LLAMA4 test_regex_timeout_handling (their input)
    ("pythonic", "hello world[A(A=" + "\t)A(A=,\t" * 2, "hello world[A(A=" + "\t)A(A=,\t" * 2, []),
    # VLLM_LLAMA4 test_tool_call
    ("pythonic", "[get_weather(city='LA', metric='C')]", "", [LA]),
    ("pythonic", "[get_weather(city='LA',metric='C'),register_user(name='Doe',age=9)]", "",
     [LA, DOE]),
    ("pythonic", "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>", "", [LA]),
    ("pythonic", ("<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', "
     "age=9)]"), "", [LA, DOE]),
    # VLLM_LLAMA4 test_streaming_tool_call_with_large_steps
    ("pythonic", ("<|python_start|>[get_weather(city='LA', metric='C'), get_weather(), "
     "do_something_cool(steps=[])]<|python_end|>"), "",
     [LA, ("get_weather", {}), ("do_something_cool", {"steps": []})]),
    # SGL_PYTHONIC test_parse_streaming_no_brackets
    ("pythonic", "This is just normal text without any tool calls.",
     "This is just normal text without any tool calls.", []),
    # SGL_PYTHONIC test_parse_streaming_bracket_without_text_before, ..._nested_brackets(_dict),
    # ..._multiple_tools_with_nested_brackets, ..._partial_(nested_)brackets
    ("pythonic", "[search(query='python programming')]", "",
     [("search", {"query": "python programming"})]),
    ("pythonic", "[get_weather(location='New York', unit='celsius', data=[1, 2, 3])]", "",
     [("get_weather", {"location": "New York", "unit": "celsius", "data": [1, 2, 3]})]),
    ("pythonic", "[search(query='test', config={'options': [1, 2], 'nested': {'key': 'value'}})]",
     "", [("search",
            {"query": "test", "config": {"options": [1, 2], "nested": {"key": "value"}}})]),
    ("pythonic", ("[get_weather(location='Paris', data=[10, 20]), search(query='test', "
     "filters=['a', 'b'])]"), "",
     [("get_weather", {"location": "Paris", "data": [10, 20]}),
      ("search", {"query": "test", "filters": ["a", "b"]})]),
    ("pythonic", "[get_weather(location='Paris')]", "", [("get_weather", {"location": "Paris"})]),
    # SGL_PYTHONIC test_parse_streaming_text_after_tool_call (SGLang keeps the leading space)
    ("pythonic", "[get_weather(location='Tokyo')] Here's the forecast:", "Here's the forecast:",
     [("get_weather", {"location": "Tokyo"})]),
    # SGL_PYTHONIC test_parse_streaming_complete_tool_call, ..._text_before_tool_call,
    # ..._partial_tool_call. ONE_LIST: SGLang reads a list after prose as calls; here only the
    # output's start holds calls, so these are content.
    ("pythonic", "Here's a tool call: [get_weather(location='New York', unit='celsius')]",
     "Here's a tool call: [get_weather(location='New York', unit='celsius')]", []),
    ("pythonic", "This is some text before [get_weather(location='London')]",
     "This is some text before [get_weather(location='London')]", []),
    ("pythonic", "Let me check the weather: [get_weather(location='Paris')]",
     "Let me check the weather: [get_weather(location='Paris')]", []),
    # SGL_PYTHONIC test_parse_streaming_multiple_tool_calls: ONE_LIST, the first list only.
    ("pythonic", "[get_weather(location='Berlin')] and [search(query='restaurants')]",
     "and [search(query='restaurants')]", [("get_weather", {"location": "Berlin"})]),
    # SGL_PYTHONIC test_parse_streaming_opening_bracket_only (held while it may be a call;
    # at the end it is content)
    ("pythonic", "Let's try this: [", "Let's try this: [", []),
    # SGL_PYTHONIC test_parse_streaming_with_python_start_and_end_token,
    # test_detect_and_parse_with_python_start_and_end_token. ONE_LIST: Llama 4's template
    # puts `<|python_start|>` first in the message, so prose before it is not the format.
    ("pythonic", ("Here's a call: <|python_start|>[get_weather(location='Tokyo', data=[1, 2, "
     "3])]<|python_end|>"), ("Here's a call: <|python_start|>[get_weather(location='Tokyo', "
     "data=[1, 2, 3])]<|python_end|>"), []),
    ("pythonic", ("<|python_start|>[get_weather(location='Mars', unit='celsius')]<|python_end|> "
     "In this way we will get the weather in Mars."),
     "In this way we will get the weather in Mars.",
     [("get_weather", {"location": "Mars", "unit": "celsius"})]),
]  # fmt: skip

CASES = HERMES + LLAMA3 + MISTRAL + PYTHONIC


def accept_all(name: str, arguments: str) -> bool:
    return True


def chunkings(text: str) -> list[list[str]]:
    """Whole, char by char, in 3- and 7-char pieces, and split in two at every position."""
    pieces = [[text[i : i + n] for i in range(0, len(text), n)] for n in (3, 7)]
    return [[text], list(text), *pieces] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


def as_objects(result: tuple[str, list[tuple[str, str]]]) -> tuple[str, Calls]:
    content, calls = result
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_peer_case_under_every_chunking(fmt: str, text: str, content: str, calls: Calls) -> None:
    expected = (content, calls)
    for accept in (None, accept_all):  # the request's tools do not change these outputs
        for chunks in chunkings(text):
            assert as_objects(run(fmt, chunks, accept)) == expected, (accept, chunks)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_peer_case_arguments_are_canonical(fmt: str, text: str, content: str, calls: Calls) -> None:
    """API.md: a call's argument deltas join to its complete JSON arguments (here: the one
    delta of a completed call, in canonical compact form), with an id and its index."""
    stream = get_parser(fmt).stream()
    deltas = stream.feed(text) + stream.finish()
    tool_deltas = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [d.index for d in tool_deltas] == list(range(len(calls)))
    assert all(d.id for d in tool_deltas)
    assert [d.arguments_delta for d in tool_deltas] == [
        json.dumps(args, separators=(",", ":"), ensure_ascii=False) for _, args in calls
    ]


def test_content_streams_before_the_call() -> None:
    """VLLM_HERMES test_hermes_streaming_content_then_tool_call_with_stream_interval, SGL_QWEN25
    test_streaming_partial_bot_token_does_not_leak_prefix: prose streams as it arrives, and a
    tail that may start the tag is held, never given out as content."""
    stream = get_parser("hermes").stream()
    assert stream.feed("Sure, let me check the weather.") == [
        ContentDelta("Sure, let me check the weather.")
    ]
    stream = get_parser("hermes").stream()
    out = stream.feed("I think <tool")
    assert "<" not in "".join(d.text for d in out if isinstance(d, ContentDelta))
    assert not [d for d in out if isinstance(d, ToolCallDelta)]


def test_llama3_json_answer_is_released_when_it_closes() -> None:
    """SGL_LLAMA32 test_streaming_non_tool_json_is_released_when_complete."""
    stream = get_parser("llama3_json").stream(accept_all)
    assert stream.feed('{"a":') == []
    assert stream.feed(" 1}") == [ContentDelta('{"a": 1}')]


# SGL_LLAMA32 / SGL_QWEN25 unknown tools: SGLang drops a call to a tool the request does not
# have (and its text). VERBATIM: it is not a call, and its text is content (base.py).
UNKNOWN_TOOLS = [
    ("llama3_json", '{"name": "unknown", "arguments": {"city": "Tokyo"}}'),
    ("llama3_json", '<|python_tag|>{"name": "unknown", "arguments": {"city": "Tokyo"}}'),
    ("llama3_json", '{"name":"unknown","arguments":{"city":"Tokyo"}}'),
    ("hermes", '<tool_call>\n{"name": "mystery", "arguments": {"x": 1}}\n</tool_call>'),
]


@pytest.mark.parametrize(("fmt", "text"), UNKNOWN_TOOLS)
def test_unknown_tools_stay_content(fmt: str, text: str) -> None:
    def known(name: str, arguments: str) -> bool:
        return name in ("get_weather", "search")

    for chunks in chunkings(text):
        assert run(fmt, chunks, known) == (text, [])


def test_text_after_python_end_survives_streaming() -> None:
    """Found porting SGL_PYTHONIC: once the end tag was read with peek in a chunk not yet
    joined, the reader's window was misaligned, so the text after `<|python_end|>` came out
    as a fragment of the tag ("<|") and the rest was lost (reader.py)."""
    text = "[f(a=1)]<|python_end|> x"
    for chunks in chunkings(text):
        assert run("pythonic", chunks, None) == ("x", [("f", '{"a":1}')]), chunks
