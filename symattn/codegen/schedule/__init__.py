"""Scheduling: a spec's forward and backward as ordered assignments, shaped by passes (naming, sharing, product
order, saving), and their memory-efficient (row-block) and second-order (tangent) variants."""
