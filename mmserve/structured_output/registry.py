"""Backend name -> implementation, imported only when first used (xgrammar and outlines-core
are optional and load native libraries)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmserve.errors import InvalidArgument

from .backend import StructuredOutputBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_BACKEND = "xgrammar"

# name -> (module, class, the pip package that provides the engine)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "xgrammar": ("mmserve.structured_output.xgrammar_backend", "XGrammarBackend", "xgrammar"),
    "outlines": ("mmserve.structured_output.outlines_backend", "OutlinesBackend", "outlines-core"),
}


# the constraint kinds (and options) a backend cannot compile (it refuses them by name): "auto"
# sends them to a backend that can
_LACKS: dict[str, frozenset[str]] = {
    "outlines": frozenset({"grammar", "structural_tag", "disable_any_whitespace"})
}


def auto_backend(needs: frozenset[str], default: str) -> str:
    """The backend "auto" means for a constraint that needs these (StructuredOutputParams.needs:
    its kind, options): the default one, unless it cannot compile it; then the first
    registered one that can (xgrammar)."""
    if not needs & _LACKS.get(default, frozenset()):
        return default
    return next((n for n in _BACKENDS if not needs & _LACKS.get(n, frozenset())), default)


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def get_backend_class(name: str) -> type[StructuredOutputBackend]:
    """The backend class registered as `name`; an unknown or uninstalled one is an error."""
    if name not in _BACKENDS:
        raise InvalidArgument(
            "structured.backend",
            f"unknown backend {name!r}; valid: {', '.join(backend_names())}",
        )
    module_name, class_name, package = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidArgument(
            "structured.backend", f"backend {name!r} needs `pip install {package}` ({e})"
        ) from None
    cls: type[StructuredOutputBackend] = getattr(module, class_name)
    return cls


def create_backend(
    name: str,
    tokenizer: PreTrainedTokenizerFast,
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> StructuredOutputBackend:
    """Build backend `name` for one model: its tokenizer, logits width and stop tokens."""
    return get_backend_class(name)(tokenizer, vocab_size, eos_token_ids)
