"""The offline batch API: `LLM(model).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Self, TypeVar

from tqdm.auto import tqdm

from mmserve.config import EngineConfig
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.chat import ChatInput
from mmserve.frontend.frontend import FrontEnd, GenerateJob, GenerationDelta
from mmserve.frontend.pooling_inputs import TextOrIds
from mmserve.frontend.prompts import PromptLimit
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.params import SamplingParams
from mmserve.processors.images import local_image

Message = dict[str, Any]
# a generate() prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}
Prompt = str | Sequence[int] | Mapping[str, Any]
PROGRESS_MIN_PROMPTS = 16  # show a progress bar from this many prompts on
T = TypeVar("T")


class LLM:
    """Batches every prompt through one engine and returns results in input order."""

    def __init__(self, model: str, **settings: Any) -> None:
        """model: an HF folder, a .gguf file, or a folder holding one .gguf. settings: engine
        settings by name, as `mmserve serve` flags without the dashes (README's table; all are
        mmserve.config.engine_settings()), e.g. dtype="float32", num_kv_blocks=64,
        enforce_eager=True (no CUDA graphs), quantization="fp8", pooling="mean"; the others
        take the config dataclasses' defaults. An unknown name raises TypeError listing them."""
        config = EngineConfig.from_settings(model, **settings)
        self.frontend = FrontEnd.start(config)
        self.tokenizer = self.frontend.tokenizer

    def shutdown(self) -> None:
        """Stops the engine (and the other ranks of a tensor-parallel model)."""
        self.frontend.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings, lists of token ids, or vLLM's prompt dicts ({"prompt": text}
        or {"prompt_token_ids": ids}); one prompt or a list (as in vLLM, one list of ints is
        one prompt). One params for all, or one per prompt (`sampling_params=`, vLLM's name,
        also takes them)."""
        params = _either("params", params, "sampling_params", sampling_params)
        each = _listed(prompts)  # one prompt (text, a dict, one list of ids) or a batch
        per_prompt = _per_prompt_params(params, len(each))
        encoded = [self._encode(p, sp, i) for i, (p, sp) in enumerate(zip(each, per_prompt, strict=True))]
        return self._run(encoded, per_prompt, use_tqdm, cache_salt)

    def _encode(self, prompt: Prompt, params: SamplingParams, index: int) -> tuple[str | None, list[int]]:
        prompt = _prompt_of(prompt, index)
        if isinstance(prompt, str):
            return prompt, self.frontend.encode_prompt(prompt, limit=self._limit(params))
        return None, prompt

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. A content part
        {"type": "image", "image": PIL image | bytes | path} puts an image in (models that
        read images). continue_final_message (with add_generation_prompt=False): the prompt
        ends inside the last message, the assistant's, and the model goes on with it.
        template_kwargs (e.g. enable_thinking=False) go to the chat template;
        chat_template_kwargs and sampling_params are vLLM's names for template_kwargs and
        params."""
        template_kwargs = _either("template_kwargs", template_kwargs, "chat_template_kwargs", chat_template_kwargs)
        params = _either("params", params, "sampling_params", sampling_params)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        per_prompt = _per_prompt_params(params, len(conversations))
        encoded, images = [], []
        for conv, sp in zip(conversations, per_prompt, strict=True):
            conv, decoded, fields = _take_images(conv)  # type: ignore[arg-type]
            chat = ChatInput(
                conv, tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs or {}, image_fields=fields,
            )
            prompt = self.frontend.render_chat(chat, decoded, self._limit(sp))
            encoded.append((prompt.text, prompt.token_ids))
            images.append(prompt.mm_inputs)
        return self._run(encoded, per_prompt, use_tqdm, cache_salt, images)

    def _limit(self, params: SamplingParams) -> PromptLimit:
        """The limit on a prompt before it is cut (none, where truncate_prompt_tokens cuts it)."""
        return self.frontend.prompt_limit(keep_last=params.truncate_prompt_tokens)

    @property
    def tasks(self) -> tuple[str, ...]:
        """What the model serves: "generate", "embed", "classify", "score", "rerank"."""
        return self.frontend.tasks

    def embed(
        self,
        inputs: TextOrIds | Any | Sequence[TextOrIds | Any],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate: str = "none",
        prompt_name: str | None = None,
    ) -> list[list[float]]:
        """One vector per input (text, token ids, or for CLIP/SigLIP-style models an image:
        PIL image, encoded bytes or a pathlib.Path), in order. truncate: "none" (too long is
        an error), "left" or "right". As sentence-transformers' encode() by default:
        normalize None normalises when the model's pipeline does (a Normalize module, or no
        sentence-transformers files); prompt_name None puts the model's default prompt, if
        any, before each text ("": none; else one of its prompts, e.g. "query")."""
        plan = pooling_api.plan_embed(
            self.frontend, _with_images(inputs, "inputs"), normalize=normalize,
            dimensions=dimensions, truncate=truncate, prompt_name=prompt_name,
        )
        vectors: list[list[float]] = pooling_api.run_sync(self.frontend, plan).embeddings.tolist()
        return vectors

    def classify(
        self, inputs: TextOrIds | Sequence[TextOrIds], *, truncate: str = "none"
    ) -> list[pooling_api.Classification]:
        """Label probabilities for each input (all labels, highest first)."""
        plan = pooling_api.plan_classify(self.frontend, _listed(inputs), truncate=truncate)
        return pooling_api.run_sync(self.frontend, plan).results

    def score(
        self,
        first: TextOrIds | Sequence[TextOrIds],
        second: TextOrIds | Sequence[TextOrIds],
        *,
        truncate: str = "none",
    ) -> list[float]:
        """One score per item of `second`, against the single `first` or pairwise. CLIP and
        SigLIP take images on either side (PIL images, bytes or paths): cosine similarity."""
        plan = pooling_api.plan_score(
            self.frontend, _with_images(first, "first"), _with_images(second, "second"),
            truncate=truncate,
        )
        return pooling_api.run_sync(self.frontend, plan).scores

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        truncate: str = "none",
    ) -> list[pooling_api.RankedDocument]:
        """Documents by relevance to the query, highest first."""
        plan = pooling_api.plan_rerank(
            self.frontend, query, documents, top_n=top_n, truncate=truncate
        )
        return pooling_api.run_sync(self.frontend, plan).results

    def _run(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        per_prompt: list[SamplingParams],  # one per prompt
        use_tqdm: bool,
        cache_salt: str | None,
        images: list[tuple[Any, ...]] | None = None,
    ) -> list[RequestOutput]:
        images = images or [()] * len(encoded)
        jobs: list[tuple[str | None, GenerateJob]] = []
        for (text, ids), p, mm in zip(encoded, per_prompt, images, strict=True):
            ids = self.frontend.truncate_prompt(ids, p, mm)  # before the thought is read
            jobs.append((text, self.frontend.validate(
                ids, p, cache_salt=cache_salt, mm_inputs=mm,
                field="prompt" if text is not None else "token_ids",
                # as the server: the budget is enforced, and refused where there is no thought
                reasoning=self.frontend.read_reasoning(ids, p, field="reasoning_budget"),
            )))
        for _, job in jobs:  # a constraint that fails to compile names its field, before any runs
            self.frontend.compile_grammar(job.params)
        results: dict[str, RequestOutput] = {}
        for text, job in jobs:  # all valid: now enqueue
            self.frontend.add(job)
            choices = [CompletionOutput(i, "", [], None) for i in range(job.params.n)]
            results[job.request_id] = RequestOutput(
                job.request_id, text, job.prompt_token_ids, choices, finished=False
            )
        bar = tqdm(total=len(jobs), disable=not use_tqdm or len(jobs) < PROGRESS_MIN_PROMPTS, desc="generate")
        while self.frontend.has_unfinished:
            for delta in self.frontend.step():
                if isinstance(delta, GenerationDelta) and _apply(results[delta.request_id], delta):
                    bar.update(1)
        bar.close()
        return [results[job.request_id] for _, job in jobs]


