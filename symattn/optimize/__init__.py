"""Rewrite rules, the cost model and the simplifier that picks the cheapest equal expression; a mask's structure
(the keys a block of rows may see, ``mask_structure``) and the block of rows of a matrix of positions
(``position_blocks``)."""
