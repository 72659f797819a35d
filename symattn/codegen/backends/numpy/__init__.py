"""The NumPy backend: its Backend object, printer and runtime helpers, and the numba kernels of its fused row
softmax (the `fast` extra)."""
