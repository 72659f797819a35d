"""Generated modules: ``schedule`` (the passes that plan a spec's forward and backward), ``emit`` (statements and
template context), ``backends`` (one object per array library: printer, runtime, template), ``report`` (costs,
pictures), and ``generate``, which renders them into files."""
