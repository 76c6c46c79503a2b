"""Messages between the front end and the engine-core process: msgspec structs sent as
msgpack bytes (never pickle). Tensors cross as raw bytes with their shape and dtype."""

from __future__ import annotations

import msgspec
import torch

from mmserve.engine.block_hash import MMPlaceholder
from mmserve.engine.multimodal import MMInput
from mmserve.outputs import EngineOutput, TokenLogprob
from mmserve.params import PoolingParams, SamplingParams
from mmserve.request import Request


class TensorData(msgspec.Struct):
    """A CPU tensor as bytes (C order)."""

    data: bytes
    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorData:
        t = t.detach().cpu().contiguous()
        return cls(t.view(torch.uint8).numpy().tobytes(), list(t.shape), str(t.dtype)[6:])

    def tensor(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(getattr(torch, self.dtype)).reshape(self.shape)


class MMInputData(msgspec.Struct):
    content_hash: str
    offset: int
    length: int
    data: dict[str, TensorData]  # the image processor's tensors


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # structured arrives as a dict: the core compiles it again
    eos_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    mm_inputs: list[MMInputData] = []
    mrope_positions: TensorData | None = None
    mrope_delta: int = 0
    pooling: PoolingParams | None = None
    token_type_ids: list[int] | None = None


class AddRequests(msgspec.Struct, tag=True):
    """The requests added since the front end last stepped, in order: one message, so the
    core sees a burst (a pooling call's inputs) whole and schedules it in one step."""

    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True):
    request_id: str


class GetStats(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


class Output(msgspec.Struct):
    """EngineOutput with the pooled tensor as TensorData."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    pooled: TensorData | None = None
    first_scheduled_time: float | None = None  # monotonic clocks are system-wide on Linux


class Outputs(msgspec.Struct, tag=True):
    outputs: list[Output]


class Ready(msgspec.Struct, tag=True):
    """What the front end needs to know about the loaded model (it never loads weights)."""

    model_folder: str  # resolved local folder, for the tokenizer
    gguf_file: str | None
    max_model_len: int
    vocab_size: int  # valid token ids (tokenizer and model agree)
    model_vocab_size: int  # width of the logits
    hidden_size: int | None
    type_vocab_size: int
    eos_token_ids: list[int]
    architecture: str
    tasks: list[str]
    score_method: str | None
    labels: list[str]
    embedding_size: int | None
    max_input_len: int | None
    yes_no_ids: tuple[int, int] | None
    st_normalize: bool
    num_kv_blocks: int
    device: str  # e.g. "cuda:0"
    compute_dtype: str  # e.g. "bfloat16"
    reads_images: bool  # a VLM or dual encoder: the front end expands/decodes images
    quantization: str  # of the loaded weights: "fp8", or "" when unquantised


class Stats(msgspec.Struct, tag=True):
    num_blocks: int
    num_free_blocks: int
    num_requests: int  # requests the scheduler still holds


class Error(msgspec.Struct, tag=True):
    message: str  # the child failed; it exits after sending this


ToCore = AddRequests | Abort | Stop | GetStats | Shutdown
FromCore = Outputs | Ready | Stats | Error
encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def encode_request(r: Request) -> AddRequest:
    return AddRequest(
        r.request_id,
        r.prompt_token_ids,
        r.params,
        sorted(r.eos_token_ids),
        r.max_tokens,
        r.cache_salt,
        [
            MMInputData(
                m.placeholder.content_hash,
                m.placeholder.offset,
                m.placeholder.length,
                {k: TensorData.of(v) for k, v in m.data.items()},
            )
            for m in r.mm_inputs
        ],
        TensorData.of(r.mrope_positions) if r.mrope_positions is not None else None,
        r.mrope_delta,
        r.pooling,
        r.token_type_ids,
    )


def decode_request(m: AddRequest) -> Request:
    return Request(
        m.request_id,
        m.prompt_token_ids,
        m.params,
        frozenset(m.eos_token_ids),
        m.max_tokens,
        m.cache_salt,
        tuple(
            MMInput(
                MMPlaceholder(i.content_hash, i.offset, i.length),
                {k: v.tensor() for k, v in i.data.items()},
            )
            for i in m.mm_inputs
        ),
        m.mrope_positions.tensor() if m.mrope_positions is not None else None,
        m.mrope_delta,
        m.pooling,
        m.token_type_ids,
    )


def encode_output(o: EngineOutput) -> Output:
    pooled = TensorData.of(o.pooled) if o.pooled is not None else None
    return Output(
        o.request_id,
        o.new_token_ids,
        o.new_logprobs,
        o.prompt_logprobs,
        o.finish_reason,
        o.stop_reason,
        o.num_prompt_tokens,
        o.num_cached_tokens,
        o.num_output_tokens,
        o.error,
        pooled,
        o.first_scheduled_time,
    )


def decode_output(m: Output) -> EngineOutput:
    return EngineOutput(
        m.request_id,
        m.new_token_ids,
        m.new_logprobs,
        m.prompt_logprobs,
        m.finish_reason,
        m.stop_reason,
        m.num_prompt_tokens,
        m.num_cached_tokens,
        m.num_output_tokens,
        m.error,
        m.pooled.tensor() if m.pooled is not None else None,
        m.first_scheduled_time,
    )
