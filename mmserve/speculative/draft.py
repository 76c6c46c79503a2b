"""A draft model: a small model with the model's tokenizer runs in the same engine, with its
own paged KV cache and its own runner (CUDA graphs for its one-token steps), and proposes k
tokens per request autoregressively, all speculating requests in one batch per draft step.

Each step it first catches up: it computes the request's tokens it has not seen (the prompt,
then the tokens accepted since its last guesses), and draws the first guess from the logits
of the last one; each next guess is one more one-token step, whose input is the guess
before it, still on the device (no wait between draft steps, one copy of the guesses to the
host at the end). What it fed stays in its cache: the next step keeps the KV of every fed
token that turned out to be the request's, and overwrites the rest.

How a guess is drawn, per request (the target's check in runner/sampler.verify_on_device
keeps each lossless):
- greedy: the draft's most likely token;
- seeded: the token the draft's distribution gives under the very noise the model will draw
  that position with (the request's seed at the position), so that where the two models
  agree the model's own draw is the guess; the model keeps its own draws, so the output is
  the same as without speculation;
- otherwise: drawn from the draft's distribution q (temperature, top-k, top-p, min-p), and
  checked by rejection sampling against the model's p with q.

A request whose state no longer fits the draft's KV pool pushes out the least recently used
states of other requests; one that still does not fit goes without guesses that step."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from mmserve.attention import get_attention_backend
from mmserve.config import ModelConfig
from mmserve.engine.sched_output import ScheduledRequest, SchedulerOutput
from mmserve.models.gguf_cache import materialize
from mmserve.models.loader import load_model, resolve_model_source
from mmserve.params import SamplingParams
from mmserve.processors.tokenizer import load_tokenizer
from mmserve.request import PLACEHOLDER, Request
from mmserve.runner.input_batch import SampledOnDevice
from mmserve.runner.model_runner import ModelRunner
from mmserve.runner.sampler import SamplingRow, argmax, distribution, draw, position_seed
from mmserve.speculative import Guesses, Proposer, ProposerContext

logger = logging.getLogger(__name__)
CUDA_KV_SHARE = 0.1  # most of the free device memory the draft's KV cache takes
CPU_KV_SHARE = 0.25  # the same, of the model's KV budget on the CPU
# the catch-up after a check is one token (the model's own after a refused guess) or two
# (the last guess and the token after it, all accepted): such steps replay a CUDA graph too
CATCH_UP_GRAPH = 2


class FreeBlocks:
    """The draft's KV block ids not in use (no prefix cache: a block has one owner)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} draft blocks, {len(self._free)} free")
        taken = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free += reversed(blocks)


@dataclass
class _State:
    """What the draft holds for one request."""

    fed: list[int] = field(default_factory=list)  # tokens whose KV it holds, from position 0
    verified: int = 0  # leading fed tokens known to be the request's (the rest were guesses)
    blocks: list[int] = field(default_factory=list)  # its KV block ids, in order
    sent: int = 0  # block ids the runner's block table holds for it


@dataclass
class _Turn:
    """One request's share of this step's drafting."""

    request: Request
    state: _State
    k: int  # guesses (0: a long prompt's chunk, caught up on without a guess)
    feed: list[int]  # the tokens to catch up on, from position len(state.fed)
    row: SamplingRow  # the request's sampling at its next output position
    mode: str  # greedy, seeded or drawn


def check_same_tokenizer(draft: object, model: object) -> None:
    """Refuses a draft whose tokenizer maps any token differently from the model's."""
    if model is None:
        raise ValueError("speculative: a draft model needs a model that generates (a tokenizer)")
    mine, theirs = draft.get_vocab(), model.get_vocab()  # type: ignore[attr-defined]
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
    token, index = differ[0]
    raise ValueError(
        f"speculative: the draft's tokenizer differs from the model's ({len(mine)} tokens "
        f"against {len(theirs)}; {len(differ)} (token, id) pairs are in one only, e.g. "
        f"{token!r} = {index}); a draft must share the model's vocabulary"
    )


