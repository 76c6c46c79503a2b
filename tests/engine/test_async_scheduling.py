"""Async scheduling (one step in flight: step N+1 is scheduled and launched before step N's
tokens reach the host) must give exactly the outputs of synchronous scheduling, whatever ends
requests (eos, stop tokens, length, the context limit, aborts, preemption) and whatever the
batch mixes (chunked prefills, prefix-cache hits, pooling, grammars, penalties)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from mmserve.request import PLACEHOLDER
from mmserve.runner import model_runner
from mmserve.structured_output.backend import GrammarMatcher, allow_tokens
from tests.engine.conftest import assert_all_blocks_free, make_core, make_request, run_all
from tests.fake_model import FakeModel

MODEL = FakeModel()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def both(make_requests, **kwargs) -> tuple[dict, dict, list, list]:  # type: ignore[no-untyped-def]
    """Runs the same requests with and without async scheduling."""
    results = []
    for mode in (False, True):
        core = make_core(MODEL, async_scheduling=mode, **kwargs)
        reqs = make_requests()
        out = run_all(core, reqs)
        assert_all_blocks_free(core)
        results.append((out, reqs))
    (sync_out, sync_reqs), (async_out, async_reqs) = results
    return sync_out, async_out, sync_reqs, async_reqs


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"budget": 5}, {"budget": 1}, {"num_blocks": 14, "budget": 16}, {"max_seqs": 2}, {"caching": False}],
)
def test_async_equals_sync_and_reference(kwargs: dict) -> None:
    ps = prompts(6)

    def reqs():  # type: ignore[no-untyped-def]
        return [make_request(f"r{i}", p, max_tokens=3 + i) for i, p in enumerate(ps)]

    sync_out, async_out, _, _ = both(reqs, **kwargs)
    assert async_out == sync_out
    assert async_out == {f"r{i}": MODEL.reference_greedy(p, 3 + i) for i, p in enumerate(ps)}


def test_stops_mid_batch_discard_the_step_in_flight() -> None:
    """Requests ending on a stop token keep going one step on the device; that token is
    dropped, their blocks come back, and the others are unaffected."""
    ps = prompts(8, seed=5)
    refs = [MODEL.reference_greedy(p, 12) for p in ps]

    def reqs():  # type: ignore[no-untyped-def]
        # stop on the reference's 3rd token (or none): outputs end there, stop token included
        return [
            make_request(f"r{i}", p, max_tokens=12, stop_token_ids=[refs[i][2]] if i % 2 else [])
            for i, p in enumerate(ps)
        ]

    sync_out, async_out, _, async_reqs = both(reqs)
    assert async_out == sync_out
    for i, r in enumerate(async_reqs):
        expected = refs[i][: refs[i].index(refs[i][2]) + 1] if i % 2 else refs[i]
        assert async_out[f"r{i}"] == expected
        assert r.status.finished


def test_context_limit_with_a_token_in_flight() -> None:
    """A request whose pending token reaches max_model_len is not scheduled again."""
    core = make_core(MODEL, async_scheduling=True)
    core.max_model_len = core.scheduler.max_model_len = 20
    p = list(range(1, 16))
    r = make_request("a", p, max_tokens=100)
    out = run_all(core, [r])
    assert len(p) + len(out["a"]) == 20
    assert out["a"] == MODEL.reference_greedy(p, 5)
    assert r.status.value == "length"
    assert_all_blocks_free(core)


def test_one_step_in_flight() -> None:
    """A decode step's tokens come back from the next call of step(), and that next step ran
    with the pending token as a placeholder filled in on the device."""
    core = make_core(MODEL, async_scheduling=True)
    p = prompts(1, seed=1)[0]
    core.add(make_request("a", p, max_tokens=4))
    assert core.step() == []  # the prefill samples; its token is not on the host yet
    plan_tokens = []
    schedule = core.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        plan = schedule()
        plan_tokens.append([s.token_ids for s in plan.scheduled])
        return plan

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    got = []
    while core.has_unfinished:
        got += [t for o in core.step() for t in o.new_token_ids]
    assert got == MODEL.reference_greedy(p, 4)
    # steps 2..4 each computed the placeholder of the step before; then one empty step
    assert plan_tokens[:3] == [[[PLACEHOLDER]]] * 3
    assert plan_tokens[3:] == [[]]


def test_abort_with_a_step_in_flight() -> None:
    core = make_core(MODEL, async_scheduling=True)
    ps = prompts(3, seed=4)
    for i, p in enumerate(ps):
        core.add(make_request(f"r{i}", p, max_tokens=8))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(3):
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    core.abort(["r1"])  # its next token is on the device
    while core.has_unfinished:
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    assert out["r0"] == MODEL.reference_greedy(ps[0], 8)
    assert out["r2"] == MODEL.reference_greedy(ps[2], 8)
    assert out["r1"] == MODEL.reference_greedy(ps[1], 8)[: len(out["r1"])]
    assert_all_blocks_free(core)


def test_penalties_and_logprobs_see_every_token() -> None:
    """Penalties read the outputs on the host: the step before's token is there in time."""
    ps = prompts(4, seed=6)

    def reqs():  # type: ignore[no-untyped-def]
        return [
            make_request(f"r{i}", p, max_tokens=10, repetition_penalty=3.0, frequency_penalty=1.5,
                         logprobs=2)
            for i, p in enumerate(ps)
        ]

    sync_out, async_out, _, _ = both(reqs)
    assert async_out == sync_out


