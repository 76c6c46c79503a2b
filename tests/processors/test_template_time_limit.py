"""A chat template that runs too long is stopped in its own thread at the deadline (the thread
is free again, not abandoned) and the chat fails, naming "chat"; the limit changes nothing
about what a template renders in time, which stays transformers' rendering."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.processors.chat_template import render_and_tokenize, render_chat
from mmserve.processors.time_limit import (
    MAX_TEMPLATE_DEPTH,
    TimeLimitExceeded,
    call_with_time_limit,
)
from tests.processors.test_chat_template import QUESTION, with_template

LIMIT_MS = 200
FOREVER = [  # each renders for ever (hours at least) under jinja's sandbox
    # range() is capped at 100,000 items: nest loops over one, making no calls inside
    (
        "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% for k in r %}"
        "{% endfor %}{% endfor %}{% endfor %}"
    ),
    # a macro calling itself twice: 2**60 calls, never deeper than 60
    (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}"
    ),
    # looping over the messages, printing
    (
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{{ m.content[:1] }}{% endfor %}{% endfor %}{% endfor %}"
    ),
]
FAILING_FAST = [
    "{% for i in range(10**12) %}{% endfor %}",  # the sandbox refuses the range
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # Python's recursion limit
]


@pytest.mark.parametrize("template", FOREVER)
def test_endless_template_stops_at_the_deadline(smollm2_tokenizer: Any, template: str) -> None:
    tok = with_template(smollm2_tokenizer, template)
    start = time.monotonic()
    with pytest.raises(InvalidArgument) as err:
        render_and_tokenize(tok, QUESTION, time_limit_ms=LIMIT_MS)
    elapsed = time.monotonic() - start
    assert err.value.field == "chat"
    assert str(err.value) == f"chat: the model's chat template did not finish within {LIMIT_MS} ms"
    assert LIMIT_MS / 1000 <= elapsed < LIMIT_MS / 1000 + 1.0
    assert sys.gettrace() is None  # the tracer is gone again


@pytest.mark.parametrize("template", FAILING_FAST)
def test_sandbox_limits_are_the_chats_error(smollm2_tokenizer: Any, template: str) -> None:
    tok = with_template(smollm2_tokenizer, template)
    with pytest.raises(InvalidArgument) as err:
        render_chat(tok, QUESTION, time_limit_ms=LIMIT_MS)
    assert err.value.field == "chat"
    assert "the model's chat template failed" in str(err.value)


def test_the_thread_is_free_after_the_deadline(smollm2_tokenizer: Any) -> None:
    stuck = with_template(smollm2_tokenizer, FOREVER[0])
    with ThreadPoolExecutor(1) as pool:  # one thread: the next render needs the stuck one's
        first = pool.submit(render_chat, stuck, QUESTION, time_limit_ms=LIMIT_MS)
        second = pool.submit(render_chat, smollm2_tokenizer, QUESTION, time_limit_ms=LIMIT_MS)
        with pytest.raises(InvalidArgument, match="did not finish"):
            first.result(timeout=5)
        expected = smollm2_tokenizer.apply_chat_template(
            QUESTION, add_generation_prompt=True, tokenize=False
        )
        assert second.result(timeout=5) == expected
        assert pool.submit(sys.gettrace).result(timeout=5) is None


def test_rendering_in_time_is_transformers_rendering(smollm2_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION] * 20
    text, ids = render_and_tokenize(smollm2_tokenizer, messages, time_limit_ms=LIMIT_MS)
    expected = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    )
    assert ids == list(expected)
    assert text == smollm2_tokenizer.decode(ids)


def test_no_except_exception_swallows_the_deadline() -> None:
    def step() -> None:
        pass

    def careless() -> None:  # what library code on the way out might do
        while True:
            try:
                step()
            except Exception:  # noqa: BLE001, S112
                continue

    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        call_with_time_limit(0.05, careless)
    assert time.monotonic() - start < 1.0


def test_nesting_is_bounded_well_before_pythons_limit(smollm2_tokenizer: Any) -> None:
    """A macro that recurses 40 deep renders; one that recurses 300 deep (within Python's own
    limit of 1,000 frames, which it would otherwise reach later) stops at MAX_TEMPLATE_DEPTH
    frames of template code, as the chat's error."""
    deep = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% else %}x{% endif %}{% endmacro %}{{ f(N) }}"
    shallow = with_template(smollm2_tokenizer, deep.replace("N", "40"))
    assert render_chat(shallow, QUESTION, time_limit_ms=LIMIT_MS) == "x"
    with pytest.raises(InvalidArgument) as err:
        render_chat(with_template(smollm2_tokenizer, deep.replace("N", "300")), QUESTION, time_limit_ms=LIMIT_MS)
    assert err.value.field == "chat"
    assert f"nested deeper than {MAX_TEMPLATE_DEPTH} calls" in str(err.value)
    assert sys.gettrace() is None  # the tracer is gone again
