"""Prometheus metrics: vLLM's names and buckets under the `mmserve:` prefix, labelled by
`model_name` (and `task`, `finished_reason`, `method`, `code` where they apply), served as
text on --metrics-port.

Two sources. The request-level metrics (tokens, finished requests, latency histograms, gRPC
calls) are observed here as each call ends (a CallObserver). The engine's own (running and
waiting sequences, KV usage, prefix-cache and encoder-cache counters, preemptions) are read
at scrape time from the EngineStats each engine left after its latest step: the engine
process sends them on the Outputs it sends anyway, so no step ever waits for metrics, and
nothing is shared between processes. Label values are served model names and fixed
vocabularies only: never a request's own text, an API key or a path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.engine.messages import EngineStats
from mmserve.server.calls import CallRecord, ChoiceRecord
from mmserve.server.models import ModelHandle

logger = logging.getLogger(__name__)
PREFIX = "mmserve:"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
GRAMMAR_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


# Generate's histograms, by key: (name, help, buckets; [] = token counts up to the context)
HISTOGRAMS: dict[str, tuple[str, str, list[float]]] = {
    "ttft": ("time_to_first_token_seconds", "Time from the call's arrival to its first token",
             TTFT_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Time between two token chunks of a choice",
            TOKEN_LATENCY_BUCKETS),
    "tpot": ("request_time_per_output_token_seconds",
             "Decode time per output token after the first, per choice", TOKEN_LATENCY_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "Time from arrival to the choice's end",
            REQUEST_LATENCY_BUCKETS),
    "queue": ("request_queue_time_seconds", "Time in the engine's queue before the first step",
              REQUEST_LATENCY_BUCKETS),
    "inference": ("request_inference_time_seconds",
                  "Time from the first step to the last token", REQUEST_LATENCY_BUCKETS),
    "prefill": ("request_prefill_time_seconds", "Time from the first step to the first token",
                REQUEST_LATENCY_BUCKETS),
    "decode": ("request_decode_time_seconds", "Time from the first token to the last",
               REQUEST_LATENCY_BUCKETS),
    "prompt_len": ("request_prompt_tokens", "Prompt tokens per request", []),
    "generation_len": ("request_generation_tokens", "Tokens generated per request", []),
}  # fmt: skip


def length_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_len:
                return buckets
            buckets.append(value)
        exponent += 1


class Metrics:
    """The server's registry of metrics (its own: never the process-global one, which also
    exports process and platform facts). A CallObserver: each ended call updates it."""

    def __init__(self, models: Iterable[ModelHandle]) -> None:
        """models: iterated again at every scrape (the server's ModelRegistry)."""
        self.registry = CollectorRegistry()
        max_len = max((h.facts.max_context for h in models), default=1 << 16)
        model = ["model_name"]

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, text, [*model, *labels], registry=self.registry)

        def histogram(name: str, text: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, text, model, buckets=buckets, registry=self.registry)

        self.calls = counter("grpc_calls", "gRPC calls ended, by method and status code",
                             "method", "code")  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of calls that ran")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter(
            "request_success", "Generate requests (choices) finished, by reason", "finished_reason"
        )
        self.pooling_inputs = counter("pooling_inputs", "Pooling inputs run, by task", "task")
        self.histograms = {
            key: histogram(name, text, buckets if buckets else length_buckets(max_len))
            for key, (name, text, buckets) in HISTOGRAMS.items()
        }
        self.registry.register(EngineCollector(models))

    def started(self, record: CallRecord) -> None:
        pass

    def ended(self, record: CallRecord) -> None:
        model = record.model
        self.calls.labels(model, record.method, record.code.name).inc()
        if record.prompt_tokens:
            self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        if record.pooling_inputs:
            self.pooling_inputs.labels(model, record.task).inc(record.pooling_inputs)
        for choice in record.choices.values():
            self._choice(record, model, choice.finished or record.end, choice)

    def _choice(self, record: CallRecord, model: str, end: float, c: ChoiceRecord) -> None:
        """One Generate choice: requests that never reached a step have no queue time, and
        those cancelled before their first token no TTFT, prefill or decode time."""
        self.request_success.labels(model, c.finish_reason or "abort").inc()
        self.generation_tokens.labels(model).inc(c.output_tokens)
        h = {key: histogram.labels(model) for key, histogram in self.histograms.items()}
        h["e2e"].observe(end - record.start)
        h["prompt_len"].observe(record.prompt_tokens)
        h["generation_len"].observe(c.output_tokens)
        for gap in c.gaps:
            h["itl"].observe(gap)
        if c.scheduled is not None:
            h["queue"].observe(max(0.0, c.scheduled - c.queued))
        if c.first_token is None:
            return
        h["ttft"].observe(c.first_token - record.start)
        last = c.last_token or c.first_token
        if c.scheduled is not None:
            h["prefill"].observe(max(0.0, c.first_token - c.scheduled))
            h["inference"].observe(max(0.0, last - c.scheduled))
        h["decode"].observe(last - c.first_token)
        if c.output_tokens > 1:
            h["tpot"].observe((last - c.first_token) / (c.output_tokens - 1))


