"""monitor.probes: the typed knobs of the mechanism probes (orchestrator/monitor/probes/runner.py), validated before a
job starts. Off by default; conf/experiment/mini_repro.yaml turns them on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

LAYERS_ALL = "all"


@dataclass
class ProbesConfig:
    enabled: bool = False
    # steps between probes (and at every checkpoint): one extra forward+backward of `batch` sequences plus FP64
    # attention per probed layer. Measured on one H200 at the mini_repro shape (results/bench/probes-h200.json): a
    # probe costs 9.3 steps, 14% of step time at every=100, so 2% needs every >= 466: the default is 500. Presets that
    # reproduce a failure (mini_repro) probe more often and pay for it.
    every: int = 500
    batch: int = 4  # sequences of the fixed probe batch, drawn once from the validation split (seed PROBE_SEED)
    layers: Any = LAYERS_ALL  # "all" or a list of 0-based layer indices

    def validate(self, key: str = "monitor.probes", n_layer: Optional[int] = None) -> "ProbesConfig":
        """Raise ValueError naming the key, the value and what is allowed; return self."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{key}.enabled={self.enabled!r} is not allowed: expected true or false")
        for name in ("every", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected an integer > 0")
        self.layer_list(n_layer, key)
        return self

    def layer_list(self, n_layer: Optional[int], key: str = "monitor.probes") -> Optional[List[int]]:
        """The probed layers (sorted, distinct); None for "all" when n_layer is unknown."""
        layers = self.layers
        if isinstance(layers, str):
            if layers != LAYERS_ALL:
                raise ValueError(f"{key}.layers={layers!r} is not allowed: expected 'all' or a list of layer "
                                 f"indices")
            return list(range(n_layer)) if n_layer is not None else None
        try:
            items = list(layers)
        except TypeError:
            raise ValueError(f"{key}.layers={layers!r} is not allowed: expected 'all' or a list of layer "
                             f"indices") from None
        hi = f" < model.n_layer={n_layer}" if n_layer is not None else ""
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (n_layer is not None and i >= n_layer):
                raise ValueError(f"{key}.layers={items!r} is not allowed: expected 'all' or a non-empty list of "
                                 f"integers >= 0{hi} (bad entry {i!r})")
        if not items:
            raise ValueError(f"{key}.layers=[] is not allowed: expected 'all' or a non-empty list of integers >= 0{hi}")
        return sorted(set(items))


__all__ = ["ProbesConfig", "LAYERS_ALL"]
