"""Tracking: MLflow that never blocks training (the tracker, its writer, the store and standard run fields)."""
