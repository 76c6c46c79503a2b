"""Pure functions from response protos to the typed results of mmserve_client.types."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from mmserve_client.types import (
    Classification,
    FinishReason,
    GenerateChunk,
    GenerateResult,
    LabelScore,
    LoadReport,
    ModelInfo,
    ModelLoad,
    RelaxedKeyword,
    RerankResult,
    ResultList,
    ScoreMethod,
    Task,
    Timing,
    TokenizeResult,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from mmserve_client.v1 import (
    common_pb2,
    generate_pb2,
    load_pb2,
    models_pb2,
    pooling_pb2,
    tokenize_pb2,
)

T = TypeVar("T")

try:
    import numpy as np
except ImportError:  # numpy is optional: vectors are then lists of floats
    np = None  # type: ignore[assignment]

_FINISH: dict[int, FinishReason] = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    generate_pb2.FINISH_REASON_ABORTED: "aborted",
}
_TASKS: dict[int, Task] = {
    models_pb2.TASK_GENERATE: "generate",
    models_pb2.TASK_EMBED: "embed",
    models_pb2.TASK_RERANK: "rerank",
    models_pb2.TASK_CLASSIFY: "classify",
    models_pb2.TASK_SCORE: "score",
}
_SCORE_METHODS: dict[int, ScoreMethod] = {
    models_pb2.SCORE_METHOD_CROSS_ENCODER: "cross_encoder",
    models_pb2.SCORE_METHOD_COSINE: "cosine",
    models_pb2.SCORE_METHOD_YES_TOKEN: "yes_token",
}


def usage(msg: Any, field: str = "usage") -> Usage | None:
    """The Usage in `msg.<field>`, or None when the server left it unset."""
    if not msg.HasField(field):
        return None
    u: common_pb2.Usage = getattr(msg, field)
    return Usage(
        u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens,
        u.draft_tokens, u.accepted_draft_tokens,
    )


def timing(msg: Any) -> Timing | None:
    """The Timing in `msg.timing`, or None when the server left it unset."""
    if not msg.HasField("timing"):
        return None
    t: common_pb2.Timing = msg.timing
    return Timing(t.queue_ms, t.first_token_ms, t.total_ms)


def _logprobs(items: Iterable[generate_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            lp.token_id,
            lp.logprob,
            lp.token,
            tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in lp.top),
        )
        for lp in items
    )


def chunk(resp: generate_pb2.GenerateResponse) -> GenerateChunk:
    """One streamed GenerateResponse as a GenerateChunk."""
    kind = resp.WhichOneof("stop_reason")
    return GenerateChunk(
        index=resp.index,
        text=resp.text,
        token_ids=tuple(resp.token_ids),
        finish_reason=_FINISH.get(resp.finish_reason),
        usage=usage(resp),
        timing=timing(resp),
        logprobs=_logprobs(resp.logprobs),
        tool_calls=tuple(
            ToolCallDelta(d.index, d.id, d.name, d.arguments_delta) for d in resp.tool_calls
        ),
        prompt_logprobs=_logprobs(resp.prompt_logprobs),
        request_id=resp.request_id,
        model=resp.model,
        stop=getattr(resp, kind) if kind else None,
        relaxed_keywords=tuple(RelaxedKeyword(r.pointer, r.keyword) for r in resp.relaxed_keywords),
        reasoning_text=resp.reasoning_text,
    )


@dataclass
class _Call:
    """A tool call being assembled from its deltas."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Choice:
    """One choice being assembled: the concatenation of its deltas so far."""

    last: GenerateChunk
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)


class Collector:
    """Joins the chunks of one Generate stream into one GenerateResult per choice.

    Invariant: per choice index, text/token_ids/logprobs are the concatenation of the deltas
    seen so far, and each tool call's arguments the concatenation of its arguments_delta.
    """

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self._first: GenerateChunk | None = None

    def add(self, c: GenerateChunk) -> None:
        """Folds one chunk in."""
        self._first = self._first or c
        choice = self._choices.setdefault(c.index, _Choice(last=c))
        choice.last = c
        choice.text.append(c.text)
        choice.reasoning.append(c.reasoning_text)
        choice.token_ids.extend(c.token_ids)
        choice.logprobs.extend(c.logprobs)
        for d in c.tool_calls:
            call = choice.calls.setdefault(d.index, _Call())
            call.id = call.id or d.id
            call.name = call.name or d.name
            call.arguments.append(d.arguments_delta)

    def results(self, n: int = 1) -> list[GenerateResult]:
        """One result per choice index in [0, max(n, indexes seen)), ordered by index; a choice
        that sent nothing comes back empty with finish_reason None."""
        count = max([n, *(i + 1 for i in self._choices)])
        return [self._result(i) for i in range(count)]

    def _result(self, index: int) -> GenerateResult:
        first = self._first
        stream_wide: dict[str, Any] = {
            "index": index,
            "request_id": first.request_id if first else "",
            "model": first.model if first else "",
            "prompt_logprobs": first.prompt_logprobs if first else (),
        }
        choice = self._choices.get(index)
        if choice is None:
            return GenerateResult(text="", token_ids=(), finish_reason=None, **stream_wide)
        last = choice.last
        return GenerateResult(
            text="".join(choice.text),
            token_ids=tuple(choice.token_ids),
            finish_reason=last.finish_reason,
            tool_calls=tuple(
                ToolCall(c.id, c.name, "".join(c.arguments))
                for _, c in sorted(choice.calls.items())
            ),
            usage=last.usage,
            timing=last.timing,
            logprobs=tuple(choice.logprobs),
            stop=last.stop,
            relaxed_keywords=last.relaxed_keywords,
            reasoning_text="".join(choice.reasoning),
            **stream_wide,
        )


