"""Typed, frozen results of the mmserve SDK (plain Python values, no protobuf types)."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

if TYPE_CHECKING:  # PIL is optional: imported only by callers that pass PIL images
    import PIL.Image

FinishReason = Literal["stop", "length", "tool_calls", "aborted"]
"""Why a choice ended (FinishReason in the proto, lower-cased, prefix dropped)."""

Task = Literal["generate", "embed", "rerank", "classify", "score"]
"""A task a model can serve; each is one RPC."""

ScoreMethod = Literal["cross_encoder", "cosine", "yes_token"]
"""How a model computes Score/Rerank scores (ModelInfo.score_method)."""

Truncate = Literal["none", "left", "right"]
"""What the server does with a too-long input: error (none), keep the end, keep the start."""

EmbeddingEncoding = Literal["float", "fp32", "fp16"]
"""How vectors travel: repeated float, or packed little-endian float32 / float16 bytes."""


@dataclass(frozen=True)
class Image:
    """An image input: exactly one of `data` (encoded bytes) or `path` (a server-side file,
    allowed only inside the server's media directory), or neither when `uuid` names an image
    the server has cached from an earlier request."""

    data: bytes | None = None
    path: str | None = None
    uuid: str = ""

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], uuid: str = "") -> Image:
        """A local file, read here (client side) and sent as data; no media dir needed."""
        return cls(data=Path(path).read_bytes(), uuid=uuid)

    @classmethod
    def from_pil(cls, image: PIL.Image.Image, uuid: str = "") -> Image:
        """A PIL image, sent as lossless PNG: the server sees the same pixels (and so the
        same content hash and cache entries) as the offline API given this image."""
        return cls(data=pil_png(image), uuid=uuid)


ImageLike = Union[Image, bytes, bytearray, "os.PathLike[str]", "PIL.Image.Image"]
"""One image: an Image, encoded bytes, a local file (a Path, read client side), or a PIL image.
A plain str is never an image (it is text); use Path(...) or Image.from_file(...)."""

InputLike = Union[str, ImageLike, "list[int]", "tuple[int, ...]"]
"""One pooling input: text, an image (see ImageLike), or token ids."""

# PNG holds these modes as they are; any other mode is first converted as the server's
# decoder would convert it, so that PNG -> server decode gives the offline API's pixels.
_PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I;16B"})


def is_pil_image(value: object) -> bool:
    """Whether value is a PIL image, without importing PIL (a PIL image implies PIL loaded)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def pil_png(image: PIL.Image.Image) -> bytes:
    """PNG bytes of a PIL image (lossless; transparency kept, EXIF not written)."""
    if image.mode == "I":  # 32-bit ints: the server reads 16-bit grey the same way
        image = image.convert("I;16")
    elif image.mode == "F":  # floats in [0, 1], as the server's decoder scales them
        image = image.point(lambda v: v * 255 + 0.5).convert("L")
    elif image.mode not in _PNG_MODES:  # CMYK, YCbCr, PA, RGBa, ...
        image = image.convert("RGBA" if image.mode.upper().endswith("A") else "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class Usage:
    """Token counts of a request (or of one choice of a Generate request)."""

    prompt_tokens: int = 0  # tokens in the prompt / inputs, image tokens included
    completion_tokens: int = 0  # generated tokens; 0 for pooling tasks
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    reasoning_tokens: int = 0  # of completion_tokens, a reasoning model's thought
    draft_tokens: int = 0  # speculative decoding: guessed tokens the model checked
    accepted_draft_tokens: int = 0  # of those, the ones it accepted


@dataclass(frozen=True)
class Timing:
    """Server-side timings in milliseconds since the server received the request."""

    queue_ms: float = 0.0  # waiting for admission
    first_token_ms: float = 0.0  # until the first token (Generate) or the result (pooling)
    total_ms: float = 0.0  # until the request finished


T = TypeVar("T")


class ResultList(list[T]):
    """The results of one call, in order (a plain list: indexing, len, ==, iteration), with
    what the response said about the call: token `usage` and server `timing` (None when the
    server sent none), the `model` that served it and its `request_id` (the caller's, or the
    one the server made)."""

    def __init__(
        self,
        items: Iterable[T] = (),
        *,
        usage: Usage | None = None,
        timing: Timing | None = None,
        model: str = "",
        request_id: str = "",
    ) -> None:
        super().__init__(items)
        self.usage = usage
        self.timing = timing
        self.model = model
        self.request_id = request_id


@dataclass(frozen=True)
class TopLogprob:
    """One likely alternative token at a position."""

    token_id: int
    logprob: float  # natural log
    token: str


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a token and the most likely alternatives at its position."""

    token_id: int
    logprob: float  # natural log, before temperature / penalties / top-k/p
    token: str
    top: tuple[TopLogprob, ...] = ()  # most likely first


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call made by the model."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def parsed_arguments(self) -> Any:
        """The arguments as Python values (json.loads); raises ValueError on bad JSON."""
        return json.loads(self.arguments) if self.arguments else {}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call in a streamed chunk; join arguments_delta by index."""

    index: int  # which call of the choice, from 0
    id: str  # set on the first delta of a call only
    name: str  # set on the first delta of a call only
    arguments_delta: str


@dataclass(frozen=True)
class RelaxedKeyword:
    """A schema keyword the server compiled around (generate(..., relaxed=True)): the output
    may not satisfy it."""

    pointer: str  # JSON pointer of the schema object holding it ("" = the root)
    keyword: str  # as the schema writes it, e.g. "uniqueItems"


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed Generate response. Choices (n > 1) interleave, told apart by `index`;
    the last chunk of each choice has finish_reason, usage and timing set."""

    index: int
    text: str  # delta since this choice's previous chunk
    token_ids: tuple[int, ...]  # delta
    finish_reason: FinishReason | None  # None while the choice runs
    usage: Usage | None
    timing: Timing | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    tool_calls: tuple[ToolCallDelta, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # first chunk of the stream only
    request_id: str = ""
    model: str = ""  # first chunk of the stream only
    stop: str | int | None = None  # matched stop string or stop token id, for "stop"
    relaxed_keywords: tuple[RelaxedKeyword, ...] = ()  # last chunk of a choice only
    reasoning_text: str = ""  # a reasoning model's thought, delta (`text` is the answer)


@dataclass(frozen=True)
class GenerateResult:
    """One complete choice, collected from the stream."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # None only if the stream ended without one
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    timing: Timing | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    request_id: str = ""
    model: str = ""
    stop: str | int | None = None  # matched stop string or stop token id
    # schema keywords not enforced (relaxed=True); empty when every keyword was
    relaxed_keywords: tuple[RelaxedKeyword, ...] = ()
    reasoning_text: str = ""  # a reasoning model's thought (`text` is only its answer)


@dataclass(frozen=True)
class RerankResult:
    """One ranked document."""

    index: int  # position in the documents passed in
    score: float  # higher is more relevant
    document: str | None = None  # the text, when return_documents=True


@dataclass(frozen=True)
class LabelScore:
    """A label and its probability."""

    label: str
    score: float


@dataclass(frozen=True)
class Classification:
    """Label probabilities of one input."""

    label: str  # the most likely label
    scores: tuple[LabelScore, ...]  # all labels, highest first


@dataclass(frozen=True)
class TokenizeResult:
    """Tokens of a text or rendered chat."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...] = ()  # vocabulary strings, when return_tokens=True
    max_context: int = 0  # the model's context window
    model: str = ""  # the model whose tokenizer was used
    request_id: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """One model the server hosts and what it can do."""

    name: str
    tasks: tuple[Task, ...]
    max_context: int
    dtype: str
    device: str
    score_method: ScoreMethod | None = None  # None: cannot score
    labels: tuple[str, ...] = ()  # classifier labels, in model order
    embedding_dimension: int = 0  # 0 when not an embedder
    architecture: str = ""
    supports_images: bool = False
    quantization: str = ""  # "" when unquantised
    vocab_size: int = 0
    speculative: str = ""  # speculative decoding's method; "" when off
    kv_cache_dtype: str = ""  # the KV cache's element type ("float8_e4m3fn" with fp8); "" if none
    tensor_parallel_size: int = 1  # ranks the model is split over


@dataclass(frozen=True)
class ModelLoad:
    """One model's load on one replica, as its engine's latest step left it (WatchLoad)."""

    model: str
    running: int  # sequences in the engine's batch (one per choice, one per pooling input)
    waiting: int  # sequences queued in the engine
    kv_usage: float  # share of KV blocks in use, 0 to 1
    free_blocks: int  # KV blocks free (empty or only cached)
    total_blocks: int  # KV blocks in all (0: no KV cache)
    prefix_hit_rate: float  # prefix-cache hits per prompt token looked up, 0 to 1
    tokens_in_flight: int  # prompt + output tokens of running and waiting sequences
    calls_in_flight: int  # calls of this model in the server
    serving: bool  # False while its engine is dead or restarting


@dataclass(frozen=True)
class LoadReport:
    """One replica's load, every requested model at the same moment."""

    models: tuple[ModelLoad, ...]
    calls_in_flight: int  # calls in the server, all models together
    draining: bool  # the server is shutting down: send it nothing new
    request_id: str = ""  # the watch's (the caller's, or the server's)
