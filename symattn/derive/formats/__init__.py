"""A derivation's printed formats: the LaTeX and text notation, long equalities broken to fit, verification
marks, documents (LaTeX, Markdown, text) and the self-contained HTML page."""
