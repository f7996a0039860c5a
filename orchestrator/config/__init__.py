"""Configs: the typed root schema, validation before anything runs, and the generated rounding-point sweep."""
