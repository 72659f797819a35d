"""Indices of table reads at positions: their interval bounds over the positions, and reads nested in them."""
