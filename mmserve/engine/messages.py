"""The data that crosses between the front end and the engine core, declared once.

The same structs serve both engine clients: the in-process client passes them as they are, the
engine-process client sends them as msgpack through msgspec (never pickle), with tensors as raw
bytes plus shape and dtype (the encoder's hooks below). A field added here reaches the other
process with no codec to update.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from mmserve.engine.sched_output import SchedulerOutput
from mmserve.inputs import MMInput
from mmserve.models.base import ImageTokenCount
from mmserve.outputs import TokenLogprob
from mmserve.params import PoolingParams, SamplingParams
from mmserve.processors.reasoning_parsers import ReasoningGate


class EngineRequest(msgspec.Struct):
    """One sequence for the engine: a generation (pooling None) or one pooling input. The
    front end has validated every field; the engine trusts them."""

    request_id: str  # unique among the engine's requests (the front end's own id, not the caller's)
    prompt_token_ids: list[int]
    params: SamplingParams  # pooling requests: SamplingParams(max_tokens=1), unused
    eos_token_ids: frozenset[int]  # tokens that end the output unless params.ignore_eos
    max_tokens: int  # resolved output cap (params.max_tokens or the room left in the context)
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks (tenants)
    mm_inputs: tuple[MMInput, ...] = ()  # images in the prompt, in order, placeholders expanded
    pooling: PoolingParams | None = None  # set for embed/classify/score: pooled, not sampled
    token_type_ids: list[int] | None = None  # segment ids of a text pair (BERT-style encoders)
    reasoning: ReasoningGate | None = None  # a thought first: its budget, a grammar after it


class EngineOutput(msgspec.Struct):
    """One step's news for one request (token ids, no text)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today; more with speculation)
    new_logprobs: list[TokenLogprob] | None  # one per new token when logprobs were asked
    prompt_logprobs: list[TokenLogprob | None] | None  # per prompt token, the first one None
    finish_reason: str | None  # None = still running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the eos/stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    error: str | None = None  # set when the request failed inside the engine
    pooled: torch.Tensor | None = None  # [dim] float32 on the CPU: a finished pooling request
    first_scheduled_time: float | None = None  # time.monotonic() of its first step (system-wide)
    num_draft_tokens: int = 0  # speculative guesses checked for it so far
    num_accepted_draft_tokens: int = 0  # of those, the ones the model accepted


