"""Names in the language: formulas parsed without eval, user values made SymPy objects without eval, and the
table of named subexpressions."""
