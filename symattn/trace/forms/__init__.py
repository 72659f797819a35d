"""Rules for the forms library attention code takes beyond the core table: constants with batch and head axes,
fused projections read in blocks, rotary embeddings and grouped key/value heads, heads chosen, shared and repeated
along the heads axis, batch and heads merged into one axis, a hand-written softmax's shift, and the piecewise-linear
functions with number parameters (clamp, hardtanh, leaky_relu)."""
