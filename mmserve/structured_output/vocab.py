"""What each token id of a Hugging Face fast tokenizer stands for, for the grammar engines.

Grammar engines match bytes of output text, so every token needs the bytes it decodes to.
Special tokens (control tokens like <|im_start|>, eos) must never be allowed as text: with
skip_special_tokens they vanish from the output, so a grammar that let one through a JSON
string would produce text that no longer matches. They map to None here.
"""

from __future__ import annotations

import json
from functools import lru_cache

from transformers import PreTrainedTokenizerFast


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> frozenset[int]:
    """Ids of special tokens: the named ones and added tokens marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def token_bytes(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> list[bytes | None]:
    """Per token id < vocab_size: the bytes it decodes to, None for special or unused ids.

    Decodes byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) exactly and SentencePiece-style
    vocabularies (`▁` for a space, `<0xNN>` byte fallback); anything else is taken as the
    token's UTF-8 text.
    """
    decode = _decoder_for(tokenizer)
    special = special_token_ids(tokenizer)
    added = {i: tok.content for i, tok in tokenizer.added_tokens_decoder.items()}
    out: list[bytes | None] = [None] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i >= vocab_size or i in special:
            continue
        # Added tokens are stored as their literal text, not in the vocabulary's encoding.
        out[i] = added[i].encode() if i in added else decode(token)
    return out


def _decoder_for(tokenizer: PreTrainedTokenizerFast):  # type: ignore[no-untyped-def]
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return _byte_level
    if kinds & {"ByteFallback", "Metaspace"}:
        return _sentencepiece
    return _utf8


def _utf8(token: str) -> bytes:
    return token.encode()


def _sentencepiece(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode()


def _byte_level(token: str) -> bytes:
    table = _byte_level_table()
    if all(ch in table for ch in token):
        return bytes(table[ch] for ch in token)
    return token.encode()  # not byte-level encoded (should not happen outside added tokens)


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table
