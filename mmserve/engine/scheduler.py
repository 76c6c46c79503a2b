"""The token-budget scheduler. There is no prefill phase and no decode phase: each request has
num_tokens and num_computed_tokens, and each step lets the second catch up with the first under
a budget of max_num_batched_tokens. Chunked prefill, prefix caching and preemption by recompute
all follow from that."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mmserve.config import SchedulerConfig
from mmserve.engine.block_pool import KVBlock
from mmserve.engine.encoder_cache import EncoderCacheManager
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.messages import EngineOutput, EngineStats
from mmserve.engine.sched_output import (
    RunnerOutput,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from mmserve.outputs import TokenLogprob
from mmserve.request import Request, RequestStatus
from mmserve.structured_output.backend import GrammarMatcher, accept_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.encoder = EncoderCacheManager(
            max(config.encoder_cache_rows, config.budget),
            config.max_encoder_rows_per_step or config.budget,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._pending: list[EngineOutput] = []  # outputs of requests ended between steps
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.on_finish: Callable[[Request], None] | None = None  # told of each ended request
        # cumulative counters for metrics (EngineStats)
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # ... found cached
        self.num_preemptions = 0
        self.spec_drafts = 0  # speculative decoding: a request's step that checked guesses
        self.spec_draft_tokens = 0  # guesses checked
        self.spec_accepted_tokens = 0  # ... accepted
        self._tokens_in_flight = 0  # known tokens (prompt + output) of self.requests, kept as they change

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self._tokens_in_flight += request.num_known_tokens
        if request.params.prompt_logprobs:
            self._prompt_logprobs[request.request_id] = [None]
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks go back to the pool now."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._pending.append(self._output(request, [], None))

    def stats(self) -> EngineStats:
        """The scheduler's load and counters now (EngineStats; O(1): taken every step)."""
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks if self.kv.num_blocks else 0,
            tokens_in_flight=self._tokens_in_flight,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            encoder_cache_hits=self.encoder.hits,
            encoder_cache_misses=self.encoder.misses,
            spec_decode_num_drafts=self.spec_drafts,
            spec_decode_num_draft_tokens=self.spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_accepted_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.budget
        self.encoder.begin_step()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new and request.num_pending and self._ends_by_length(request):
                num_new = 0  # its pending token is its last: nothing more to compute
            num_new = self._fit_images(request, request.num_computed_tokens, num_new)
            if num_new == 0:  # its next image waits for encoder budget, or it is done
                i += 1
                continue
            probs, request.draft_probs = request.draft_probs, None
            drafts = self._drafts(request, num_new, budget)
            if not drafts or not self.kv.allocate_slots(request, num_new + len(drafts)):
                drafts = []  # (guesses never preempt anyone)
                if not self._allocate_or_preempt(request, num_new, out):
                    break  # it preempted itself: nothing after it is running any more
            out.scheduled.append(self._scheduled(request, num_new, drafts, probs))
            budget -= num_new + len(drafts)
            i += 1
        while self.waiting and budget > 0 and not out.num_preempted:
            if len(self.running) >= self.config.max_num_seqs or self.waiting[0].num_pending:
                break  # (a request preempted with a token in flight waits for its value)
            num_new = self._admit(self.waiting[0], budget)
            if num_new == 0:
                break  # FCFS: no later request overtakes one that does not fit
            request = self.waiting.popleft()
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        out.encoder_free = self.encoder.end_step()
        return out

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The speculative guesses this step checks for a decoding request: its proposer's,
        cut to the token budget, max_tokens and the context (a guess is an output token)."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if not drafts or num_new != 1 or request.num_pending:
            return []
        room = min(
            budget - 1,
            request.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return drafts[: max(room, 0)]

    def _fit_images(self, request: Request, start: int, num_new: int) -> int:
        """num_new, or fewer so that the chunk stops before an image the encoder cannot run
        this step (0: not this step). Reserves encoder-cache room for the images it keeps."""
        if not request.mm_inputs:
            return num_new
        touched = [mm for mm in request.mm_inputs if mm.overlaps(start, start + num_new)]
        if request.pooling is not None:  # all of the input or nothing
            return num_new if not touched or self.encoder.plan(touched) is not None else 0
        for mm in touched:  # in prompt order: keep the images that fit, stop before the first that does not
            if self.encoder.plan([mm]) is None:
                return max(mm.start - start, 0)
        return num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()  # the newest request goes first
            self._preempt(victim)
            out.num_preempted += 1
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int) -> int:
        """Looks up the prefix cache and allocates; returns the tokens to compute (0 = no room)."""
        hits: list[KVBlock] = []
        num_hit_tokens = 0
        if request.num_computed_tokens == 0:
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
        if request.pooling is not None and num_new < request.num_tokens:
            # pooling sees the whole input in one step; alone in a step it may pass the budget
            if budget < self.config.budget:
                return 0
            num_new = request.num_tokens
        num_new = self._fit_images(request, request.num_computed_tokens + num_hit_tokens, num_new)
        if num_new == 0:
            return 0
        if not self.kv.allocate_slots(request, num_new, hits):
            return 0
        request.num_computed_tokens += num_hit_tokens
        if self.kv.looks_up(request):  # counted once admitted: a request may wait and retry
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        return num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _ends_by_length(self, request: Request) -> bool:
        """Whether the request's pending tokens reach its output or context limit."""
        num_out = len(request.output_token_ids) + request.num_pending
        return num_out >= request.max_tokens or request.num_tokens >= self.max_model_len

    def _scheduled(
        self,
        request: Request,
        num_new: int,
        drafts: list[int] | None = None,
        probs: Any = None,
    ) -> ScheduledRequest:
        """The request's share of this step, committed now: its computed count moves on, and
        a token it will sample counts as pending until update() brings its value. Guesses
        (drafts) are computed after its tokens, and counted only once update() accepts them;
        probs: the distributions a draft model drew them from (None: chosen, not drawn)."""
        start = request.num_computed_tokens
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        done = start + num_new == request.num_tokens
        request.num_computed_tokens = start + num_new
        if done and request.pooling is None:
            request.num_pending += 1
        mm_inputs = request.mm_inputs
        if mm_inputs:
            mm_inputs = tuple(mm for mm in mm_inputs if mm.overlaps(start, start + num_new))
        token_ids = request.token_ids_range(start, start + num_new)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + drafts if drafts else token_ids,
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=done and request.pooling is None,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            pooling=request.pooling if done else None,
            token_type_ids=request.token_type_ids,
            grammar=request.grammar if done else None,
            mm_inputs=mm_inputs,
            mrope_positions=request.mrope_positions,
            mrope_delta=request.mrope_delta,
            num_kept_blocks=self.kv.num_kept_blocks(request.request_id),
            draft_token_ids=drafts or [],
            draft_probs=None if probs is None or not drafts else probs[: len(drafts)],
        )

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[EngineOutput]:
        """Applies one step's results (with async scheduling, while the next step runs);
        returns news for every request that has any."""
        outputs, self._pending = self._pending, []
        refused = self._accept_grammar_tokens(plan, result)
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status.finished:
                continue  # aborted, or ended by the step before, while the step ran
            if result.prompt_logprobs:
                self._collect_prompt_logprobs(request, result)
            sampled = result.sampled.get(item.request_id)
            if sampled is not None and item.draft_token_ids:
                request.num_pending -= 1
                outputs.append(self._append_checked(request, item, result, sampled))
            elif sampled is not None:
                request.num_pending -= 1
                if item.request_id in refused or self._forbidden(request, sampled.token_id):
                    outputs.append(self._end_constrained(request))
                else:
                    outputs.append(self._append_token(request, sampled))
            elif item.pooling is not None:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._output(request, [], None))
                outputs[-1].pooled = result.pooled.get(item.request_id)
        return outputs

    def grammar_accepts(self, plan: SchedulerOutput) -> list[tuple[str, GrammarMatcher]]:
        """The constrained requests of a launched step whose sampled token the update puts
        into their matcher (those still running, without guesses: those take theirs one by
        one), as (request id, matcher). The runner may take them earlier (start_grammars)."""
        accepts = []
        for item in plan.scheduled:
            if item.grammar is None or item.draft_token_ids:
                continue
            request = self.requests.get(item.request_id)
            if request is not None and not request.status.finished:
                accepts.append((item.request_id, item.grammar))
        return accepts

    def _accept_grammar_tokens(self, plan: SchedulerOutput, result: RunnerOutput) -> set[str]:
        """Every constrained request's new token into its matcher, in one batched call (the
        bitmask allowed only acceptable tokens; _check_stop then reads is_terminated), unless
        the runner did (result.grammar_refused). Returns the requests whose matcher refused
        its token: their row had nothing left to draw from (the grammar, complete, allowed
        only the stop tokens that min_tokens held back)."""
        if result.grammar_refused is not None:
            return result.grammar_refused
        matchers, tokens, ids = [], [], []
        for request_id, matcher in self.grammar_accepts(plan):
            sampled = result.sampled.get(request_id)
            if sampled is not None:
                matchers.append(matcher)
                tokens.append(sampled.token_id)
                ids.append(request_id)
        if not matchers:
            return set()
        accepted = accept_tokens(matchers, tokens)
        return {rid for rid, ok in zip(ids, accepted, strict=True) if not ok}

    def _end_constrained(self, request: Request) -> EngineOutput:
        """Ends a request whose grammar refused its sampled token, or whose token its other masks
        forbid (_forbidden), without that token: the output so far is what the constraints
        allow (a token drawn from a row with nothing allowed would break them), so the
        constraints win over min_tokens."""
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return self._output(request, [], None)

    @staticmethod
    def _forbidden(request: Request, token: int) -> bool:
        """Whether allowed_token_ids, bad_words or min_tokens forbid token as the next output
        token. The sampler masks what they forbid, so such a token was drawn from a row they
        (with a grammar) left nothing in: every logit -inf, the draw index 0 (a two-token bad
        word that bans the last allowed token after its first, allowed_token_ids that only a
        min_tokens-held EOS is in). vLLM returns that token; here the request ends without it."""
        params = request.params
        if params.allowed_token_ids:
            if request.allowed_token_set is None:
                request.allowed_token_set = frozenset(params.allowed_token_ids)
            if token not in request.allowed_token_set:
                return True
        if not params.bad_words_token_ids and len(request.output_token_ids) >= params.min_tokens:
            return False
        return token in params.banned_after(request.output_token_ids, request.eos_token_ids)

    def _collect_prompt_logprobs(self, request: Request, result: RunnerOutput) -> None:
        """Appends a prompt chunk's logprobs past those collected: a recompute after a
        preemption computes the positions again, in chunks whose bounds may differ."""
        chunk = result.prompt_logprobs.get(request.request_id)
        collected = self._prompt_logprobs.get(request.request_id)
        if chunk and collected is not None and chunk[0] <= len(collected):
            collected.extend(chunk[1][len(collected) - chunk[0] :])

    def _append_token(self, request: Request, sampled: SampledToken) -> EngineOutput:
        request.output_token_ids.append(sampled.token_id)
        self._tokens_in_flight += 1
        status, stop_reason = self._check_stop(request, sampled.token_id)
        if status is not None:
            self._finish(request, status)
        logprobs = [sampled.logprob] if sampled.logprob is not None else None
        return self._output(request, [sampled.token_id], logprobs, stop_reason)

    def _append_checked(
        self,
        request: Request,
        item: ScheduledRequest,
        result: RunnerOutput,
        sampled: SampledToken,
    ) -> EngineOutput:
        """A step that checked guesses: the accepted ones, then the model's token, each
        taken like one sampled token (grammar, stop tokens, max_tokens) until one ends the
        request. The KV of the refused guesses is dropped: the computed count covers the
        accepted ones only, and blocks past it go back to the pool (none was hashed)."""
        accepted = result.accepted.get(item.request_id, [])
        checked = len(item.draft_token_ids)
        request.num_draft_tokens += checked
        request.num_accepted_draft_tokens += len(accepted)
        self.spec_drafts += 1
        self.spec_draft_tokens += checked
        self.spec_accepted_tokens += len(accepted)
        request.num_computed_tokens += len(accepted)
        tokens, logprobs = [], []
        status: RequestStatus | None = None
        stop_reason: int | None = None
        for one in [*accepted, sampled]:
            # (allowed: its position's mask held it, unless that mask left nothing to draw:
            # then the request ends without it, as in _end_constrained)
            refused = request.grammar is not None and not request.grammar.accept_token(one.token_id)
            if refused or self._forbidden(request, one.token_id):
                status = RequestStatus.FINISHED_STOPPED
                break
            request.output_token_ids.append(one.token_id)
            self._tokens_in_flight += 1
            tokens.append(one.token_id)
            if one.logprob is not None:
                logprobs.append(one.logprob)
            status, stop_reason = self._check_stop(request, one.token_id)
            if status is not None:
                break
        if status is not None:
            self._finish(request, status)
        else:
            self.kv.trim(request, request.num_computed_tokens + 1)
        return self._output(request, tokens, logprobs or None, stop_reason)

    def _check_stop(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params, num_out = request.params, len(request.output_token_ids)
        if request.grammar is not None and request.grammar.is_terminated():  # token accepted already
            return RequestStatus.FINISHED_STOPPED, token if token in request.eos_token_ids else None
        if num_out >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, token
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if num_out >= request.max_tokens or request.num_known_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def finish_stopped(self, request_id: str) -> None:
        """Ends a request that the front end stopped (a stop string matched its text)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            self._prompt_logprobs.pop(request_id, None)  # (no output follows to carry them)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        if self.requests.pop(request.request_id, None) is not None:
            self._tokens_in_flight -= request.num_known_tokens
        self._finished_ids.append(request.request_id)
        if self.on_finish is not None:
            self.on_finish(request)

    def _output(
        self,
        request: Request,
        new_tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        stop_reason: int | str | None = None,
    ) -> EngineOutput:
        finished = request.status.finished
        prompt_logprobs = None
        # with the first tokens (several at once when the last prompt token checked guesses)
        if request.request_id in self._prompt_logprobs and (finished or request.output_token_ids):
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id)
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=request.status.value if finished else None,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=len(request.output_token_ids),
            first_scheduled_time=request.first_scheduled_time,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_draft_tokens,
        )