def _with_images(inputs: Any, field: str) -> list[Any]:
    """A batch of inputs with each image (anything not text or token ids) decoded."""
    return [
        x if isinstance(x, (str, list, tuple)) else local_image(x, f"{field}[{i}]")
        for i, x in enumerate(_listed(inputs))
    ]


def _take_images(conv: Sequence[Message]) -> tuple[list[Message], list[Any], list[str]]:
    """The conversation with each image part as {"type": "image"}, the decoded images and
    their fields, in order."""
    out, decoded, fields = [], [], []
    for i, message in enumerate(conv):
        content = message.get("content")
        if isinstance(content, list) and any(_is_image(p) for p in content):
            parts = []
            for j, part in enumerate(content):
                if _is_image(part):
                    field = f"messages[{i}].content[{j}].image"
                    decoded.append(local_image(part.get("image"), field))
                    fields.append(field)
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, decoded, fields


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _either(name: str, value: T, alias: str, aliased: T) -> T:
    """A keyword given under our name or vLLM's, not both."""
    if aliased is None:
        return value
    if value is not None:
        raise TypeError(f"give {name} or {alias}, not both")
    return aliased


def _prompt_of(prompt: Any, index: int) -> str | list[int]:
    """A generate() prompt as text or token ids; vLLM's TextPrompt / TokensPrompt dicts are
    read, anything else is a TypeError naming the prompt."""
    where = f"prompts[{index}]"
    if isinstance(prompt, Mapping):
        if "multi_modal_data" in prompt:
            raise TypeError(f"{where}: multi_modal_data is not taken with a raw prompt; pass images "
                            "as content parts of a chat() message")
        keys = {"prompt", "prompt_token_ids"} & set(prompt)
        if len(keys) != 1:
            raise TypeError(f"{where}: a prompt dict holds 'prompt' (text) or 'prompt_token_ids', "
                            f"one of them; got keys {sorted(map(str, prompt))}")
        prompt = prompt[keys.pop()]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError(f"{where}: a prompt is a str, a list of token ids (int) or a dict with "
                    f"'prompt' or 'prompt_token_ids'; got {type(prompt).__name__}")


def _listed(inputs: Any) -> list[Any]:
    """A single input (text, list of token ids, image, prompt dict) becomes a batch of one."""
    if isinstance(inputs, (list, tuple)) and not (inputs and isinstance(inputs[0], int)):
        return list(inputs)
    return [inputs]


def _per_prompt_params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [replace(params) for _ in range(n)]
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} for {n} prompts")
    return list(params)


def _apply(result: RequestOutput, delta: GenerationDelta) -> bool:
    """Folds a delta into the result; True when the whole request has just finished."""
    out = result.outputs[delta.index]
    out.text += delta.text
    out.token_ids += delta.token_ids
    if delta.logprobs:
        out.logprobs = (out.logprobs or []) + delta.logprobs
    if delta.prompt_logprobs is not None:
        result.prompt_logprobs = delta.prompt_logprobs
    result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
    if delta.finish_reason is not None:
        out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        result.num_draft_tokens += delta.num_draft_tokens  # (each choice's totals, once)
        result.num_accepted_draft_tokens += delta.num_accepted_draft_tokens
    result.finished = all(o.finish_reason is not None for o in result.outputs)
    return result.finished
