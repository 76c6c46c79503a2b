"""`mmserve bench quality`: how far each quantisation scheme moves --model's next-token
distribution from its float32 run, at every position of a real text (--text).

The text is tokenised once and cut into windows of --window tokens (each one request, within
the model's context). Every scheme serves every window through the engine as it serves any
request: greedy, one output token, prompt logprobs on, so the runner computes logits at each
prompt position (through the quantised linears, and the paged KV cache's write and read). Those
logits are taken as the runner computes them (recorded_logits, around the model's
compute_logits: no API of its own), checked against the prompt logprobs the engine returned,
and compared with the float32 run's at the same positions: KL(P_fp32 || P_scheme) in nats and
whether the argmax is the same token.

Schemes (--schemes): float32 (the reference itself: KL 0), int8 (--quantization int8), fp8
(--quantization fp8), fp8-kv (--kv-cache-dtype fp8, float weights), and wNa16[-gG]: the float
weights re-quantised to a compressed-tensors pack-quantized checkpoint (bench/requantize.py),
N = 4 or 8 bits, in groups of G input channels (none: per output channel). A "+q8" suffix (on
float32 or a wNa16 scheme) also rounds the input of every decoder projection as the one-row
int8-activation products do on CUDA (gguf_gemm.DP4A, wna16.DP4A: ggml's q8_1, by 32; here at
every position, as each decode step at batch 1 would be). gguf-a8: a GGUF on the CPU served
with --cpu-gguf-activations int8 (its projections and head through the library's
int8-activation products). All run in float32, so only the scheme differs from the reference.
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmserve.bench.engine_flags import engine_config
from mmserve.frontend.frontend import FrontEnd
from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams

KL_ROWS = 256  # rows of two [rows, vocab] float64 distributions compared at a time
LOGPROB_TOLERANCE = 1e-4  # recorded logits against the served prompt logprobs


@dataclass(frozen=True)
class Scheme:
    """One way of serving the model: the engine settings it changes from the reference."""

    name: str  # as --schemes names it
    quantization: str | None = None  # --quantization at load
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    weight_bits: int = 0  # a re-quantised weight-only checkpoint of these bits; 0: none
    group_size: int = 0  # its input channels per scale; 0: one scale per output channel
    q8_activations: bool = False  # the decoder projections' inputs rounded as DP4A's are
    cpu_gguf_activations: str = "float32"  # --cpu-gguf-activations (a GGUF on the CPU)


REFERENCE = Scheme("float32")
SCHEMES = {
    s.name: s
    for s in (
        REFERENCE,
        Scheme("int8", quantization="int8"),
        Scheme("fp8", quantization="fp8"),
        Scheme("fp8-kv", kv_cache_dtype="fp8"),
        Scheme("gguf-a8", cpu_gguf_activations="int8"),
    )
}
_WEIGHT_ONLY = re.compile(r"w(4|8)a16(?:-g([1-9][0-9]*))?")


def parse_scheme(name: str) -> Scheme:
    """A --schemes entry; an unknown one raises ValueError listing the valid ones."""
    base, plus, suffix = name.partition("+")
    if plus:
        scheme = parse_scheme(base)
        if suffix != "q8" or scheme != Scheme(base, weight_bits=scheme.weight_bits, group_size=scheme.group_size):
            raise ValueError(f"--schemes: {name!r}: only float32 and wNa16 schemes take +q8 (activations in int8)")
        return Scheme(name, weight_bits=scheme.weight_bits, group_size=scheme.group_size, q8_activations=True)
    if name in SCHEMES:
        return SCHEMES[name]
    match = _WEIGHT_ONLY.fullmatch(name)
    if match is None:
        raise ValueError(
            f"--schemes: unknown scheme {name!r}; valid: {', '.join(SCHEMES)}, w4a16-gG, "
            "w8a16-gG (G input channels per scale), w4a16, w8a16 (per output channel), and "
            "float32 or those with +q8 (activations in int8)"
        )
    return Scheme(name, weight_bits=int(match[1]), group_size=int(match[2] or 0))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="quality: a UTF-8 text file to measure on")
    p.add_argument("--schemes", default="w4a16-g64,int8,fp8,fp8-kv",
                   help="quality: schemes to compare with float32, comma-separated")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None,
                   help="quality: measure at most this many of the text's tokens (default all)")  # fmt: skip
    p.add_argument("--window", type=int, default=1024,
                   help="quality: tokens per request (capped by the model's context)")  # fmt: skip


@dataclass(frozen=True)
class Divergence:
    """Per measured position: a scheme's next-token distribution against the reference's."""

    kl: torch.Tensor  # [T] float64: KL(P_ref || P_scheme) in nats
    same_top1: torch.Tensor  # [T] bool: both argmaxes are the same token

    @staticmethod
    def concat(parts: Iterable[Divergence]) -> Divergence:
        """The positions of several parts (windows), in order."""
        listed = list(parts)
        return Divergence(torch.cat([p.kl for p in listed]), torch.cat([p.same_top1 for p in listed]))

    def summary(self) -> dict[str, float | int]:
        q = torch.quantile(self.kl, torch.tensor([0.5, 0.99], dtype=torch.float64))
        return {
            "kl_mean": float(self.kl.mean()), "kl_median": float(q[0]), "kl_p99": float(q[1]),
            "kl_max": float(self.kl.max()), "top1_agreement": float(self.same_top1.double().mean()),
            "tokens": int(self.kl.numel()),
        }  # fmt: skip


def divergence(reference: torch.Tensor, logits: torch.Tensor) -> Divergence:
    """reference, logits: [T, vocab] logits at the same T positions (float64 maths)."""
    if reference.shape != logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} against {tuple(reference.shape)}")
    kls = []
    for start in range(0, reference.shape[0], KL_ROWS):
        p = torch.log_softmax(reference[start : start + KL_ROWS].double(), -1)
        q = torch.log_softmax(logits[start : start + KL_ROWS].double(), -1)
        kls.append(torch.nn.functional.kl_div(q, p, reduction="none", log_target=True).sum(-1))
    same = reference.argmax(-1) == logits.argmax(-1)
    return Divergence(torch.cat(kls), same)


@contextmanager
def recorded_logits(model: Any) -> Iterator[list[torch.Tensor]]:
    """Every logits tensor model.compute_logits returns while inside, copied to the CPU in
    float32, in call order (the runner's calls: prompt logprobs, then sampling)."""
    seen: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits.detach().to("cpu", torch.float32, copy=True))
        return logits

    model.compute_logits = recording  # an instance attribute, over the class's method
    try:
        yield seen
    finally:
        del model.compute_logits


