"""Interventions as typed plug-ins: what an intervention file declares (spec.py), the train hooks it may bring
(hooks.py) and the hooks that ship with the project (qk_clip.py).

Home: the orchestrator, because an intervention is an orchestration concept. It patches two configs (attention,
model), adds code to the train loop and tells localization which scope it takes; kernels/ and models/ stay
unaware of it (models/gpt.py only offers a q/k observer slot).

Public API:
    scoped(kind)          intervention names whose scope takes 'layer' / 'heads' (read from the files)
    scope(name), names(), load(name, layer=None, heads=None)
    effective_model(model_cfg, iv)   the model config with the intervention's model patch
    build_hooks(iv.hooks)            a HookSet (hydra.utils.instantiate per `_target_`)
"""
from flash_forensics.orchestrator.interventions.hooks import HookSet, TrainHook
from flash_forensics.orchestrator.interventions.hooks import build as build_hooks
from flash_forensics.orchestrator.interventions.spec import (
                                             CONF_DIR,
                                             InterventionConfig,
                                             ModelPatch,
                                             effective_model,
                                             load,
                                             names,
                                             scope,
                                             scoped,
)

__all__ = ["InterventionConfig", "ModelPatch", "effective_model", "scoped", "scope", "names", "load", "build_hooks",
           "HookSet", "TrainHook", "CONF_DIR"]
