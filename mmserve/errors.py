"""Errors raised at the edge; the server maps them to gRPC status codes."""

from __future__ import annotations


class MMServeError(Exception):
    """Base class of mmserve's own errors."""


class InvalidArgument(MMServeError, ValueError):
    """A request field is malformed or out of range. The message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message  # without the field


class ResourceExhausted(MMServeError):
    """The engine is at its admission limit; retry later."""


class UnsupportedModel(MMServeError, ValueError):
    """The model's architecture or a feature of its config is not supported."""


class EngineDead(MMServeError, RuntimeError):
    """A model's engine can serve nothing more (its process died, or its loop crashed)."""


class EngineStalled(EngineDead):
    """The watchdog declared an engine dead: it had work but made no step for too long."""


class RankLost(EngineDead):
    """A rank of a tensor-parallel model died, or a collective between the ranks waited past
    distributed_timeout: the engine serves nothing more (UNAVAILABLE, as a stall)."""