class EngineStats(msgspec.Struct, frozen=True):
    """The engine's load as its latest step left it, and its counters since it started.
    Taken after every step and carried on the Outputs message already sent (no message of
    its own, and nobody waits for it); metrics and load reports read the latest one."""

    num_running: int = 0  # sequences (one per choice, one per pooling input) in the batch
    num_waiting: int = 0  # sequences queued or preempted, not yet running
    num_blocks: int = 0  # KV blocks in all (0: a model that keeps no KV cache)
    num_free_blocks: int = 0  # KV blocks empty or holding only cached prefixes
    tokens_in_flight: int = 0  # prompt + output tokens (known) of every running or waiting one
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # ... of them found cached, cumulative
    num_preemptions: int = 0  # sequences preempted (to be recomputed), cumulative
    encoder_cache_hits: int = 0  # image-encoder outputs found cached, cumulative
    encoder_cache_misses: int = 0  # ... computed, cumulative
    spec_decode_num_drafts: int = 0  # steps of a request that checked guesses, cumulative
    spec_decode_num_draft_tokens: int = 0  # guesses checked, cumulative
    spec_decode_num_accepted_tokens: int = 0  # ... accepted, cumulative

    @property
    def kv_usage(self) -> float:
        """The share of KV blocks in use by running sequences, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix-cache hits per token queried since the engine started (0 before any)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class EngineInfo(msgspec.Struct, frozen=True):
    """What the layers above the engine know about its model: everything they read, so that
    none of them reads the runner or the model. The engine answers it when it starts."""

    model_folder: str  # resolved local folder (a GGUF's converted one): tokenizer, templates
    gguf_file: str | None  # the GGUF file the tokenizer is read from, if any
    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    tasks: tuple[str, ...]  # of "generate", "embed", "classify", "score", "rerank"
    max_model_len: int  # prompt + output tokens
    vocab_size: int  # valid token ids are [0, vocab_size) (tokenizer and model agree)
    logits_width: int  # the model's vocabulary width (bitmasks cover it; may be padded)
    eos_token_ids: frozenset[int]
    device: str  # e.g. "cuda:0"
    dtype: str  # the compute dtype, e.g. "bfloat16"
    quantization: str  # of the loaded weights: "fp8", "gguf:Q4_1" (GGUF blocks kept), or ""
    num_kv_blocks: int  # 0 for encoders (no KV cache)
    block_size: int  # tokens per KV block
    uses_token_types: bool  # reads segment ids (BERT pairs)
    score_method: str | None = None  # "cross-encoder" | "cosine" | "yes-token"; None: no Score
    labels: tuple[str, ...] = ()  # a classifier's label names, by label id
    embedding_size: int | None = None  # full embedding dimension; None when it cannot embed
    max_input_len: int | None = None  # pooling inputs' token limit (sentence-transformers)
    normalize: bool = True  # Embed's default for normalize (False: a dot-product model)
    # sentence-transformers' named prompts, prepended to texts that are embedded, and the
    # one used when a request names none (None: no prompt)
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    pooler_tasks: frozenset[str] = frozenset()  # PoolingParams tasks the pooler computes
    reads_images: bool = False  # a VLM: images in chat prompts
    embeds_images: bool = False  # a dual encoder (CLIP, SigLIP): image inputs to Embed/Score
    uses_mrope: bool = False  # multimodal rotary positions (the engine computes them)
    image_token_id: int = -1  # the placeholder of one image in a rendered prompt; -1: none
    image_tokens: ImageTokenCount | None = None  # reads_images: tokens per image
    pad_text_to: int | None = None  # texts to embed are padded to this length (SigLIP)
    pad_token_id: int | None = None  # ... with this token when the tokenizer has none
    speculative: str = ""  # speculative decoding's method ("ngram", ...); "" when off
    kv_cache_dtype: str = ""  # the KV cache's element type; "" without one (encoders)
    tensor_parallel_size: int = 1  # ranks the model is split over

    @property
    def max_pooling_len(self) -> int:
        """Token limit of one pooling input: the context, or less where the model's
        sentence-transformers config says so (inputs beyond it were never trained on)."""
        return min(self.max_model_len, self.max_input_len or self.max_model_len)


# Messages on the engine process's pipe.


class AddRequests(msgspec.Struct, tag=True):
    """The requests added since the front end last stepped, in order: one message, so the
    core sees a burst (a pooling call's inputs) whole and schedules it in one step."""

    requests: list[EngineRequest]


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True):
    request_id: str  # the front end saw a stop string: end it as stopped


class GetStats(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


class Outputs(msgspec.Struct, tag=True):
    outputs: list[EngineOutput]
    stats: EngineStats | None = None  # the engine as this step left it


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class Stats(msgspec.Struct, tag=True):
    num_blocks: int
    num_free_blocks: int
    num_requests: int  # requests the scheduler still holds


class Error(msgspec.Struct, tag=True):
    message: str  # the child failed; it exits after sending this
    rank_lost: bool = False  # the failure was a tensor-parallel rank's (errors.RankLost)


ToCore = AddRequests | Abort | Stop | GetStats | Shutdown
FromCore = Outputs | Ready | Stats | Error


# Messages from rank 0 of a tensor-parallel model to the other ranks (engine/tp_workers.py).


class RankStep(msgspec.Struct, tag=True):
    plan: SchedulerOutput  # as tp_workers.for_ranks() left it: no matchers, no pooling


class RankCapture(msgspec.Struct, tag=True):
    max_batch: int  # ModelRunner.capture_graphs' arguments
    max_model_len: int
    max_tokens: int
    spec: tuple[int, int]
    prefill_tokens: int


class RankShutdown(msgspec.Struct, tag=True):
    pass


ToRank = RankStep | RankCapture | RankShutdown


def _encode_tensor(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return (str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())
    raise NotImplementedError(f"cannot send {type(obj).__name__}")


def _decode_tensor(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        dtype, shape, data = obj
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    raise NotImplementedError(f"cannot receive {kind}")


encoder = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)
to_core_decoder = msgspec.msgpack.Decoder(ToCore, dec_hook=_decode_tensor)
from_core_decoder = msgspec.msgpack.Decoder(FromCore, dec_hook=_decode_tensor)
to_rank_decoder = msgspec.msgpack.Decoder(ToRank, dec_hook=_decode_tensor)


def tensor_from_wire(obj: Any) -> torch.Tensor:
    """A tensor sent in a field typed Any (ScheduledRequest.mrope_positions)."""
    return _decode_tensor(torch.Tensor, obj)  # type: ignore[no-any-return]
