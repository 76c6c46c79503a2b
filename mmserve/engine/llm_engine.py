"""One model behind one engine: validation, tokens <-> text, n > 1, stop strings.

Synchronous and single-threaded; the async front end runs it on its own thread."""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserve.config import EngineConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.multimodal import ImagePrompts, MMInput, check_placeholders
from mmserve.engine.pooling_inputs import InputEncoder
from mmserve.engine.pooling_setup import PoolingSetup
from mmserve.errors import InvalidArgument
from mmserve.outputs import EngineOutput, TokenLogprob
from mmserve.params import PoolingParams, SamplingParams
from mmserve.processors.detokenizer import IncrementalDetokenizer
from mmserve.request import Request

if TYPE_CHECKING:
    from mmserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class GenerationDelta:
    """News for one choice of one request, with text."""

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
    pooled: Any = None  # torch.Tensor result of a pooling request, on its final delta
    first_scheduled_time: float | None = None  # time.monotonic() when it first ran a step


@dataclass
class _Choice:
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None  # None for pooling requests (no text)
    stopped: str | None = None  # the stop string that ended it, once seen


@dataclass
class _Parent:
    children: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        setup: PoolingSetup | None = None,
        architecture: str = "",
        images: ImagePrompts | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size  # valid token ids are [0, vocab_size)
        # the tasks this engine serves and how it pools; generation only unless told
        self.setup = setup or PoolingSetup(("generate",), None, None)
        self.architecture = architecture  # HF architecture name, e.g. "BertModel"
        self.images = images  # expands images in prompts; None: the model reads no images
        use_types = getattr(core.runner.model, "type_vocab_size", 1) > 1
        self.input_encoder = InputEncoder(tokenizer, self.max_pooling_len, use_types)
        self._choices: dict[str, _Choice] = {}
        self._parents: dict[str, _Parent] = {}
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from mmserve.engine.loading import load_engine_parts

        return load_engine_parts(config)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def tasks(self) -> tuple[str, ...]:
        """What this engine serves: "generate", "embed", "classify", "score", "rerank"."""
        return self.setup.tasks

    @property
    def max_pooling_len(self) -> int:
        """Token limit of one pooling input: the context, or less where the model's
        sentence-transformers config says so (inputs beyond it were never trained on)."""
        return min(self.max_model_len, self.setup.max_input_len or self.max_model_len)

    def shutdown(self) -> None:
        """Stops the engine-core process, if the core runs in one."""
        close = getattr(self.core, "shutdown", None)
        if close is not None:
            close()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def check_token_ids(self, token_ids: list[int], field: str = "token_ids") -> None:
        """Raises InvalidArgument naming field when an id is outside the vocabulary."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return  # builtins at C speed; the bad id is looked for only when there is one
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} outside [0, {self.vocab_size})")

    @property
    def num_kv_blocks(self) -> int:
        return int(self.core.num_kv_blocks)

    @property
    def device(self) -> str:
        return str(self.core.device)

    @property
    def compute_dtype(self) -> str:
        """The model's dtype, e.g. "bfloat16"."""
        return str(self.core.compute_dtype)

    @property
    def quantization(self) -> str:
        """The loaded weights' quantisation: "fp8", or "" when unquantised."""
        return str(self.core.quantization)

    @property
    def supports_images(self) -> bool:
        return self.images is not None

    @property
    def embeds_images(self) -> bool:
        """A dual encoder (CLIP, SigLIP): Embed takes image inputs."""
        return bool(getattr(self.core.runner.model, "is_dual_encoder", False))

    def check_images(self, prompt_token_ids: list[int], mm_inputs: tuple[MMInput, ...]) -> None:
        """Images only for models that read them; placeholder tokens exactly where images are."""
        if self.images is None:
            if mm_inputs:
                raise InvalidArgument("images", "this model does not read images")
            return
        check_placeholders(prompt_token_ids, self.images.image_token_id, mm_inputs, "prompt")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Every check that needs the model; raises InvalidArgument naming the field."""
        if "generate" not in self.tasks:
            can = ", ".join(self.tasks)
            raise InvalidArgument("model", f"this model cannot generate (it can: {can})")
        if not prompt_token_ids:
            raise InvalidArgument("prompt", "must not be empty")
        self.check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidArgument(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room to generate within the context "
                f"limit {self.max_model_len}",
            )
        params.validate_for_model(self.vocab_size, len(prompt_token_ids), self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        grammar: Any = None,
        mm_inputs: tuple[MMInput, ...] = (),
    ) -> None:
        """grammar: the CompiledGrammar of params.structured when the caller compiled it
        already (off its event loop); compiled here otherwise. mm_inputs: the prompt's images
        as ImagePrompts.process() expanded them."""
        self.validate(prompt_token_ids, params)
        self.check_images(prompt_token_ids, mm_inputs)
        if request_id in self._parents:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
        if params.structured is not None and grammar is None:
            grammar = self.compile_grammar(params)
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        parent = self._parents[request_id] = _Parent()
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i
            )
            child_id = f"{request_id}#{i}"
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            self._choices[child_id] = _Choice(request_id, i, detok)
            parent.children.append(child_id)
            self.core.add_request(
                Request(
                    child_id, list(prompt_token_ids), child_params, self.eos_token_ids, max_tokens,
                    cache_salt, mm_inputs, grammar=grammar.matcher() if grammar is not None else None,
                )
            )

    @functools.cached_property
    def structured(self) -> StructuredOutputManager:
        """Compiles output constraints for this model (built on first use)."""
        from mmserve.structured_output import StructuredOutputManager

        vocab = self.core.runner.model.vocab_size  # bitmasks cover the logits' full width
        return StructuredOutputManager(self.tokenizer, vocab, sorted(self.eos_token_ids))

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The CompiledGrammar of params.structured (cached; blocks: call it off the loop)."""
        return self.structured.compile(params.structured) if params.structured is not None else None

    def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        token_type_ids: list[int] | None = None,
        mm_inputs: tuple[MMInput, ...] = (),
        checked: bool = False,
    ) -> None:
        """Queues one input to pool; its single delta carries `pooled`. Inputs must already
        fit the context (truncation happens at the edge). mm_inputs: an image to embed
        (dual encoders: prompt_token_ids is then one placeholder token). checked: the caller
        ran validate_pooling on these very arguments already."""
        if not checked:
            self.validate_pooling(prompt_token_ids, params, mm_inputs)
        if request_id in self._parents:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
        child_id = f"{request_id}#0"
        self._parents[request_id] = _Parent([child_id])
        self._choices[child_id] = _Choice(request_id, 0, None)
        request = Request(
            child_id, list(prompt_token_ids), SamplingParams(max_tokens=1), frozenset(), 0,
            pooling=params, token_type_ids=token_type_ids, mm_inputs=mm_inputs,
        )
        self.core.add_request(request)

    def validate_pooling(
        self, prompt_token_ids: list[int], params: PoolingParams, mm_inputs: tuple[MMInput, ...] = ()
    ) -> None:
        params.validate(self.hidden_size)
        if mm_inputs and not self.embeds_images:
            raise InvalidArgument("inputs", "this model does not embed images")
        if params.task not in self.setup.pooler_tasks:
            raise InvalidArgument("task", f"this model cannot pool for {params.task!r}")
        if not prompt_token_ids:
            raise InvalidArgument("inputs", "an input has no tokens")
        self.check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) > self.max_pooling_len:
            raise InvalidArgument(
                "inputs", f"{len(prompt_token_ids)} tokens exceed the limit {self.max_pooling_len}"
            )

    @property
    def hidden_size(self) -> int | None:
        """Full embedding size (the bound of Matryoshka `dimensions`)."""
        return self.setup.embedding_size or getattr(self.core.runner.model, "hidden_size", None)

    def abort(self, request_id: str) -> None:
        parent = self._parents.get(request_id)
        if parent is not None:
            self.core.abort(parent.children)

    def is_active(self, request_id: str) -> bool:
        """Whether any choice of the request is still running."""
        return request_id in self._parents

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def step(self) -> list[GenerationDelta]:
        return [self._delta(o) for o in self.core.step() if o.request_id in self._choices]

    def _delta(self, out: EngineOutput) -> GenerationDelta:
        choice = self._choices[out.request_id]
        text, stop_reason, finish = "", out.stop_reason, out.finish_reason
        if out.new_token_ids and choice.stopped is None and choice.detok is not None:
            d = choice.detok.update(out.new_token_ids)
            text = d.text_delta
            if d.stopped_on is not None:
                choice.stopped = d.stopped_on
                stop_reason, finish = d.stopped_on, "stop"
                self.core.stop(out.request_id)
        if finish is not None and finish != "abort" and choice.stopped is None and choice.detok:
            text += choice.detok.finish().text_delta
        if finish is not None:
            self._forget(out.request_id, choice)
        return GenerationDelta(
            request_id=choice.parent_id,
            index=choice.index,
            text=text,
            token_ids=out.new_token_ids,
            logprobs=out.new_logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_logprobs=out.prompt_logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            error=out.error,
            pooled=out.pooled,
            first_scheduled_time=out.first_scheduled_time,
        )

    def _forget(self, child_id: str, choice: _Choice) -> None:
        del self._choices[child_id]
        parent = self._parents.get(choice.parent_id)
        if parent is not None:
            parent.children.remove(child_id)
            if not parent.children:
                del self._parents[choice.parent_id]
