"""Which chat templates get a message's text parts as a list, checked on real templates and
against transformers' rendering.

The templates in chat_templates/ are real ones, byte for byte as found in:
- huggingface.js packages/jinja/test/e2e.test.js: Qwen/Qwen3.5-4B (qwen3_5),
  moonshotai/Kimi-K2-Thinking (kimi_k2_thinking), LiquidAI/LFM2.5-VL-450M (lfm2_5_vl),
  HuggingFaceTB/SmolVLM-Instruct (smolvlm), mistralai/Mistral-Nemo-Instruct-2407
  (mistral_nemo);
- huggingface.js packages/ollama-utils chat-template-automap.ts, the GGUF copies of
  google/gemma-3-*-it (gemma3, ollama's gemma3:1b) and meta-llama/Llama-4-Scout (llama4);
- llama.cpp models/templates: mistralai/Mistral-Small-3.1-24B-Instruct-2503
  (mistral_small_3_1);
- an LM Studio preset of Qwen3-VL-*-Thinking (qwen3_vl_thinking), and transformers'
  llava-onevision conversion script (llava_onevision);
- huggingface.js packages/jinja/test/e2e.test.js (commit fe42e68): meta-llama/
  Llama-3.2-11B-Vision-Instruct (llama3_2_vision);
- text-generation-inference's router chat-template tests: HuggingFaceM4/idefics2-8b-chatty
  (idefics2; Idefics3's is the same with `<|begin_of_text|>` in front).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mmserve.processors.chat_template import render_and_tokenize, render_chat
from mmserve.processors.content_parts import content_format, reads_parts

TEMPLATES = Path(__file__).parent / "chat_templates"
# whether the template reads text parts: what decides how they reach it
READS_PARTS = {
    "qwen3_5": True,  # render_content(message.content, ...): a macro loops over the parts
    "qwen3_vl_thinking": True,  # the same macro, Qwen3-VL's
    "kimi_k2_thinking": True,  # render_content(message), then msg.get('content') in it
    "lfm2_5_vl": True,  # parse_content(message.content)
    "gemma3": True,  # `for item in message['content']`, directly
    "llama4": True,
    "smolvlm": True,
    "llava_onevision": True,  # `message['content'] | selectattr('type', 'equalto', ...)`
    "idefics2": True,
    "llama3_2_vision": True,  # an unguarded loop looks for images; the next has `is string`
    "mistral_small_3_1": True,  # reads user parts; also Nemo's loop below
    "mistral_nemo": False,  # `set tool_calls = message.content` loops over tool calls only
}
# templates whose part loops have no `is string` branch: a string renders as nothing there
READS_ONLY_PARTS = {"smolvlm", "idefics2", "llava_onevision"}
# templates that place images (the rest have no image branch)
VISION = sorted(set(READS_PARTS) - {"mistral_nemo"})


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def with_template(tokenizer: Any, text: str) -> Any:
    clone = copy.copy(tokenizer)  # shares the Rust tokenizer; only the template differs
    clone.chat_template = text
    return clone


def transformers_render(
    tokenizer: Any, messages: list[dict[str, Any]], as_parts: bool, wrap_strings: bool = False
) -> str:
    """transformers' rendering of the messages as an OpenAI-style server passes them: text
    parts as the list, for templates that read parts, else joined by newlines; with
    wrap_strings, each string as one text part."""
    if not as_parts:
        messages = [{**m, "content": _joined(m["content"])} for m in messages]
    if wrap_strings:
        messages = [{**m, "content": _wrapped(m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return str(text)


def _wrapped(content: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _joined(content: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    if isinstance(content, str) or any(p["type"] != "text" for p in content):
        return content
    return "\n".join(p["text"] for p in content)


def test_every_template_is_listed() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(READS_PARTS)


@pytest.mark.parametrize("name", sorted(READS_PARTS))
def test_reads_parts_of_real_templates(name: str) -> None:
    assert reads_parts(template(name)) is READS_PARTS[name]


@pytest.mark.parametrize("name", sorted(READS_PARTS))
def test_content_format_of_real_templates(name: str) -> None:
    expected = "parts_only" if name in READS_ONLY_PARTS else "parts"
    assert content_format(template(name)) == (expected if READS_PARTS[name] else "string")


@pytest.mark.parametrize("name", sorted(READS_PARTS))
def test_string_content_renders_its_text(smollm2_tokenizer: Any, name: str) -> None:
    # A template that reads only lists gets each string as one text part, rendered as
    # transformers renders that part; every other template gets the strings as they are
    # (Llama 3.2 Vision's `is string` branch and its `content | trim` of the first message
    # render a wrapped string differently).
    tok = with_template(smollm2_tokenizer, template(name))
    messages = [
        {"role": "user", "content": "Describe this."},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "What colour?"},
    ]
    expected = transformers_render(tok, messages, True, name in READS_ONLY_PARTS)
    assert render_chat(tok, messages) == expected
    assert all(m["content"] in expected for m in messages)


@pytest.mark.parametrize("name", sorted(READS_ONLY_PARTS))
def test_string_system_and_mixed_content_on_list_only_templates(
    smollm2_tokenizer: Any, name: str
) -> None:
    tok = with_template(smollm2_tokenizer, template(name))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "What colour?"},
    ]
    text, _ = render_and_tokenize(tok, messages, allow_images=True)
    for words in ("Be brief.", "A cat.", "What colour?"):
        assert words in text
    assert "<image>" in text


@pytest.mark.parametrize("name", sorted(READS_PARTS))
def test_text_parts_render_as_transformers_does(smollm2_tokenizer: Any, name: str) -> None:
    # Qwen3.5, Qwen3-VL, Kimi K2 and LFM2.5-VL read the parts in a macro: joined with
    # newlines (as they were before the walk followed macros) they render differently.
    tok = with_template(smollm2_tokenizer, template(name))
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": " this."}]
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": parts},
    ]
    expected = transformers_render(tok, messages, READS_PARTS[name], name in READS_ONLY_PARTS)
    assert render_chat(tok, messages) == expected
    assert ("Describe\n this." in expected) is not READS_PARTS[name]
    assert "A cat." in expected


@pytest.mark.parametrize("name", VISION)
def test_image_parts_render_as_transformers_does(smollm2_tokenizer: Any, name: str) -> None:
    tok = with_template(smollm2_tokenizer, template(name))
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]
    # the parts as they reach the template: an image part without its pixels
    as_given = [p if p["type"] == "text" else {"type": "image"} for p in parts]
    text, _ = render_and_tokenize(tok, [{"role": "user", "content": parts}], allow_images=True)
    expected = transformers_render(tok, [{"role": "user", "content": as_given}], as_parts=True)
    assert text == expected and "Compare" in text


FOLLOWED = {
    # MiMo-V2.5's shape: the macro's parameter has another name
    "macro parameter": (
        "{% macro show(message_content) %}{% for c in message_content %}"
        "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    ),
    "keyword, then a second macro": (
        "{% macro inner(xs) %}{% for x in xs %}{{ x.text }}{% endfor %}{% endmacro %}"
        "{% macro outer(flag, body=none) %}{{ inner(body) }}{% endmacro %}"
        "{% for m in messages %}{{ outer(true, body=m['content']) }}{% endfor %}"
    ),
    "variable, loop filter": (
        "{% for m in messages %}{% set c = m.content if m.content is not string else [] %}"
        "{% for p in c if p.type == 'text' %}{{ p }}{% endfor %}{% endfor %}"
    ),
    "message into a macro, .get": (
        "{% macro show(msg) %}{% for p in msg.get('content') %}{% if 'image' in p %}<img>"
        "{% endif %}{% endfor %}{% endmacro %}{% for m in messages %}{{ show(m) }}{% endfor %}"
    ),
    "selectattr on the type": (
        "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', "
        "'image') %}<image>{% endfor %}{% endfor %}"
    ),
}
NOT_PARTS = {
    "printed whole": "{% for m in messages %}{{ m.content }}{% endfor %}",
    # Mistral Nemo's: content that is a list of tool calls
    "tool calls": (
        "{% for m in messages %}{% set calls = m.content %}{% for c in calls %}{{ c.id }}"
        "{% endfor %}{% endfor %}"
    ),
    "macro printing it whole": (
        "{% macro show(content) %}{{ content | trim }}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% for t in m.tool_calls %}{{ t.type }}"
        "{% endfor %}{% endfor %}"
    ),
    # a string is iterable too
    "characters": (
        "{% for m in messages %}{% for c in m.content %}{{ c | upper }}{% endfor %}{% endfor %}"
    ),
    "syntax error": "{% for m in messages %}{{ m.content",  # rendering reports it
}


# part loops under a string test of the content: strings stay strings ("parts")
STRING_BRANCHES = {
    "else of is string": (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
    ),
    # in an elif after the test, inside a macro, on a name set from the content
    "elif in a macro": (
        "{% macro show(c) %}{% if c is not string and c is not none %}{% for p in c %}"
        "{{ p['text'] }}{% endfor %}{% elif c %}{{ c }}{% endif %}{% endmacro %}"
        "{% for m in messages %}{% set body = m['content'] %}{{ show(body) }}{% endfor %}"
    ),
}
# part loops under no such test: strings are wrapped ("parts_only")
NO_STRING_BRANCH = {
    # the test reads only the first message (its else a part); the loop reads lists only
    "test outside the loop": (
        "{% if messages[0].content is string %}{{ messages[0].content }}"
        "{% else %}{{ messages[0].content[0].text }}{% endif %}"
        "{% for m in messages[1:] %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    ),
    "test of another value": (
        "{% for m in messages %}{% if m.role is string %}{% for p in m.content %}{{ p.text }}"
        "{% endfor %}{% endif %}{% endfor %}"
    ),
}


@pytest.mark.parametrize("text", STRING_BRANCHES.values(), ids=STRING_BRANCHES.keys())
def test_content_format_finds_string_branches(text: str) -> None:
    assert content_format(text) == "parts"


@pytest.mark.parametrize("text", NO_STRING_BRANCH.values(), ids=NO_STRING_BRANCH.keys())
def test_content_format_without_string_branch(text: str) -> None:
    assert content_format(text) == "parts_only"


@pytest.mark.parametrize("text", FOLLOWED.values(), ids=FOLLOWED.keys())
def test_reads_parts_follows_content(text: str) -> None:
    assert reads_parts(text)


@pytest.mark.parametrize("text", NOT_PARTS.values(), ids=NOT_PARTS.keys())
def test_reads_parts_needs_a_loop_reading_parts(text: str) -> None:
    assert not reads_parts(text)
