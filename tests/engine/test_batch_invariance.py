"""A request's results must not depend on what else runs, nor on how it was scheduled:
regressions found by differential fuzzing (batch vs alone)."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from mmserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.grammars import PendingGrammars
from mmserve.engine.messages import EngineOutput, EngineRequest
from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams
from mmserve.request import Request
from mmserve.speculative import Proposer
from mmserve.structured_output.params import StructuredOutputParams
from tests.engine.conftest import assert_all_blocks_free, make_core, make_request
from tests.fake_model import FakeModel

MODEL = FakeModel()


def _prompt_logprobs(outputs: list[EngineOutput], request_id: str) -> list[TokenLogprob | None]:
    found = [o.prompt_logprobs for o in outputs if o.request_id == request_id and o.prompt_logprobs]
    assert len(found) == 1
    return found[0]


def _engine(settings: dict[str, Any]) -> EngineCore:
    """A FakeModel engine; settings: as _workload draws them."""
    config = EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(
            block_size=settings["block_size"],
            num_blocks=settings["num_blocks"],
            enable_prefix_caching=settings["caching"],
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=settings["budget"],
            max_num_seqs=settings["max_seqs"],
            async_scheduling=settings["async"],
        ),
        speculative=SpeculativeConfig(method=settings["speculative"], num_speculative_tokens=3),
    )
    return EngineCore(config, MODEL, 512, torch.device("cpu"), torch.float32)


def _run(core: EngineCore, requests: list[Request]) -> list[EngineOutput]:
    for r in requests:
        core.add(r)
    outputs: list[EngineOutput] = []
    while core.has_unfinished:
        outputs += core.step()
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_survive_a_recompute_with_other_chunks(async_scheduling: bool) -> None:
    # 4 blocks of 4: the decoding request "a" outgrows the pool and preempts "b" after its
    # first prompt chunk; b's recompute then runs in chunks whose bounds differ (the budget
    # is shared differently), and its prompt logprobs must still cover every position
    prompt = list(range(10, 20))
    alone = _prompt_logprobs(
        _run(make_core(MODEL), [make_request("b", prompt, 2, prompt_logprobs=1)]), "b"
    )
    core = make_core(MODEL, num_blocks=4, budget=5, async_scheduling=async_scheduling)
    b = make_request("b", prompt, 2, prompt_logprobs=1)
    got = _prompt_logprobs(_run(core, [make_request("a", [1, 2, 3], 8), b]), "b")
    assert b.num_preemptions > 0
    assert len(got) == len(prompt)
    assert got[0] is None and None not in got[1:]
    assert [x.token_id for x in got[1:] if x] == prompt[1:]
    expected = [x.logprob for x in alone[1:] if x]
    assert [x.logprob for x in got[1:] if x] == pytest.approx(expected, rel=1e-5)
    assert_all_blocks_free(core)


class _SlowCompiler:
    """A grammar compiler whose compiles finish only when released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def compile(self, params: StructuredOutputParams, counted: bool = True) -> None:
        self.release.wait(10)
        raise ValueError("never needed")


def test_abort_while_its_grammar_compiles_still_answers_abort() -> None:
    # the front end (and the server's stream) wait for a finish of every request they sent
    compiler = _SlowCompiler()
    core = make_core(MODEL)
    core._compiling = PendingGrammars(compiler)  # type: ignore[arg-type]
    params = SamplingParams(
        max_tokens=4, temperature=0.0, structured=StructuredOutputParams("regex", "a+")
    )
    core.add_request(EngineRequest("c", [1, 2, 3], params, frozenset(), 4))
    core.abort(["c"])
    outputs = []
    while core.has_unfinished:
        outputs += core.step()
    compiler.release.set()
    core.shutdown()
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("c", "abort", None)]


class _Oracle(Proposer):
    """Guesses the model's own greedy continuation: every guess is accepted."""

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        context = [*request.all_token_ids, *after]
        return MODEL.reference_greedy(context, k)


def test_prompt_logprobs_come_with_the_first_tokens_even_several() -> None:
    # the prompt's last chunk is its last token alone: that step checks guesses and its
    # first output is several tokens; a stop string then ends it (the front end's stop),
    # so no later output could carry the prompt logprobs
    prompt = list(range(1, 10))
    settings = {"block_size": 4, "num_blocks": 64, "budget": 8, "max_seqs": 4}
    core = _engine({**settings, "caching": True, "async": True, "speculative": "ngram"})
    assert core.speculator is not None
    core.speculator.proposer = _Oracle()
    core.add(make_request("a", prompt, 8, prompt_logprobs=1))
    outputs: list[EngineOutput] = []
    while not any(o.new_token_ids for o in outputs):
        outputs += core.step()
    first = next(o for o in outputs if o.new_token_ids)
    assert len(first.new_token_ids) > 1
    core.stop("a")
    while core.has_unfinished:
        core.step()
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
    assert not core.scheduler._prompt_logprobs
    assert_all_blocks_free(core)


# -- a compact differential fuzz: random mixes against each request run alone ------------------


@dataclass(frozen=True)
class _Spec:
    rid: str
    prompt: list[int]
    params: dict[str, Any]  # SamplingParams keywords
    arrival: int  # step at which it is added
    abort_at: int | None  # step at which it is aborted (a no-op once it ended)
    salt: str | None


