"""Paged attention backends. Every backend reads and writes the same page layout (see executor_svc.pages)."""

from __future__ import annotations

import torch

from executor_svc.attention.cuda_backend import CudaPagedAttention, unavailable_reason
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchPagedAttention

BACKENDS = {"torch": TorchPagedAttention, "cuda": CudaPagedAttention}


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """The backend to run and why: ``auto`` is ``cuda`` where its kernels can run (a CUDA device, CuPy, a
    supported dtype and head_dim), else ``torch``; an explicit ``cuda`` that cannot run is an error that
    names the flag."""
    if requested == "torch":
        return "torch", "requested"
    reason = unavailable_reason(device, dtype, head_dim)
    if requested == "cuda":
        if reason is not None:
            raise ValueError(f"--attention-backend cuda: {reason}. Use --attention-backend torch (or auto)")
        return "cuda", "requested"
    if requested != "auto":
        raise ValueError(f"--attention-backend {requested!r}: choose auto, {', '.join(BACKENDS)}")
    return ("torch", f"auto: {reason}") if reason is not None else ("cuda", "auto: CUDA kernels available")


__all__ = ["AttentionMetadata", "BACKENDS", "CudaPagedAttention", "TorchPagedAttention", "select_backend"]