def test_generated_blocks_are_cached_when_the_request_ends() -> None:
    """A block filled by a token still pending when it was scheduled is cached once known."""
    core = make_core(MODEL, num_blocks=16, async_scheduling=True)
    out = run_all(core, [make_request("b", [40, 41, 42], max_tokens=2)])  # block 0: 3 prompt + 1 out
    assert core.kv.pool.num_cached_blocks == 1
    prompt = [40, 41, 42, out["b"][0], 7]  # its KV must be that of the token sampled, once known
    again = make_request("c", prompt)
    assert run_all(core, [again])["c"] == MODEL.reference_greedy(prompt, 8)
    assert again.num_cached_tokens == 4


class EvenTokens(GrammarMatcher):
    """Allows even token ids only; after `length` tokens, only the stop token 0."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id % 2 or (len(self.accepted) >= self.length and token_id != 0):
            return False
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = [0] if len(self.accepted) >= self.length else range(0, MODEL.vocab_size, 2)
        bitmask[row].zero_()
        allow_tokens(bitmask[row], allowed)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return len(self.accepted) > self.length

    def reset(self) -> None:
        self.accepted.clear()


def test_grammar_masks_with_a_step_in_flight_equal_sync() -> None:
    """Constrained requests (masks filled after the step before's tokens are accepted) next to
    unconstrained ones: the same tokens as synchronous scheduling, every one allowed, and
    each constrained request ends on its stop token."""
    ps = prompts(5, seed=7)

    def reqs():  # type: ignore[no-untyped-def]
        out = []
        for i, p in enumerate(ps):
            r = make_request(f"r{i}", p, max_tokens=20)
            if i % 2 == 0:
                r.grammar = EvenTokens(length=3 + i)
            out.append(r)
        return out

    sync_out, async_out, _, async_reqs = both(reqs)
    assert async_out == sync_out
    for i, r in enumerate(async_reqs):
        if i % 2 == 0:
            tokens = async_out[f"r{i}"]
            assert len(tokens) == 3 + i + 1 and tokens[-1] == 0
            assert all(t % 2 == 0 for t in tokens)
            assert r.grammar.accepted == tokens
        else:
            assert async_out[f"r{i}"] == MODEL.reference_greedy(ps[i], 20)


def test_the_runner_keeps_prompt_ids_only_while_their_request_runs() -> None:
    """The repetition penalty's prompt ids, converted once per request, are let go when it ends."""
    core = make_core(MODEL)
    for i, p in enumerate(prompts(3, seed=7)):
        core.add(make_request(f"r{i}", p, max_tokens=6, repetition_penalty=2.0))
    held = 0
    while core.has_unfinished:
        core.step()
        held = max(held, len(core.runner._prompt_ids))
    core.step()  # (an ended request's ids go with the next step's plan)
    assert held == 3 and core.runner._prompt_ids == {}


class SlowFillEvenTokens(EvenTokens):
    """EvenTokens whose fill is slow and notes its thread; accepting a token (or rolling back)
    while a fill is under way is a race the runner must not allow."""

    threads: ClassVar[set[str]] = set()
    accepted_on: ClassVar[set[str]] = set()  # the threads that put tokens into matchers

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.filling = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.filling = True
        SlowFillEvenTokens.threads.add(threading.current_thread().name)
        time.sleep(0.002)
        super().fill_bitmask(bitmask, row)
        self.filling = False

    def accept_token(self, token_id: int) -> bool:
        assert not self.filling, "a token reached the matcher while its mask was being filled"
        SlowFillEvenTokens.accepted_on.add(threading.current_thread().name)
        return super().accept_token(token_id)


def test_masks_filled_on_the_fill_thread_equal_the_main_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """model_runner.MASK_FILL_THREAD: the masks are filled on the filler's thread, and its fill
    ends before the matchers take the step's tokens; outputs as when filled in line."""
    ps = prompts(6, seed=11)

    def reqs():  # type: ignore[no-untyped-def]
        out = []
        for i, p in enumerate(ps):
            r = make_request(f"r{i}", p, max_tokens=16)
            if i % 3:
                r.grammar = SlowFillEvenTokens(length=2 + i)
            out.append(r)
        return out

    results = []
    for threaded in (False, True):
        monkeypatch.setattr(model_runner, "MASK_FILL_THREAD", threaded)
        SlowFillEvenTokens.threads, SlowFillEvenTokens.accepted_on = set(), set()
        core = make_core(MODEL, async_scheduling=True)
        assert (core.runner._filler is not None) == threaded
        out = run_all(core, reqs())
        assert_all_blocks_free(core)
        results.append(out)
        filled_on = {name.startswith("mmserve-mask-fill") for name in SlowFillEvenTokens.threads}
        assert filled_on == {threaded}
        # with a filler the step before's tokens go into the matchers on its thread, just
        # before the fill (start_grammars; a step with no constrained step after it is left
        # to the update, on the engine's thread)
        accepted_on = {name.startswith("mmserve-mask-fill") for name in SlowFillEvenTokens.accepted_on}
        assert (True in accepted_on) == threaded and accepted_on
        core.shutdown()
    assert results[0] == results[1]
    for i in range(1, 6):
        if i % 3:
            assert len(results[1][f"r{i}"]) == 2 + i + 1 and results[1][f"r{i}"][-1] == 0


class RefusesAfter(EvenTokens):
    """Its masks allow every even token, but it refuses all tokens after `length`: the update
    must end the request without the refused token, wherever it was refused."""

    def accept_token(self, token_id: int) -> bool:
        if len(self.accepted) >= self.length:
            return False
        return super().accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        allow_tokens(bitmask[row], range(0, MODEL.vocab_size, 2))


@pytest.mark.parametrize("threaded", [False, True])
def test_a_refused_token_ends_its_request_without_it(monkeypatch: pytest.MonkeyPatch, threaded: bool) -> None:
    """A matcher that refuses its sampled token ends the request without it, whether the
    update puts the tokens into the matchers or the filler's thread does (and hands the
    update the refusals: RunnerOutput.grammar_refused); its neighbours run on."""
    monkeypatch.setattr(model_runner, "MASK_FILL_THREAD", threaded)
    core = make_core(MODEL, async_scheduling=True)
    reqs = []
    for i, p in enumerate(prompts(4, seed=5)):
        r = make_request(f"r{i}", p, max_tokens=12)
        if i < 3:
            r.grammar = RefusesAfter(length=2 + 3 * i)
        reqs.append(r)
    out = run_all(core, reqs)
    assert_all_blocks_free(core)
    for i in range(3):
        assert out[f"r{i}"] == reqs[i].grammar.accepted and len(out[f"r{i}"]) == 2 + 3 * i
    assert out["r3"] == MODEL.reference_greedy(prompts(4, seed=5)[3], 12)
    core.shutdown()


class BrokenFill(EvenTokens):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise ValueError("bitmask width 1, expected 2")


@pytest.mark.parametrize("threaded", [False, True])
def test_a_fill_that_raises_fails_the_step(monkeypatch: pytest.MonkeyPatch, threaded: bool) -> None:
    """On the filler's thread too, a fill's error reaches the engine (by the step after at
    the latest), rather than being lost with the mask it did not fill."""
    monkeypatch.setattr(model_runner, "MASK_FILL_THREAD", threaded)
    core = make_core(MODEL, async_scheduling=True)
    r = make_request("a", prompts(1, seed=3)[0], max_tokens=8)
    r.grammar = BrokenFill(length=4)
    core.add(r)
    with pytest.raises(ValueError, match="bitmask width"):
        for _ in range(3):
            core.step()
    core.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_real_grammars_filled_on_the_fill_thread_equal_in_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backend: str
) -> None:
    """A tiny model's JSON under each grammar backend, 6 streams, greedy: with the filler's
    thread (which also takes each step's tokens into the matchers: start_grammars) the same
    text as filled in line, and every answer that ended parses and fits its schema."""
    import json

    import jsonschema

    from mmserve.entrypoints.llm import LLM
    from mmserve.params import SamplingParams
    from mmserve.structured_output.params import StructuredOutputParams
    from tests.utils.tiny_models import make_tiny_model

    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "bc", "d"]}},
              "required": ["id", "tag"], "additionalProperties": False}  # fmt: skip
    path = make_tiny_model(tmp_path, max_position_embeddings=512)
    questions = [f"Answer {i} in JSON:" for i in range(6)]
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured=StructuredOutputParams("json_schema", json.dumps(schema), backend=backend)
    )
    texts = []
    for threaded in (False, True):
        monkeypatch.setattr(model_runner, "MASK_FILL_THREAD", threaded)
        llm = LLM(str(path), device="cpu", dtype="float32")
        try:
            texts.append([(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(questions, params)])
        finally:
            llm.shutdown()
    assert texts[0] == texts[1]
    ended = [text for text, reason in texts[1] if reason == "stop"]  # (a random model may pad
    assert len(ended) >= 3  # with whitespace until max_tokens: those are cut, not checked)
    for text in ended:
        jsonschema.validate(json.loads(text), schema)
