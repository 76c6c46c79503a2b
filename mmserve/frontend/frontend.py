"""One model's front end: chats into prompts (chat.py), validation (once, into typed engine
requests), the output side (detokenising, stop strings, n > 1 fan-in; tool calls:
tool_stream.py) and the engine client it drives.

It reads the engine's EngineInfo, never the runner or the model. Synchronous and
single-threaded on its engine side (add_* and step); AsyncFrontEnd runs that on a thread.
The gRPC servicer and the offline LLM both call it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmserve.config import DEFAULT_TEMPLATE_TIMEOUT_MS, EngineConfig
from mmserve.engine.client import EngineClient, InProcessClient, start_engine
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.messages import EngineInfo, EngineOutput, EngineRequest
from mmserve.errors import InvalidArgument
from mmserve.frontend import chat
from mmserve.frontend.images import ImagePrompts, check_placeholders
from mmserve.frontend.pooling_inputs import InputEncoder
from mmserve.frontend.prompts import PromptLimit, TokenLimit, encode_prompt
from mmserve.frontend.reasoning import ReasoningOutput, engine_gate, reasoning_output
from mmserve.frontend.tool_stream import ToolOutput
from mmserve.frontend.tools import ToolRequest
from mmserve.inputs import MMInput
from mmserve.outputs import TokenLogprob
from mmserve.params import PoolingParams, SamplingParams
from mmserve.processors.bad_words import bad_words_token_ids
from mmserve.processors.detokenizer import IncrementalDetokenizer
from mmserve.processors.images import DecodedImage
from mmserve.processors.long_texts import TooManyTokens
from mmserve.processors.reasoning_parsers import ReasoningGate
from mmserve.processors.tokenizer import load_tokenizer
from mmserve.structured_output.backend import CompiledGrammar, allocate_bitmask
from mmserve.structured_output.cache import GrammarCache
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.structured_output.schema_tree import RelaxedKeyword


@dataclass
class GenerationDelta:
    """News for one choice of one generation request, with text."""

    request_id: str  # the caller's id (shared by the n choices)
    index: int  # which choice
    text: str  # new text since the last delta
    token_ids: list[int]  # new tokens since the last delta
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # eos/stop token id or the stop string
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    first_scheduled_time: float | None = None  # time.monotonic() when it first ran a step
    num_draft_tokens: int = 0  # speculative guesses checked for this choice so far
    num_accepted_draft_tokens: int = 0  # of those, the ones the model accepted
    # the schema keywords its constraint compiled around (StructuredOutputParams.relaxed);
    # on the delta that finishes the choice only
    relaxed_keywords: tuple[RelaxedKeyword, ...] = ()

    @property
    def ends_on_stop_token(self) -> bool:
        """Whether the last of token_ids is the EOS or stop token id that ended the choice
        (its text is not shown unless include_stop_str_in_output)."""
        return ends_on_stop_token(self.finish_reason, self.stop_reason)


def ends_on_stop_token(finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """Whether an output that finished so ended on an EOS or stop token id (its last)."""
    return finish_reason == "stop" and isinstance(stop_reason, int)


@dataclass
class PooledResult:
    """The result of one pooling request."""

    request_id: str
    output: EngineOutput  # its final output: `pooled` set, or `error` / finish "abort"


@dataclass(frozen=True)
class GenerateJob:
    """A generation request validated by FrontEnd.validate: ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    mm_inputs: tuple[MMInput, ...] = ()  # the prompt's images, placeholders expanded
    reasoning: ReasoningGate | None = None  # for the engine: a budget, a grammar after it


@dataclass
class _Choice:
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None  # None for pooling requests (no text)
    stopped: str | None = None  # the stop string that ended it, once seen


@dataclass
class _Parent:
    children: list[str] = field(default_factory=list)