class DraftProposer(Proposer):
    def __init__(self, path: str, context: ProposerContext) -> None:
        self.context = context
        source = materialize(resolve_model_source(path))
        check_same_tokenizer(load_tokenizer(source.folder, source.gguf_file), context.tokenizer)
        device, dtype = context.device, context.dtype
        backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
        config = ModelConfig(
            str(source.folder), str(dtype).removeprefix("torch."), str(device),
            load_format=context.load_format,
        )
        model, hf_config, _ = load_model(config, device, dtype, backend)
        if not model.capabilities.uses_kv_cache or not model.capabilities.causal:
            raise ValueError("speculative: a draft must be a causal language model")
        own_limit = model.max_model_len or getattr(hf_config, "max_position_embeddings", None)
        self.max_model_len = min(own_limit or context.max_model_len, context.max_model_len)
        self.vocab_size = context.vocab_size or model.vocab_size
        self.k = context.num_speculative_tokens
        block_size = context.block_size
        num_blocks = self._num_blocks(model, dtype)
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, context.seed)
        self.pool = FreeBlocks(num_blocks)
        self.block_size = block_size
        self.generator = torch.Generator(device=device).manual_seed(context.seed + 1)
        self._states: OrderedDict[str, _State] = OrderedDict()  # least recently used first
        self._forgotten: list[str] = []  # states dropped since the last draft step
        if context.cuda_graphs:  # one-token steps, and catch-ups of up to CATCH_UP_GRAPH tokens
            self.runner.capture_graphs(
                context.max_batch, self.max_model_len, context.max_tokens,
                (CATCH_UP_GRAPH, context.max_batch), context.prefill_graph_tokens,
            )
        logger.info(
            "speculative draft %s: %d KV blocks, up to %d tokens per step",
            type(model).__name__,
            num_blocks,
            self.k,
        )

    def _num_blocks(self, model: object, dtype: torch.dtype) -> int:
        """Room for max_batch + 1 requests of the longest context with their guesses, capped by
        a share of the device's free memory (CUDA) or of the model's KV budget (CPU)."""
        context, size = self.context, self.context.block_size
        per_request = -(-(self.max_model_len + self.k) // size)
        wanted = per_request * (context.max_batch + 1)
        per_block = ModelRunner.kv_bytes_per_block(model, size, dtype)  # type: ignore[arg-type]
        if context.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(context.device)
            cap = int(free * CUDA_KV_SHARE) // per_block
        else:
            cap = int(context.kv_cache_memory_bytes * CPU_KV_SHARE) // per_block
        return max(per_request, min(wanted, cap))

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        # (behind another proposer: its guesses are part of the context; drawn or not, a
        # guess is checked as a chosen one there, so draw the most likely)
        return self._draft([(request, k, list(after))], chosen=True)[0].tokens

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Guesses]:
        return self._draft([(r, k, []) for r, k in zip(requests, ks, strict=True)], chosen=False)

    def finished(self, request: Request) -> None:
        self._drop(request.request_id)

    def _drop(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.pool.free(state.blocks)
            self._forgotten.append(request_id)

    @torch.inference_mode()
    def _draft(self, asks: list[tuple[Request, int, list[int]]], chosen: bool) -> list[Guesses]:
        turns: dict[str, _Turn] = {}
        budget = self.context.max_tokens
        asking = {r.request_id for r, _, _ in asks}
        for request, k, after in asks:
            turn = self._turn(request, k, after, budget, asking, chosen)
            if turn is not None:
                turns[request.request_id] = turn
                budget -= len(turn.feed)
        guesses = self._run(list(turns.values()))
        return [guesses.get(request.request_id, Guesses()) for request, _, _ in asks]

    def _turn(
        self,
        request: Request,
        k: int,
        after: list[int],
        budget: int,
        asking: set[str],
        chosen: bool,
    ) -> _Turn | None:
        """The request's share of this step, its blocks allocated (None: no guesses now)."""
        context = request.all_token_ids + after
        k = min(k, self.max_model_len - len(context))
        if k <= 0 or budget <= 0:
            return None
        state = self._states.pop(request.request_id, None) or _State()
        self._states[request.request_id] = state  # (now the most recently used)
        kept = state.verified
        while kept < min(len(state.fed), len(context)) and state.fed[kept] == context[kept]:
            kept += 1
        kept = min(kept, len(context) - 1)  # the last token is fed again: its logits guess
        del state.fed[kept:]
        state.verified = kept
        feed = context[kept:]
        if len(feed) > budget:  # a long prompt: a chunk now, guesses once it is caught up
            feed, k = feed[:budget], 0
        if not self._reserve(state, kept + len(feed) + max(k - 1, 0), asking):
            return None
        params = request.params
        output = request.output_token_ids + after
        seed = None if params.seed is None or chosen else position_seed(params.seed, len(output))
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.context.device)
        row = SamplingRow(
            params, request.prompt_token_ids, output, request.eos_token_ids, gen, seed
        )
        mode = "greedy" if params.greedy or chosen else "seeded" if seed is not None else "drawn"
        return _Turn(request, state, k, feed, row, mode)

    def _reserve(self, state: _State, num_tokens: int, asking: set[str]) -> bool:
        """Blocks for num_tokens positions, pushing out states of requests not asking now."""
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        while needed > self.pool.num_free_blocks:
            idle = next((rid for rid in self._states if rid not in asking), None)
            if idle is None:
                return False
            self._drop(idle)
        if needed > 0:
            state.blocks += self.pool.allocate(needed)
        return True

    def _run(self, turns: list[_Turn]) -> dict[str, Guesses]:
        """The draft steps: the catch-up with the first guesses, then one step per guess."""
        if not turns:
            return {}
        drawn: list[list[torch.Tensor]] = [[] for _ in turns]  # q of each guess (drawn mode)
        steps: list[tuple[list[int], torch.Tensor]] = []  # each step's turns and guesses
        alive = list(range(len(turns)))  # the turns of the current draft step
        previous: SampledOnDevice | None = None
        for j in range(max(t.k for t in turns) or 1):
            members = alive if j == 0 else [i for i in alive if turns[i].k > j]
            if not members:
                break
            plan = SchedulerOutput(
                [self._scheduled(turns[i], j) for i in members], finished_ids=self._forgotten
            )
            self._forgotten = []
            alive = [i for i in members if turns[i].k > j]  # (the rows that sample)
            logits = self.runner.draft_logits(plan, previous)
            if not alive:
                break
            tokens = self._guess(self._widen(logits), [turns[i] for i in alive], j, drawn, alive)
            previous = SampledOnDevice(
                tokens, {turns[i].request.request_id: n for n, i in enumerate(alive)}
            )
            steps.append((alive, tokens))
        guessed: list[list[int]] = [[] for _ in turns]
        if steps:
            flat = iter(torch.cat([tokens for _, tokens in steps]).tolist())  # the one wait
            for rows, _ in steps:
                for i in rows:
                    guessed[i].append(next(flat))
        out: dict[str, Guesses] = {}
        for i, turn in enumerate(turns):
            state = turn.state
            state.fed += turn.feed + guessed[i][: max(turn.k - 1, 0)]
            state.verified = min(len(state.fed), turn.request.num_tokens)
            probs = torch.stack(drawn[i]) if drawn[i] else None
            out[turn.request.request_id] = Guesses(guessed[i], probs)
        return out

    def _scheduled(self, turn: _Turn, j: int) -> ScheduledRequest:
        state, request = turn.state, turn.request
        ids = list(state.blocks)
        kept, state.sent = min(state.sent, len(ids)), len(ids)
        if j == 0:
            token_ids, start = turn.feed, len(state.fed)
        else:
            token_ids, start = [PLACEHOLDER], len(state.fed) + len(turn.feed) + j - 1
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=ids,
            sample=turn.k > 0,
            params=_PLAIN,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            num_kept_blocks=kept,
        )

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, the model's vocabulary] float32: the draft's logits, cut or padded (with
        -inf) to the model's logits width."""
        logits = logits.float()
        width = logits.shape[1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=1)
        return logits

    def _guess(
        self,
        logits: torch.Tensor,
        turns: list[_Turn],
        j: int,
        drawn: list[list[torch.Tensor]],
        alive: list[int],
    ) -> torch.Tensor:
        """[len(turns)] guesses at draft step j, on the device."""
        if all(t.mode == "greedy" for t in turns):
            return argmax(logits)
        rows = []
        for turn in turns:
            row = turn.row
            if j:  # the position j tokens later (penalties see only the request's output)
                seed = row.params.seed
                position = (
                    None
                    if seed is None or turn.mode != "seeded"
                    else position_seed(seed, len(row.output_token_ids) + j)
                )
                row = replace(row, position_seed=position)
            rows.append(row)
        probs = distribution(logits, rows)
        generator = self.generator
        tokens = draw(probs, rows, generator)
        greedy = torch.tensor([t.mode == "greedy" for t in turns]).to(
            logits.device, non_blocking=True
        )
        tokens = torch.where(greedy, argmax(logits), tokens)
        for n, turn in enumerate(turns):
            if turn.mode == "drawn":
                drawn[alive[n]].append(probs[n])
        return tokens


_PLAIN = SamplingParams(max_tokens=1)  # a draft step's params: nothing the runner acts on
