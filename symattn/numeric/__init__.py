"""Numeric evaluation: expressions compiled to NumPy (or exact) callables, random points."""
