"""Triton kernels with their PyTorch references, imported as `lm_kernels`.

One folder per op: the Triton kernel, the PyTorch reference and the autograd wrapper side by side.
This package imports nothing from `lm`.
"""