@dataclass(frozen=True)
class TextRun:
    """One scheme's run over the text's windows."""

    logits: list[torch.Tensor]  # per window [W, vocab] float32: next-token logits at each position
    nll: torch.Tensor  # [targets] float64: -log P(the text's next token), as served
    quantization: str  # what the engine reports it runs ("" = unquantised)
    kv_cache_dtype: str


def serve_windows(engine: FrontEnd, windows: Sequence[list[int]]) -> TextRun:
    """Each window as one request, one at a time (so every recorded row is its own)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    logits, nll = [], []
    for i, ids in enumerate(windows):
        served: list[TokenLogprob | None] | None = None
        with recorded_logits(engine.core.runner.model) as seen:
            engine.add_request(f"quality-{i}", ids, params)
            while engine.has_unfinished:
                for delta in engine.step_deltas():
                    served = delta.prompt_logprobs if delta.prompt_logprobs is not None else served
        rows = torch.cat(seen)
        logits.append(rows)
        nll.append(-_check_rows(rows, ids, served))
    info = engine.info
    return TextRun(logits, torch.cat(nll), info.quantization, info.kv_cache_dtype)


def _check_rows(
    rows: torch.Tensor, ids: list[int], served: list[TokenLogprob | None] | None
) -> torch.Tensor:
    """The recorded rows are the window's positions in order: one per token, and at each but
    the last the logprob of the next token is the one the engine returned. Returns those."""
    if rows.shape[0] != len(ids) or served is None or len(served) != len(ids):
        got = None if served is None else len(served)
        raise RuntimeError(f"recorded {rows.shape[0]} logit rows, {got} prompt logprobs, for {len(ids)} tokens")
    targets = torch.tensor(ids[1:]).unsqueeze(1)
    mine = torch.log_softmax(rows[:-1].double(), -1).gather(1, targets).squeeze(1)
    theirs = torch.tensor([lp.logprob for lp in served[1:] if lp is not None], dtype=torch.float64)
    if theirs.shape != mine.shape or not torch.allclose(mine, theirs, atol=LOGPROB_TOLERANCE, rtol=0):
        raise RuntimeError("the recorded logits are not those the prompt logprobs came from")
    return theirs


def text_windows(ids: list[int], window: int, max_tokens: int | None) -> list[list[int]]:
    """The first max_tokens of ids (all without it) in consecutive windows; a last window of
    a single token (no next token inside it) is dropped."""
    ids = ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids) - i > 1]


def run(args: argparse.Namespace, emit: Any) -> None:
    """The float32 reference over the text's windows, then each scheme over the same windows:
    one line per scheme (emit(**fields))."""
    if args.model is None or args.text is None:
        raise ValueError("bench quality needs --model (float weights) and --text FILE")
    if args.window < 2:
        raise ValueError(f"--window: at least 2 tokens, got {args.window}")
    if (
        args.quantization is not None
        or args.kv_cache_dtype != "auto"
        or args.cpu_gguf_activations != "float32"
        or args.dtype not in ("auto", "float32")
    ):
        raise ValueError(
            "bench quality: --schemes sets quantization, the KV cache dtype and the CPU's GGUF "
            "activations; it runs float32"
        )
    schemes = [parse_scheme(name.strip()) for name in args.schemes.split(",") if name.strip()]
    text = Path(args.text).read_text(encoding="utf-8")
    engine = _engine(args, args.model, REFERENCE)
    try:
        window = min(args.window, engine.max_model_len - 1)  # (room for the one output token)
        windows = text_windows(list(engine.tokenizer.encode(text)), window, args.max_tokens)
        if not windows:
            raise ValueError(f"--text {args.text}: fewer than two tokens to measure")
        reference = serve_windows(engine, windows)
    finally:
        engine.shutdown()
    for scheme in schemes:
        with _model_for(args.model, scheme) as model:
            engine = _engine(args, model, scheme)
            try:
                if scheme.q8_activations:
                    round_projection_inputs(engine.core.runner.model)
                measured = serve_windows(engine, windows)
            finally:
                engine.shutdown()
        d = Divergence.concat(map(divergence, reference.logits, measured.logits))
        emit(
            bench="quality", scheme=scheme.name, reference="float32", **d.summary(),
            windows=len(windows), window=window,
            perplexity=math.exp(float(measured.nll.mean())),
            reference_perplexity=math.exp(float(reference.nll.mean())),
            served_quantization=measured.quantization, kv_cache_dtype=measured.kv_cache_dtype,
        )  # fmt: skip


def round_projection_inputs(model: Any) -> int:
    """Forward pre-hooks on the decoder layers' projections (not the LM head): each input
    rounded by q8_round_trip (groups of 32 along its last dimension), as the one-row
    int8-activation products round it. Returns how many projections got one."""
    from mmserve.kernels._common import q8_round_trip

    def rounded(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"+q8: a projection's input is a {type(x).__name__}, not a tensor")
        return (q8_round_trip(x.reshape(-1, x.shape[-1])).reshape(x.shape).to(x.dtype), *args[1:])

    projections = [m for m in model.model.layers.modules() if m is not model and _is_projection(m)]
    for module in projections:
        module.register_forward_pre_hook(rounded)
    if not projections:
        raise ValueError("+q8: the model's layers have no projections to round the inputs of")
    return len(projections)


def _is_projection(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("Linear")


def _engine(args: argparse.Namespace, model: str, scheme: Scheme) -> FrontEnd:
    flags = argparse.Namespace(**{
        **vars(args), "dtype": "float32", "quantization": scheme.quantization,
        "kv_cache_dtype": scheme.kv_cache_dtype, "cpu_gguf_activations": scheme.cpu_gguf_activations,
    })  # fmt: skip
    return FrontEnd.start(engine_config(flags, model, dummy=False))


@contextmanager
def _model_for(model: str, scheme: Scheme) -> Iterator[str]:
    """The checkpoint a scheme loads: --model, or its re-quantised copy (removed after)."""
    if not scheme.weight_bits:
        yield model
        return
    from mmserve.bench.requantize import write_weight_only

    with tempfile.TemporaryDirectory(prefix="mmserve-quality-") as tmp:
        yield str(write_weight_only(model, Path(tmp), scheme.weight_bits, scheme.group_size))
