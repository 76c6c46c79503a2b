"""Attention over the paged KV cache: metadata, backend interface and registry."""

from mmserve.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
