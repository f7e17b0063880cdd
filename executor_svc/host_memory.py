"""Keep the memory a step frees in the process, for the next step.

glibc's malloc hands large blocks back to the kernel when they are freed: a block above its mmap threshold is
unmapped, and the top of a heap is trimmed once more than its trim threshold is free. A CPU step allocates its
activations afresh (torch has no caching allocator on the CPU), so each step's big tensors come back as new pages:
one page fault per 4 KiB, the page zeroed, on the step's own threads. On a VM that reports free pages to its host
(virtio-balloon free page reporting) the kernel's free pages are not even backed. SmolLM2's 2,048-token prefill
step took ~50,000 such faults a step (12.6 MB for each layer's SiLU output alone, 11-20 ms of a 1.3 ms op).

``keep_freed_memory`` raises both thresholds (``mallopt``): blocks up to 32 MiB (glibc's largest mmap threshold on
64-bit) come from the heap and stay there once freed, and heaps are never trimmed. The process keeps its peak
activation memory, as a GPU caching allocator does. Blocks over 32 MiB are still mapped and unmapped each time.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc: HEAP_MAX_SIZE / 2 on 64-bit; larger values are refused
TRIM_NEVER = (1 << 31) - 1  # mallopt takes an int


def keep_freed_memory() -> str | None:
    """Set the thresholds; None when done, else why not (not glibc, or glibc refused a value)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded (libc's among them; no ldconfig lookup)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
    except (OSError, AttributeError):
        return "not glibc's malloc"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX):
        return "glibc refused M_MMAP_THRESHOLD"
    if not mallopt(M_TRIM_THRESHOLD, TRIM_NEVER):
        return "glibc refused M_TRIM_THRESHOLD"
    return None
