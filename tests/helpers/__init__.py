"""Test helpers: composing and running jobs, child processes, the import graph, screenshots."""