PoolingResponse: TypeAlias = (
    pooling_pb2.EmbedResponse
    | pooling_pb2.RerankResponse
    | pooling_pb2.ClassifyResponse
    | pooling_pb2.ScoreResponse
)


def _listed(items: Iterable[T], resp: PoolingResponse) -> ResultList[T]:
    """items with the response's usage, timing, model and request id."""
    return ResultList(
        items, usage=usage(resp), timing=timing(resp), model=resp.model, request_id=resp.request_id
    )


def vectors(resp: pooling_pb2.EmbedResponse, encoding: int) -> ResultList[Any]:
    """The embeddings in input order: float32 numpy arrays when numpy is installed (fp16 is
    widened), else lists of floats. Packed bytes are little-endian per the request's encoding."""
    return _listed((_vector(e, encoding) for e in resp.embeddings), resp)


def _vector(e: pooling_pb2.Embedding, encoding: int) -> Any:
    if not e.packed:
        return np.asarray(e.values, dtype=np.float32) if np is not None else list(e.values)
    fp16 = encoding == pooling_pb2.ENCODING_FP16_BYTES
    width, fmt = (2, "e") if fp16 else (4, "f")
    if len(e.packed) % width:
        raise ValueError(f"packed embedding of {len(e.packed)} bytes is not a multiple of {width}")
    if np is not None:
        return np.frombuffer(e.packed, dtype="<f2" if fp16 else "<f4").astype(np.float32)
    return list(struct.unpack(f"<{len(e.packed) // width}{fmt}", e.packed))


def rerank_results(resp: pooling_pb2.RerankResponse) -> ResultList[RerankResult]:
    """Ranked documents, highest score first (the server's order)."""
    return _listed((RerankResult(r.index, r.score, r.document or None) for r in resp.results), resp)


def classifications(resp: pooling_pb2.ClassifyResponse) -> ResultList[Classification]:
    """One Classification per input, in input order."""
    return _listed(
        (
            Classification(c.label, tuple(LabelScore(s.label, s.score) for s in c.scores))
            for c in resp.results
        ),
        resp,
    )


def scores(resp: pooling_pb2.ScoreResponse) -> ResultList[float]:
    """One score per item of `second`, in order."""
    return _listed(resp.scores, resp)


def tokenize_result(resp: tokenize_pb2.TokenizeResponse) -> TokenizeResult:
    """Token ids (and strings, when asked for) of a TokenizeResponse."""
    return TokenizeResult(
        tuple(resp.token_ids), tuple(resp.tokens), resp.max_context, resp.model, resp.request_id
    )


def model_list(resp: models_pb2.ListModelsResponse) -> ResultList[ModelInfo]:
    """The hosted models, with the response's request id."""
    return ResultList(model_infos(resp.models), request_id=resp.request_id)


def model_infos(models: Sequence[models_pb2.ModelInfo]) -> list[ModelInfo]:
    """ModelInfo protos as dataclasses; unknown (newer) task values are skipped."""
    return [
        ModelInfo(
            name=m.name,
            tasks=tuple(_TASKS[t] for t in m.tasks if t in _TASKS),
            max_context=m.max_context,
            dtype=m.dtype,
            device=m.device,
            score_method=_SCORE_METHODS.get(m.score_method),
            labels=tuple(m.labels),
            embedding_dimension=m.embedding_dimension,
            architecture=m.architecture,
            supports_images=m.supports_images,
            quantization=m.quantization,
            vocab_size=m.vocab_size,
            speculative=m.speculative,
            kv_cache_dtype=m.kv_cache_dtype,
            tensor_parallel_size=m.tensor_parallel_size or 1,  # 0: a server from before
        )
        for m in models
    ]


def load_report(report: load_pb2.WatchLoadResponse) -> LoadReport:
    models = tuple(
        ModelLoad(
            model=m.model, running=m.running, waiting=m.waiting, kv_usage=m.kv_usage,
            free_blocks=m.free_blocks, total_blocks=m.total_blocks,
            prefix_hit_rate=m.prefix_hit_rate, tokens_in_flight=m.tokens_in_flight,
            calls_in_flight=m.calls_in_flight, serving=m.serving,
        )
        for m in report.models
    )
    return LoadReport(models, report.calls_in_flight, report.draining, report.request_id)
