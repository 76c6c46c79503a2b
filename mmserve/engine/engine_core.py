"""The engine core: token ids in, token ids out, one step at a time."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch

from mmserve.config import CacheConfig, EngineConfig
from mmserve.engine.grammars import PendingGrammars
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.messages import EngineOutput, EngineRequest, EngineStats
from mmserve.engine.sched_output import RunnerOutput, SchedulerOutput
from mmserve.engine.scheduler import Scheduler
from mmserve.engine.warmup import timed_warm_up, watch_late_compiles
from mmserve.heap import thaw_heap
from mmserve.inputs import grid_thw
from mmserve.models.base import CausalLM
from mmserve.models.fp8 import is_fp8
from mmserve.models.gguf_linear import gguf_quantization
from mmserve.models.int8 import is_int8
from mmserve.request import Request
from mmserve.runner.distributed import RankMirror
from mmserve.runner.model_runner import LaunchedStep, ModelRunner
from mmserve.runner.pooler import Pooler
from mmserve.speculative import ProposerContext
from mmserve.speculative.controller import Speculator
from mmserve.structured_output.backend import CompiledGrammar, GrammarMatcher
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.structured_output.reasoning import ReasoningMatcher

logger = logging.getLogger(__name__)
GPU_ACTIVATION_RESERVE = 4 << 30  # bytes kept free for activations, logits and CUDA graphs
COMPILE_POLL_S = 0.005  # an engine waiting only for grammar compiles checks this often


class EngineCore:
    """Owns the scheduler, the KV cache and the model runner of one model."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        model_max_len: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        pooler: Pooler | None = None,
        structured: StructuredOutputManager | None = None,
        mirror: RankMirror | None = None,
    ) -> None:
        """structured: compiles the output constraints of requests (None: the model cannot
        generate, and no request carries one). mirror: the other ranks of a tensor-parallel
        model, which run every step this core's runner runs."""
        # the token budget's default depends on the device
        config = replace(config, scheduler=config.scheduler.on_device(device.type))
        self.config = config
        cache = config.cache
        limit = config.model.max_model_len or model_max_len
        # speculative decoding; first, so that a draft model's weights and KV cache are
        # counted before the model's KV cache takes what is left of the device
        self.speculator: Speculator | None = None
        if config.speculative.method is not None and model.capabilities.uses_kv_cache:
            max_len = min(limit, model_max_len)
            context = self._proposer_context(model, structured, device, kv_dtype, max_len)
            self.speculator = Speculator(config.speculative, context)
        cache_dtype = kv_cache_dtype(cache, kv_dtype)
        self.kv_cache_dtype = str(cache_dtype).removeprefix("torch.")
        num_blocks = 0  # encoders keep no KV cache
        if model.capabilities.uses_kv_cache:
            num_blocks = cache.num_blocks or kv_blocks_for_budget(config.cache, model, cache_dtype, device)
        if mirror is not None:
            num_blocks = mirror.parallel.min_over_ranks(num_blocks)  # every rank's pool the same
        self.runner = ModelRunner(
            model, num_blocks, cache.block_size, device, cache_dtype, config.seed, pooler, mirror
        )
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.num_kv_blocks = num_blocks
        self.device = str(device)
        self.compute_dtype = str(kv_dtype).removeprefix("torch.")  # the model's dtype too
        # FP8 or INT8 as run, the weight-only scheme a checkpoint held (weight_only.py), or
        # the GGUF types kept as blocks (gguf_linear.py)
        self.quantization = (
            "fp8" if is_fp8(model)
            else "w8a8-int8" if is_int8(model)
            else model.weight_scheme or gguf_quantization(model)
        )  # fmt: skip
        kv_limit = num_blocks * cache.block_size if num_blocks else model_max_len
        self.max_model_len = min(limit, model_max_len, kv_limit)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # sampled, not yet read
        self.structured = structured
        self._compiling = PendingGrammars(structured) if structured is not None else None
        if self.speculator is not None:
            self.scheduler.on_finish = self.speculator.finished
        self._failed: list[EngineOutput] = []  # requests that failed before they ran
        if not config.model.enforce_eager:
            scheduler, spec = config.scheduler, config.speculative
            graph_tokens = config.model.prefill_graph_tokens_for(self.quantization)
            guesses = (1 + spec.num_speculative_tokens, spec.disable_batch_size)
            self.runner.capture_graphs(
                scheduler.max_num_seqs, self.max_model_len, scheduler.budget,
                guesses if self.speculator is not None else (0, 0), graph_tokens,
            )
        self.warmup_seconds = 0.0  # the start-up warm-up's time (engine/warmup.py)
        warm = config.model.warmup if config.model.warmup is not None else device.type == "cuda"
        caps = model.capabilities  # (a decoder generates, unless a classifier or embeds_only)
        if warm and num_blocks and caps.causal and not (caps.classifier or caps.embeds_only):
            self.warmup_seconds = timed_warm_up(
                self.runner, config, num_blocks, self.max_model_len, model.vocab_size, structured is not None
            )
        # what compiles from here on made a request wait (logged: what to warm up next)
        self.late_compiles = watch_late_compiles() if device.type == "cuda" else None
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens at most in flight), max_model_len %d",
            num_blocks, cache.block_size, num_blocks * cache.block_size, self.max_model_len,
        )

    def _proposer_context(
        self,
        model: CausalLM,
        structured: StructuredOutputManager | None,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> ProposerContext:
        config = self.config
        spec, scheduler = config.speculative, config.scheduler
        return ProposerContext(
            tokenizer=structured.tokenizer if structured is not None else None,
            vocab_size=model.vocab_size,
            device=device,
            dtype=dtype,
            block_size=config.cache.block_size,
            max_model_len=max_model_len,
            max_batch=min(spec.disable_batch_size, scheduler.max_num_seqs),
            max_tokens=scheduler.budget,
            num_speculative_tokens=spec.num_speculative_tokens,
            seed=config.seed,
            cuda_graphs=not config.model.enforce_eager,
            prefill_graph_tokens=config.model.prefill_graph_tokens_for(""),  # (an unquantised draft)
            kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes,
            load_format=config.model.load_format,
        )

    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request; a constrained one joins once its grammar compiled."""
        if request.params.structured is None:
            self._admit_or_fail(request, None)
        elif self._compiling is None:
            self._fail(request, ValueError("this model does not generate"))
        else:
            self._compiling.submit(request)

    def _admit_or_fail(self, request: EngineRequest, grammar: CompiledGrammar | None) -> None:
        try:
            self._admit(request, grammar)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            self._fail(request, e)

    def _admit(self, er: EngineRequest, grammar: CompiledGrammar | None) -> None:
        request = Request(
            er.request_id, er.prompt_token_ids, er.params, er.eos_token_ids, er.max_tokens,
            er.cache_salt, er.mm_inputs, pooling=er.pooling, token_type_ids=er.token_type_ids,
            grammar=_matcher(er, grammar),
        )
        self.add(request)

    def add(self, request: Request) -> None:
        """A request in the engine's own form joins the scheduler (tests build these)."""
        model = self.runner.mrope_model
        if model is not None and request.mm_inputs and request.mrope_positions is None:
            grids = [grid_thw(mm.data) for mm in request.mm_inputs]
            positions, delta = model.mrope_positions(request.prompt_token_ids, grids)
            request.mrope_positions, request.mrope_delta = positions, delta
        self.scheduler.add_request(request)

    def _fail(self, request: EngineRequest, error: Exception) -> None:
        self._failed.append(
            EngineOutput(request.request_id, [], None, None, "abort", error=str(error))
        )

    def _admit_compiled(self) -> list[EngineOutput]:
        """Requests whose grammar is ready join the scheduler; the outputs of those that
        failed before they ran."""
        if self._compiling is not None:
            idle = not self.scheduler.has_unfinished and self._in_flight is None
            if idle and not self._failed:
                self._compiling.wait(COMPILE_POLL_S)
            self._compiling.ready(self._admit, self._fail)
        failed, self._failed = self._failed, []
        return failed

    def abort(self, request_ids: list[str]) -> None:
        """Ends the requests; each comes back once with finish_reason "abort" (one still
        compiling its grammar too, or its caller would wait for it forever)."""
        if self._compiling is not None:
            for request in self._compiling.drop(request_ids):
                self._failed.append(EngineOutput(request.request_id, [], None, None, "abort"))
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def stop(self, request_id: str) -> None:
        """The front end saw a stop string: end the request as stopped, free its blocks."""
        self.scheduler.finish_stopped(request_id)

    @property
    def has_unfinished(self) -> bool:
        busy = self.scheduler.has_unfinished or self._in_flight is not None
        return busy or bool(self._compiling) or bool(self._failed)

    def stats(self) -> EngineStats:
        """The load and counters as the latest step left them (metrics, load reports)."""
        return self.scheduler.stats()

    def check_alive(self) -> None:
        """EngineDead when a rank of a tensor-parallel model is gone."""
        self.runner.check_alive()

    def shutdown(self) -> None:
        if self._compiling is not None:
            self._compiling.close()
        self.runner.shutdown()
        thaw_heap()  # load_engine froze this engine's objects: they may be freed now

    def step(self) -> list[EngineOutput]:
        """One step. With async scheduling a step that samples stays in flight: the next
        call schedules and launches the step after it first, then takes its tokens (so the
        host's scheduling, batch building and launches overlap the device's work, and so do
        the grammar accept and bitmask fill), and returns its outputs. So does a step that
        pools: its results come to the host while the next step is launched."""
        outputs = self._admit_compiled()
        speculator, scheduler = self.speculator, self.scheduler
        budget, max_seqs = self.config.scheduler.budget, self.config.scheduler.max_num_seqs
        if speculator is not None and speculator.active(
            scheduler.running, scheduler.waiting, budget, max_seqs
        ):
            # guesses follow the latest tokens: the step in flight lands first, and a step
            # that checks guesses is not left in flight (its accepted run is not known yet)
            outputs += self._land_in_flight()
            speculator.propose(scheduler.running)
        plan = self.scheduler.schedule()
        step = self.runner.launch(plan)
        if step is not None and self._in_flight is not None:  # (the grammars' fill: now)
            before, launched = self._in_flight
            accepts = functools.partial(self.scheduler.grammar_accepts, before)
            self.runner.start_grammars(step, launched, accepts, self.scheduler.requests)
        outputs += self._land_in_flight()
        if step is None:
            return outputs + self.scheduler.update(plan, RunnerOutput())
        self.runner.sample(step, self.scheduler.requests)
        if self.async_scheduling and step.pending and not step.checked_guesses:
            self._in_flight = (plan, step)
            return outputs
        return outputs + self.scheduler.update(plan, self.runner.resolve(step))

    def _land_in_flight(self) -> list[EngineOutput]:
        """The outputs of the step in flight, once its tokens are on the host (none: [])."""
        if self._in_flight is None:
            return []
        before, launched = self._in_flight
        self._in_flight = None
        return self.scheduler.update(before, self.runner.resolve(launched))


def kv_cache_dtype(cache: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype, or FP8 (--kv-cache-dtype fp8)."""
    return torch.float8_e4m3fn if cache.kv_cache_dtype == "fp8" else dtype


def kv_blocks_for_budget(
    cache: CacheConfig, model: CausalLM, kv_dtype: torch.dtype, device: torch.device
) -> int:
    """CPU: a fixed byte budget. CUDA: the share gpu_memory_utilization of the card, minus
    what is already used (weights) and a reserve for activations and CUDA graphs."""
    per_block = ModelRunner.kv_bytes_per_block(model, cache.block_size, kv_dtype)
    budget = cache.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - GPU_ACTIVATION_RESERVE
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use after loading, %.1f GiB for the KV cache",
            total / 2**30, (total - free) / 2**30, budget / 2**30,
        )
    return max(1, budget // per_block)


def _matcher(er: EngineRequest, grammar: CompiledGrammar | None) -> GrammarMatcher | None:
    """The request's matcher: its grammar's, behind its reasoning gate when it has one (the
    grammar starts after the thought; a budget forces the thought's end)."""
    inner = grammar.matcher() if grammar is not None else None
    if er.reasoning is None:
        return inner
    return ReasoningMatcher(er.reasoning, inner, er.eos_token_ids)
