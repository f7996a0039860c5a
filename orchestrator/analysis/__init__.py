"""Analysis over runs: the isolation pipeline, localization, early warning and the stabilizers table."""
