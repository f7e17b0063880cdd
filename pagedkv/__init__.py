"""pagedkv: LLM serving with PagedAttention (scheduler + executors over gRPC)."""

__version__ = "0.1.0"
