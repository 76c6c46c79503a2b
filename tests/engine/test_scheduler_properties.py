"""Scheduler + KV cache invariants under random workloads, against a cache-free reference.

A fake runner keeps, for every KV slot, what a model would have stored there: the token, the
image row (content and row index) it came from and the tenant (cache_salt) that computed it.
It samples a token as a hash of the context it reads back through the request's block ids, so
any wrong prefix hit, lost chunk, stale block or shared slot changes the output, which must
equal the reference computed from the request's own tokens alone.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.messages import EngineOutput

# the only import of the scheduler's output types (moving to engine/sched_output.py)
from mmserve.engine.sched_output import RunnerOutput, SampledToken, SchedulerOutput
from mmserve.engine.scheduler import Scheduler
from mmserve.inputs import MMInput, MMPlaceholder
from mmserve.params import SamplingParams
from mmserve.request import PLACEHOLDER, Request, RequestStatus

VOCAB = 24  # small: eos (0) comes up often, and shared text prefixes are likely
EOS = 0
IMAGE = VOCAB  # placeholder token of every image
Slot = tuple[int, str | None, str | None]  # (token, image row, cache_salt) a slot was computed from


@dataclass(frozen=True)
class Spec:
    """One request of a workload."""

    arrival: int  # step at which it is added
    prompt: tuple[int, ...]
    images: tuple[MMPlaceholder, ...]
    max_tokens: int  # resolved: fits the context
    ignore_eos: bool
    salt: str | None
    abort_at: int | None  # step at which the client aborts it (a no-op once it has ended)


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    budget: int  # max_num_batched_tokens
    max_seqs: int
    caching: bool
    async_scheduling: bool
    specs: tuple[Spec, ...]
    speculate: bool = False  # speculative guesses, right and wrong, before each step

    @property
    def max_model_len(self) -> int:
        return self.block_size * self.num_blocks  # one request alone always fits the pool

    @property
    def step_bound(self) -> int:
        """The oldest running request is never preempted and gets the budget first, so it
        computes at least one token a step; twice the work of all requests run one by one."""
        work = sum(len(s.prompt) + s.max_tokens + 2 for s in self.specs)
        return max(s.arrival for s in self.specs) + 2 * work + 10


def sample(context: list[Slot]) -> int:
    """The fake model: a deterministic function of everything the KV cache holds."""
    return zlib.crc32(repr(context).encode()) % VOCAB


def image_row(images: tuple[MMPlaceholder, ...] | list[MMPlaceholder], pos: int) -> str | None:
    for ph in images:
        if ph.offset <= pos < ph.offset + ph.length:
            return f"{ph.content_hash}:{pos - ph.offset}"
    return None


def reference(spec: Spec) -> tuple[list[int], str]:
    """The output of the request computed alone, without any cache."""
    context = [(t, image_row(spec.images, p), spec.salt) for p, t in enumerate(spec.prompt)]
    out: list[int] = []
    while len(out) < spec.max_tokens:
        out.append(sample(context))
        if out[-1] == EOS and not spec.ignore_eos:
            return out, "stop"
        context.append((out[-1], None, spec.salt))
    return out, "length"


@dataclass
class FakeRunner:
    block_size: int
    salts: dict[str, str | None]
    slots: dict[tuple[int, int], Slot] = field(default_factory=dict)  # (block id, offset) -> KV
    last: dict[str, int] = field(default_factory=dict)  # request id -> its latest sampled token

    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        for item in plan.scheduled:  # the whole batch is written before anything is read
            images = [mm.placeholder for mm in item.mm_inputs]
            for pos, token in enumerate(item.token_ids, item.start_pos):
                token = self.last[item.request_id] if token == PLACEHOLDER else token
                slot = (token, image_row(images, pos), self.salts[item.request_id])
                self.slots[self._where(item.block_ids, pos)] = slot
        out = RunnerOutput()
        for item in plan.scheduled:
            if item.sample:
                # with guesses: a position per guess, then one; accepted while they agree
                end = item.start_pos + len(item.token_ids) - len(item.draft_token_ids)
                accepted = []
                for j in range(len(item.draft_token_ids) + 1):
                    context = [self.slots[self._where(item.block_ids, p)] for p in range(end + j)]
                    token = sample(context)
                    if j == len(item.draft_token_ids) or item.draft_token_ids[j] != token:
                        break
                    accepted.append(SampledToken(token))
                self.last[item.request_id] = token
                out.sampled[item.request_id] = SampledToken(token)
                if item.draft_token_ids:
                    out.accepted[item.request_id] = accepted
        return out

    def _where(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size


@st.composite
def prompts(
    draw: st.DrawFn, prefixes: list[list[int]], max_len: int
) -> tuple[list[int], list[MMPlaceholder]]:
    """A shared prefix (maybe empty), then text and images (placeholder runs) up to max_len."""
    ids = list(draw(st.sampled_from(prefixes)))[:max_len]
    images: list[MMPlaceholder] = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            ids += draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8))
        else:
            length = draw(st.integers(1, 6))
            images.append(MMPlaceholder(draw(st.sampled_from("ab")), len(ids), length))
            ids += [IMAGE] * length
    while len(ids) > max_len:  # drop whole images only
        if images and images[-1].offset + images[-1].length > max_len:
            ids = ids[: images.pop().offset]
        else:
            ids = ids[:max_len]
    return ids or [1], images


@st.composite
def specs(draw: st.DrawFn, prefixes: list[list[int]], max_model_len: int) -> Spec:
    prompt, images = draw(prompts(prefixes, max_model_len - 1))
    arrival = draw(st.integers(0, 12))
    aborted = draw(st.integers(0, 9)) == 0
    return Spec(
        arrival=arrival,
        prompt=tuple(prompt),
        images=tuple(images),
        max_tokens=min(draw(st.integers(1, 12)), max_model_len - len(prompt)),
        ignore_eos=draw(st.booleans()),
        salt=draw(st.sampled_from([None, None, "t1", "t2"])),
        abort_at=arrival + draw(st.integers(0, 15)) if aborted else None,
    )


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(max(2, 8 // block_size), 64 // block_size))
    max_len = block_size * num_blocks
    text = st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=min(24, max_len))
    prefixes = draw(st.lists(text, min_size=1, max_size=3))
    return Workload(
        block_size=block_size,
        num_blocks=num_blocks,
        budget=draw(st.sampled_from([1, 3, 8, 16, 64])),
        max_seqs=draw(st.integers(1, 6)),
        caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        specs=tuple(draw(st.lists(specs(prefixes, max_len), min_size=1, max_size=8))),
        speculate=draw(st.booleans()),
    )


def make_request(rid: str, spec: Spec) -> Request:
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=spec.ignore_eos)
    return Request(
        rid,
        list(spec.prompt),
        params,
        eos_token_ids=frozenset({EOS}),
        max_tokens=spec.max_tokens,
        cache_salt=spec.salt,
        mm_inputs=tuple(MMInput(ph, {}) for ph in spec.images),
    )


def check_blocks(scheduler: Scheduler, ids: list[str]) -> None:
    """Reference counts are the holders' counts; free = unreferenced; ended requests hold none."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    held = Counter(b for rid in ids for b in kv.block_ids(rid))
    assert [b.ref_cnt for b in pool.blocks] == [held[b.block_id] for b in pool.blocks]
    assert pool.num_free_blocks == sum(b.ref_cnt == 0 for b in pool.blocks)
    holders = {r.request_id for r in scheduler.running}
    assert all(not kv.block_ids(rid) for rid in ids if rid not in holders)
    cached = [b for b in pool.blocks if b.block_hash is not None]
    assert pool.num_cached_blocks == len(cached)
    assert all(pool.lookup(b.block_hash) is b for b in cached if b.block_hash is not None)
    stats = scheduler.stats()  # the load the metrics and WatchLoad report, kept incrementally
    known = sum(r.num_known_tokens for r in scheduler.requests.values())
    assert (stats.num_running, stats.num_waiting, stats.tokens_in_flight) == (
        len(scheduler.running), len(scheduler.waiting), known
    )
    assert stats.num_free_blocks == (pool.num_free_blocks if kv.num_blocks else 0)