class FrontEnd:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        structured: StructuredOutputManager | None = None,
        template_timeout_ms: int = DEFAULT_TEMPLATE_TIMEOUT_MS,
    ) -> None:
        """structured: the grammar compiler to share with an in-process engine; None makes
        one of this front end's own on first use. template_timeout_ms: the budget of one
        chat's template render."""
        self.client = client
        self.info: EngineInfo = client.info
        self.tokenizer = tokenizer
        self.template_timeout_ms = template_timeout_ms
        self.images = ImagePrompts.of(self.info)  # None: the model reads no images
        self.input_encoder = InputEncoder(
            tokenizer, self.info.max_pooling_len, self.info.uses_token_types
        )
        self._structured = structured
        self._choices: dict[str, _Choice] = {}
        self._parents: dict[str, _Parent] = {}
        self._ids = itertools.count()
        # compiled grammars whose start state allows some token (compile_grammar checked)
        self._allows_output: weakref.WeakSet[CompiledGrammar] = weakref.WeakSet()

    @classmethod
    def start(
        cls, config: EngineConfig, template_timeout_ms: int = DEFAULT_TEMPLATE_TIMEOUT_MS
    ) -> FrontEnd:
        """Starts the engine of config (in its own process when config.multiprocess)."""
        client, loaded = start_engine(config)
        if loaded is not None:
            return cls(client, loaded.tokenizer, loaded.core.structured, template_timeout_ms)
        info = client.info
        tokenizer = load_tokenizer(info.model_folder, info.gguf_file)
        return cls(client, tokenizer, template_timeout_ms=template_timeout_ms)

    @property
    def tasks(self) -> tuple[str, ...]:
        """What this model serves: "generate", "embed", "classify", "score", "rerank"."""
        return self.info.tasks

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size  # valid token ids are [0, vocab_size)

    @property
    def embedding_size(self) -> int | None:
        """Full embedding size (the bound of Matryoshka `dimensions`); None: no embeddings."""
        return self.info.embedding_size

    def shutdown(self) -> None:
        self.client.shutdown()

    @property
    def core(self) -> EngineCore:
        """The engine core, when it runs in this process (benchmarks and tests look inside);
        TypeError for an engine process."""
        if not isinstance(self.client, InProcessClient):
            raise TypeError("the engine core runs in its own process")
        return self.client.core

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # -- prompts: texts and chats, and the reading of tool calls ------------------------

    def prompt_limit(self, max_prompt_tokens: int | None = None, keep_last: int | None = None) -> PromptLimit:
        """The context's limit on a prompt, or a server's max_prompt_tokens where smaller.
        keep_last: the prompt is cut to its last this many tokens (truncate_prompt_tokens)
        once tokenised, so no length is refused before (the cut prompt is checked)."""
        return PromptLimit(self.info.max_model_len, max_prompt_tokens, keep_last)

    def encode_prompt(
        self,
        text: str,
        add_special_tokens: bool = True,
        limit: PromptLimit | None = None,
        field: str = "prompt",
    ) -> list[int]:
        """The text's token ids (blocking: off the event loop for long texts). A text far
        past `limit` (None: the context's) is refused from a head of it, InvalidArgument on
        field, the rest never tokenised; validate() checks the exact count."""
        limit = limit or self.prompt_limit()
        return encode_prompt(self.tokenizer, text, add_special_tokens, limit, field)

    def render_chat(
        self,
        conversation: chat.ChatInput,
        images: Sequence[DecodedImage] = (),
        limit: TokenLimit | None = None,
    ) -> chat.ChatPrompt:
        """The chat's prompt text, token ids and images (blocking: off the event loop); its
        template is stopped after template_timeout_ms (InvalidArgument on "chat"). limit: a
        rendered text far past it is refused (on "chat") before it is tokenised; None: any
        length."""
        prompts = self.images if self.info.reads_images else None
        max_tokens = None if limit is None else limit.tokens
        try:
            return chat.render(
                self.tokenizer, prompts, conversation, images, self.template_timeout_ms,
                max_tokens,
            )
        except TooManyTokens as e:  # raised only under a limit
            if limit is None:
                raise
            raise limit.error("chat", e.at_least, at_least=True) from None

    def read_tools(
        self,
        request: ToolRequest,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        backend: str,
        parser_name: str | None = None,
    ) -> ToolOutput:
        """How a chat's output is read for tool calls (chat.read_tools: under a forced
        tool_choice it sets params.structured, with `backend`)."""
        return chat.read_tools(
            request, self.tokenizer, self.info.architecture, prompt_token_ids, params, backend,
            parser_name,
        )

    def read_reasoning(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        parser_name: str | None = None,
        field: str = "params.reasoning_budget",
    ) -> ReasoningOutput | None:
        """How the output's thought is read (frontend/reasoning.py); None: the model does not
        reason (then a reasoning_budget is InvalidArgument on `field`).
        parser_name: the operator's --reasoning-parser, over the chat template's."""
        return reasoning_output(self.tokenizer, prompt_token_ids, params, parser_name, field)

    # -- validation: every check that needs the model, once ------------------------------

    def check_token_ids(self, token_ids: Sequence[int], field: str = "token_ids") -> None:
        """Raises InvalidArgument naming field when an id is outside the vocabulary."""
        vocab = self.info.vocab_size
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab):
            return  # builtins at C speed; the bad id is looked for only when there is one
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} is outside the vocabulary [0, {vocab})")

    def check_token_batch(self, inputs: Sequence[Sequence[int]], fields: Sequence[str]) -> None:
        """check_token_ids over several inputs in one vectorised pass (a Python min and max
        per input cost 0.18 ms for 64 x 128 ids): InvalidArgument names the first input that
        holds an id outside the vocabulary, with its first such id."""
        total = sum(map(len, inputs))
        if not total:
            return
        try:
            flat = np.fromiter(itertools.chain.from_iterable(inputs), np.int64, total)
        except OverflowError:  # an id past int64 is out of range too: found input by input
            for ids, field in zip(inputs, fields, strict=True):
                self.check_token_ids(ids, field)
            return
        vocab = self.info.vocab_size
        bad = np.flatnonzero((flat < 0) | (flat >= vocab))
        if bad.size:
            ends = np.cumsum([len(ids) for ids in inputs])
            index = int(np.searchsorted(ends, bad[0], side="right"))
            raise InvalidArgument(
                fields[index], f"token id {flat[bad[0]]} is outside the vocabulary [0, {vocab})"
            )

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        mm_inputs: tuple[MMInput, ...] = (),
        field: str = "prompt",
        params_field: str = "",
        reasoning: ReasoningOutput | None = None,
    ) -> GenerateJob:
        """The request checked against the model; InvalidArgument names the field (the
        prompt's as `field`, a parameter's under `params_field`, e.g. "params.").
        reasoning: the reading of its thought (read_reasoning), for the engine's gate.
        A prompt is cut to its last params.truncate_prompt_tokens first (truncate_prompt)."""
        self.require("generate")
        if not prompt_token_ids:
            raise InvalidArgument(field, "must not be empty")
        with _fields_under(params_field):
            params.validate()
            prompt_token_ids = self.truncate_prompt(prompt_token_ids, params, mm_inputs)
        self.check_token_ids(prompt_token_ids, field)
        limit = self.info.max_model_len
        if len(prompt_token_ids) >= limit:
            raise self.prompt_limit().error(field, len(prompt_token_ids))
        with _fields_under(params_field):
            params.validate_for_model(self.info.vocab_size, len(prompt_token_ids), limit)
            params.bad_words_token_ids = self._bad_words_token_ids(params)
        if params.structured is not None:
            params.structured.validate()
        self._check_images(prompt_token_ids, mm_inputs, field)
        rid = request_id or self.new_request_id()
        gate = engine_gate(reasoning, params)
        return GenerateJob(rid, list(prompt_token_ids), params, cache_salt, mm_inputs, gate)

    @staticmethod
    def truncate_prompt(
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_inputs: tuple[MMInput, ...] = (),
        field: str = "truncate_prompt_tokens",
    ) -> list[int]:
        """The prompt's last params.truncate_prompt_tokens tokens (vLLM's left truncation; the
        prompt as it is when unset or already that short). Cutting cannot keep images'
        placeholders whole: refused where it would cut a prompt with images (InvalidArgument
        on `field`). Cutting twice cuts once; 0 cuts nothing (validate() refuses it)."""
        keep = params.truncate_prompt_tokens
        if keep is None or keep < 1 or len(prompt_token_ids) <= keep:
            return prompt_token_ids
        if mm_inputs:
            raise InvalidArgument(field, "cannot cut a prompt with images; leave it unset")
        return prompt_token_ids[-keep:]

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """params.bad_words as the sampler's token sequences (processors/bad_words.py); a
        one-token word that bans every allowed_token_ids is refused (no token would be left
        to draw)."""
        if not params.bad_words:
            return []
        words = bad_words_token_ids(self.tokenizer, params.bad_words)
        for ids in words:
            self.check_token_ids(ids, "bad_words")
        if params.allowed_token_ids:
            always = {ids[0] for ids in words if len(ids) == 1}
            if always.issuperset(params.allowed_token_ids):
                raise InvalidArgument("bad_words", "bans every one of allowed_token_ids")
        return words

    def require(self, task: str) -> None:
        if task not in self.info.tasks:
            can = ", ".join(self.info.tasks)
            raise InvalidArgument("model", f"this model cannot {task} (it can: {can})")

    def _check_images(
        self, prompt_token_ids: list[int], mm_inputs: tuple[MMInput, ...], field: str
    ) -> None:
        """Images only for models that read them; placeholder tokens exactly where images are
        (field: the prompt's, e.g. token_ids for ids sent as they are)."""
        if self.images is None or not self.info.reads_images:
            if mm_inputs:
                raise InvalidArgument("images", "this model does not read images")
            return
        check_placeholders(prompt_token_ids, self.images.image_token_id, mm_inputs, field)

    @functools.cached_property
    def structured(self) -> StructuredOutputManager:
        """Compiles output constraints for this model (built on first use)."""
        if self._structured is not None:
            return self._structured
        info = self.info  # bitmasks cover the logits' full width
        return StructuredOutputManager(self.tokenizer, info.logits_width, sorted(info.eos_token_ids))

    def grammar_cache(self) -> GrammarCache | None:
        """The grammar cache once this front end has one (metrics read its counters)."""
        manager = self._structured or self.__dict__.get("structured")  # built, not building it
        return manager.cache if manager is not None else None

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """params.structured compiled (cached; blocks: call it off the event loop). The
        engine compiles it again for itself; here it refuses a bad one, naming its field,
        and one that allows no output at all (`root ::= root`): the engine would have no
        token to draw."""
        if params.structured is None:
            return None
        grammar = self.structured.compile(params.structured)
        if grammar not in self._allows_output:
            bitmask = allocate_bitmask(1, self.info.logits_width)
            grammar.matcher().fill_bitmask(bitmask, 0)  # the start state's tokens, EOS too
            if not bool(bitmask.any()):
                raise InvalidArgument(
                    params.structured.field, "allows no output at all (not even an empty one)"
                )
            self._allows_output.add(grammar)
        return grammar

    # -- the engine side: one thread --------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        cache_salt: str | None = None, mm_inputs: tuple[MMInput, ...] = (),
    ) -> None:
        """validate() then add(), compiling a constraint here (blocking): for callers that
        step the engine themselves (benchmarks, tests)."""
        job = self.validate(
            prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
            mm_inputs=mm_inputs,
        )
        self.compile_grammar(params)
        self.add(job)

    def add(self, job: GenerateJob) -> None:
        """Sends a validated request to the engine: one engine request per choice."""
        if job.request_id in self._parents:
            raise InvalidArgument("request_id", f"{job.request_id!r} is already in flight")
        params, prompt = job.params, job.prompt_token_ids
        max_tokens = params.max_tokens or self.info.max_model_len - len(prompt)
        parent = self._parents[job.request_id] = _Parent()
        requests = []
        for i in range(params.n):
            child = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i
            )
            child_id = f"{job.request_id}#{i}"
            self._choices[child_id] = _Choice(job.request_id, i, self._detokenizer(prompt, params))
            parent.children.append(child_id)
            requests.append(EngineRequest(
                child_id, prompt, child, self.info.eos_token_ids, max_tokens, job.cache_salt,
                job.mm_inputs, reasoning=job.reasoning,
            ))
        self.client.add(requests)

    def _detokenizer(self, prompt: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def add_pooling(
        self,
        items: Sequence[tuple[str, list[int], list[int] | None, tuple[MMInput, ...]]],
        params: PoolingParams,
    ) -> None:
        """Sends pooling inputs, (request id, token ids, segment ids, images) each, as one
        batch; each gets one PooledResult. A pooling plan's encode() checked them (the one
        validation of pooling inputs: frontend/pooling_plans.py)."""
        requests = []
        parents, choices = self._parents, self._choices
        unused = SamplingParams(max_tokens=1)  # read by nothing, shared by the batch
        for request_id, ids, type_ids, mm_inputs in items:
            if request_id in parents:
                raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
            child_id = f"{request_id}#0"
            parents[request_id] = _Parent([child_id])
            choices[child_id] = _Choice(request_id, 0, None)
            requests.append(EngineRequest(
                child_id, ids, unused, frozenset(), 0,
                pooling=params, token_type_ids=type_ids, mm_inputs=mm_inputs,
            ))
        self.client.add(requests)

    def abort(self, request_id: str) -> None:
        parent = self._parents.get(request_id)
        if parent is not None:
            self.client.abort(parent.children)

    def is_active(self, request_id: str) -> bool:
        """Whether any choice of the request is still running."""
        return request_id in self._parents

    @property
    def has_unfinished(self) -> bool:
        return self.client.has_unfinished

    def step(self) -> list[GenerationDelta | PooledResult]:
        """The engine's news since the last call, as text deltas and pooled results."""
        return [self._news(o) for o in self.client.outputs() if o.request_id in self._choices]

    def step_deltas(self) -> list[GenerationDelta]:
        """step() for callers that run only generation requests (benchmarks)."""
        return [d for d in self.step() if isinstance(d, GenerationDelta)]

    def _news(self, out: EngineOutput) -> GenerationDelta | PooledResult:
        choice = self._choices[out.request_id]
        if choice.detok is None:
            self._forget(out.request_id, choice)
            return PooledResult(choice.parent_id, out)
        text, stop_reason, finish = "", out.stop_reason, out.finish_reason
        token_ids, logprobs = out.new_token_ids, out.new_logprobs
        on_token = ends_on_stop_token(finish, stop_reason)  # (its text is not shown)
        if token_ids and choice.stopped is None:
            texts = []
            # several tokens (speculative decoding): one at a time, so that the tokens after
            # the one that completes a stop string are dropped, as they would never have come
            for i, token in enumerate(token_ids):
                d = choice.detok.update([token], on_token and i == len(token_ids) - 1)
                texts.append(d.text_delta)
                if d.stopped_on is not None:
                    choice.stopped = d.stopped_on
                    stop_reason, finish = d.stopped_on, "stop"
                    self.client.stop(out.request_id)
                    token_ids, logprobs = token_ids[: i + 1], logprobs and logprobs[: i + 1]
                    break
            text = "".join(texts)
        if finish is not None and finish != "abort" and choice.stopped is None:
            d = choice.detok.finish()
            text += d.text_delta
            if d.stopped_on is not None:  # in the text of a character the output left unfinished
                stop_reason, finish = d.stopped_on, "stop"
        if finish is not None:
            self._forget(out.request_id, choice)
        return GenerationDelta(
            request_id=choice.parent_id,
            index=choice.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_logprobs=out.prompt_logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            error=out.error,
            first_scheduled_time=out.first_scheduled_time,
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_draft_tokens=out.num_accepted_draft_tokens,
        )

    def _forget(self, child_id: str, choice: _Choice) -> None:
        del self._choices[child_id]
        parent = self._parents.get(choice.parent_id)
        if parent is not None:
            parent.children.remove(child_id)
            if not parent.children:
                del self._parents[choice.parent_id]


@contextlib.contextmanager
def _fields_under(prefix: str) -> Iterator[None]:
    """An InvalidArgument raised inside names its field under prefix (e.g. "params.")."""
    try:
        yield
    except InvalidArgument as e:
        if not prefix:
            raise
        raise InvalidArgument(prefix + e.field, str(e).removeprefix(f"{e.field}: ")) from e
