"""Printed derivations: the replayed steps, the notation printer, documents, and `check`."""
