"""End to end on a GPU through the real processes (``pagedkv serve --device cuda --attention-backend cuda``).

Skipped without CUDA, CuPy, or structlog (the services log with it; on the device machine
bench/gpu_check.sh installs it from carried wheels).

What is compared, and why it is sound:

* float32: greedy output token-exact against Hugging Face transformers (eager, fp32, one prompt at a time),
  the same standard as the CPU end-to-end tests. The random models are built with a large
  initializer_range, so greedy choices are far from ties; the kernels' fp32 error (~1e-6 relative) cannot
  flip one.
* float16: against the torch backend in the same process setup on the same GPU (HF fp16 would differ in
  its own rounding). fp16 attention outputs differ between the two backends by ~1e-3 relative, which can
  flip a near-tie late in a long generation; so the first 16 tokens of every request must agree exactly,
  and at least 90% of all requests must agree on every token.
* sliding window (per-request sink + window, dropped pages): cuda against torch in float32, token-exact.
* fp8 KV pages (--kv-cache-dtype fp8_e4m3): cuda against torch in float16, judged as float16.

Contexts reach ~800 tokens, so the decode kernel's split-K path (partitions of 512) runs too.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from pagedkv.client import Client
from tests.support.hf_reference import hf_greedy, random_prompts


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    from kernels_cuda.loader import cupy_import_error

    if (err := cupy_import_error()) is not None:
        return f"needs CuPy ({err})"
    if importlib.util.find_spec("structlog") is None:
        return "needs structlog for the services (carry its wheel: see bench/gpu_check.sh)"
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

PROMPT_LENS = [3, 17, 64, 130, 250, 700, 1, 33, 520, 90]
OUTPUT_LENS = [40, 24, 33, 20, 31, 60, 45, 16, 50, 38]
VOCAB = 259
PROMPTS = random_prompts(5, PROMPT_LENS, VOCAB)
MODELS = {"d64": dict(hidden_size=512, num_heads=8, num_kv_heads=2),
          "d128": dict(hidden_size=1024, num_heads=8, num_kv_heads=2)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    from pagedkv.tools.random_model import build_random_model

    return {name: build_random_model(tmp_path_factory.mktemp(f"llama-{name}"), arch="llama", seed=11,
                                     intermediate_size=1024, num_layers=4, **kw) for name, kw in MODELS.items()}


async def _run(address: str, prompts, max_tokens) -> tuple[list, object]:
    async with Client(address) as client:
        outs = await asyncio.gather(*[client.complete(p, max_tokens=n, temperature=0)
                                      for p, n in zip(prompts, max_tokens)])
        return list(outs), await client.model_info()


def _serve(start_server, model_dir, backend: str, dtype: str, *extra: str):
    server = start_server("--model", str(model_dir), "--device", "cuda", "--attention-backend", backend,
                          "--dtype", dtype, "--num-pages", "2048", "--max-num-batched-tokens", "512", *extra)
    outs, info = asyncio.run(_run(server.address, PROMPTS, OUTPUT_LENS))
    assert info.attention_backend == backend
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("model,block_size", [("d64", "8"), ("d128", "16"), ("d64", "32")])
def test_fp32_greedy_matches_transformers(start_server, model_dirs, model, block_size):
    expected = hf_greedy(model_dirs[model], PROMPTS, OUTPUT_LENS)
    got = _serve(start_server, model_dirs[model], "cuda", "float32", "--block-size", block_size)
    for i, (out, ref) in enumerate(zip(got, expected)):
        assert out == ref, f"request {i} (prompt {PROMPT_LENS[i]} tokens) differs from transformers"


def test_fp16_cuda_agrees_with_torch_backend(start_server, model_dirs):
    cuda = _serve(start_server, model_dirs["d128"], "cuda", "float16")
    ref = _serve(start_server, model_dirs["d128"], "torch", "float16")
    for i, (a, b) in enumerate(zip(cuda, ref)):
        assert a[:16] == b[:16], f"request {i}: the first 16 fp16 tokens differ between the backends"
    identical = sum(a == b for a, b in zip(cuda, ref))
    assert identical >= 0.9 * len(ref), f"only {identical}/{len(ref)} requests identical between the backends"


def test_sliding_window_matches_torch_backend(start_server, model_dirs):
    extra = ("--sliding-window", "96", "--sink-tokens", "16", "--block-size", "16")
    cuda = _serve(start_server, model_dirs["d64"], "cuda", "float32", *extra)
    ref = _serve(start_server, model_dirs["d64"], "torch", "float32", *extra)
    assert cuda == ref


def test_fp8_kv_cuda_agrees_with_torch_backend(start_server, model_dirs):
    """--kv-cache-dtype fp8_e4m3 through pagedkv serve on both backends: the same bytes are written (the kernels
    reproduce the torch quantizer), read by paged_decode_q8 vs the torch gather; judged like fp16 above."""
    extra = ("--kv-cache-dtype", "fp8_e4m3")
    cuda = _serve(start_server, model_dirs["d128"], "cuda", "float16", *extra)
    ref = _serve(start_server, model_dirs["d128"], "torch", "float16", *extra)
    for i, (a, b) in enumerate(zip(cuda, ref)):
        assert a[:16] == b[:16], f"request {i}: the first 16 tokens differ between the backends on fp8 pages"
    identical = sum(a == b for a, b in zip(cuda, ref))
    assert identical >= 0.9 * len(ref), f"only {identical}/{len(ref)} requests identical between the backends"
