"""Request parameters, validated at the edge before anything reaches the engine."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.structured_output.params import StructuredOutputParams

MAX_N = 16  # cap on choices per request
# temperatures below this are greedy (as vLLM takes them): 1 / 1e-300 overflows float32 logits
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # cap on top-k logprobs per token
MAX_STOP_STRINGS = 16
# the scheduler looks each sampled token up in this list, every step: millions of (repeated)
# ids made every step of the engine slow, for every request in it
MAX_STOP_TOKEN_IDS = 1024
# the sampler writes a request's allowed set into its row of the logits every step: the size
# of a large vocabulary (Qwen2's is 151,936) is room for any real allow-list
MAX_ALLOWED_TOKEN_IDS = 1 << 17
# each word is tokenized twice and its variants matched against the output every step
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024


@dataclass
class StructuredOutputsParams:
    """vLLM's spelling of a constraint (`SamplingParams(structured_outputs=...)`), for code
    written against vLLM's offline API: one of json (a schema, dict or JSON text), regex,
    choice, grammar (EBNF or Lark), json_object or structural_tag (dict or JSON text); it
    becomes SamplingParams.structured. disable_any_whitespace is taken (json and json_object);
    disable_fallback is what mmserve always does (a backend that cannot compile a constraint
    refuses it). vLLM's other options are refused (ValueError) rather than ignored:
    disable_additional_properties and whitespace_pattern would change what the output may be."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | Mapping[str, Any] | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _VLLM_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one constraint of {list(_VLLM_KINDS)}, got {given}")
        for option in ("disable_additional_properties", "whitespace_pattern"):
            if getattr(self, option) not in (False, None):
                raise ValueError(f"structured_outputs.{option} is not supported by mmserve")

    def as_structured(self) -> StructuredOutputParams | None:
        """The constraint as SamplingParams.structured takes it (None: none given)."""
        for name, kind in _VLLM_KINDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            compact = self.disable_any_whitespace
            if kind == "json_object":
                return StructuredOutputParams(kind, disable_any_whitespace=compact) if value else None
            if kind == "choice":
                return StructuredOutputParams(kind, tuple(value))
            text = value if isinstance(value, str) else json.dumps(value)
            return StructuredOutputParams(kind, text, disable_any_whitespace=compact)
        return None


# StructuredOutputsParams' fields -> StructuredOutputParams.kind
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object", "structural_tag": "structural_tag"}  # fmt: skip


