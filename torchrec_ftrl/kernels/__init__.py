"""Kernels of the fused FTRL TBE: the PyTorch update rule, the compiled CPU kernel, Triton CUDA kernels."""
