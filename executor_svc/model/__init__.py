"""Model implementations that run over the paged KV pool."""

from executor_svc.model.llama import LlamaModel, load_model

__all__ = ["LlamaModel", "load_model"]
