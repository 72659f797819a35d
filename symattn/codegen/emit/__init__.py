"""Emission: a schedule's statements, sections and template context, printed by a backend's printer."""
