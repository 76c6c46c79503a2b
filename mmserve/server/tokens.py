"""The Tokenize and Detokenize RPCs: the model's own tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.server.generate import off_loop, render_chat
from mmserve.server.images import ImageInputs
from mmserve.server.models import ModelHandle
from mmserve_client.v1 import tokenize_pb2

# ids of one Detokenize call: decoding holds Python's lock (10M ids held every call of the
# server ~3 s); a million is far past any context
MAX_DETOKENIZE_IDS = 1 << 20


async def tokenize(
    request: tokenize_pb2.TokenizeRequest,
    handle: ModelHandle,
    request_id: str,
    images: ImageInputs | None = None,
    namespace: str = "",
) -> tokenize_pb2.TokenizeResponse:
    """namespace: the caller's scope of image uuids (its tenant's)."""
    tokenizer = handle.tokenizer
    kind = request.WhichOneof("input")
    explicit = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if kind == "text":
        add_special = True if explicit is None else explicit
        ids = await off_loop(
            handle, len(request.text), tokenizer.encode, request.text, add_special_tokens=add_special
        )
    elif kind == "chat":
        prompt = await render_chat(handle, request.chat, images, namespace)
        text, ids = prompt.text, prompt.token_ids
        if explicit:  # the template placed its own special tokens; add the tokenizer's too
            ids = await off_loop(handle, len(text), _with_special_tokens, tokenizer, text, ids)
    else:
        raise InvalidArgument("input", "set text or chat")
    tokens = []  # a Python call per id: off the loop for long texts
    if request.return_tokens:
        tokens = await off_loop(handle, len(ids), tokenizer.convert_ids_to_tokens, ids)
    return tokenize_pb2.TokenizeResponse(
        request_id=request_id,
        token_ids=ids,
        tokens=tokens,
        max_context=handle.facts.max_context,
        model=handle.name,
    )


def _with_special_tokens(tokenizer: Any, text: str, ids: list[int]) -> list[int]:
    """ids (the rendered chat, images expanded) wrapped in the special tokens the tokenizer
    adds around `text` (e.g. BOS in front)."""
    plain: list[int] = tokenizer.encode(text, add_special_tokens=False)
    full: list[int] = tokenizer.encode(text, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start] + ids + full[start + len(plain) :]
    raise InvalidArgument("add_special_tokens", "the tokenizer's special tokens do not wrap this chat")


async def detokenize(
    request: tokenize_pb2.DetokenizeRequest, handle: ModelHandle, request_id: str
) -> tokenize_pb2.DetokenizeResponse:
    if len(request.token_ids) > MAX_DETOKENIZE_IDS:  # the tokenizer holds the GIL: 10M ids, 3 s
        raise InvalidArgument(
            "token_ids", f"{len(request.token_ids)} ids; at most {MAX_DETOKENIZE_IDS}"
        )
    ids = list(request.token_ids)
    handle.frontend.check_token_ids(ids, "token_ids")
    # ~4 characters per token: the same threshold as for text.
    text = await off_loop(
        handle, 4 * len(ids), handle.tokenizer.decode, ids, skip_special_tokens=request.skip_special_tokens
    )
    return tokenize_pb2.DetokenizeResponse(request_id=request_id, text=text, model=handle.name)