def check_after_guesses(scheduler: Scheduler, plan: SchedulerOutput) -> None:
    """After a step that checked guesses, a request still running has computed every token
    it knows but the last (an accepted guess is not computed again), and holds the blocks
    of those tokens, and of the next at most (the refused guesses' blocks went back)."""
    for item in plan.scheduled:
        request = scheduler.requests.get(item.request_id)
        if item.draft_token_ids and request is not None and request.status == RequestStatus.RUNNING:
            assert request.num_computed_tokens == request.num_known_tokens - 1
            size = scheduler.kv.block_size
            held = len(scheduler.kv.block_ids(item.request_id))
            assert -(-request.num_computed_tokens // size) <= held
            assert held <= -(-request.num_known_tokens // size)


def check_plan(
    w: Workload, scheduler: Scheduler, plan: SchedulerOutput, before: list[Request]
) -> None:
    assert plan.num_tokens <= w.budget
    assert len(scheduler.running) <= w.max_seqs and len(plan.scheduled) <= w.max_seqs
    assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
    for s in plan.scheduled:
        assert len(s.block_ids) * w.block_size >= s.start_pos + len(s.token_ids)
    preempted = [r for r in before if r.status == RequestStatus.PREEMPTED]
    assert plan.num_preempted == len(preempted)
    assert before[len(before) - len(preempted) :] == preempted  # the newest go first


@dataclass
class Run:
    """One workload driven step by step the way EngineCore.step drives it."""

    w: Workload
    scheduler: Scheduler
    runner: FakeRunner
    ids: list[str] = field(default_factory=list)  # every request added so far
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None

    def events(self, step: int) -> None:
        for i, spec in enumerate(self.w.specs):
            if spec.arrival == step:
                self.ids.append(f"r{i}")
                self.tokens[f"r{i}"] = []
                self.scheduler.add_request(make_request(f"r{i}", spec))
            if spec.abort_at == step:
                self.scheduler.abort(f"r{i}")

    def step(self) -> None:
        if self.w.speculate:  # as EngineCore: the step in flight lands, then guesses
            self.land()
            self.guess()
        before = list(self.scheduler.running)
        plan = self.scheduler.schedule()
        check_plan(self.w, self.scheduler, plan, before)
        result = self.runner.run(plan)
        self.land()
        guessed = any(s.draft_token_ids for s in plan.scheduled)
        if self.w.async_scheduling and result.sampled and not guessed:
            self.in_flight = (plan, result)
        else:
            self.collect(self.scheduler.update(plan, result))
            if guessed:
                check_after_guesses(self.scheduler, plan)
        check_blocks(self.scheduler, self.ids)

    def land(self) -> None:
        if self.in_flight is not None:
            self.collect(self.scheduler.update(*self.in_flight))
            self.in_flight = None

    def guess(self) -> None:
        """Up to 3 guesses per decoding request: the reference's next tokens, some of them
        changed (which one, from a hash), so runs are accepted whole, in part or not at all."""
        for request in self.scheduler.running:
            if request.num_pending or request.num_tokens - request.num_computed_tokens != 1:
                continue
            expected, _ = reference(self.w.specs[int(request.request_id[1:])])
            done = len(request.output_token_ids)
            h = zlib.crc32(f"{request.request_id}:{done}".encode())
            guesses = expected[done : done + h % 4]
            if guesses and h % 3 == 0:
                wrong = (h >> 4) % len(guesses)
                guesses[wrong] = (guesses[wrong] + 1) % VOCAB
            request.draft_token_ids = guesses

    def collect(self, outputs: list[EngineOutput]) -> None:
        for o in outputs:
            self.tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                assert o.request_id not in self.reasons, "finished twice"
                self.reasons[o.request_id] = o.finish_reason

    @property
    def done(self) -> bool:
        arrived = len(self.ids) == len(self.w.specs)
        return arrived and not self.scheduler.has_unfinished and self.in_flight is None


def drive(w: Workload) -> Run:
    kv = KVCacheManager(w.num_blocks, w.block_size, w.caching)
    config = SchedulerConfig(max_num_batched_tokens=w.budget, max_num_seqs=w.max_seqs)
    salts = {f"r{i}": s.salt for i, s in enumerate(w.specs)}
    run = Run(w, Scheduler(config, kv, w.max_model_len), FakeRunner(w.block_size, salts))
    for step in range(w.step_bound):
        run.events(step)
        if run.done:
            return run
        run.step()
    raise AssertionError(f"not finished after {w.step_bound} steps")


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_scheduler_invariants_and_outputs(w: Workload) -> None:
    run = drive(w)
    pool = run.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert_outputs_match_reference(run)


def assert_outputs_match_reference(run: Run) -> None:
    for i, spec in enumerate(run.w.specs):
        expected, reason = reference(spec)
        got = run.tokens[f"r{i}"]
        if run.reasons[f"r{i}"] == "abort":
            assert spec.abort_at is not None and got == expected[: len(got)]
        else:
            assert (got, run.reasons[f"r{i}"]) == (expected, reason), f"r{i}"


def test_images_split_differently_do_not_share_kv() -> None:
    """The same two images over the same placeholder run, split at another offset: a block
    holds the same tokens and the same images, but not the same KV."""
    prompt = (IMAGE,) * 8 + (1,)

    def spec(arrival: int, split: int) -> Spec:
        images = (MMPlaceholder("a", 0, split), MMPlaceholder("b", split, 8 - split))
        return Spec(arrival, prompt, images, 4, True, None, None)

    w = Workload(4, 16, 64, 4, True, False, (spec(0, 2), spec(20, 3)))
    assert_outputs_match_reference(drive(w))
