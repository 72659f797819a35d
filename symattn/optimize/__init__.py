"""Rewrite rules, the cost model and the simplifier that picks the cheapest equal expression."""
