"""The one list of kernel instantiations, shared by the NVRTC loader and the nvcc compile test.

NVRTC instantiates templates at run time from *name expressions*; nvcc (in CI, without a GPU) gets the same
expressions through a generated translation unit that takes each kernel's address (see ``nvcc_unit``), so a
kernel the loader can ask for is a kernel CI has compiled.
"""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("decode.cu", "cache.cu", "lora_sgmv.cu")

DTYPES = {"float16": "pkv::f16", "bfloat16": "pkv::bf16", "float32": "float"}
HEAD_DIMS = (64, 128)
GROUP_TILES = (1, 2, 4, 8)  # query heads per CTA; a model's group size is rounded up to one of these
BLOCK_SIZES = (8, 16, 32)  # run-time (a shift) in the kernels; listed here for the tests and benchmarks
OPTIONS = ("-std=c++17",)  # NVRTC (CuPy adds -ftz=true to every build of its own)
NVCC_OPTIONS = (*OPTIONS, "-ftz=true")  # the same code generation from nvcc


def group_tile(group: int) -> int:
    """The smallest tile >= group (the largest tile if none: the group is then split over several CTAs)."""
    return next((t for t in GROUP_TILES if t >= group), GROUP_TILES[-1])


def decode_name(dtype: str, head_dim: int, tile: int) -> str:
    return f"pkv::paged_decode<{DTYPES[dtype]}, {head_dim}, {tile}>"


KV8 = {"fp8_e4m3": "pkv::fp8e4m3", "int8": "pkv::i8"}  # 8-bit KV page formats (executor_svc/kv_quant.py)


def decode_q8_name(dtype: str, kv_dtype: str, head_dim: int, tile: int) -> str:
    return f"pkv::paged_decode_q8<{DTYPES[dtype]}, {KV8[kv_dtype]}, {head_dim}, {tile}>"


def reduce_name(dtype: str, head_dim: int) -> str:
    return f"pkv::paged_decode_reduce<{DTYPES[dtype]}, {head_dim}>"


def write_name(dtype: str) -> str:
    return f"pkv::write_kv_cache<{DTYPES[dtype]}>"


def write_q8_token_name(dtype: str, kv_dtype: str) -> str:
    return f"pkv::write_kv_q8_token<{DTYPES[dtype]}, {KV8[kv_dtype]}>"


def write_k_i8_channel_name(dtype: str) -> str:
    return f"pkv::write_k_i8_channel<{DTYPES[dtype]}>"


def gather_q8_name(dtype: str, kv_dtype: str) -> str:
    return f"pkv::gather_kv_q8<{DTYPES[dtype]}, {KV8[kv_dtype]}>"


def gather_name(dtype: str) -> str:
    return f"pkv::gather_kv<{DTYPES[dtype]}>"


def lora_shrink_name(dtype: str) -> str:
    return f"pkv::lora_shrink<{DTYPES[dtype]}>"


def lora_expand_name(dtype: str) -> str:
    return f"pkv::lora_expand<{DTYPES[dtype]}>"


COPY_NAME = "pkv::copy_pages"
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def name_expressions(source: str) -> list[str]:
    """Every kernel of ``source`` the loader may ask for."""
    if source == "decode.cu":
        names = [decode_name(dt, d, t) for dt in DTYPES for d in HEAD_DIMS for t in GROUP_TILES]
        names += [decode_q8_name(dt, kv, d, t) for dt in DTYPES for kv in KV8 for d in HEAD_DIMS for t in GROUP_TILES]
        return names + [reduce_name(dt, d) for dt in DTYPES for d in HEAD_DIMS]
    if source == "cache.cu":
        return ([write_name(dt) for dt in DTYPES] + [gather_name(dt) for dt in DTYPES] + [COPY_NAME]
                + [write_q8_token_name(dt, kv) for dt in DTYPES for kv in KV8]
                + [write_k_i8_channel_name(dt) for dt in DTYPES]
                + [gather_q8_name(dt, kv) for dt in DTYPES for kv in KV8])
    if source == "lora_sgmv.cu":
        return [lora_shrink_name(dt) for dt in DTYPES] + [lora_expand_name(dt) for dt in DTYPES]
    raise ValueError(f"unknown kernel source {source!r}; known: {', '.join(SOURCES)}")


def nvcc_unit(source: str) -> str:
    """A translation unit for nvcc: the source, then the address of every name expression (which makes nvcc
    instantiate exactly what NVRTC would)."""
    lines = [f'#include "{KERNEL_DIR / source}"', "void* pagedkv_nvcc_instantiations[] = {"]
    lines += [f"    (void*)&{name}," for name in name_expressions(source)]
    lines.append("};")
    return "\n".join(lines) + "\n"


def source_text(source: str) -> str:
    """The source with its local includes expanded (each once), as handed to NVRTC: CuPy's on-disk cache
    is keyed by this text, so an edited header recompiles too."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def include(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand((KERNEL_DIR / name).read_text())

        return _INCLUDE.sub(include, text)

    return expand((KERNEL_DIR / source).read_text())
