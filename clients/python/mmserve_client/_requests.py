"""Pure functions from Python values to request protos, shared by Client and AsyncClient.

Client-side mistakes (an unknown keyword, a message dict without a role) raise TypeError or
ValueError here, before anything is sent; range checks are the server's (INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar

from mmserve_client.types import (
    EmbeddingEncoding,
    Image,
    ImageLike,
    InputLike,
    Truncate,
    is_pil_image,
)
from mmserve_client.v1 import common_pb2, generate_pb2, pooling_pb2, tokenize_pb2


class GenerateKwargs(TypedDict, total=False):
    """Keyword arguments of generate/chat (and their _stream forms); None means unset."""

    model: str  # empty: the one model that can generate
    request_id: str  # echoed back; the server makes one if empty
    cache_salt: str  # isolates the prefix cache between tenants
    add_special_tokens: bool  # raw prompts only; default true
    timeout: float  # seconds for the whole call (overrides the client's default)
    # SamplingParams, as in protos/mmserve/v1/generate.proto:
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int  # top alternatives per generated token; 0 is off
    prompt_logprobs: int  # top alternatives per prompt token; 0 is off
    logit_bias: Mapping[int, float]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    reasoning_budget: int  # reasoning models: most thinking tokens, then `</think>` is forced
    disable_speculation: bool  # leave this request out of speculative decoding
    allowed_token_ids: Sequence[int]  # only these may be generated; empty: any
    bad_words: str | Sequence[str]  # words never to be generated (vLLM's semantics)
    truncate_prompt_tokens: int  # keep only the prompt's last this many tokens
    # StructuredOutput: at most one constraint.
    json_schema: str | Mapping[str, Any]  # a dict is sent as JSON text
    json_object: bool
    regex: str
    choice: Sequence[str]
    grammar: str  # EBNF, or Lark's syntax
    structural_tag: str | Mapping[str, Any]  # vLLM's structural tag; a dict is sent as JSON text
    structured_backend: Literal["auto", "xgrammar", "outlines"]
    # json_schema (and structural_tag's schemas): compile around keywords the backend cannot
    # enforce instead of failing; they are listed in the result's relaxed_keywords
    relaxed: bool
    # json_schema / json_object: no whitespace but ", " and ": " (vLLM's option of that name)
    disable_any_whitespace: bool


V = TypeVar("V")

_REQUEST_KEYS = ("model", "request_id", "cache_salt", "add_special_tokens")
# The proto's single-valued SamplingParams fields, set as they are (n and the repeated fields
# take a shape of their own below): a new scalar field needs no change here
# beyond its line in GenerateKwargs.
_SAMPLING_KEYS = tuple(
    f.name
    for f in generate_pb2.SamplingParams.DESCRIPTOR.fields
    if not f.is_repeated and f.name != "n"
)
_GENERATE_KEYS = frozenset(GenerateKwargs.__annotations__) | frozenset(_SAMPLING_KEYS)
_CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
_BACKENDS = {
    "auto": generate_pb2.StructuredOutput.BACKEND_AUTO,
    "xgrammar": generate_pb2.StructuredOutput.BACKEND_XGRAMMAR,
    "outlines": generate_pb2.StructuredOutput.BACKEND_OUTLINES,
}
_TRUNCATE = {
    None: common_pb2.TRUNCATE_UNSPECIFIED,
    "none": common_pb2.TRUNCATE_NONE,
    "left": common_pb2.TRUNCATE_LEFT,
    "right": common_pb2.TRUNCATE_RIGHT,
}
_ENCODINGS = {
    "float": pooling_pb2.ENCODING_FLOAT,
    "fp32": pooling_pb2.ENCODING_FP32_BYTES,
    "fp16": pooling_pb2.ENCODING_FP16_BYTES,
}


def _lookup(table: Mapping[Any, V], key: Any, what: str) -> V:
    if key not in table:
        raise ValueError(f"{what} must be one of {sorted(map(str, table))}, got {key!r}")
    return table[key]


def json_text(value: str | Mapping[str, Any] | Sequence[Any]) -> str:
    """JSON text as is; any other value serialised with json.dumps."""
    return value if isinstance(value, str) else json.dumps(value)


def generate_request(
    source: str | Sequence[int] | generate_pb2.Chat, n: int | None, kw: GenerateKwargs
) -> generate_pb2.GenerateRequest:
    """Builds a GenerateRequest from a prompt, token ids or a Chat and the keyword arguments."""
    unknown = set(kw) - _GENERATE_KEYS
    if unknown:
        valid = sorted(_GENERATE_KEYS)
        raise TypeError(f"unknown arguments {sorted(unknown)}; valid: {valid}")
    values: dict[str, Any] = {k: v for k, v in kw.items() if v is not None}
    req = generate_pb2.GenerateRequest(**{k: values[k] for k in _REQUEST_KEYS if k in values})
    if isinstance(source, str):
        req.prompt = source
    elif isinstance(source, generate_pb2.Chat):
        req.chat.CopyFrom(source)
    else:
        req.token_ids.ids.extend(source)
    params = req.params
    for key in _SAMPLING_KEYS:
        if key in values:
            setattr(params, key, values[key])
    if n is not None:
        params.n = n
    stop = values.get("stop", ())
    params.stop.extend([stop] if isinstance(stop, str) else stop)
    params.stop_token_ids.extend(values.get("stop_token_ids", ()))
    params.allowed_token_ids.extend(values.get("allowed_token_ids", ()))
    bad_words = values.get("bad_words", ())
    params.bad_words.extend([bad_words] if isinstance(bad_words, str) else bad_words)
    params.logit_bias.update({int(t): float(b) for t, b in values.get("logit_bias", {}).items()})
    _set_constraint(req, values)
    return req


def _set_constraint(req: generate_pb2.GenerateRequest, values: dict[str, Any]) -> None:
    given = [k for k in _CONSTRAINT_KEYS if k in values and values[k] is not False]
    if len(given) > 1:
        raise ValueError(f"pass at most one of {_CONSTRAINT_KEYS}, got {given}")
    structured = req.structured
    if given:
        key = given[0]
        if key == "choice":
            structured.choice.choices.extend(values[key])
        elif key in ("json_schema", "structural_tag"):
            setattr(structured, key, json_text(values[key]))
        else:
            setattr(structured, key, values[key])
    if "structured_backend" in values:
        structured.backend = _lookup(_BACKENDS, values["structured_backend"], "structured_backend")
    if values.get("relaxed"):
        structured.relaxed = True
    if values.get("disable_any_whitespace"):
        structured.disable_any_whitespace = True


def image(img: ImageLike, uuid: str = "") -> common_pb2.Image:
    """An image as a proto: an Image as is, bytes as data, a local file (os.PathLike) read
    here, a PIL image as lossless PNG. `uuid`, when given, replaces the Image's own."""
    if not isinstance(img, Image):
        img = _as_image(img)
    if img.data is not None and img.path is not None:
        raise ValueError("an Image takes data or path, not both")
    out = common_pb2.Image(uuid=uuid or img.uuid)
    if img.data is not None:
        out.data = img.data
    elif img.path is not None:
        out.path = img.path
    return out


