"""Test helpers: composing and running jobs, the import graph, screenshots."""
