"""What an intervention file declares, typed: `InterventionConfig` (the `intervention` node of the root config).

One file in conf/intervention/ is one experiment:
- `name`, `expect` (stable | diverges: what the paper observed), `paper` (where it says so);
- scope: `layer` (0-based) and/or `heads` (0-based), the parameters the patches interpolate
  (`${intervention.layer}`); a file that sets one of them takes that scope (`scoped()`);
- the attention patch: attention knobs at the file's top level (`softmax: stabilized`, `beta: 2.0`) and per-layer
  `overrides`. They stay at the top level so that `intervention.beta=4` on the command line keeps its meaning;
- the model patch: `model: {qk_norm: true}`, any field of models/gpt.py's ModelConfig (None = leave it alone);
- train hooks: `hooks: [{_target_: dotted.Class, arg: value}]`, built with hydra.utils.instantiate
  (orchestrator/interventions/hooks.py says what a hook is and where the train loop calls it).
"""
from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from flash_forensics.kernels.config import KnobPatch, LayerOverride
from flash_forensics.models.gpt import ModelConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "intervention"
SCOPES = ("layer", "heads")

# flash_forensics.models.gpt.ModelConfig field by field, each optional (None = leave the run's value alone): read from
# the dataclass, so a new model field is patchable without a second list
_MODEL_HINTS = typing.get_type_hints(ModelConfig)
ModelPatch = make_dataclass(
    "ModelPatch", [(f.name, Optional[_MODEL_HINTS[f.name]], field(default=None)) for f in fields(ModelConfig)],
    namespace={"__doc__": "A partial flash_forensics.models.gpt.ModelConfig: the fields an intervention sets "
                          "(None = not set).",
               "set_fields": lambda self: {f.name: getattr(self, f.name) for f in fields(self)
                                           if getattr(self, f.name) is not None}})
ModelPatch.__module__ = __name__


@dataclass
class InterventionConfig(KnobPatch):
    """One isolation experiment: what the paper observed, where, its scope, and what it changes.

    The attention knobs (inherited from KnobPatch) are a typed partial (None = leave the attention config alone);
    `overrides` are appended to attention.overrides; `model` patches the model config; `hooks` are train hooks.
    """

    name: str = "baseline"
    expect: str = "diverges"
    paper: str = ""
    layer: Optional[int] = None
    heads: List[int] = field(default_factory=list)
    overrides: List[LayerOverride] = field(default_factory=list)
    model: ModelPatch = field(default_factory=ModelPatch)
    hooks: List[Any] = field(default_factory=list)  # each {_target_: ..., **kwargs}


def effective_model(model: ModelConfig, iv: InterventionConfig) -> ModelConfig:
    """The run's model config with the intervention's model patch applied (a new object)."""
    return ModelConfig(**{**asdict(model), **iv.model.set_fields()})


# ------------------------------------------------------------------------------------------------- the files
def path(name: str) -> Path:
    return CONF_DIR / f"{name}.yaml"


def names() -> List[str]:
    """Every intervention file's name, sorted."""
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def scope(name: str) -> Tuple[str, ...]:
    """The scope kinds ('layer', 'heads') the intervention's file takes, read from the file itself."""
    node = OmegaConf.load(path(name))
    return tuple(k for k in SCOPES if k in node)


def scoped(kind: str) -> List[str]:
    """The intervention names whose scope takes `kind` ('layer' or 'heads'), e.g. for localization's overrides."""
    if kind not in SCOPES:
        raise ValueError(f"kind={kind!r} is not allowed: expected one of {', '.join(SCOPES)}")
    return [n for n in names() if kind in scope(n)]


def load(name: str, layer: Optional[int] = None, heads: Optional[List[int]] = None) -> InterventionConfig:
    """One intervention file on its own, typed; layer/heads (when given) replace the file's scope first."""
    scope_values: Dict[str, Any] = {}
    if layer is not None:
        scope_values["layer"] = layer
    if heads is not None:
        scope_values["heads"] = list(heads)
    # merged under a root `intervention`, so that ${intervention.layer} resolves as in a run
    root = OmegaConf.merge({"intervention": OmegaConf.structured(InterventionConfig)},
                           {"intervention": OmegaConf.load(path(name))}, {"intervention": scope_values})
    OmegaConf.resolve(root)
    return OmegaConf.to_object(root.intervention)


__all__ = ["InterventionConfig", "ModelPatch", "effective_model", "names", "scope", "scoped", "load", "path",
           "CONF_DIR", "SCOPES"]
