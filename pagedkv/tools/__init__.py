"""Checkpoints made rather than downloaded, for the built-in tiny-llama, the tests and the benchmarks.

- ``random_model``: random Hugging Face checkpoints of every supported family with a byte-level tokenizer
  (tiny-llama is one, from a fixed seed);
- ``quantize``: 4-bit AWQ (GEMM) and GPTQ copies of a checkpoint by round-to-nearest (the format, not the quality);
- ``trained_tiny``: a tiny Llama trained for a few minutes on Python's standard library (KV quantization quality).
"""
