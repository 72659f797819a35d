"""The expression language: nodes, shapes, the formula parser, naming, safe conversion of user values."""
