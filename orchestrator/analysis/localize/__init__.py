"""Localization: which layer and which heads of a baseline run to intervene on, read from its own metrics.

One job per module: the rules and the algorithm (algorithm.py, whose docstring documents them), its config and
result types (stats.py), the text report (text.py), the plots (plot.py), where the input comes from (source.py) and
the command line (cli.py; `flash-forensics localize`). The third stage, layer -> heads -> rounding point, reads
the rounding-point forks of a report (rounding.py: the rules; rounding_io.py: files, MLflow tags, `... rounding DIR`).
"""
from flash_forensics.orchestrator.analysis.localize.algorithm import (
                                         PREFIXES,
                                         History,
                                         _split_outliers,
                                         localize,
                                         parse_history,
)
from flash_forensics.orchestrator.analysis.localize.cli import main
from flash_forensics.orchestrator.analysis.localize.plot import plot
from flash_forensics.orchestrator.analysis.localize.source import load_history, resolve_source
from flash_forensics.orchestrator.analysis.localize.stats import (
                                         HeadStats,
                                         LayerStats,
                                         Localization,
                                         LocalizeConfig,
                                         scoped_interventions,
)
from flash_forensics.orchestrator.analysis.localize.text import format_localization

__all__ = ["localize", "parse_history", "LocalizeConfig", "HeadStats", "LayerStats", "Localization",
           "format_localization", "plot", "load_history", "resolve_source", "main", "PREFIXES", "History",
           "scoped_interventions", "_split_outliers"]