@dataclass
class SamplingParams:
    """How to sample one request's output. Defaults follow OpenAI / vLLM."""

    max_tokens: int | None = 16  # None = up to the context limit
    # eos and stop_token_ids are masked until this many tokens exist, and no stop string may
    # end in their text
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF semantics over prompt and output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; OpenAI semantics over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; OpenAI semantics over output tokens
    seed: int | None = None  # per-request generator: same seed, same output, whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings (not included unless asked)
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end the output
    ignore_eos: bool = False  # keep going past eos
    n: int = 1  # independent choices
    logprobs: int = 0  # top-k logprobs per sampled token (0 = off); the sampled token always comes too
    prompt_logprobs: int = 0  # top-k logprobs per prompt token (0 = off)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    skip_special_tokens: bool = True  # in detokenised text
    # keep the stop string, or the text of the eos/stop token id, that ended the output
    include_stop_str_in_output: bool = False
    structured: StructuredOutputParams | None = None  # a constraint on the output
    reasoning_budget: int | None = None  # most thinking tokens; then `</think>` is forced
    disable_speculation: bool = False  # no speculative decoding for this request
    allowed_token_ids: list[int] = field(default_factory=list)  # only these may be sampled; [] = any
    bad_words: list[str] = field(default_factory=list)  # words never to be generated (vLLM's)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens
    # bad_words as token sequences (vLLM's variants, processors/bad_words.py): filled by the
    # front end when it validates the request; the sampler reads these, never bad_words
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's keyword for a constraint: read into `structured` when made, then None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is None:
            return
        if self.structured is not None:
            raise TypeError("give structured or structured_outputs, not both")
        self.structured, self.structured_outputs = self.structured_outputs.as_structured(), None

    @property
    def greedy(self) -> bool:
        """Picks the most likely token: temperature 0 (or below SAMPLING_EPS, where dividing
        the logits by it would overflow) or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def banned_after(self, output_token_ids: list[int], eos_token_ids: frozenset[int]) -> set[int]:
        """The tokens bad_words and min_tokens keep out of the token after these output tokens:
        the last token of each bad word whose other tokens the output ends with (vLLM's
        NoBadWordsLogitsProcessor: a one-token word always; only the output's tokens count),
        and while fewer than min_tokens are out, the stop token ids and EOS (unless
        ignore_eos)."""
        out, banned = output_token_ids, set()
        for word in self.bad_words_token_ids:
            before = len(word) - 1
            if before == 0 or (before <= len(out) and out[-before:] == word[:-1]):
                banned.add(word[-1])
        if len(out) >= self.min_tokens:
            return banned
        return banned | set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    def validate(self) -> None:
        """Checks that need no model (`structured` checks itself: its errors name
        structured.*). Raises InvalidArgument naming the field."""
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"{self.min_tokens} exceeds max_tokens ({self.max_tokens}; an unset max_tokens "
                "is the context's room after the prompt, capped by the server)",
            )
        _check(
            _finite(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be a finite number >= 0",
        )
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be a finite number > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_finite(v) and -2 <= v <= 2, name, "must be in [-2, 2]")
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        _check(
            0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.reasoning_budget is None or self.reasoning_budget >= 0,
            "reasoning_budget",
            "must be >= 0",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"{len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
        )
        for tok, bias in self.logit_bias.items():
            _check(_finite(bias) and -100 <= bias <= 100, f"logit_bias[{tok}]", "must be in [-100, 100]")
        _check(
            len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
            "allowed_token_ids",
            f"{len(self.allowed_token_ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS}",
        )
        _check(
            len(self.bad_words) <= MAX_BAD_WORDS,
            "bad_words",
            f"{len(self.bad_words)} words; at most {MAX_BAD_WORDS}",
        )
        for i, word in enumerate(self.bad_words):
            _check(
                0 < len(word) <= MAX_BAD_WORD_CHARS,
                f"bad_words[{i}]",
                f"{len(word)} characters; must be 1 to {MAX_BAD_WORD_CHARS}",
            )
            _check(bool(word.strip()), f"bad_words[{i}]", "must not be only whitespace")
        _check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            "must be >= 1 (unset: no truncation)",
        )

    def validate_for_model(self, vocab_size: int, prompt_len: int, max_model_len: int) -> None:
        """Checks against the model: vocabulary and context length (validate() first)."""
        for tok in self.stop_token_ids:
            _check(0 <= tok < vocab_size, "stop_token_ids", f"token id {tok} outside [0, {vocab_size})")
        for tok in self.logit_bias:
            _check(0 <= tok < vocab_size, "logit_bias", f"token id {tok} outside [0, {vocab_size})")
        if self.allowed_token_ids:
            low, high = min(self.allowed_token_ids), max(self.allowed_token_ids)
            bad = low if low < 0 else high
            _check(
                low >= 0 and high < vocab_size,
                "allowed_token_ids",
                f"token id {bad} outside [0, {vocab_size})",
            )
        room = max_model_len - prompt_len
        if self.max_tokens is not None:
            _check(
                self.max_tokens <= room,
                "max_tokens",
                f"{self.max_tokens} + prompt length {prompt_len} exceeds the context "
                f"limit {max_model_len}",
            )

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)  # type: ignore[arg-type]


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(field_name, message)


POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """How to turn one input's hidden states into a result (embedding, label scores, score)."""

    task: str = "embed"  # "embed" | "classify" | "score"
    normalize: bool = True  # embed: L2-normalise (after Matryoshka truncation)
    dimensions: int | None = None  # embed: keep the first `dimensions` values (Matryoshka)
    activation: bool = True  # classify/score: softmax across labels, sigmoid for a single one

    def validate(self, hidden_size: int | None = None) -> None:
        _check(self.task in POOLING_TASKS, "task", f"must be one of {POOLING_TASKS}")
        if self.dimensions is not None:
            _check(self.dimensions >= 1, "dimensions", "must be >= 1")
            if hidden_size is not None:
                _check(
                    self.dimensions <= hidden_size,
                    "dimensions",
                    f"{self.dimensions} exceeds the model's embedding size {hidden_size}",
                )