def is_image(x: object) -> bool:
    """Whether x is one image (never a str: text stays text)."""
    return isinstance(x, (bytes, bytearray, memoryview, Image, os.PathLike)) or is_pil_image(x)


def _as_image(x: object) -> Image:
    if isinstance(x, (bytes, bytearray, memoryview)):
        return Image(data=bytes(x))
    if isinstance(x, os.PathLike):
        return Image.from_file(x)
    if is_pil_image(x):
        return Image.from_pil(x)  # type: ignore[arg-type]
    raise TypeError(f"an image is an Image, bytes, a Path or a PIL image; got {type(x).__name__}")


def _is_token_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, int) for i in x)


def inputs(items: InputLike | Sequence[InputLike]) -> list[common_pb2.Input]:
    """One input (a str, an image (see ImageLike) or a list of token ids) or a sequence."""
    if isinstance(items, str) or is_image(items) or _is_token_ids(items):
        return [_input(items)]
    return [_input(x) for x in items]  # type: ignore[union-attr]


def _input(x: Any) -> common_pb2.Input:
    if isinstance(x, str):
        return common_pb2.Input(text=x)
    if is_image(x):
        return common_pb2.Input(image=image(x))
    if _is_token_ids(x):
        return common_pb2.Input(token_ids=common_pb2.TokenIds(ids=x))
    raise TypeError(
        f"an input is a str, an image (bytes, Image, Path, PIL image) or a non-empty list of "
        f"ints; got {x!r:.80}"
    )


