"""symattn's version: one leaf module, which the package and the generated modules' headers read."""

__version__ = "0.1.0"
