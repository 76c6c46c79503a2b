"""Bad input and faults against a running server (the README's `mmserve serve`, its two
default models): 122 calls, most malformed or extreme, each printed with its
status; five cancelled n = 4 streams and a call past a 0.2-s deadline, with a 200-token stream
running beside them; then the KV blocks' count from WatchLoad. A refused call must be
INVALID_ARGUMENT naming its field; the script flags INTERNAL / UNKNOWN statuses and messages
that show a path or a traceback (FLAGGED at the end). A record, not a test: the tests under
tests/server check each refusal's message.

    python scripts/fault_run.py [127.0.0.1:50051]
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import grpc

from mmserve_client.v1 import common_pb2 as c
from mmserve_client.v1 import generate_pb2 as g
from mmserve_client.v1 import inference_pb2_grpc, load_pb2
from mmserve_client.v1 import pooling_pb2 as p
from mmserve_client.v1 import tokenize_pb2 as t

M = "smollm2-135m-instruct"
E = "all-minilm-l6-v2"
LEAK = re.compile(r"/(work|root|usr|tmp|home)/|Traceback|File \"|\.py\b")


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    big = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    s = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(target, options=big))
    bad: list[str] = []
    def chk(name, fn):
        try:
            r = fn()
            if hasattr(r, "__iter__") and not hasattr(r, "ListFields"):
                out = list(r); r = f"{len(out)} msgs; last={str(out[-1])[:150] if out else None}"
            print(f"OK   {name}: {str(r)[:200]!r}")
        except grpc.RpcError as e:
            d = e.details() or ""
            flag = ""
            if LEAK.search(d): flag = " <<<LEAK"; bad.append(name)
            if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN): flag += " <<<INTERNAL"; bad.append(name)
            print(f"ERR  {name}: {e.code().name}: {d[:220]}{flag}")
    def gen(**kw):
        params = kw.pop("params", None)
        return lambda: s.Generate(g.GenerateRequest(model=M, params=g.SamplingParams(**(params or {"max_tokens": 8})), **kw), timeout=60)
    chat = lambda txt: g.Chat(messages=[g.Message(role="user", content=[g.ContentPart(text=txt)])])
    # a long stream in the background, to check it survives
    res = {}
    def long():
        try:
            out = list(s.Generate(g.GenerateRequest(model=M, prompt="Count: 1 2 3", params=g.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=300))
            res["long"] = sum(len(o.outputs[0].token_ids) if o.outputs else 0 for o in out) if hasattr(out[0], "outputs") else len(out)
        except grpc.RpcError as e: res["long"] = e.code().name
    th = threading.Thread(target=long); th.start()
    chk("empty prompt", gen(prompt=""))
    chk("no input", gen())
    chk("unknown model", lambda: list(s.Generate(g.GenerateRequest(model="nope", prompt="x"), timeout=10)))
    chk("model path-ish", lambda: list(s.Generate(g.GenerateRequest(model="../../etc/passwd", prompt="x"), timeout=10)))
    chk("huge max_tokens", gen(prompt="hi", params={"max_tokens": 4_000_000_000}))
    chk("max_tokens 0", gen(prompt="hi", params={"max_tokens": 0}))
    chk("min>max", gen(prompt="hi", params={"max_tokens": 4, "min_tokens": 10}))
    chk("temp nan", gen(prompt="hi", params={"max_tokens": 4, "temperature": float("nan")}))
    chk("temp inf", gen(prompt="hi", params={"max_tokens": 4, "temperature": float("inf")}))
    chk("temp -1", gen(prompt="hi", params={"max_tokens": 4, "temperature": -1}))
    chk("top_p 0", gen(prompt="hi", params={"max_tokens": 4, "top_p": 0.0}))
    chk("top_p nan", gen(prompt="hi", params={"max_tokens": 4, "top_p": float("nan")}))
    chk("top_k huge", gen(prompt="hi", params={"max_tokens": 4, "top_k": 4_000_000_000}))
    chk("min_p 2", gen(prompt="hi", params={"max_tokens": 4, "min_p": 2}))
    chk("min_p nan", gen(prompt="hi", params={"max_tokens": 4, "min_p": float("nan")}))
    chk("rep pen 0", gen(prompt="hi", params={"max_tokens": 4, "repetition_penalty": 0}))
    chk("rep pen nan", gen(prompt="hi", params={"max_tokens": 4, "repetition_penalty": float("nan")}))
    chk("presence inf", gen(prompt="hi", params={"max_tokens": 4, "presence_penalty": float("inf")}))
    chk("freq -3", gen(prompt="hi", params={"max_tokens": 4, "frequency_penalty": -3}))
    chk("n huge", gen(prompt="hi", params={"max_tokens": 4, "n": 100000}))
    chk("n 0", gen(prompt="hi", params={"max_tokens": 4, "n": 0}))
    chk("logprobs huge", gen(prompt="hi", params={"max_tokens": 4, "logprobs": 100000}))
    chk("prompt_logprobs huge", gen(prompt="hi", params={"max_tokens": 4, "prompt_logprobs": 100000}))
    chk("logit_bias bad id", gen(prompt="hi", params={"max_tokens": 4, "logit_bias": {4000000: 5.0}}))
    chk("logit_bias nan", gen(prompt="hi", params={"max_tokens": 4, "logit_bias": {5: float("nan")}}))
    chk("logit_bias -inf all", gen(prompt="hi", params={"max_tokens": 4, "logit_bias": {i: float("-inf") for i in range(49152)}}))
    chk("allowed bad id", gen(prompt="hi", params={"max_tokens": 4, "allowed_token_ids": [10**9]}))
    chk("allowed empty-effect", gen(prompt="hi", params={"max_tokens": 4, "allowed_token_ids": [5]}))
    chk("stop_token bad", gen(prompt="hi", params={"max_tokens": 4, "stop_token_ids": [10**9]}))
    chk("stop empty string", gen(prompt="hi", params={"max_tokens": 4, "stop": [""]}))
    chk("stop many", gen(prompt="hi", params={"max_tokens": 4, "stop": ["x"*10]*10000}))
    chk("stop huge", gen(prompt="hi", params={"max_tokens": 4, "stop": ["x"*1_000_000]}))
    chk("bad_words", gen(prompt="hi", params={"max_tokens": 4, "bad_words": ["", " ", "the"*1000]}))
    chk("token ids bad", gen(token_ids=c.TokenIds(ids=[10**9])))
    chk("token ids empty", gen(token_ids=c.TokenIds(ids=[])))
    chk("token ids long", gen(token_ids=c.TokenIds(ids=[5]*20000)))
    chk("prompt long", gen(prompt="hello "*20000))
    chk("truncate_prompt_tokens", gen(prompt="hello "*20000, params={"max_tokens": 4, "truncate_prompt_tokens": 100}))
    chk("truncate 0", gen(prompt="hello", params={"max_tokens": 4, "truncate_prompt_tokens": 0}))
    chk("reasoning budget", gen(prompt="hello", params={"max_tokens": 4, "reasoning_budget": 0}))
    chk("seed max", gen(prompt="hello", params={"max_tokens": 4, "seed": 2**64-1, "temperature": 1.0}))
    chk("chat empty", gen(chat=g.Chat()))
    chk("chat bad role", gen(chat=g.Chat(messages=[g.Message(role="wizard", content=[g.ContentPart(text="x")])])))
    chk("chat empty role", gen(chat=g.Chat(messages=[g.Message(role="", content=[g.ContentPart(text="x")])])))
    chk("chat image on text model", gen(chat=g.Chat(messages=[g.Message(role="user", content=[g.ContentPart(image=c.Image(data=b"\x89PNG garbage"))])])))
    chk("chat image path", gen(chat=g.Chat(messages=[g.Message(role="user", content=[g.ContentPart(image=c.Image(path="/etc/passwd"))])])))
    chk("chat tools bad json", gen(chat=g.Chat(messages=chat("x").messages, tools=[g.Tool(name="f", parameters_json="{not json")])))
    chk("chat tools dup names", gen(chat=g.Chat(messages=chat("x").messages, tools=[g.Tool(name="f", parameters_json="{}"), g.Tool(name="f", parameters_json="{}")])))
    chk("chat tool_choice unknown fn", gen(chat=g.Chat(messages=chat("x").messages, tools=[g.Tool(name="f", parameters_json="{}")], tool_choice=g.ToolChoice(function_name="zz"))))
    chk("chat tool_choice required no tools", gen(chat=g.Chat(messages=chat("x").messages, tool_choice=g.ToolChoice(mode=g.ToolChoice.MODE_REQUIRED))))
    chk("template kwargs", gen(chat=g.Chat(messages=chat("x").messages, template_kwargs={"a": "{{ 7*7 }}"})))
    chk("template kwargs junk", gen(chat=g.Chat(messages=chat("x").messages, template_kwargs={"a": "\x00"*1000})))
    chk("tool msg no id", gen(chat=g.Chat(messages=[g.Message(role="tool", content=[g.ContentPart(text="r")])])))
    chk("assistant tool call bad args", gen(chat=g.Chat(messages=[g.Message(role="user", content=[g.ContentPart(text="q")]), g.Message(role="assistant", tool_calls=[g.ToolCall(id="1", name="f", arguments_json="{bad")]) ])))
    chk("continue final + gen prompt", gen(chat=g.Chat(messages=[g.Message(role="assistant", content=[g.ContentPart(text="x")])], continue_final_message=True, add_generation_prompt=True)))
    chk("continue final but last user", gen(chat=g.Chat(messages=chat("x").messages, continue_final_message=True)))
    for name, so in [
      ("schema bad json", g.StructuredOutput(json_schema="{bad")),
      ("schema not object", g.StructuredOutput(json_schema="5")),
      ("schema unknown type", g.StructuredOutput(json_schema='{"type":"nope"}')),
      ("schema deep", g.StructuredOutput(json_schema='{"type":"object","properties":{"a":'*300 + '{"type":"string"}' + '}}'*300)),
      ("schema recursive ref", g.StructuredOutput(json_schema='{"$ref":"#"}')),
      ("schema ext ref", g.StructuredOutput(json_schema='{"$ref":"http://example.com/x.json"}')),
      ("schema file ref", g.StructuredOutput(json_schema='{"$ref":"file:///etc/passwd"}')),
      ("schema bad pattern", g.StructuredOutput(json_schema='{"type":"string","pattern":"(("}')),
      ("schema minmax", g.StructuredOutput(json_schema='{"type":"integer","minimum":10,"maximum":1}')),
      ("schema huge enum", g.StructuredOutput(json_schema=json.dumps({"enum": [str(i) for i in range(100000)]}))),
      ("schema minItems huge", g.StructuredOutput(json_schema='{"type":"array","minItems":1000000000}')),
      ("schema minLength huge", g.StructuredOutput(json_schema='{"type":"string","minLength":1000000000}')),
      ("schema maxLength huge", g.StructuredOutput(json_schema='{"type":"string","maxLength":1000000000}')),
      ("schema false", g.StructuredOutput(json_schema='false')),
      ("regex bad", g.StructuredOutput(regex="(")),
      ("regex catastrophic", g.StructuredOutput(regex="(a|a)*b" * 50)),
      ("regex huge rep", g.StructuredOutput(regex="a{1000000000}")),
      ("regex backref", g.StructuredOutput(regex=r"(a)\1")),
      ("regex lookahead", g.StructuredOutput(regex=r"(?=a)a")),
      ("regex empty", g.StructuredOutput(regex="")),
      ("choice empty", g.StructuredOutput(choice=g.ChoiceList(choices=[]))),
      ("choice empty str", g.StructuredOutput(choice=g.ChoiceList(choices=[""]))),
      ("grammar bad", g.StructuredOutput(grammar="root ::= ")),
      ("grammar undefined", g.StructuredOutput(grammar="root ::= foo")),
      ("grammar left recursion", g.StructuredOutput(grammar='root ::= root "a" | "a"')),
      ("grammar outlines backend", g.StructuredOutput(grammar='root ::= "a"', backend=g.StructuredOutput.BACKEND_OUTLINES)),
      ("lark ok", g.StructuredOutput(grammar='start: "SELECT"i NAME\nNAME: /[a-z]+/\n%import common.WS\n%ignore WS')),
      ("lark template", g.StructuredOutput(grammar="start: _sep{a, b}\n_sep{x, y}: x (y x)*")),
      ("lark undefined", g.StructuredOutput(grammar="start: foo")),
      ("lark no rule", g.StructuredOutput(grammar='ITEM: "x"')),
      ("lark regex flags", g.StructuredOutput(grammar="start: /ab/i")),
      ("lark deep", g.StructuredOutput(grammar="start: " + "(" * 5000 + '"a"' + ")" * 5000)),
      ("lark bad import", g.StructuredOutput(grammar="start: A\n%import ..secret.A")),
      ("stag ok", g.StructuredOutput(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}))),
      ("stag ok at least one", g.StructuredOutput(structural_tag=json.dumps({"format": {"type": "triggered_tags", "triggers": ["<f"], "at_least_one": True, "stop_after_first": True, "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</f>"}]}}))),
      ("stag bad json", g.StructuredOutput(structural_tag="{")),
      ("stag bad format", g.StructuredOutput(structural_tag='{"format": {"type": "x"}}')),
      ("stag no trigger", g.StructuredOutput(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}))),
      ("stag schema not", g.StructuredOutput(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {"not": {}}, "end": "</f>"}], "triggers": ["<f"]}))),
      ("stag file ref", g.StructuredOutput(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {"$ref": "file:///etc/passwd"}, "end": "</f>"}], "triggers": ["<f"]}))),
      ("stag grammar", g.StructuredOutput(structural_tag=json.dumps({"format": {"type": "grammar", "grammar": "root ::= foo"}}))),
      ("stag token", g.StructuredOutput(structural_tag=json.dumps({"format": {"type": "token", "token": "<|im_start|>"}}))),
      ("stag deep", g.StructuredOutput(structural_tag="[" * 5000 + "]" * 5000)),
      ("stag outlines", g.StructuredOutput(structural_tag='{"format": {"type": "any_text"}}', backend=g.StructuredOutput.BACKEND_OUTLINES)),
      ("json_object outlines", g.StructuredOutput(json_object=True, backend=g.StructuredOutput.BACKEND_OUTLINES)),
      ("compact json", g.StructuredOutput(json_schema='{"type":"array","items":{"type":"integer"}}', disable_any_whitespace=True)),
      ("compact outlines", g.StructuredOutput(json_object=True, disable_any_whitespace=True, backend=g.StructuredOutput.BACKEND_OUTLINES)),
      ("compact regex", g.StructuredOutput(regex="[a-z ]+", disable_any_whitespace=True)),
      ("empty structured", g.StructuredOutput()),
    ]:
        chk(name, gen(prompt="Answer:", structured=so, params={"max_tokens": 16}))
    # pooling
    chk("embed none", lambda: s.Embed(p.EmbedRequest(model=E), timeout=30))
    chk("embed empty text", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input(text="")]), timeout=30))
    chk("embed unset input", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input()]), timeout=30))
    chk("embed many", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input(text="a")]*100000), timeout=30))
    chk("embed long", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input(text="word "*5000)]), timeout=30))
    chk("embed bad ids", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input(token_ids=c.TokenIds(ids=[10**9]))]), timeout=30))
    chk("embed image", lambda: s.Embed(p.EmbedRequest(model=E, inputs=[c.Input(image=c.Image(data=b"xx"))]), timeout=30))
    chk("embed on gen model", lambda: s.Embed(p.EmbedRequest(model=M, inputs=[c.Input(text="hi")]), timeout=30))
    chk("rerank empty", lambda: s.Rerank(p.RerankRequest(model=E), timeout=30))
    chk("classify on embedder", lambda: s.Classify(p.ClassifyRequest(model=E, inputs=[c.Input(text="x")]), timeout=30))
    chk("score empty", lambda: s.Score(p.ScoreRequest(model=E), timeout=30))
    chk("tokenize empty", lambda: s.Tokenize(t.TokenizeRequest(model=M), timeout=30))
    chk("detokenize bad", lambda: s.Detokenize(t.DetokenizeRequest(model=M, token_ids=[10**9]), timeout=30))
    chk("detokenize many", lambda: s.Detokenize(t.DetokenizeRequest(model=M, token_ids=[5]*2_000_000), timeout=30))
    chk("watchload 0 interval", lambda: next(iter(s.WatchLoad(load_pb2.WatchLoadRequest(interval_ms=0), timeout=5))))
    # cancellation mid-stream and deadline
    for i in range(5):
        it = s.Generate(g.GenerateRequest(model=M, prompt="Tell a story", params=g.SamplingParams(max_tokens=300, ignore_eos=True, n=4)), timeout=120)
        next(it); it.cancel()
    chk("deadline tiny", lambda: list(s.Generate(g.GenerateRequest(model=M, prompt="Tell a story", params=g.SamplingParams(max_tokens=300, ignore_eos=True)), timeout=0.2)))
    th.join()
    print("long stream:", res)
    time.sleep(3)
    print(next(iter(s.WatchLoad(load_pb2.WatchLoadRequest(interval_ms=100), timeout=5))))
    chk("final", gen(chat=chat("What is the capital of France?"), params={"max_tokens": 20, "temperature": 0}))
    print("FLAGGED", bad)


if __name__ == "__main__":
    main()
