"""mmserve_client: the Python SDK of the mmserve v1 gRPC API (protos/mmserve/v1).

    from mmserve_client import Client
    with Client("127.0.0.1:50051", api_key=None) as c:
        r = c.generate("Hello", max_tokens=32, temperature=0)   # GenerateResult
        for chunk in c.generate_stream("Hello", max_tokens=32):  # GenerateChunk
            print(chunk.text, end="")

AsyncClient has the same methods as coroutines / async iterators. Every failed call raises
MMServeError(code, message). The generated protobuf / gRPC modules live in
mmserve_client.v1 (made by scripts/gen_protos.sh; the server imports them too).
"""

from mmserve_client._chat import ChatKwargs, ChatOptions
from mmserve_client._requests import GenerateKwargs
from mmserve_client.aio import AsyncClient
from mmserve_client.client import Client
from mmserve_client.errors import MMServeError
from mmserve_client.streams import AsyncGenerateStream, GenerateStream
from mmserve_client.types import (
    Classification,
    GenerateChunk,
    GenerateResult,
    Image,
    LabelScore,
    LoadReport,
    ModelInfo,
    ModelLoad,
    RelaxedKeyword,
    RerankResult,
    ResultList,
    Timing,
    TokenizeResult,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "ChatKwargs",
    "ChatOptions",
    "Classification",
    "Client",
    "GenerateChunk",
    "GenerateKwargs",
    "GenerateResult",
    "GenerateStream",
    "Image",
    "LabelScore",
    "LoadReport",
    "MMServeError",
    "ModelInfo",
    "ModelLoad",
    "RelaxedKeyword",
    "RerankResult",
    "ResultList",
    "Timing",
    "TokenLogprob",
    "TokenizeResult",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
]
