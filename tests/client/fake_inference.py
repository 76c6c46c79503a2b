"""A fake mmserve servicer for the SDK tests: the generated servicer base, echo-like behaviour.

Generate echoes its input one character per chunk (token id = ord). Special prompts: "slow"
streams forever until the call ends; "fail:<CODE>" aborts with that status; "rich:<CODE>" too,
with google.rpc details as mmserve sends them (a BadRequest, a RetryInfo); "flaky" answers
UNAVAILABLE on its first attempt; "midfail" streams one chunk, then fails UNAVAILABLE. The
pooling RPCs are deterministic functions of their inputs. A `draining` servicer refuses every
call UNAVAILABLE, as mmserve's admission does while it drains.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mmserve_client.v1 import (
    common_pb2,
    generate_pb2,
    inference_pb2_grpc,
    models_pb2,
    pooling_pb2,
    tokenize_pb2,
)

VECTOR = (3.0, 0.5, -1.0)  # Embed's answer for a 3-character text


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Records what arrives (metadata, requests, attempts, cancellations) for the tests."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.metadata: list[dict[str, str]] = []  # invocation metadata, one per call
        self.requests: list[Any] = []  # the request messages, in arrival order
        self.attempts: Counter[str] = Counter()  # per "<rpc>:<text>" key
        self.slow_ended = threading.Event()  # a "slow" Generate call terminated
        self.draining = False  # refuse every call UNAVAILABLE (they are not recorded)
        self.served = 0  # calls answered (not refused while draining)
        self.refused = 0  # calls refused while draining

    def _begin(self, context: grpc.ServicerContext, request: Any, key: str) -> None:
        if self.draining:
            self.refused += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        self.served += 1
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.append(request)
        self.attempts[key] += 1
        if key.split(":", 1)[1] == "flaky" and self.attempts[key] == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "flaky: try again")
        if ":fail:" in key:
            code = grpc.StatusCode[key.rsplit(":", 1)[1]]
            context.abort(code, f"fake failure {code.name}")
        if ":rich:" in key:
            context.abort_with_status(rich_status(grpc.StatusCode[key.rsplit(":", 1)[1]]))

    def Generate(self, request, context):  # generated (PascalCase) name
        text = _generate_text(request)
        self._begin(context, request, f"Generate:{text}")
        rid = request.request_id or "gen-1"
        if text == "slow":
            context.add_callback(self.slow_ended.set)
            yield from _slow(context, rid)
            return
        if text == "midfail":
            yield generate_pb2.GenerateResponse(request_id=rid, text="m", token_ids=[ord("m")])
            context.abort(grpc.StatusCode.UNAVAILABLE, "failed after its first chunk")
        n = request.params.n if request.params.HasField("n") else 1
        yield from _echo(request, text, n, rid)

    def Embed(self, request, context):
        self._begin(context, request, f"Embed:{_input_text(request.inputs[0])}")
        out = pooling_pb2.EmbedResponse()
        for item in request.inputs:
            vec = (float(len(_input_text(item))), 0.5, -1.0)
            if request.encoding == pooling_pb2.ENCODING_FP32_BYTES:
                out.embeddings.add(packed=struct.pack("<3f", *vec))
            elif request.encoding == pooling_pb2.ENCODING_FP16_BYTES:
                out.embeddings.add(packed=struct.pack("<3e", *vec))
            else:
                out.embeddings.add(values=vec)
        return _with_details(out, request, sum(len(_input_text(i)) for i in request.inputs))

    def Rerank(self, request, context):
        self._begin(context, request, f"Rerank:{request.query}")
        words = set(request.query.split())
        scored = sorted(
            (
                (len(words & set(d.split())) / max(len(words), 1), i)
                for i, d in enumerate(request.documents)
            ),
            key=lambda s: (-s[0], s[1]),
        )
        if request.HasField("top_n"):
            scored = scored[: request.top_n]
        out = pooling_pb2.RerankResponse(request_id=request.request_id)
        for score, i in scored:
            doc = request.documents[i] if request.return_documents else ""
            out.results.add(index=i, score=score, document=doc)
        return _with_details(out, request, len(request.query) + sum(map(len, request.documents)))

    def Classify(self, request, context):
        self._begin(context, request, f"Classify:{_input_text(request.inputs[0])}")
        out = pooling_pb2.ClassifyResponse(request_id=request.request_id)
        for item in request.inputs:
            best, other = ("long", "short") if len(_input_text(item)) > 5 else ("short", "long")
            c = out.results.add(label=best)
            c.scores.add(label=best, score=0.75)
            c.scores.add(label=other, score=0.25)
        return _with_details(out, request, sum(len(_input_text(i)) for i in request.inputs))

    def Score(self, request, context):
        self._begin(context, request, f"Score:{_input_text(request.first[0])}")
        firsts = [_input_text(i) for i in request.first]
        seconds = [_input_text(i) for i in request.second]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        out = pooling_pb2.ScoreResponse(
            scores=[1.0 if a == b else 0.0 for a, b in zip(firsts, seconds)]
        )
        return _with_details(out, request, sum(map(len, firsts + seconds)))

    def Tokenize(self, request, context):
        text = request.text or "".join(p.text for m in request.chat.messages for p in m.content)
        self._begin(context, request, f"Tokenize:{text}")
        return tokenize_pb2.TokenizeResponse(
            request_id=request.request_id,
            token_ids=[ord(c) for c in text],
            tokens=list(text) if request.return_tokens else [],
            max_context=2048,
            model="fake-model",
        )

    def Detokenize(self, request, context):
        self._begin(context, request, f"Detokenize:{len(request.token_ids)}")
        return tokenize_pb2.DetokenizeResponse(text="".join(map(chr, request.token_ids)))

    def ListModels(self, request, context):
        self._begin(context, request, f"ListModels:{request.model}")
        info = models_pb2.ModelInfo(
            name="fake-model",
            tasks=[models_pb2.TASK_GENERATE, models_pb2.TASK_SCORE],
            max_context=2048,
            dtype="float32",
            device="cpu",
            score_method=models_pb2.SCORE_METHOD_YES_TOKEN,
            vocab_size=256,
        )
        return models_pb2.ListModelsResponse(request_id=request.request_id, models=[info])


POOLING_MODEL, POOLING_TOTAL_MS = "fake-pooler", 2.5  # what _with_details says


def _with_details(out: Any, request: Any, prompt_tokens: int) -> Any:
    """A pooling response with what mmserve adds: request id, model, usage and timing."""
    out.request_id = request.request_id or "pool-1"
    out.model = POOLING_MODEL
    out.usage.prompt_tokens = prompt_tokens
    out.timing.total_ms = POOLING_TOTAL_MS
    return out


RICH_FIELD, RICH_DELAY_S = "chat.messages[0].role", 1.5  # what rich_status's details say


def rich_status(code: grpc.StatusCode) -> grpc.Status:
    """A status with the details mmserve attaches: a BadRequest naming RICH_FIELD for
    INVALID_ARGUMENT, a RetryInfo of RICH_DELAY_S for RESOURCE_EXHAUSTED."""
    detail = any_pb2.Any()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        bad = error_details_pb2.BadRequest.FieldViolation(field=RICH_FIELD, description="bad")
        detail.Pack(error_details_pb2.BadRequest(field_violations=[bad]))
    else:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(RICH_DELAY_S * 1e9))
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    message = f"fake rich failure {code.name}"
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def _generate_text(request: generate_pb2.GenerateRequest) -> str:
    kind = request.WhichOneof("input")
    if kind == "chat":
        return "".join(p.text for p in request.chat.messages[-1].content)
    if kind == "token_ids":
        return "".join(map(chr, request.token_ids.ids))
    return request.prompt


def _input_text(item: common_pb2.Input) -> str:
    kind = item.WhichOneof("kind")
    if kind == "token_ids":
        return "".join(map(chr, item.token_ids.ids))
    return item.image.data.decode("latin-1") if kind == "image" else item.text


def _slow(context: grpc.ServicerContext, rid: str) -> Iterator[generate_pb2.GenerateResponse]:
    deadline = time.monotonic() + 10
    while context.is_active() and time.monotonic() < deadline:
        yield generate_pb2.GenerateResponse(request_id=rid, text="tick", token_ids=[1])
        time.sleep(0.02)


def _echo(
    request: generate_pb2.GenerateRequest, text: str, n: int, rid: str
) -> Iterator[generate_pb2.GenerateResponse]:
    k = request.params.logprobs
    for pos, ch in enumerate(text):
        for index in range(n):
            chunk = generate_pb2.GenerateResponse(
                request_id=rid,
                index=index,
                text=ch,
                token_ids=[ord(ch)],
                model="fake-model" if pos == index == 0 else "",
            )
            if k:
                lp = chunk.logprobs.add(token_id=ord(ch), logprob=-0.5, token=ch)
                for j in range(k):
                    lp.top.add(token_id=ord(ch) + j, logprob=-0.5 - j, token=chr(ord(ch) + j))
            yield chunk
    tools = request.chat.tools
    for index in range(n):
        last = generate_pb2.GenerateResponse(request_id=rid, index=index)
        if tools:
            last.tool_calls.add(index=0, id="call_0", name=tools[0].name, arguments_delta='{"ci')
            last.tool_calls.add(index=0, arguments_delta='ty": "Paris"}')
            last.finish_reason = generate_pb2.FINISH_REASON_TOOL_CALLS
        else:
            last.finish_reason = generate_pb2.FINISH_REASON_STOP
            last.stop_token_id = 2
        last.usage.prompt_tokens = len(text)
        last.usage.completion_tokens = len(text)
        last.timing.total_ms = 1.5
        yield last
