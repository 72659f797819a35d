"""Differentiation: a VJP rule and a forward differential per node, and the reverse-mode engine."""
