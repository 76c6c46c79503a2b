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
  llava-onevision conversion script (llava_onevision).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mmserve.processors.chat_template import render_and_tokenize, render_chat
from mmserve.processors.content_parts import reads_parts

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
    "mistral_small_3_1": True,  # reads user parts; also Nemo's loop below
    "mistral_nemo": False,  # `set tool_calls = message.content` loops over tool calls only
}
# templates that place images (the rest have no image branch)
VISION = sorted(set(READS_PARTS) - {"mistral_nemo"})


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def with_template(tokenizer: Any, text: str) -> Any:
    clone = copy.copy(tokenizer)  # shares the Rust tokenizer; only the template differs
    clone.chat_template = text
    return clone


def transformers_render(tokenizer: Any, messages: list[dict[str, Any]], as_parts: bool) -> str:
    """transformers' rendering of the messages as an OpenAI-style server passes them: text
    parts as the list, for templates that read parts, else joined by newlines."""
    if not as_parts:
        messages = [{**m, "content": _joined(m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return str(text)


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
    expected = transformers_render(tok, messages, READS_PARTS[name])
    assert render_chat(tok, messages) == expected
    assert ("Describe\n this." in expected) is not READS_PARTS[name]


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


@pytest.mark.parametrize("text", FOLLOWED.values(), ids=FOLLOWED.keys())
def test_reads_parts_follows_content(text: str) -> None:
    assert reads_parts(text)


@pytest.mark.parametrize("text", NOT_PARTS.values(), ids=NOT_PARTS.keys())
def test_reads_parts_needs_a_loop_reading_parts(text: str) -> None:
    assert not reads_parts(text)
