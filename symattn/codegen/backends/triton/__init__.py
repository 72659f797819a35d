"""The Triton backend: the n × m core of a spec found, its entrywise steps printed into FlashAttention-style kernels."""
