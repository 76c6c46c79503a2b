"""Runs one step: builds the flat batch from the scheduler's plan, runs the model once, computes
logits only where a token is sampled (or prompt logprobs are wanted), and samples."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from mmserve.config import PREFILL_GRAPH_TOKENS
from mmserve.engine.sched_output import (
    RunnerOutput,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from mmserve.kernels import cpu_layers
from mmserve.models.base import (
    CausalLM,
    DualEncoderModel,
    MRopeModel,
    MultiModalCausalLM,
    check_capabilities,
)
from mmserve.models.parallel import TensorParallel
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.outputs import TokenLogprob
from mmserve.params import PoolingParams
from mmserve.runner.cuda_graphs import DecodeGraphs, EncoderGraphs, MixedGraphs, VisionGraphs
from mmserve.runner.distributed import RankMirror
from mmserve.runner.input_batch import FlatBatch, InputBatchBuilder, SampledOnDevice
from mmserve.runner.mask_fill import MaskFiller
from mmserve.runner.pooler import ModelPooler, Pooler, finish_embedding
from mmserve.runner.sampler import (
    SamplingRow,
    position_seed,
    sample_on_device,
    top_logprobs,
    verify_on_device,
)
from mmserve.structured_output.backend import (
    GrammarMatcher,
    accept_tokens,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)

logger = logging.getLogger(__name__)

# Prompt logprobs take the logits of this many prompt rows at a time: [rows, vocab] float32
# (256 x 128k is 128 MiB), whatever the chunk the token budget let through.
PROMPT_LOGPROB_ROWS = 256


# Grammar masks reach CUDA logits through _MaskCopies (False: copied on the compute stream, as
# before session 30; for scripts/ab_switch.py)
MASK_COPY_STREAM = True
# Grammar masks filled on a thread of their own (mask_fill.MaskFiller): None on CUDA only, True
# everywhere (the CPU joins the fill before applying it: for tests), False nowhere (as before
# session 32; for scripts/ab_switch.py)
MASK_FILL_THREAD: bool | None = None
# With a filler, the step before's tokens go into the matchers on its thread, right before the
# fill (ModelRunner.start_grammars); False: the update accepts them and the fill starts after
# it (as before session 35; for scripts/ab_switch.py)
EARLY_ACCEPT = True


class _MaskCopies:
    """A filled grammar mask's copy to the GPU on a stream of its own, into one of two device
    buffers taken in turn (as the host's, _bitmask_buffer). On the compute stream the copy
    (1 MB at 64 rows of Llama 3's vocabulary, from pinned memory) waited for the forward pass
    and then held the LM head's logits back from sampling; on its own stream the copy engine
    moves it while the pass computes, and the compute stream waits only for its end. Each
    buffer's next copy waits for the mask applied from it before."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(0, 0, dtype=torch.int32, device=device)] * 2
        self.applied: list[torch.cuda.Event | None] = [None, None]

    def to_device(self, mask: torch.Tensor, filler: MaskFiller | None = None) -> torch.Tensor:
        """mask (pinned, on the host) on the device, its copy started (after filler's fill,
        when it has one); the current stream will wait for it."""
        compute = torch.cuda.current_stream(self.stream.device)
        self.buffers.reverse()
        self.applied.reverse()
        with torch.cuda.stream(self.stream):
            if filler is not None:
                filler.wait()  # the copy stream waits for the fill, not the host
            if self.buffers[0].shape[0] < mask.shape[0] or self.buffers[0].shape[1] != mask.shape[1]:
                # from the copy stream's pool; freed only after the compute stream's last use
                self.buffers[0] = torch.empty(mask.shape, dtype=mask.dtype, device=self.stream.device)
                self.buffers[0].record_stream(compute)
            elif self.applied[0] is not None:
                self.stream.wait_event(self.applied[0])
            out = self.buffers[0][: mask.shape[0]]
            out.copy_(mask, non_blocking=True)
        compute.wait_stream(self.stream)
        return out

    def done(self) -> None:
        """The mask copied last is applied (call after enqueueing its use)."""
        event = torch.cuda.Event()
        event.record()
        self.applied[0] = event


def _mask(
    logits: torch.Tensor,
    bitmask: tuple[torch.Tensor, list[int]],
    copies: _MaskCopies | None,
    filler: MaskFiller | None = None,
) -> None:
    """A step's grammar masks on its logits: float32 CPU logits by the C library's kernel
    (mmserve.kernels.cpu_layers), the others by the device's (apply_bitmask); copies: how a
    mask reaches CUDA logits; filler: the one filling the mask now (else it is filled)."""
    mask, rows = bitmask
    if copies is not None and logits.device.type == "cuda" and mask.is_pinned():
        apply_bitmask(logits, copies.to_device(mask, filler), rows)
        copies.done()
        return
    if filler is not None:
        filler.wait()
    kernel = cpu_layers.apply_bitmask_cpu if cpu_layers.supports(logits) else None
    apply_bitmask(logits, mask, rows, kernel)


def _constrained_rows(reqs: list[ScheduledRequest], live: Container[str] | None) -> list[int]:
    """The sampling rows whose request has a grammar and is live (all when live is None)."""
    return [i for i, r in enumerate(reqs) if r.grammar is not None and (live is None or r.request_id in live)]


def _to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of a device tensor, started now, and the event that marks it done (CUDA:
    into pinned memory, without waiting; on the CPU the tensor itself and no event)."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


@dataclass
class PooledOnDevice:
    """A step's pooled results on their way to the host: one flat float32 tensor holding
    each request's result (of the given shape) in order."""

    ids: list[str]
    shapes: list[tuple[int, ...]]
    host: torch.Tensor
    copied: torch.cuda.Event | None

    def resolve(self) -> dict[str, torch.Tensor]:
        """request id -> its result on the host (waits for the copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.shapes and self.shapes.count(self.shapes[0]) == len(self.shapes):
            # results of one shape (an embed step's): one view and one unbind (64 rows:
            # 27 against 93 us split and viewed row by row)
            rows = self.host.view(len(self.shapes), *self.shapes[0]).unbind(0)
            return dict(zip(self.ids, rows, strict=True))
        sizes = [math.prod(shape) for shape in self.shapes]
        parts = torch.split(self.host, sizes)
        return {
            request_id: part.view(shape)
            for request_id, part, shape in zip(self.ids, parts, self.shapes, strict=True)
        }


@dataclass
class LaunchedStep:
    """A step whose forward pass is enqueued; sample() and resolve() finish it."""

    batch: FlatBatch
    hidden: torch.Tensor
    out: RunnerOutput  # prompt logprobs already; sampled tokens and pooled by resolve()
    pooled: PooledOnDevice | None = None
    logprobs: list[TokenLogprob | None] | None = None
    host_tokens: torch.Tensor | None = None  # the sampled tokens on the host, once copied
    copied: torch.cuda.Event | None = None  # recorded after the tokens' copy (CUDA)
    # a step that checked speculative guesses: host_tokens is [2, rows], each sampling
    # request's guesses' positions and one more (the tokens, then whether each was accepted)
    checked_guesses: bool = False
    # start_grammars: this step's grammar masks (the mask, its constrained rows), filling
    # since before the step before landed; and the requests whose matcher refused this step's
    # token, being found on the filler's thread (resolve() hands them to the update)
    grammar_mask: tuple[torch.Tensor, list[int]] | None = None
    grammar_refused: Future[set[str]] | None = None

    @property
    def pending(self) -> bool:
        """Whether results of this step are still on their way to the host."""
        return bool(self.batch.sample_rows) or self.pooled is not None


class ModelRunner:
    """Owns the model, the KV cache tensors and per-request sampling generators."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int = 0,
        pooler: Pooler | None = None,
        mirror: RankMirror | None = None,
        parallel: TensorParallel | None = None,
    ) -> None:
        """mirror: on rank 0 of a tensor-parallel model, the other ranks (each launch and
        graph capture is sent to them first); parallel: the group, on every rank (rank 0's
        sampled tokens reach the others, whose next batch reads them)."""
        self.model = model
        self.mirror = mirror
        self.parallel = parallel if mirror is None else mirror.parallel
        self.block_size = block_size
        self.device = device
        self.pooler = pooler  # turns a pooling request's hidden states into its result
        self.causal = model.capabilities.causal  # False for encoders
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(model.num_layers if num_blocks else 0)
        ]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs() on CUDA
        # the same for steps of up to 1 + k tokens per request (speculative decoding)
        self.spec_graphs: DecodeGraphs | None = None
        self.encoder_graphs: EncoderGraphs | None = None  # the same, for an encoder
        # a decoder's steps with prefill tokens (small prefills, prefix hits, mixed steps)
        self.mixed_graphs: MixedGraphs | None = None
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_ids: dict[str, torch.Tensor] = {}  # repetition penalty: distinct prompt ids
        self._allowed_ids: dict[str, torch.Tensor] = {}  # allowed_token_ids, on the device
        caps = model.capabilities
        self.mrope = caps.uses_mrope
        self.dual = caps.dual_encoder  # CLIP/SigLIP: Embed only
        # the model as its capabilities' Protocols, for the methods only they have
        check_capabilities(model)
        self.vision: MultiModalCausalLM | None = (
            model if isinstance(model, MultiModalCausalLM) and caps.reads_images else None
        )
        self.dual_model: DualEncoderModel | None = (
            model if isinstance(model, DualEncoderModel) and self.dual else None
        )
        self.mrope_model: MRopeModel | None = (
            model if isinstance(model, MRopeModel) and self.mrope else None
        )
        # builds each step's flat batch; keeps block tables (and on CUDA pinned buffers)
        self.input_batch = InputBatchBuilder(block_size, device, self.causal, self.mrope, not self.dual)
        # image content hash -> encoder output rows [length, hidden]; the scheduler's
        # EncoderCacheManager decides what stays (plan.encoder_free)
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self._previous: SampledOnDevice | None = None  # the tokens the latest step sampled
        self._bitmasks = [torch.empty(0, 0, dtype=torch.int32)] * 2  # see _bitmask_buffer
        self._mask_copies = _MaskCopies(device) if device.type == "cuda" and MASK_COPY_STREAM else None
        threaded = device.type == "cuda" if MASK_FILL_THREAD is None else MASK_FILL_THREAD
        self._filler = MaskFiller(device) if threaded else None

    def capture_graphs(
        self, max_batch: int, max_model_len: int, max_tokens: int, spec: tuple[int, int] = (0, 0),
        prefill_tokens: int = PREFILL_GRAPH_TOKENS,
    ) -> None:  # fmt: skip
        """Captures decode graphs and graphs of steps with prefill tokens (up to prefill_tokens
        and max_tokens, the step budget), or an encoder's step graphs up to max_tokens
        (CUDA only, where attention is the graph-safe Triton backend). spec: (1 + k, batch limit) of
        speculative decoding: graphs for its steps too (not for M-RoPE models). With tensor
        parallelism every rank captures the same graphs, which hold the all-reduces."""
        if self.mirror is not None:
            self.mirror.capture_graphs(max_batch, max_model_len, max_tokens, spec, prefill_tokens)
        if self.device.type != "cuda":
            return
        if not self.kv_caches:
            if not self.causal and not self.dual:
                self.encoder_graphs = EncoderGraphs(
                    self.model, max_tokens, max_batch, max_model_len, self.device
                )
                self.encoder_graphs.capture()
            return
        tower = getattr(self.vision, "visual", None)  # (Qwen2-VL's tower: graphs as images come)
        if isinstance(tower, VisionTransformer):
            self.vision.visual_graphs = VisionGraphs(tower)  # type: ignore[union-attr]
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, max_batch, max_blocks, max_model_len, self.device,
            mrope=self.mrope,
        )
        self.graphs.capture()
        mixed = MixedGraphs(
            self.model, self.kv_caches, min(max_tokens, prefill_tokens), max_batch, max_blocks,
            max_model_len, self.device, mrope=self.mrope,
        )
        try:  # (a model whose prefill steps cannot be captured runs them eagerly)
            if mixed.sizes:
                mixed.capture()
                self.mixed_graphs = mixed
        except RuntimeError as e:
            logger.warning("steps with prefill tokens run eagerly: their CUDA graphs failed (%s)", e)
        query_len, spec_batch = spec
        if query_len > 1 and not self.mrope:
            self.spec_graphs = DecodeGraphs(
                self.model, self.kv_caches, min(spec_batch, max_batch), max_blocks,
                max_model_len, self.device, query_len=query_len,
            )
            self.spec_graphs.capture()

    def check_alive(self) -> None:
        """EngineDead when another rank of a tensor-parallel model is gone."""
        if self.mirror is not None:
            self.mirror.check_alive()

    def shutdown(self) -> None:
        """Stops the other ranks of a tensor-parallel model, and the mask filler's thread."""
        if self.mirror is not None:
            self.mirror.shutdown()
        if self._filler is not None:
            self._filler.shutdown()

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim
        return per_token * block_size * torch.empty((), dtype=kv_dtype).element_size()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One whole step: launch, sample, wait for the tokens."""
        step = self.launch(plan)
        if step is None:
            return RunnerOutput()
        self.sample(step)
        return self.resolve(step)

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> LaunchedStep | None:
        """Builds the batch and enqueues the forward pass (None for an empty plan); the
        step before's sampled tokens fill this batch's placeholders on the device. Pooled
        results start on their way to the host; prompt logprobs are computed here."""
        if self.mirror is not None:
            self.mirror.launch(plan)  # the other ranks run the same step
        for request_id in plan.finished_ids:
            self._generators.pop(request_id, None)
            self._prompt_ids.pop(request_id, None)
            self._allowed_ids.pop(request_id, None)
        for key in plan.encoder_free:
            self.encoder_outputs.pop(key, None)
        self.input_batch.forget(plan.finished_ids)
        if plan.is_empty:
            return None
        batch = self.input_batch.build(plan, self._previous)
        hidden = self._forward(batch)
        pooled = self._pool(plan, hidden, self._embed_image_inputs(plan) if self.dual else {})
        out = RunnerOutput(prompt_logprobs=self._prompt_logprobs(plan, hidden))
        return LaunchedStep(batch, hidden, out, pooled=pooled)

    @torch.inference_mode()
    def draft_logits(
        self, plan: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> torch.Tensor:
        """A draft model's step (speculative decoding): the plan's forward pass and the logits
        of its sampling rows, [rows, vocab] in plan order; previous fills its placeholders
        (the tokens the draft drew a step before, still on the device). Nothing is sampled,
        pooled or kept."""
        self.input_batch.forget(plan.finished_ids)
        batch = self.input_batch.build(plan, previous)
        hidden = self._forward(batch)
        return self.model.compute_logits(self._sampled_rows(hidden, batch.sample_rows))

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, live: Container[str] | None = None) -> None:
        """Enqueues logits, grammar masks and sampling for a launched step; the tokens start
        on their way to the host. live: the requests still running (rows of others are
        sampled and ignored; their grammars are not consulted). With async scheduling the
        grammar matchers have taken the step before's tokens by now."""
        batch = step.batch
        if not batch.sample_rows:
            return
        reqs = batch.sample_reqs
        if any(s.draft_token_ids for s in reqs):
            self._check_guesses(step, live)
            return
        # the LM head enqueued first: the grammars' bitmask fill (host work) then overlaps it
        # as well as the forward pass, and a slow fill delays the GPU less
        logits = self.model.compute_logits(self._sampled_rows(step.hidden, batch.sample_rows))
        bitmask = step.grammar_mask or self._grammar_bitmask(reqs, live)  # (on the filler's thread)
        if bitmask is not None:
            _mask(logits, bitmask, self._mask_copies, self._filler)
        rows = [self._sampling_row(s) for s in reqs]
        tokens, step.logprobs = sample_on_device(logits, rows, self.generator)
        if self.parallel is not None:
            tokens = self.parallel.broadcast(tokens)  # rank 0's, on every rank
        self._previous = SampledOnDevice(tokens, {s.request_id: i for i, s in enumerate(reqs)})
        step.host_tokens, step.copied = _to_host(tokens)

    def _check_guesses(self, step: LaunchedStep, live: Container[str] | None) -> None:
        """sample() for a step with speculative guesses: logits at every guess's position
        and one after, each under the grammar state and penalties its position would have,
        checked by verify_on_device; resolve() then reads the accepted runs."""
        batch = step.batch
        reqs = batch.sample_reqs
        rows: list[int] = []
        sampling: list[SamplingRow] = []
        drafts: list[int | None] = []
        drawn: list[int] = []  # rows whose guess a draft model drew from a distribution
        probs: list[torch.Tensor] = []  # those distributions, one tensor per request
        for item, last in zip(reqs, batch.sample_rows, strict=True):
            guesses = item.draft_token_ids
            if item.draft_probs is not None and not item.params.greedy and item.params.seed is None:
                drawn += range(len(drafts), len(drafts) + len(guesses))
                probs.append(item.draft_probs)
            rows += range(last - len(guesses), last + 1)
            for j in range(len(guesses) + 1):
                output = item.output_token_ids + guesses[:j] if j else item.output_token_ids
                sampling.append(self._sampling_row(item, output))
                drafts.append(guesses[j] if j < len(guesses) else None)
        logits = self.model.compute_logits(self._sampled_rows(step.hidden, rows))
        bitmask = self._guess_bitmask(reqs, len(rows), live)  # (host work beside the LM head)
        if bitmask is not None:
            _mask(logits, bitmask, self._mask_copies)
        q = (drawn, torch.cat(probs)) if probs else None
        tokens, accepted, step.logprobs = verify_on_device(
            logits, sampling, drafts, self.generator, q
        )
        self._previous = None  # a step after guesses has no placeholders to fill
        # one copy: row 0 the tokens, row 1 whether each row's guess was accepted
        step.host_tokens, step.copied = _to_host(torch.stack([tokens, accepted.long()]))
        step.checked_guesses = True

    def _guess_bitmask(
        self, reqs: list[ScheduledRequest], num_rows: int, live: Container[str] | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens at each position of each constrained request: its matcher
        takes the guesses one by one between fills, and is rolled back after."""
        if not any(r.grammar is not None for r in reqs):
            return None
        bitmask = self._bitmask_buffer(num_rows)
        rows: list[int] = []
        row = 0
        for item in reqs:
            matcher, span = item.grammar, len(item.draft_token_ids) + 1
            if matcher is not None and (live is None or item.request_id in live):
                taken = 0
                for j in range(span):
                    matcher.fill_bitmask(bitmask, row + j)
                    rows.append(row + j)
                    if j == span - 1:
                        break
                    if matcher.accept_token(item.draft_token_ids[j]):
                        taken += 1
                        continue
                    # an ungrammatical guess: refused at j, so the rows after it never count
                    bitmask[row + j + 1 : row + span] = bitmask[row + j]
                    rows += range(row + j + 1, row + span)
                    break
                matcher.rollback(taken)
            row += span
        return bitmask, rows

    def resolve(self, step: LaunchedStep) -> RunnerOutput:
        """Waits for a step's tokens and pooled results to reach the host; its output."""
        out = step.out
        if step.copied is not None:
            step.copied.synchronize()
        if step.grammar_refused is not None:  # (the next step's fill goes on: start_grammars)
            out.grammar_refused = step.grammar_refused.result()
        elif self._filler is not None:
            self._filler.finish()  # the matchers are the scheduler's again
        if step.checked_guesses:
            self._resolve_guesses(step)
        elif step.host_tokens is not None:
            logprobs = step.logprobs or [None] * len(step.batch.sample_reqs)
            tokens = step.host_tokens.tolist()
            for item, token, lp in zip(step.batch.sample_reqs, tokens, logprobs):
                out.sampled[item.request_id] = SampledToken(token, lp)
        if step.pooled is not None:
            out.pooled = step.pooled.resolve()
        return out

    def _resolve_guesses(self, step: LaunchedStep) -> None:
        """Each request's accepted guesses and the token after them, into step.out."""
        out = step.out
        assert step.host_tokens is not None
        tokens, accepted = step.host_tokens.tolist()
        logprobs = step.logprobs or [None] * len(tokens)
        row = 0
        for item in step.batch.sample_reqs:
            guesses = item.draft_token_ids
            j = 0
            while j < len(guesses) and accepted[row + j]:
                j += 1
            taken = [SampledToken(guesses[i], logprobs[row + i]) for i in range(j)]
            out.sampled[item.request_id] = SampledToken(tokens[row + j], logprobs[row + j])
            if guesses:
                out.accepted[item.request_id] = taken
            row += len(guesses) + 1

    def _sampled_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden[rows] without a blocking host-to-device copy of the index (which would
        wait for the forward pass): a decode batch samples every row, in order."""
        if len(rows) == hidden.shape[0]:
            return hidden
        index = torch.tensor(rows, dtype=torch.int64)
        return hidden[index.to(hidden.device, non_blocking=True)]

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        plain = batch.token_type_ids is None and not batch.image_rows
        hidden = None
        if self.graphs is not None and batch.meta.max_query_len == 1 and plain:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        elif self.spec_graphs is not None and plain and batch.meta.max_query_len > 1:
            hidden = self.spec_graphs.run_padded(batch.input_ids, batch.positions, batch.meta)
        if hidden is None and self.mixed_graphs is not None and plain:  # (or what did not fit)
            hidden = self.mixed_graphs.run(batch.input_ids, batch.positions, batch.meta)
        if hidden is None and self.encoder_graphs is not None and not batch.image_rows:
            meta, types = batch.meta, batch.token_type_ids
            hidden = self.encoder_graphs.run(batch.input_ids, batch.positions, meta, types)
        if hidden is not None:
            return hidden
        extra: dict[str, torch.Tensor] = {}
        if batch.token_type_ids is not None:
            extra["token_type_ids"] = batch.token_type_ids
        if batch.image_rows:
            extra["inputs_embeds"] = self._embeddings_with_images(batch)
        return self.model.forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta, **extra)

    def _embeddings_with_images(self, batch: FlatBatch) -> torch.Tensor:
        """Token embeddings [T, hidden] with each image's placeholder rows replaced by its
        encoder output (encoded now unless the encoder cache holds it)."""
        missing = {mm.key: mm for _, mm, _, _ in batch.image_rows if mm.key not in self.encoder_outputs}
        model = self.vision
        if model is None:
            raise RuntimeError("image rows reached a model that reads no images")
        if missing:
            encoded = model.encode_images([mm.data for mm in missing.values()])
            for key, rows in zip(missing, encoded, strict=True):
                self.encoder_outputs[key] = rows
        x = model.embed_input_ids(batch.input_ids)
        for row, mm, first, end in batch.image_rows:
            x[row : row + end - first] = self.encoder_outputs[mm.key][first:end].to(x.dtype)
        return x

    def start_grammars(
        self,
        step: LaunchedStep,
        before: LaunchedStep,
        accepts: Callable[[], Sequence[tuple[str, GrammarMatcher]]],
        live: Container[str] | None = None,
    ) -> None:
        """Async scheduling with a filler (CUDA): starts step's grammar masks before the step
        before it (in flight) lands. The filler's thread waits for before's tokens on the host,
        puts each request's into its matcher (`accepts()`: request id and matcher, those the
        scheduler's update would accept, Scheduler.grammar_accepts; asked only where a fill
        starts here, so a step without grammars pays nothing), then fills step's masks;
        resolve(before) hands the update the requests whose matcher refused its token
        (RunnerOutput.grammar_refused). So the fill waits for the tokens only, not for the
        main thread's update as well (issue 23, target 6). Rows of requests that the update
        then ends are filled for nothing; their tokens are ignored. Does nothing without a
        filler, or where guesses are checked: sample() fills then, after the update."""
        reqs = step.batch.sample_reqs
        if self._filler is None or not EARLY_ACCEPT or before.checked_guesses or before.host_tokens is None:
            return
        if any(s.draft_token_ids for s in reqs):
            return
        rows = _constrained_rows(reqs, live)
        if not rows:
            return  # (the update accepts the tokens, as without a filler)
        sampled = {s.request_id: i for i, s in enumerate(before.batch.sample_reqs)}
        taking = [(rid, matcher, sampled[rid]) for rid, matcher in accepts() if rid in sampled]
        host, copied = before.host_tokens, before.copied

        def accept() -> set[str]:
            if not taking:
                return set()
            if copied is not None:
                copied.synchronize()  # (without the GIL)
            tokens = host.tolist()
            ok = accept_tokens([m for _, m, _ in taking], [tokens[row] for _, _, row in taking])
            return {rid for (rid, _, _), took in zip(taking, ok, strict=True) if not took}

        bitmask = self._bitmask_buffer(len(reqs))
        matchers = [reqs[i].grammar for i in rows]
        before.grammar_refused = self._filler.start(matchers, bitmask, rows, accept)
        step.grammar_mask = (bitmask, rows)

    def _grammar_bitmask(
        self, reqs: list[ScheduledRequest], live: Container[str] | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """Allowed tokens of each constrained row, [rows, ceil(vocab / 32)] int32 on the CPU
        (pinned when the logits are on a GPU, so apply_bitmask's copy is asynchronous); with
        a filler, still being filled on its thread."""
        rows = _constrained_rows(reqs, live)
        if not rows:
            return None
        bitmask = self._bitmask_buffer(len(reqs))
        matchers = [reqs[i].grammar for i in rows]
        if self._filler is not None:
            self._filler.start(matchers, bitmask, rows)
        else:
            fill_bitmasks(matchers, bitmask, rows)  # in parallel (xgrammar)
        return bitmask, rows

    def _bitmask_buffer(self, num_rows: int) -> torch.Tensor:
        """num_rows rows of one of two bitmask buffers, taken in turn and never reset: the
        fill writes every constrained row whole and only those rows are applied. Reused, not
        allocated per step: filling a fresh all-ones mask (64 x 4,008 words at Llama 3's
        vocabulary) ran on torch's CPU threads, which then held the cores xgrammar's fill
        threads needed. Two buffers: a step's copy to the GPU (asynchronous, from pinned
        memory) is done by the time its buffer comes round again, since the step between
        was resolved after it."""
        self._bitmasks.reverse()
        if self._bitmasks[0].shape[0] < num_rows:
            pin = self.device.type == "cuda"
            self._bitmasks[0] = allocate_bitmask(num_rows, self.model.vocab_size, pin)
        return self._bitmasks[0][:num_rows]

    def _pool(
        self, plan: SchedulerOutput, hidden: torch.Tensor, images: dict[str, torch.Tensor]
    ) -> PooledOnDevice | None:
        """images: a dual encoder's image inputs, already embedded (request id -> vector).
        Embeddings sharing their params are pooled together; the results start on their way
        to the host in one copy (nothing waits for them here)."""
        ids: list[str] = []
        results: list[torch.Tensor] = []
        batches: dict[tuple[bool, int | None], list[tuple[str, int, int]]] = {}
        batched = not self.dual and isinstance(self.pooler, ModelPooler)  # it pools in batches
        row = 0
        for item in plan.scheduled:
            n = len(item.token_ids)
            if item.pooling is not None:
                if item.pooling.task == "embed" and batched:
                    key = (item.pooling.normalize, item.pooling.dimensions)
                    batches.setdefault(key, []).append((item.request_id, row, n))
                else:
                    ids.append(item.request_id)
                    results.append(self._pool_one(item, hidden[row : row + n], images).float())
            row += n
        shapes = [tuple(r.shape) for r in results]
        for (normalize, dimensions), group in batches.items():
            starts, lengths = [g[1] for g in group], [g[2] for g in group]
            params = PoolingParams("embed", normalize=normalize, dimensions=dimensions)
            vectors = self.pooler.embed_batch(hidden, starts, lengths, params)  # type: ignore[union-attr]
            ids += [g[0] for g in group]
            shapes += [tuple(vectors.shape[1:])] * len(group)
            results.append(vectors)
        if not results:
            return None
        host, copied = _to_host(torch.cat([r.reshape(-1) for r in results]))
        return PooledOnDevice(ids, shapes, host, copied)

    def _pool_one(
        self, item: ScheduledRequest, rows: torch.Tensor, images: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        assert item.pooling is not None
        if self.dual:
            vector = images.get(item.request_id)
            if vector is None:
                vector = self._dual().pool_text(rows, item.token_ids)
            return finish_embedding(vector, item.pooling)
        if self.pooler is None:
            raise RuntimeError("a pooling request reached a runner without a pooler")
        return self.pooler(rows, item.pooling).float()

    def _dual(self) -> DualEncoderModel:
        if self.dual_model is None:
            raise RuntimeError("a dual-encoder request reached a runner of another model")
        return self.dual_model

    def _embed_image_inputs(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """A dual encoder's image inputs of this step, embedded in batches of one size."""
        groups: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
        for item in plan.scheduled:
            if item.pooling is not None and item.mm_inputs:
                pixels = item.mm_inputs[0].data["pixel_values"]
                groups.setdefault(tuple(pixels.shape), []).append((item.request_id, pixels))
        out: dict[str, torch.Tensor] = {}
        model = self._dual()
        for group in groups.values():
            pixels = torch.cat([p for _, p in group]).to(self.device)
            for (request_id, _), vector in zip(group, model.embed_images(pixels), strict=True):
                out[request_id] = vector
        return out

    def _sampling_row(
        self, item: ScheduledRequest, output: list[int] | None = None
    ) -> SamplingRow:
        """output: the tokens before the row's position (default the request's output; with
        guesses, the output and the guesses before it): penalties and the seed's position."""
        output = item.output_token_ids if output is None else output
        gen = None
        if item.params.seed is not None:
            gen = self._generators.get(item.request_id)
            if gen is None:
                gen = torch.Generator(device=self.device).manual_seed(item.params.seed)
                self._generators[item.request_id] = gen
        seed = None if item.params.seed is None else position_seed(item.params.seed, len(output))
        prompt_ids = None
        if item.params.repetition_penalty != 1.0:  # (converted once, not every step)
            prompt_ids = self._prompt_ids.get(item.request_id)
            if prompt_ids is None:
                prompt_ids = torch.unique(torch.tensor(item.prompt_token_ids, dtype=torch.int64))
                prompt_ids = prompt_ids.to(self.device, non_blocking=True)
                self._prompt_ids[item.request_id] = prompt_ids
        allowed = None
        if item.params.allowed_token_ids:  # (converted once, not every step)
            allowed = self._allowed_ids.get(item.request_id)
            if allowed is None:
                allowed = torch.tensor(item.params.allowed_token_ids, dtype=torch.int64)
                allowed = self._allowed_ids[item.request_id] = allowed.to(self.device, non_blocking=True)
        return SamplingRow(
            item.params, item.prompt_token_ids, output, item.eos_token_ids, gen, seed, prompt_ids,
            allowed,
        )

    def _prompt_logprobs(
        self, plan: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """For each prompt chunk of a request that asked: the logprob of every next prompt
        token, keyed by the position of the first target. The chunk is the scheduler's (the
        token budget bounds it); its logits are taken PROMPT_LOGPROB_ROWS rows at a time."""
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        row = 0
        for item in plan.scheduled:
            n, k = len(item.token_ids), item.params.prompt_logprobs
            end = min(item.start_pos + n, len(item.prompt_token_ids) - 1)  # last with a target
            if k and item.start_pos < end:
                targets = item.prompt_token_ids[item.start_pos + 1 : end + 1]
                rows = hidden[row : row + end - item.start_pos]
                out[item.request_id] = (item.start_pos + 1, self._logprobs_of(rows, targets, k))
            row += n
        return out

    def _logprobs_of(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """hidden: [T, H] -> each row's logprob of its target with rank and top k, batched:
        a few tensor ops per slice of rows, one copy to the host (not T of each)."""
        found: list[TokenLogprob] = []
        for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            chunk = targets[start : start + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[start : start + len(chunk)])
            logprobs = torch.log_softmax(logits.float(), -1)
            ids = torch.tensor(chunk).to(logprobs.device, non_blocking=True)
            found += top_logprobs(logprobs, ids, [k] * len(chunk))
        return found