# The engine's metrics, by name: (a gauge, else a counter; help; its value in EngineStats)
ENGINE_METRICS: dict[str, tuple[bool, str, Callable[[EngineStats], float]]] = {
    "num_requests_running": (True, "Sequences in the engine's batch", lambda s: s.num_running),
    "num_requests_waiting": (True, "Sequences queued in the engine", lambda s: s.num_waiting),
    "kv_cache_usage_perc": (True, "Share of KV cache blocks in use, 0 to 1",
                            lambda s: s.kv_usage),
    "kv_cache_free_blocks": (True, "KV cache blocks free (empty or only cached)",
                             lambda s: s.num_free_blocks),
    "num_tokens_in_flight": (True, "Tokens of running and waiting sequences",
                             lambda s: s.tokens_in_flight),
    "prefix_cache_queries": (False, "Prompt tokens looked up in the prefix cache",
                             lambda s: s.prefix_cache_queries),
    "prefix_cache_hits": (False, "Prompt tokens found in the prefix cache",
                          lambda s: s.prefix_cache_hits),
    "num_preemptions": (False, "Sequences preempted (recomputed later)",
                        lambda s: s.num_preemptions),
    "encoder_cache_hits": (False, "Image-encoder outputs found cached",
                           lambda s: s.encoder_cache_hits),
    "encoder_cache_misses": (False, "Image-encoder outputs computed",
                             lambda s: s.encoder_cache_misses),
    "spec_decode_num_drafts": (False, "Speculative decoding: request steps that checked guesses",
                               lambda s: s.spec_decode_num_drafts),
    "spec_decode_num_draft_tokens": (False, "Speculative decoding: guessed tokens checked",
                                     lambda s: s.spec_decode_num_draft_tokens),
    "spec_decode_num_accepted_tokens": (False, "Speculative decoding: guessed tokens accepted",
                                        lambda s: s.spec_decode_num_accepted_tokens),
}  # fmt: skip


class EngineCollector(Collector):
    """The engines' metrics, read at scrape time from each model's latest EngineStats and
    its grammar cache. An engine restarted starts its counters again (Prometheus reads a
    counter that falls as a reset)."""

    def __init__(self, models: Iterable[ModelHandle]) -> None:
        self.models = models
        self._compile_time = Histogram(
            PREFIX + "grammar_compile_time_seconds", "Seconds one grammar compile took",
            ["model_name"], buckets=GRAMMAR_BUCKETS, registry=None,
        )
        self._lock = threading.Lock()  # scrapes may run at once: one drains the times at a time

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: describing would read every engine at registration

    def collect(self) -> Iterator[Metric]:
        families = {
            name: (GaugeMetricFamily if gauge else CounterMetricFamily)(
                PREFIX + name, text, labels=["model_name"]
            )
            for name, (gauge, text, _) in ENGINE_METRICS.items()
        }
        compiles = CounterMetricFamily(
            PREFIX + "grammar_compiles", "Grammars compiled (cache misses)", labels=["model_name"]
        )
        compile_hits = CounterMetricFamily(
            PREFIX + "grammar_cache_hits", "Grammars found in the compile cache",
            labels=["model_name"],
        )
        with self._lock:
            for handle in self.models:
                stats = handle.engine.stats()
                for name, (_, _, read) in ENGINE_METRICS.items():
                    families[name].add_metric([handle.name], read(stats))
                cache = handle.frontend.grammar_cache()
                if cache is not None:
                    compiles.add_metric([handle.name], cache.compiles)
                    compile_hits.add_metric([handle.name], cache.hits)
                    for seconds in cache.take_compile_times():
                        self._compile_time.labels(handle.name).observe(seconds)
            yield from (*families.values(), compiles, compile_hits)
            yield from self._compile_time.collect()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[WSGIServer, int]:
    """Serves the registry as Prometheus text over HTTP (GET /metrics) from a daemon thread;
    returns the server (shutdown() stops it) and its bound port (port 0 picks one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
