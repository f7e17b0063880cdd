"""CUDA C++ kernels for the page layout (see bench/NOTES.md) and their NVRTC loader (CuPy)."""
