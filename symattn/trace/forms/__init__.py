"""Rules for the forms library attention code takes beyond the core table: constants with batch and head axes,
fused projections read in blocks, rotary embeddings and grouped key/value heads, heads chosen, shared and repeated
along the heads axis, and batch and heads merged into one axis."""
