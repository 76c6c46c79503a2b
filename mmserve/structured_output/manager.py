"""One model's structured-output service: its backends, built lazily, and the grammar cache.

The engine (or the front end, before a request reaches the engine) calls `compile` /
`compile_async` with validated params and gets a CompiledGrammar, then one
`CompiledGrammar.matcher()` per request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from .backend import CompiledGrammar, StructuredOutputBackend
from .cache import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_COMPILE_WORKERS,
    GrammarCache,
)
from .params import StructuredOutputParams
from .registry import DEFAULT_BACKEND, auto_backend, create_backend, get_backend_class


class StructuredOutputManager:
    """Compiles constraints for one model. Thread-safe; `compile` blocks, so call it off
    the event loop (or use `compile_async`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        default_backend: str = DEFAULT_BACKEND,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        compile_workers: int = DEFAULT_COMPILE_WORKERS,
    ) -> None:
        get_backend_class(default_backend)  # fail at start-up, listing the valid names
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width: every bitmask covers it
        self.eos_token_ids = tuple(eos_token_ids)
        self.default_backend = default_backend
        self.cache = GrammarCache(cache_entries, compile_timeout_s, compile_workers)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._lock = threading.Lock()

    def backend(self, name: str = "auto") -> StructuredOutputBackend:
        """Backend `name` ("auto" = the default), built on first use (~0.5 s)."""
        name = self.default_backend if name == "auto" else name
        with self._lock:  # built once even if several requests ask at the same time
            if name not in self._backends:
                self._backends[name] = create_backend(
                    name, self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            return self._backends[name]

    def compile(self, params: StructuredOutputParams, counted: bool = True) -> CompiledGrammar:
        """Validate and compile (cached). Raises InvalidArgument / ResourceExhausted.
        counted: False for the engine's own lookup (GrammarCache.get)."""
        params.validate()
        name = params.backend
        if name == "auto":  # the default, or a backend that compiles this kind
            name = auto_backend(params.needs, self.default_backend)
        backend = self.backend(name)  # outside the compile time limit
        key = (backend.name, *params.cache_key)
        return self.cache.get(key, lambda: backend.compile(params), params.field, counted)

    async def compile_async(self, params: StructuredOutputParams) -> CompiledGrammar:
        return await asyncio.to_thread(self.compile, params)

    def close(self) -> None:
        self.cache.close()
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            backend.close()
