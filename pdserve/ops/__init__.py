"""Attention and fused kernels.

Every op has a plain-torch reference (``reference.py``). Triton kernels are used for CUDA
tensors when Triton is importable; a CPU install never imports Triton (see ``registry.py``).
"""
