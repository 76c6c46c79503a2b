"""The Tokenize and Detokenize RPCs: the model's own tokenizer and chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.frontend.prompts import encode_prompt
from mmserve.server.generate import off_loop, render_chat
from mmserve.server.images import ImageInputs
from mmserve.server.models import ModelHandle
from mmserve_client.v1 import tokenize_pb2

# tokens of one Tokenize text or chat, ids of one Detokenize call: both hold Python's lock
# (a 30 MB text held a thread ~40 s, 10M ids held every call of the server ~3 s); a million
# is far past any context
MAX_TOKENIZE_IDS = 1 << 20


@dataclass(frozen=True)
class TokenizeLimit:
    """Tokenize's TokenLimit: a text found far past it from a head of it is refused without
    tokenising the rest (long_texts.py), one past it by its exact count after."""

    tokens: int  # the most token ids one call returns

    def error(self, field: str, tokens: int, at_least: bool = False) -> InvalidArgument:
        count = f"at least {tokens}" if at_least else str(tokens)
        return InvalidArgument(field, f"{count} tokens; at most {self.tokens} tokens")

    def check(self, field: str, ids: list[int]) -> list[int]:
        if len(ids) > self.tokens:
            raise self.error(field, len(ids))
        return ids


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
    limit = TokenizeLimit(MAX_TOKENIZE_IDS)
    if kind == "text":
        add_special = True if explicit is None else explicit
        ids = await off_loop(
            handle, len(request.text), encode_prompt, tokenizer, request.text, add_special,
            limit, "text",
        )
    elif kind == "chat":
        prompt = await render_chat(handle, request.chat, images, namespace, limit)
        text, ids = prompt.text, limit.check("chat", prompt.token_ids)  # before encoding again
        if explicit:  # the template placed its own special tokens; add the tokenizer's too
            ids = await off_loop(handle, len(text), _with_special_tokens, tokenizer, text, ids)
    else:
        raise InvalidArgument("input", "set text or chat")
    limit.check(kind, ids)  # the exact count: of all the text, with any special tokens added
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
    if len(request.token_ids) > MAX_TOKENIZE_IDS:  # the tokenizer holds the GIL: 10M ids, 3 s
        raise InvalidArgument(
            "token_ids", f"{len(request.token_ids)} ids; at most {MAX_TOKENIZE_IDS}"
        )
    ids = list(request.token_ids)
    handle.frontend.check_token_ids(ids, "token_ids")
    # ~4 characters per token: the same threshold as for text.
    text = await off_loop(
        handle, 4 * len(ids), handle.tokenizer.decode, ids, skip_special_tokens=request.skip_special_tokens
    )
    return tokenize_pb2.DetokenizeResponse(request_id=request_id, text=text, model=handle.name)
