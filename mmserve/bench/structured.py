"""`mmserve bench structured`: what constrained decoding costs (issue 6, item 8), on one
offline engine. One JSON line per figure:

- structured-compile, per backend: cold compile time of every schema in a set (the real-world
  schemas shipped in schemas/, or --schemas DIR), p50 / p99 / max over schemas x repeats. The
  backend is the one the engine's StructuredOutputManager builds (its build time is reported
  apart); its `compile` is called directly, so the grammar cache never answers (the backends
  keep no cache of their own). Schemas a backend refuses are listed with the reason.
- structured-tpot, per backend and batch size: `batch` requests of --output-len tokens
  (ignore_eos, min_tokens) on the same prompts, unconstrained and each under a JSON grammar,
  in turns. TPOT is a request's time from its first to its last token over the tokens after
  the first; the line has its median and p99 over requests, decode steps/s (steps once every
  request has its first token), and the overhead: constrained / unconstrained - 1.

The TPOT constraint, ENDLESS_GRAMMAR, is JSON objects {"lines": [strings], "next": <the same>}
without end (an EBNF grammar: a JSON schema with no finite instance is refused), so xgrammar
never reaches an end where a stop token is allowed: every constrained request runs the full
--output-len and the batch stays full, as in the unconstrained runs. Random weights give
random tokens; the bitmask keeps them grammar-valid, and most land inside the free strings of
"lines", a usual state for JSON output. The grammar is written the way xgrammar's own JSON
schema converter writes one: whitespace runs bounded as our schemas bound them
(JSON_MAX_WHITESPACE), and a string's body right-recursive with a lookahead. Written as
`"\"" char* "\""` with an escape alternative in `char` (llama.cpp's json.gbnf), xgrammar 0.2.9
takes about 130 ms for one row's mask inside a string, against 0.3 (2 GHz EPYC, the Llama 3
vocabulary), and the bench timed that instead of the engine (the engine now folds that form
into this one itself: structured_output/star_fold.py). outlines-core compiles to a regex, which cannot express
that recursion: it runs LONG_SCHEMA, and a --tpot-schema may have an end: then requests can
finish early, TPOT covers the tokens each produced, and the line counts the requests that
finished early.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmserve.bench.host_times import HostTimes, host_times
from mmserve.bench.offline import DEFAULT_BATCH_SIZES, parse_batch_sizes, random_prompt
from mmserve.errors import InvalidArgument
from mmserve.frontend.frontend import FrontEnd
from mmserve.params import SamplingParams
from mmserve.structured_output import BACKEND_NAMES, StructuredOutputParams

SCHEMAS_DIR = Path(__file__).with_name("schemas")
# {"lines": [JSON strings], "next": <the same>}, for ever (xgrammar's EBNF)
ENDLESS_GRAMMAR = r"""root ::= "{" ws "\"lines\"" ws ":" ws lines ws "," ws "\"next\"" ws ":" ws root ws "}"
lines ::= "[" ws (string (ws "," ws string)*)? ws "]"
string ::= "\"" string_rest
string_rest ::= ("\"" | [^"\\\x00-\x1f] string_rest | "\\" escape string_rest) (= ws [,\]])
escape ::= ["\\/bfnrt] | "u" [0-9a-fA-F]{4}
ws ::= [ \n\t]{0,32}
"""
# For backends that refuse recursion (outlines): one long array of free strings; it can end,
# so requests may finish early (the figures count them)
LONG_SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}}},
    "required": ["lines"],
    "additionalProperties": False,
}
WARMUP_TOKENS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only `bench structured` reads (--model, --input-len, --output-len and the
    engine flags are shared with the other kinds)."""
    p.add_argument(
        "--structured-backend",
        default="xgrammar",
        help="structured: backend(s), comma-separated: xgrammar, outlines",
    )
    p.add_argument(
        "--schemas",
        default=None,
        help="structured: a folder of *.json schemas to compile (default: shipped set), or a "
        "JSONSchemaBench-style corpus file: then compile rates, random-walk soundness and "
        "compile times per source (schema_corpus.py), with --model's tokenizer",
    )
    p.add_argument(
        "--walks", type=int, default=2, help="structured --schemas FILE: random walks per schema"
    )
    p.add_argument(
        "--compile-repeats", type=int, default=3, help="structured: cold compiles of each schema"
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help=f"structured: TPOT batch sizes; spec, spec-cost: batch sizes (default {DEFAULT_BATCH_SIZES}); "
        "decode: one line per batch size, in one engine (default --batch-size)",
    )
    p.add_argument("--tpot-repeats", type=int, default=3, help="structured: timed runs per side")
    p.add_argument(
        "--tpot-schema",
        default=None,
        help="structured: the JSON schema file of the TPOT runs (default: endless)",
    )


@dataclass
class DecodeSamples:
    """What the timed runs of one kind (constrained or not) measured, pooled over repeats."""

    tpot_ms: list[float] = field(default_factory=list)  # per request with > 1 token
    output_tokens: list[int] = field(default_factory=list)  # per request
    decode_steps: int = 0  # steps once every request of a run had its first token
    decode_s: float = 0.0  # their wall time
    sample_text: str = ""  # the first request's output (of the last run): what was decoded
    host: HostTimes = field(default_factory=HostTimes)  # the host thread's time, by part

    def summary(self, output_len: int) -> dict[str, Any]:
        return {
            "tpot_ms_median": statistics.median(self.tpot_ms),
            "tpot_ms_p99": percentile(self.tpot_ms, 0.99),
            "steps_per_s": self.decode_steps / self.decode_s if self.decode_s > 0 else None,
            "output_tokens_mean": statistics.fmean(self.output_tokens),
            # stopped before output_len: their grammar reached an end (not with ENDLESS_GRAMMAR)
            "finished_early": sum(n < output_len for n in self.output_tokens),
            # the host's ms per step in each part (mmserve.bench.host_times: "wait" is the
            # time it waited for the device)
            "host_ms_per_step": self.host.per_step_ms(),
            # the wall ms per step of the same steps (prefill's included, unlike steps_per_s)
            "host_wall_ms_per_step": self.host.wall_ms_per_step(),
            "sample_output": self.sample_text[:400],  # what one request decoded, cut
        }


def load_schemas(folder: Path) -> dict[str, str]:
    """name (file stem) -> schema text, of every *.json in folder, sorted by name."""
    schemas = {path.stem: path.read_text() for path in sorted(folder.glob("*.json"))}
    if not schemas:
        raise ValueError(f"--schemas: no *.json files in {folder}")
    return schemas


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def compile_figures(
    engine: FrontEnd, backend_name: str, schemas: dict[str, str], repeats: int
) -> dict[str, Any]:
    """Cold compile times (ms) of each schema on the engine's backend, and the refusals."""
    start = time.perf_counter()
    backend = engine.structured.backend(backend_name)
    build_ms = 1e3 * (time.perf_counter() - start)
    times: list[float] = []
    rejected: dict[str, str] = {}
    slowest = ("", 0.0)
    for name, text in schemas.items():
        params = StructuredOutputParams("json_schema", text, backend=backend_name)
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                backend.compile(params)
            except InvalidArgument as e:
                rejected[name] = str(e)
                break
            ms = 1e3 * (time.perf_counter() - start)
            times.append(ms)
            slowest = max(slowest, (name, ms), key=lambda s: s[1])
    figures: dict[str, Any] = {
        "backend_build_ms": build_ms,
        "num_schemas": len(schemas),
        "compiled": len(schemas) - len(rejected),
        "repeats": repeats,
    }
    if times:
        figures.update(
            p50_ms=percentile(times, 0.5),
            p99_ms=percentile(times, 0.99),
            max_ms=max(times),
            mean_ms=statistics.fmean(times),
            slowest=slowest[0],
        )
    figures["rejected"] = rejected
    return figures


def decode_run(
    engine: FrontEnd,
    prompts: list[list[int]],
    params: SamplingParams,
    tag: str,
    into: DecodeSamples | None = None,
) -> None:
    """Runs every prompt at once to the end, timing each request's tokens by when step()
    hands them over (with async scheduling, one call after the step that sampled them)."""
    engine.core.kv.pool.reset_cache()  # every run prefills the same prompts in full
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)  # its grammar: cached (tpot_figures)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = {}
    decode_start, decode_steps = 0.0, 0
    sample = ""
    with host_times(engine.core, into.host if into is not None else HostTimes()):
        while engine.has_unfinished:
            deltas = engine.step_deltas()
            now = time.perf_counter()
            if len(first) == len(prompts):  # every request had its first token before this step
                decode_steps += 1
            for delta in deltas:
                if into is not None and delta.request_id == f"{tag}-0":
                    sample += delta.text
                if delta.token_ids:
                    first.setdefault(delta.request_id, now)
                    last[delta.request_id] = now
                    tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(delta.token_ids)
            if not decode_start and len(first) == len(prompts):
                decode_start = now
    if into is not None:
        into.tpot_ms += [1e3 * (last[r] - first[r]) / (n - 1) for r, n in tokens.items() if n > 1]
        into.output_tokens += tokens.values()
        into.decode_steps += decode_steps
        into.decode_s += time.perf_counter() - decode_start
        into.sample_text = sample


def tpot_figures(
    engine: FrontEnd, backend_name: str, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    """`batch` requests run unconstrained and constrained in turns, --tpot-repeats times each,
    after one warm-up of each (so neither side gains from running second)."""
    name, structured = tpot_constraint(backend_name, args.tpot_schema)
    engine.structured.compile(structured)  # compiled once, before any timing (then cached)
    rng = random.Random(batch)
    prompts = [random_prompt(rng, args.input_len, engine.vocab_size) for _ in range(batch)]
    sides = {"unconstrained": None, "constrained": structured}
    samples = {label: DecodeSamples() for label in sides}
    for label, shape in sides.items():
        decode_run(engine, prompts, _fixed_length(WARMUP_TOKENS, shape), f"warm-{label}-{batch}")
    for rep in range(args.tpot_repeats):
        for label, shape in sides.items():
            timed = _fixed_length(args.output_len, shape)
            decode_run(engine, prompts, timed, f"{label}-{batch}-{rep}", samples[label])
    plain, shaped = (samples[label].summary(args.output_len) for label in sides)
    return {
        "batch_size": batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.tpot_repeats,
        "constraint": name,
        "tpot_overhead_pct": 100 * (shaped["tpot_ms_median"] / plain["tpot_ms_median"] - 1),
        "tpot_p99_overhead_pct": 100 * (shaped["tpot_ms_p99"] / plain["tpot_ms_p99"] - 1),
        "unconstrained": plain,
        "constrained": shaped,
    }


def _fixed_length(n: int, structured: StructuredOutputParams | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, structured=structured
    )


def tpot_constraint(backend_name: str, path: str | None) -> tuple[str, StructuredOutputParams]:
    """The TPOT runs' constraint: the schema at --tpot-schema, else ENDLESS_GRAMMAR (LONG_SCHEMA
    for outlines, which cannot express its recursion)."""
    if path:
        return Path(path).stem, StructuredOutputParams("json_schema", Path(path).read_text(), backend=backend_name)
    if backend_name == "outlines":
        return "long", StructuredOutputParams("json_schema", json.dumps(LONG_SCHEMA), backend=backend_name)
    return "endless", StructuredOutputParams("grammar", ENDLESS_GRAMMAR, backend=backend_name)


def parse_backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    valid = [n for n in BACKEND_NAMES if n != "auto"]
    bad = [n for n in names if n not in valid]
    if not names or bad:
        raise ValueError(f"--structured-backend: {bad or text!r}; valid: {', '.join(valid)}")
    return names


def run(args: argparse.Namespace) -> None:
    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import model_folder
    from mmserve.models.loader import resolve_device, resolve_dtype

    backends = parse_backends(args.structured_backend)
    if args.schemas and Path(args.schemas).is_file():
        corpus_run(args, backends)
        return
    batch_sizes = parse_batch_sizes(args.batch_sizes or DEFAULT_BATCH_SIZES)
    for flag in ("compile_repeats", "tpot_repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    schemas = load_schemas(Path(args.schemas) if args.schemas else SCHEMAS_DIR)
    model = args.model or "shape:llama3-8b"
    folder, dummy = model_folder(model, args.load_format)
    engine = FrontEnd.start(engine_config(args, str(folder), dummy))
    device = resolve_device(args.device)
    common = {
        "model": model,
        "device": str(device),
        "gpu": _gpu_name(device),
        "dtype": str(resolve_dtype(args.dtype, device)).removeprefix("torch."),
    }
    for name in backends:
        figures = compile_figures(engine, name, schemas, args.compile_repeats)
        _emit(bench="structured-compile", backend=name, **common, **figures)
    for name in backends:
        for batch in batch_sizes:
            _emit(
                bench="structured-tpot",
                backend=name,
                **common,
                **tpot_figures(engine, name, batch, args),
            )


def corpus_run(args: argparse.Namespace, backend_names: list[str]) -> None:
    """--schemas FILE: the corpus figures (schema_corpus.py), on --model's tokenizer only."""
    import xgrammar as xgr

    from mmserve.bench.grammar_walk import Vocab
    from mmserve.bench.models import model_folder
    from mmserve.bench.schema_corpus import load_corpus, run_corpus
    from mmserve.processors.tokenizer import load_tokenizer
    from mmserve.structured_output import create_backend
    from mmserve.structured_output.vocab import token_bytes

    model = args.model or "shape:llama3-8b"
    folder, _ = model_folder(model)
    tokenizer = load_tokenizer(folder)
    size, eos = len(tokenizer), [int(tokenizer.eos_token_id)]
    backends = {name: create_backend(name, tokenizer, size, eos) for name in backend_names}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=eos)
    raw = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    vocab = Vocab(token_bytes(tokenizer, size), eos)
    corpus = load_corpus(Path(args.schemas))
    try:
        for row in run_corpus(backends, vocab, corpus, args.walks, raw):
            _emit(bench="structured-corpus", model=model, walks=args.walks, **row)
    finally:
        for backend in backends.values():
            backend.close()


def _gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)
