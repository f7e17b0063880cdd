"""Paged attention backends: each one a ``PagedAttention`` (executor_svc.attention.interface) over the same
page layout (see executor_svc.pages)."""

from __future__ import annotations

import torch

from executor_svc.attention.cuda_backend import CudaPagedAttention, unavailable_reason
from executor_svc.attention.interface import PagedAttention
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchPagedAttention

BACKENDS: dict[str, type[PagedAttention]] = {"torch": TorchPagedAttention, "cuda": CudaPagedAttention}

# NOTE: the CUDA kernels pass nvcc, ptxas (no spills) and a CPU emulator of their source, but have not yet run
# on a GPU. Until bench/gpu_check.sh has passed on one, ``auto`` keeps the torch reference and says so;
# ``--attention-backend cuda`` opts in. The session that verifies them on a GPU sets this to True.
CUDA_VERIFIED_ON_GPU = False


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   kv_quantized: bool = False) -> tuple[str, str]:
    """The backend to run and why: ``auto`` is ``cuda`` where its kernels can run (a CUDA device, CuPy, a
    supported dtype and head_dim) once they are verified on a GPU (CUDA_VERIFIED_ON_GPU), else ``torch``; an
    explicit ``cuda`` that cannot run is an error that names the flag. ``kv_quantized`` (8-bit pages) changes
    nothing: the cuda backend decodes them with its own kernel (the write and prefill gather in torch ops)."""
    if requested == "torch":
        return "torch", "requested"
    reason = unavailable_reason(device, dtype, head_dim)
    if requested == "cuda":
        if reason is not None:
            raise ValueError(f"--attention-backend cuda: {reason}. Use --attention-backend torch (or auto)")
        return "cuda", "requested"
    if requested != "auto":
        raise ValueError(f"--attention-backend {requested!r}: choose auto, {', '.join(BACKENDS)}")
    if reason is not None:
        return "torch", f"auto: {reason}"
    if not CUDA_VERIFIED_ON_GPU:
        return "torch", ("auto: the CUDA kernels are not yet verified on a GPU (bench/gpu_check.sh); "
                         "--attention-backend cuda uses them")
    return "cuda", "auto: CUDA kernels available"


__all__ = ["AttentionMetadata", "BACKENDS", "CudaPagedAttention", "PagedAttention", "TorchPagedAttention",
           "select_backend"]
