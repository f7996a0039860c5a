"""Localization as a picture: per-head W_Q of the chosen layer and the layer ranking with the chosen bar
highlighted (drawn by orchestrator/plots.py: localization, beside the report's other plots)."""
from __future__ import annotations

from pathlib import Path

from orchestrator.localize.algorithm import History
from orchestrator.localize.stats import Localization


def plot(loc: Localization, history: History, path: Path) -> Path:
    from orchestrator.plots import localization
    return localization(loc, history, path)
