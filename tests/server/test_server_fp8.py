"""`mmserve serve --quantization fp8`: the decoder is served in FP8 (greedy tokens equal the
offline FP8 engine's, ListModels says "fp8"); an encoder beside it loads unquantised."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.server.cli import build_parser, engine_template
from mmserve.server.config import ModelSpec
from mmserve.server.models import ModelRegistry, load_model
from mmserve_client import Client
from tests.pooling.tiny_pooling_models import make_tiny_bert
from tests.server.conftest import TEST_CONFIG, ServerThread, tiny_template
from tests.utils.tiny_models import make_tiny_model

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {
        "llama": make_tiny_model(root, "llama"),
        "bert": make_tiny_bert(root / "bert", num_labels=None),
    }


@pytest.fixture(scope="module")
def client(folders: dict[str, Path]) -> Iterator[Client]:
    template = tiny_template()
    template = replace(template, model=replace(template.model, quantization="fp8"))
    registry = ModelRegistry(
        [load_model(ModelSpec(n, str(p)), template, 16) for n, p in folders.items()]
    )
    server = ServerThread(registry, TEST_CONFIG).start()
    with Client(server.target, timeout=60) as c:
        yield c
    server.stop()


def test_the_decoder_is_fp8_and_the_encoder_is_not(client: Client) -> None:
    models = {m.name: m for m in client.list_models()}
    assert (models["llama"].quantization, models["bert"].quantization) == ("fp8", "")
    assert len(client.embed(["a cat"], model="bert")) == 1  # served all the same


def test_greedy_tokens_equal_the_offline_fp8_engine(
    client: Client, folders: dict[str, Path]
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    fp8 = LLM(str(folders["llama"]), quantization="fp8", block_size=4).generate(PROMPT, params)[0]
    plain = LLM(str(folders["llama"]), block_size=4).generate(PROMPT, params)[0]
    got = client.generate(PROMPT, model="llama", max_tokens=12, temperature=0)
    assert got.token_ids == tuple(fp8.outputs[0].token_ids)
    assert fp8.outputs[0].token_ids != plain.outputs[0].token_ids  # FP8 changed this model's answer


def test_the_flag_reaches_the_engine_template() -> None:
    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert engine_template(args).model.quantization == "fp8"
