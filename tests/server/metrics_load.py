"""A known load for the observability tests, and a scrape of /metrics: the requests, what
their responses said, and helpers that read parsed Prometheus text."""

from __future__ import annotations

import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from mmserve_client.v1 import common_pb2, generate_pb2, inference_pb2_grpc, pooling_pb2

MAX_TOKENS = 5
SHARED = list(range(10, 31))  # 21 tokens: two requests share it (the second hits 20 cached)
REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_TOOL_CALLS: "stop",
}


@dataclass
class Load:
    """What the load sent and what came back."""

    finished: list[generate_pb2.GenerateResponse] = field(default_factory=list)  # last chunks
    cancelled_prompts: list[int] = field(default_factory=list)  # their prompt lengths
    cancelled_ids: list[str] = field(default_factory=list)
    embed_inputs: int = 0
    embed_prompt_tokens: int = 0
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)  # (method, code)

    def reasons(self) -> Counter[str]:
        counts = Counter(REASONS[r.finish_reason] for r in self.finished)
        counts["abort"] += len(self.cancelled_ids)
        return counts

    @property
    def num_requests(self) -> int:
        return len(self.finished) + len(self.cancelled_ids)


def _request(ids: list[int], max_tokens: int = MAX_TOKENS, **params: Any) -> Any:
    sampling = generate_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, **params
    )
    return generate_pb2.GenerateRequest(model="tiny-a", token_ids={"ids": ids}, params=sampling)


def _generate(stub: Any, request: Any, load: Load) -> list[generate_pb2.GenerateResponse]:
    chunks = list(stub.Generate(request, timeout=120))
    load.calls["Generate", "OK"] += 1
    load.finished.append(chunks[-1])
    return chunks


def run_load(target: str) -> Load:
    """Four finished Generate requests (three sharing a prefix, one ended by a stop token), two
    cancelled after their first token, one INVALID_ARGUMENT, one Embed of three inputs."""
    load = Load()
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        first = _generate(stub, _request(SHARED), load)  # caches SHARED's blocks
        assert first[-1].usage.completion_tokens == MAX_TOKENS
        _generate(stub, _request(SHARED), load)  # a prefix hit
        # a hit again, ended by its own first token as a stop token: one token, "stop"
        _generate(stub, _request(SHARED, stop_token_ids=[first[0].token_ids[0]]), load)
        _generate(stub, _request(list(range(40, 52)), max_tokens=3), load)
        for n, start in enumerate((100, 200)):  # unique prompts: no hits
            prompt = list(range(start, start + 9 + n))
            call = stub.Generate(_request(prompt, max_tokens=400), timeout=120)
            chunk = next(call)
            assert chunk.token_ids
            call.cancel()
            load.cancelled_prompts.append(len(prompt))
            load.cancelled_ids.append(chunk.request_id)
            load.calls["Generate", "CANCELLED"] += 1
        try:
            list(stub.Generate(_request([10**6]), timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            load.calls["Generate", "INVALID_ARGUMENT"] += 1
        texts = [common_pb2.Input(text=t) for t in ("a b c", "d e", "f")]
        embedded = stub.Embed(pooling_pb2.EmbedRequest(model="tiny-a", inputs=texts), timeout=60)
        load.calls["Embed", "OK"] += 1
        load.embed_inputs, load.embed_prompt_tokens = 3, embedded.usage.prompt_tokens
    return load


def scrape(port: int) -> dict[str, Any]:
    """GET /metrics over HTTP, parsed: {sample name: [(labels, value), ...]}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    samples: dict[str, Any] = {"_text": text}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of a sample's values over the series whose labels include `labels`."""
    return sum(
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    )
