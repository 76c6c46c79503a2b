"""`mmserve bench spec` and `mmserve bench spec-cost`: what speculative decoding gains, and what
checking guesses costs.

spec: on --model (real weights: acceptance depends on them), four input-grounded sets built
from real text that ships with packages on the index (torch's and transformers' docstrings and
source): rewrite a given passage, edit a given piece of code, extract a JSON object under a
schema, and repeat an agent's tool call with other arguments (constrained, as a forced tool
call is). For each set, method (--spec-methods, "none" = no speculation) and batch size
(--batch-sizes): greedy requests of --output-len tokens; TPOT (per request, from its first
token to its last), output tokens per engine step, and the guesses checked and accepted.

spec-cost: the step time when every one of B decoding requests checks k guesses (1 + k tokens
each: guesses that are always wrong, so the steps are all alike) against 1 token, at each
batch size: what a guess costs on this model and device. With spec's tokens per step the
speed-up a proposer would give on this model is (tokens per step) x (step time at 1 token) /
(step time at 1 + k tokens): a computation, printed as such, not a measurement.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mmserve.bench.offline import DEFAULT_BATCH_SIZES, parse_batch_sizes, random_prompt
from mmserve.config import SpeculativeConfig
from mmserve.frontend.frontend import FrontEnd
from mmserve.params import SamplingParams
from mmserve.request import Request
from mmserve.speculative import Proposer
from mmserve.structured_output.params import StructuredOutputParams

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 48},
        "summary": {"type": "string", "maxLength": 200},
        "arguments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 32},
                               "default": {"type": "string", "maxLength": 32}},
                "required": ["name", "default"],
                "additionalProperties": False,
            },
            "maxItems": 12,
        },
    },
    "required": ["name", "summary", "arguments"],
    "additionalProperties": False,
}
CITIES = ["Berlin", "Lisbon", "Osaka", "Lima", "Nairobi", "Oslo", "Perth", "Quito"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-methods",
        default="none,ngram,suffix,jump+suffix",
        help="spec: speculative methods to compare, comma-separated (none = off)",
    )
    p.add_argument(
        "--spec-sets", default="rewrite,code,json,agent", help="spec: the input-grounded sets"
    )
    p.add_argument(
        "--spec-k", default="1,2,4", help="spec-cost: guesses per request to time (besides 0)"
    )
    p.add_argument(
        "--spec-draft",
        default=None,
        help="spec-cost: also time steps whose guesses a draft model makes (a path, "
        "first:N = --model's first N layers, or shape:NAME with random weights)",
    )


@dataclass(frozen=True)
class Task:
    messages: list[dict[str, str]]
    structured: StructuredOutputParams | None = None


def _docs() -> list[tuple[str, str, str]]:
    """(name, docstring, source) of real library functions and classes (torch, transformers)."""
    import torch
    import transformers

    objects: list[Any] = [
        torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding, torch.nn.LayerNorm,
        torch.nn.functional.scaled_dot_product_attention, torch.topk,
        transformers.GenerationConfig, transformers.PreTrainedTokenizerBase.apply_chat_template,
    ]  # fmt: skip
    out = []
    for obj in objects:
        doc = inspect.getdoc(obj) or ""
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            source = ""
        out.append((getattr(obj, "__qualname__", str(obj)), doc[:2400], source[:2400]))
    return out


def tasks(name: str) -> list[Task]:
    """The prompts of one set (a few each, taken in turn by the requests of a batch)."""
    docs = _docs()
    if name == "rewrite":
        return [
            Task([{"role": "user", "content": "Rewrite this documentation in clear, plain "
                   f"English, keeping every detail:\n\n{doc}"}])
            for _, doc, _ in docs if doc
        ]
    if name == "code":
        return [
            Task([{"role": "user", "content": "Rename every variable `input` to `x` in this "
                   f"code and return the whole code:\n\n```python\n{src}\n```"}])
            for _, _, src in docs if src
        ][:6] or [Task([{"role": "user", "content": "Write a Python function."}])]
    if name == "json":
        structured = StructuredOutputParams("json_schema", json.dumps(EXTRACT_SCHEMA))
        return [
            Task([{"role": "user", "content": f"Extract the name, a one-line summary and the "
                   f"arguments with their defaults of `{qual}` as JSON:\n\n{doc}"}], structured)
            for qual, doc, _ in docs if doc
        ]
    if name == "agent":
        structured = StructuredOutputParams("json_schema", json.dumps(TOOL_SCHEMA))
        out = []
        for i, city in enumerate(CITIES):
            previous = {"name": "get_weather",
                        "arguments": {"city": CITIES[i - 1], "unit": "celsius", "days": 3}}
            out.append(Task([
                {"role": "system", "content": "You call tools by answering with one JSON object "
                 '{"name": ..., "arguments": {...}}. Tool: get_weather(city, unit, days).'},
                {"role": "user", "content": f"Weather in {CITIES[i - 1]} for 3 days?"},
                {"role": "assistant", "content": json.dumps(previous)},
                {"role": "user", "content": f"The same for {city}, 5 days, in fahrenheit."},
            ], structured))  # fmt: skip
        return out
    raise ValueError(f"--spec-sets: unknown set {name!r}; valid: rewrite, code, json, agent")


def _prompt_ids(engine: FrontEnd, task: Task) -> list[int]:
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n\n".join(m["content"] for m in task.messages) + "\n\n"
    return list(tokenizer.encode(text))


@dataclass
class SetResult:
    tpot_ms: list[float]
    output_tokens: int
    steps: int
    seconds: float
    drafts: int
    accepted: int


def run_set(engine: FrontEnd, items: list[Task], batch: int, output_len: int) -> SetResult:
    """`batch` greedy requests at once (the set's prompts in turn), to the end."""
    engine.core.kv.pool.reset_cache()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    drafts = accepted = 0
    for i in range(batch):
        task = items[i % len(items)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, structured=task.structured)
        engine.add_request(f"s{i}", _prompt_ids(engine, task), params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished:
        deltas = engine.step_deltas()
        now = time.perf_counter()
        steps += 1
        for d in deltas:
            if d.token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                counts[d.request_id] = counts.get(d.request_id, 0) + len(d.token_ids)
            if d.finish_reason is not None:
                drafts += d.num_draft_tokens
                accepted += d.num_accepted_draft_tokens
    seconds = time.perf_counter() - start
    tpot = [
        1e3 * (last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1
    ]
    return SetResult(tpot, sum(counts.values()), steps, seconds, drafts, accepted)


def run(args: argparse.Namespace, emit: Any, engine_for: Any) -> None:
    """engine_for(speculative config) -> a FrontEnd on --model with the shared engine flags."""
    batches = parse_batch_sizes(args.batch_sizes or DEFAULT_BATCH_SIZES)
    sets = {name: tasks(name) for name in args.spec_sets.split(",")}
    for method in args.spec_methods.split(","):
        spec = SpeculativeConfig(
            method=None if method == "none" else resolve_method(method, args.model),
            num_speculative_tokens=args.num_speculative_tokens,
            disable_batch_size=args.speculative_disable_batch_size,
        )
        engine = engine_for(spec)
        try:
            run_set(engine, sets[next(iter(sets))], 1, 16)  # warm-up: allocations, autotuning
            for name, items in sets.items():
                for batch in batches:
                    r = run_set(engine, items, batch, args.output_len)
                    emit(
                        bench="spec", set=name, method=method, batch_size=batch,
                        tpot_ms_median=statistics.median(r.tpot_ms) if r.tpot_ms else None,
                        output_tokens=r.output_tokens, steps=r.steps,
                        tokens_per_step=r.output_tokens / max(r.steps, 1),
                        output_tokens_per_s=r.output_tokens / r.seconds,
                        draft_tokens=r.drafts, accepted_draft_tokens=r.accepted,
                        acceptance=r.accepted / r.drafts if r.drafts else None,
                    )
        finally:
            engine.shutdown()
            del engine  # (the last reference: its memory is free before the next one starts)
            _release()


def _release() -> None:
    """Gives the GPU memory of an engine shut down and dropped back, before the next one
    sizes its KV cache from what is free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _AlwaysWrong(Proposer):
    """k guesses that are never the model's token (a token id the model never samples:
    the last of the vocabulary, as random weights make every id about as likely, it is
    rejected as any random guess mostly is; the steps' cost is what is measured)."""

    def __init__(self, k: int, token: int) -> None:
        self.k, self.token = k, token

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        return [self.token] * min(self.k, k)


def resolve_method(method: str, model: str | None) -> str:
    """A --spec-methods entry as a SpeculativeConfig method: a draft named first:N becomes
    --model's first N layers (bench/models.first_layers_folder), one named shape:NAME a
    folder of that shape (random weights: with a --model of random weights only)."""
    from mmserve.bench.models import first_layers_folder, make_model_folder

    head, sep, draft = method.partition("draft=")
    if draft.startswith("first:"):
        if model is None or model.startswith("shape:"):
            raise ValueError("a draft of first:N layers needs a --model with real weights")
        draft = str(first_layers_folder(model, int(draft.removeprefix("first:"))))
    elif draft.startswith("shape:"):
        import tempfile
        from pathlib import Path

        draft = str(make_model_folder(draft.removeprefix("shape:"), Path(tempfile.mkdtemp()) / "draft"))
    return head + sep + draft


def run_cost(args: argparse.Namespace, emit: Any, engine_for: Any) -> None:
    """Decode step time with 1 + k tokens per request against 1, per batch size; with
    --spec-draft, also with the k guesses made by that draft model (its steps included)."""
    ks = [0] + [int(k) for k in args.spec_k.split(",")]
    batches = parse_batch_sizes(args.batch_sizes or DEFAULT_BATCH_SIZES)
    method = "ngram" if args.spec_draft is None else resolve_method(f"draft={args.spec_draft}", args.model)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=max(ks),
                             disable_batch_size=max(batches))  # fmt: skip
    engine = engine_for(spec)
    speculator = engine.core.speculator
    assert speculator is not None
    speculator.adaptive = False
    draft = speculator.proposer if args.spec_draft is not None else None
    rng = random.Random(0)
    base: dict[int, float] = {}
    try:
        for batch in batches:
            for k in ks:
                for proposer in ("always-wrong", "draft") if k and draft else ("always-wrong",):
                    speculator.proposer = draft if proposer == "draft" else _AlwaysWrong(
                        k, engine.vocab_size - 1
                    )
                    speculator.k = max(k, 1)
                    ms = _step_ms(engine, batch, args.input_len, rng, k)
                    if k == 0:
                        base[batch] = ms
                    emit(bench="spec-cost", batch_size=batch, guesses=k, proposer=proposer,
                         tokens_per_request=1 + k, step_ms=ms,
                         ratio_to_one_token=ms / base[batch])  # fmt: skip
    finally:
        engine.shutdown()


def _step_ms(engine: FrontEnd, batch: int, context: int, rng: random.Random, k: int) -> float:
    """Median time of the steps where every one of `batch` requests decodes (with k guesses,
    all refused), at about `context` tokens."""
    engine.core.kv.pool.reset_cache()
    params = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"c{k}-{i}", random_prompt(rng, context, engine.vocab_size), params)
    times: list[float] = []
    core = engine.core
    while engine.has_unfinished:
        running = core.scheduler.running
        decoding = len(running) == batch and not core.scheduler.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in running
        )
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:] or times)


def engine_factory(args: argparse.Namespace) -> Any:
    """engine_for(SpeculativeConfig) -> FrontEnd, from --model and the shared flags."""
    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import model_folder

    folder, dummy = model_folder(args.model or "shape:llama3-8b", args.load_format)

    def engine_for(spec: SpeculativeConfig) -> FrontEnd:
        config = replace(engine_config(args, str(folder), dummy), speculative=spec)
        return FrontEnd.start(config)

    return engine_for
