"""Paged attention backends. Every backend reads and writes the same page layout (see executor_svc.pages)."""

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchPagedAttention

BACKENDS = {"torch": TorchPagedAttention}

__all__ = ["AttentionMetadata", "BACKENDS", "TorchPagedAttention"]