def embed_request(
    items: InputLike | Sequence[InputLike],
    normalize: bool | None,
    dimensions: int | None,
    truncate: Truncate | None,
    encoding: EmbeddingEncoding,
    model: str,
    request_id: str,
    prompt_name: str | None = None,
) -> pooling_pb2.EmbedRequest:
    """An EmbedRequest; None leaves an optional field unset (the server's default)."""
    req = pooling_pb2.EmbedRequest(
        model=model,
        request_id=request_id,
        inputs=inputs(items),
        truncate=_lookup(_TRUNCATE, truncate, "truncate"),
        encoding=_lookup(_ENCODINGS, encoding, "encoding"),
    )
    if normalize is not None:
        req.normalize = normalize
    if dimensions is not None:
        req.dimensions = dimensions
    if prompt_name is not None:
        req.prompt_name = prompt_name
    return req


def rerank_request(
    query: str,
    documents: Sequence[str],
    top_n: int | None,
    return_documents: bool,
    truncate: Truncate | None,
    model: str,
    request_id: str,
) -> pooling_pb2.RerankRequest:
    """A RerankRequest; top_n None ranks every document."""
    if isinstance(documents, str):
        raise TypeError("documents must be a sequence of str, not one str")
    req = pooling_pb2.RerankRequest(
        model=model,
        request_id=request_id,
        query=query,
        documents=documents,
        return_documents=return_documents,
        truncate=_lookup(_TRUNCATE, truncate, "truncate"),
    )
    if top_n is not None:
        req.top_n = top_n
    return req


def classify_request(
    items: InputLike | Sequence[InputLike], truncate: Truncate | None, model: str, request_id: str
) -> pooling_pb2.ClassifyRequest:
    """A ClassifyRequest."""
    return pooling_pb2.ClassifyRequest(
        model=model,
        request_id=request_id,
        inputs=inputs(items),
        truncate=_lookup(_TRUNCATE, truncate, "truncate"),
    )


def score_request(
    first: InputLike | Sequence[InputLike],
    second: InputLike | Sequence[InputLike],
    truncate: Truncate | None,
    model: str,
    request_id: str,
) -> pooling_pb2.ScoreRequest:
    """A ScoreRequest: `first` is one input (scored against each of `second`) or as many as
    `second` (pairwise)."""
    return pooling_pb2.ScoreRequest(
        model=model,
        request_id=request_id,
        first=inputs(first),
        second=inputs(second),
        truncate=_lookup(_TRUNCATE, truncate, "truncate"),
    )


def tokenize_request(
    source: str | generate_pb2.Chat,
    add_special_tokens: bool | None,
    return_tokens: bool,
    model: str,
    request_id: str,
) -> tokenize_pb2.TokenizeRequest:
    """A TokenizeRequest for text or a Chat; add_special_tokens None: the server's default."""
    req = tokenize_pb2.TokenizeRequest(
        model=model, request_id=request_id, return_tokens=return_tokens
    )
    if isinstance(source, str):
        req.text = source
    else:
        req.chat.CopyFrom(source)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req
