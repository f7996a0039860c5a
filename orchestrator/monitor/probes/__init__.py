"""Mechanism probes (the paper, Sec. 3.3): `monitor.probes` (config.py), the scheduling, capture and logging
(runner.py) around the pure math of kernels/probes.py."""
from flash_forensics.orchestrator.monitor.probes.config import LAYERS_ALL, ProbesConfig

__all__ = ["ProbesConfig", "LAYERS_ALL"]
