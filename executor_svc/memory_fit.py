"""Whether the KV pages asked for fit in the memory there is, checked before they are allocated: a request that
cannot fit is one line naming the flag, the value and what fits (not the allocator's traceback).

On the CPU the pages are host memory: they must fit in what /proc/meminfo calls available, the weights (loaded by
then) already taken out, less a margin for activations and the rest of the process. On CUDA they must fit in the
device memory free after the weights."""

from __future__ import annotations

import torch

from executor_svc.pages import GiB

HEADROOM = 0.1  # the share of the available memory left for activations, the host tier's bookkeeping, the process


def weights_bytes(model) -> int:
    """The checkpoint's tensors as loaded (``model.raw``; 0 when a model keeps no such dict)."""
    raw = getattr(model, "raw", None) or {}
    return sum(t.numel() * t.element_size() for t in raw.values() if isinstance(t, torch.Tensor))


def _size(n: int) -> str:
    return f"{n / GiB:.3g} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def kv_flag(args) -> str:
    """The flag that set the KV size, as the user typed it."""
    if args.num_pages is not None:
        return f"--num-pages {args.num_pages}"
    if args.kv_cache_gb is not None:
        return f"--kv-cache-gb {args.kv_cache_gb:g}"
    return "the default KV size (--kv-cache-gb)"


def check_kv_fits(asked: str, kv_bytes: int, device: torch.device, weights: int, available_host: int) -> None:
    """Raises ValueError (one line: ``asked``, the bytes, what fits) unless ``kv_bytes`` fit on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"{device} has {free / GiB:.1f} GiB free after the weights ({_size(weights)})"
        room = free
    else:
        where = (f"this machine has {available_host / GiB:.1f} GiB of memory available beside the weights "
                 f"({_size(weights)}, loaded)")
        room = available_host
    fits = int(room * (1 - HEADROOM))
    if kv_bytes > fits:
        raise ValueError(f"{asked}: {_size(kv_bytes)} of KV pages, but {where}; at most ~{fits / GiB:.1f} GiB "
                         "fits: ask for less (--kv-cache-gb GiB or --num-pages N)")