def _workload(rng: random.Random) -> tuple[dict[str, Any], list[_Spec]]:
    """Small KV pools (preemption), small budgets (chunking), shared and repeated prompts
    (prefix hits), greedy and seeded sampling with every per-request option, aborts."""
    block_size = rng.choice([1, 2, 4, 8])
    settings: dict[str, Any] = {
        "block_size": block_size,
        "num_blocks": rng.randint(max(3, 24 // block_size), 96 // block_size),
        "budget": rng.choice([1, 3, 5, 8, 16, 32]),
        "max_seqs": rng.randint(1, 6),
        "caching": rng.random() < 0.8,
        "async": rng.random() < 0.6,
        "speculative": rng.choice([None, "ngram"]),
    }
    max_len = settings["num_blocks"] * block_size
    vocab = MODEL.vocab_size
    shared = [rng.randrange(1, vocab) for _ in range(rng.randint(0, 20))]
    specs: list[_Spec] = []
    for i in range(rng.randint(1, 8)):
        if specs and rng.random() < 0.2:
            prompt = list(rng.choice(specs).prompt)
        else:
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 20))]
            prompt = (shared if rng.random() < 0.5 else []) + prompt
        prompt = prompt[: max_len - 1]
        room = max_len - len(prompt)
        params: dict[str, Any] = {"max_tokens": min(rng.randint(1, 20), room), "temperature": 0.0}
        if rng.random() < 0.4:
            params.update(temperature=rng.choice([5.0, 30.0]), seed=rng.randrange(1 << 20))
            params.update(rng.choice([{}, {"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.1}]))
        options = {
            "min_tokens": rng.randint(0, params["max_tokens"]),
            "stop_token_ids": rng.sample(range(1, vocab), 4),
            "ignore_eos": True,
            "logprobs": 2,
            "prompt_logprobs": 1,
            "presence_penalty": rng.choice([-1.0, 1.5]),
            "frequency_penalty": rng.choice([-0.5, 1.0]),
            "repetition_penalty": rng.choice([0.5, 2.0]),
            "logit_bias": {rng.randrange(vocab): rng.choice([-100.0, 20.0])},
        }
        params.update({k: v for k, v in options.items() if rng.random() < 0.25})
        arrival = rng.choice([0, 0, rng.randint(0, 12)])
        abort_at = arrival + rng.randint(0, 15) if rng.random() < 0.15 else None
        specs.append(_Spec(f"r{i}", prompt, params, arrival, abort_at, rng.choice([None, "t"])))
    return settings, specs


def _drive(core: EngineCore, specs: list[_Spec]) -> dict[str, dict[str, Any]]:
    """Adds each spec at its step, aborts at its step; each request's tokens, logprobs,
    prompt logprobs and finish reason."""
    results: dict[str, dict[str, Any]] = {
        s.rid: {"tokens": [], "logprobs": [], "prompt_logprobs": None, "finish": None}
        for s in specs
    }
    waiting = sorted(specs, key=lambda s: s.arrival)
    step = 0
    while waiting or core.has_unfinished:
        while waiting and (waiting[0].arrival <= step or not core.has_unfinished):
            s = waiting.pop(0)
            params = SamplingParams(**s.params)
            max_tokens = s.params["max_tokens"]
            core.add(Request(s.rid, list(s.prompt), params, frozenset({0}), max_tokens, s.salt))
        core.abort([s.rid for s in specs if s.abort_at == step])
        for o in core.step():
            result = results[o.request_id]
            assert result["finish"] is None, f"{o.request_id}: news after its end"
            result["tokens"] += o.new_token_ids
            result["logprobs"] += o.new_logprobs or []
            if o.prompt_logprobs is not None:
                result["prompt_logprobs"] = o.prompt_logprobs
            result["finish"] = o.finish_reason
        step += 1
    assert not core.scheduler.requests and not core.kv._blocks
    assert_all_blocks_free(core)
    return results


def _logprobs(found: list[TokenLogprob | None]) -> list[tuple[int, Any] | None]:
    """Token ids, and logprobs up to float noise (the batch's shape changes the sums)."""
    return [None if x is None else (x.token_id, pytest.approx(x.logprob, abs=1e-3)) for x in found]


@pytest.mark.parametrize("seed", [20, 26, 28, 30])  # (each caught the recompute above)
def test_random_mixes_give_each_request_its_output_alone(seed: int) -> None:
    settings, specs = _workload(random.Random(seed))
    batch = _drive(_engine(settings), specs)
    for s in specs:
        got = batch[s.rid]
        alone = _drive(_engine(settings), [replace(s, arrival=0, abort_at=None)])[s.rid]
        if s.params["temperature"] and "seed" not in s.params:
            continue
        if got["finish"] == "abort":
            assert got["tokens"] == alone["tokens"][: len(got["tokens"])], s
            continue
        assert (got["tokens"], got["finish"]) == (alone["tokens"], alone["finish"]), s
        assert _logprobs(got["logprobs"]) == _logprobs(alone["logprobs"]), s
        if s.params.get("prompt_logprobs"):
            assert len(got["prompt_logprobs"]) == len(s.prompt), s
            assert _logprobs(got["prompt_logprobs"]) == _logprobs(alone["prompt_logprobs"]), s
