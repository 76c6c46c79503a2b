"""Planning Embed, Classify, Score and Rerank calls: every check, tokenisation and truncation
happens here. A plan checks the call when it is made, encodes (checks and tokenises) its
inputs a slice at a time on demand, one pooling request per input, and says how to turn
their results into the call's answer. Free of protobuf."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from mmserve.errors import InvalidArgument
from mmserve.frontend.frontend import FrontEnd
from mmserve.frontend.pooling_inputs import EncodedInput, TextOrIds
from mmserve.params import PoolingParams
from mmserve.processors.images import DecodedImage

MAX_INPUTS_PER_CALL = 2048  # inputs (or score pairs, or rerank documents) in one call
T = TypeVar("T")


@dataclass
class EmbedResult:
    embeddings: torch.Tensor  # [num_inputs, dimensions] float32 on the CPU, in input order
    prompt_tokens: int  # tokens of all inputs after truncation


@dataclass
class LabelScore:
    label: str
    score: float  # probability (softmax across labels; sigmoid for single/multi-label heads)


@dataclass
class Classification:
    label: str  # the best label
    scores: list[LabelScore]  # every label, highest first


@dataclass
class ClassifyResult:
    results: list[Classification]  # in input order
    prompt_tokens: int


@dataclass
class ScoreResult:
    scores: list[float]  # one per item of `second`, in order
    prompt_tokens: int


@dataclass
class RankedDocument:
    index: int  # position in the request's documents
    score: float
    document: str


@dataclass
class RerankResult:
    results: list[RankedDocument]  # highest score first, at most top_n
    prompt_tokens: int


@dataclass
class PoolingPlan(Generic[T]):
    """Validated engine work for one call, and how to turn its results into the answer. The
    call's own checks ran when it was planned; each input's checks and tokenisation run in
    encode(), a slice at a time, so a runner can send the first inputs to the engine while
    it tokenises the next."""

    count: int  # pooling requests: one per input
    params: PoolingParams  # shared by all of them
    encode_range: Callable[[int, int], list[EncodedInput]]  # inputs [start, end), checked
    finish: Callable[[list[torch.Tensor], int], T]  # (pooled in input order, prompt tokens)

    def encode(self, start: int = 0, end: int | None = None) -> list[EncodedInput]:
        """Inputs [start, end) (default all) checked and tokenised; raises InvalidArgument."""
        return self.encode_range(start, self.count if end is None else end)


def plan_embed(
    engine: FrontEnd,
    inputs: Sequence[TextOrIds],
    *,
    normalize: bool | None = None,
    dimensions: int | None = None,
    truncate: str = "none",
    prompt_name: str | None = None,
) -> PoolingPlan[EmbedResult]:
    """normalize None: as the model's sentence-transformers pipeline does (EngineInfo);
    prompt_name: one of the model's prompts, put before each text; None: its default prompt
    (if any); "": no prompt."""
    engine.require("embed")
    _check_count(len(inputs), "inputs")
    if normalize is None:
        normalize = engine.info.normalize
    params = PoolingParams("embed", normalize=normalize, dimensions=dimensions)
    params.validate(engine.embedding_size)
    names = _names("inputs", len(inputs))
    prompt = _prompt(engine, prompt_name)

    def encode(start: int, end: int) -> list[EncodedInput]:
        return _encode_with_images(engine, inputs[start:end], truncate, names[start:end], prompt)

    return PoolingPlan(
        len(inputs), params, encode, lambda pooled, tokens: EmbedResult(torch.stack(pooled), tokens)
    )


def plan_classify(
    engine: FrontEnd, inputs: Sequence[TextOrIds], *, truncate: str = "none"
) -> PoolingPlan[ClassifyResult]:
    engine.require("classify")
    _check_count(len(inputs), "inputs")
    names = _names("inputs", len(inputs))
    labels = engine.info.labels

    def encode(start: int, end: int) -> list[EncodedInput]:
        return _encode(engine, inputs[start:end], truncate, names[start:end])

    def finish(pooled: list[torch.Tensor], tokens: int) -> ClassifyResult:
        return ClassifyResult([_classification(labels, p) for p in pooled], tokens)

    return PoolingPlan(len(inputs), PoolingParams("classify"), encode, finish)


def plan_score(
    engine: FrontEnd,
    first: Sequence[TextOrIds],
    second: Sequence[TextOrIds],
    *,
    truncate: str = "none",
) -> PoolingPlan[ScoreResult]:
    """`first` has one item (scored against each of `second`) or one per item of `second`."""
    engine.require("score")
    _check_count(len(second), "second")
    if len(first) not in (1, len(second)):
        raise InvalidArgument(
            "first", f"has {len(first)} items; needs 1 or as many as second ({len(second)})"
        )
    first_names = _names("first", len(first))
    return _plan_pairs(engine, first, second, truncate, first_names, _names("second", len(second)))


def plan_rerank(
    engine: FrontEnd,
    query: str,
    documents: Sequence[str],
    *,
    top_n: int | None = None,
    truncate: str = "none",
) -> PoolingPlan[RerankResult]:
    engine.require("rerank")
    _check_count(len(documents), "documents")
    if top_n is not None and top_n < 1:
        raise InvalidArgument("top_n", "must be >= 1 when set")
    if not query.strip():
        raise InvalidArgument("query", "must not be empty")
    names = _names("documents", len(documents))
    scored = _plan_pairs(engine, [query], documents, truncate, ["query"], names)

    def finish(pooled: list[torch.Tensor], tokens: int) -> RerankResult:
        scores = scored.finish(pooled, tokens).scores
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        ranked = [RankedDocument(i, scores[i], documents[i]) for i in order]
        return RerankResult(ranked, tokens)

    return PoolingPlan(scored.count, scored.params, scored.encode_range, finish)


def _plan_pairs(
    engine: FrontEnd,
    first: Sequence[TextOrIds],
    second: Sequence[TextOrIds],
    truncate: str,
    first_names: list[str],
    second_names: list[str],
) -> PoolingPlan[ScoreResult]:
    """Scores second[i] against first[0] (one first) or first[i] (pairwise), as the model's
    score method says: cosine of embeddings, or one joint pass per pair."""
    if engine.info.score_method == "cosine":
        return _plan_cosine(engine, first, second, truncate, first_names, second_names)
    index = [0 if len(first) == 1 else i for i in range(len(second))]
    pairs = [
        (_text(first[j], first_names[j]), _text(b, name), first_names[j], name)
        for j, b, name in zip(index, second, second_names, strict=True)
    ]
    encoder = engine.input_encoder
    yes_no = engine.info.score_method == "yes-token"

    def encode(start: int, end: int) -> list[EncodedInput]:
        chunk, names = pairs[start:end], second_names[start:end]
        if yes_no:
            encoded = [encoder.encode_yes_no(a, b, truncate, fa, fb) for a, b, fa, fb in chunk]
        else:
            encoded = encoder.encode_pairs([(a, b) for a, b, _, _ in chunk], truncate, names)
        _check_vocab(engine, encoded, names, [True] * len(encoded))
        return encoded

    return PoolingPlan(
        len(pairs),
        PoolingParams("score"),
        encode,
        lambda pooled, tokens: ScoreResult([float(p[0]) for p in pooled], tokens),
    )


def _plan_cosine(
    engine: FrontEnd,
    first: Sequence[TextOrIds],
    second: Sequence[TextOrIds],
    truncate: str,
    first_names: list[str],
    second_names: list[str],
) -> PoolingPlan[ScoreResult]:
    """Embeds each side once; a score is the dot product of two unit vectors. Images are
    inputs too where the model embeds them (CLIP, SigLIP: text-image similarity)."""
    items = [*first, *second]
    names = first_names + second_names
    prompt = _prompt(engine, None)  # the default prompt, as sentence-transformers' encode()

    def encode(start: int, end: int) -> list[EncodedInput]:
        return _encode_with_images(engine, items[start:end], truncate, names[start:end], prompt)

    def finish(pooled: list[torch.Tensor], tokens: int) -> ScoreResult:
        a, b = torch.stack(pooled[: len(first)]), torch.stack(pooled[len(first) :])
        return ScoreResult((a * b).sum(-1).tolist(), tokens)  # one `first` row broadcasts

    return PoolingPlan(len(items), PoolingParams("embed", normalize=True), encode, finish)


def _prompt(engine: FrontEnd, name: str | None) -> str:
    """The text a prompt name stands for (sentence-transformers' prompts): None is the
    model's default prompt, "" none; an unknown name is refused, listing the known ones."""
    prompts = dict(engine.info.prompts)
    if name is None:
        name = engine.info.default_prompt_name or ""
    if not name:
        return ""
    if name not in prompts:
        known = sorted(prompts) or "none"
        raise InvalidArgument("prompt_name", f"unknown prompt {name!r:.80}; this model has {known}")
    return prompts[name]


def _check_count(count: int, field: str) -> None:
    if count == 0:
        raise InvalidArgument(field, "must not be empty")
    if count > MAX_INPUTS_PER_CALL:
        raise InvalidArgument(field, f"{count} items exceed the limit of {MAX_INPUTS_PER_CALL}")


def _names(field: str, count: int) -> list[str]:
    return [f"{field}[{i}]" for i in range(count)]


def _text(item: TextOrIds, field: str) -> str:
    if not isinstance(item, str):
        raise InvalidArgument(field, "must be text: this model reads each pair jointly")
    return item


def _encode(
    engine: FrontEnd, items: Sequence[TextOrIds], truncate: str, names: list[str], prompt: str = ""
) -> list[EncodedInput]:
    encoded = engine.input_encoder.encode(items, truncate, names, prompt)
    _check_vocab(engine, encoded, names, [isinstance(item, str) for item in items])
    return encoded


def _encode_with_images(
    engine: FrontEnd,
    items: Sequence[TextOrIds | DecodedImage],
    truncate: str,
    names: list[str],
    prompt: str = "",
) -> list[EncodedInput]:
    """Texts (after prompt) and token ids as _encode does; each DecodedImage as one image
    input."""
    images = {i for i, item in enumerate(items) if isinstance(item, DecodedImage)}
    if not images:
        return _padded(engine, _encode(engine, items, truncate, names, prompt), names)  # type: ignore[arg-type]
    if not engine.info.embeds_images or engine.images is None:
        raise InvalidArgument(f"{names[min(images)]}.image", "this model does not embed images")
    texts = [i for i in range(len(items)) if i not in images]
    encoded = _encode(engine, [items[i] for i in texts], truncate, [names[i] for i in texts], prompt)  # type: ignore[misc]
    encoded = _padded(engine, encoded, [names[i] for i in texts])
    out: list[EncodedInput] = []
    rest = iter(encoded)
    for i, item in enumerate(items):
        if i in images:
            mm = engine.images.single(item, f"{names[i]}.image")  # type: ignore[arg-type]
            out.append(EncodedInput([0], None, (mm,)))
        else:
            out.append(next(rest))
    return out


def _padded(engine: FrontEnd, encoded: list[EncodedInput], names: list[str]) -> list[EncodedInput]:
    """Texts padded to the length the model was trained on (SigLIP: 64), if it says so."""
    length = engine.info.pad_text_to  # SigLIP's
    if not length:
        return encoded
    limit = engine.info.max_pooling_len
    if encoded and length > limit:  # the context was set shorter than the padded texts
        raise InvalidArgument(names[0], f"{length} tokens exceed the limit {limit}")
    pad_id = engine.tokenizer.pad_token_id
    pad_id = engine.info.pad_token_id if pad_id is None else pad_id
    if pad_id is None:
        return encoded
    pad = [int(pad_id)]
    return [
        EncodedInput(e.token_ids + pad * (length - len(e.token_ids)), e.token_type_ids, e.mm_inputs)
        if len(e.token_ids) < length else e
        for e in encoded
    ]


def _check_vocab(
    engine: FrontEnd, encoded: list[EncodedInput], names: list[str], tokenised: list[bool]
) -> None:
    """Every id in the vocabulary, else InvalidArgument naming the first input with one.
    tokenised: which inputs the model's tokenizer made, whose ids need no look when it
    emits none past the vocabulary (InputEncoder.max_token_id): the rest in one pass."""
    trusted = engine.input_encoder.max_token_id < engine.vocab_size
    look = [i for i, made in enumerate(tokenised) if not (made and trusted)]
    engine.check_token_batch([encoded[i].token_ids for i in look], [names[i] for i in look])


def _classification(labels: Sequence[str], probs: torch.Tensor) -> Classification:
    pairs = zip(labels, probs.tolist(), strict=True)
    scores = sorted((LabelScore(label, float(p)) for label, p in pairs), key=lambda s: -s.score)
    return Classification(scores[0].label, scores)
