"""mmserve: one engine per model serving generation and pooling tasks over gRPC."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:
    from mmserve.entrypoints.llm import LLM
    from mmserve.params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:  # lazy: `import mmserve` stays cheap (no torch import)
    if name == "LLM":
        from mmserve.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from mmserve import params

        return getattr(params, name)
    raise AttributeError(name)
