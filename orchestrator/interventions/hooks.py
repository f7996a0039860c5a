"""Train hooks: code an intervention runs inside the train loop, declared in its file by `_target_`.

The protocol (duck-typed; `TrainHook` gives no-op defaults):

    check(model_cfg)                                 before launch (validation): raise ValueError naming the
                                                     argument, the value and what is allowed
    attach(model)                                    once, after the model is built (e.g. register observers)
    after_optimizer_step(step, model, metrics)       the ONE place the train loop calls hooks: right after
                                                     optimizer.step() and zero_grad() of optimizer step `step`
                                                     (0-based), on every rank; metrics = {"loss", "grad_norm"}
                                                     of that step as device scalars. No host sync here.
    state_dict() / load_state_dict(state)            saved in every checkpoint (key "hooks"), restored on
                                                     resume; a fork starts its own hooks fresh
    final_metrics() -> {name: float}                 logged to MLflow once, at the end of the run

`HookSet` is what the job holds: the intervention's hooks, built with hydra.utils.instantiate.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence


class TrainHook:
    """Base class with the protocol's no-op defaults."""

    def check(self, model_cfg) -> None:
        pass

    def attach(self, model) -> None:
        pass

    def after_optimizer_step(self, step: int, model, metrics: Mapping[str, Any]) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def final_metrics(self) -> Dict[str, float]:
        return {}


def _target(spec) -> str:
    return str(spec.get("_target_", "")) if isinstance(spec, Mapping) else ""


def build(specs: Sequence[Any], key: str = "intervention.hooks") -> "HookSet":
    """Instantiate each `{_target_: ..., **kwargs}`; a bad spec raises ValueError naming `key[i]`."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    hooks, targets = [], []
    for i, spec in enumerate(specs):
        if OmegaConf.is_config(spec):
            spec = OmegaConf.to_container(spec, resolve=True)
        if not _target(spec):
            raise ValueError(f"{key}[{i}]={spec!r} is not allowed: expected a mapping with _target_ (a dotted "
                             f"class path) and its arguments")
        try:
            hook = instantiate(spec, _convert_="all")
        except Exception as e:  # Hydra's InstantiationException wraps the import / argument error
            cause = e.__cause__ or e
            raise ValueError(f"{key}[{i}]._target_={spec['_target_']!r} could not be built: {cause}") from None
        missing = [m for m in ("after_optimizer_step", "state_dict", "load_state_dict") if not hasattr(hook, m)]
        if missing:
            raise ValueError(f"{key}[{i}]._target_={spec['_target_']!r} is not allowed: expected a train hook "
                             f"(orchestrator/interventions/hooks.py), it lacks {', '.join(missing)}")
        hooks.append(hook)
        targets.append(spec["_target_"])
    return HookSet(hooks, targets)


class HookSet:
    """The job's hooks, called in file order."""

    def __init__(self, hooks: List[Any] = (), targets: List[str] = ()):
        self.hooks, self.targets = list(hooks), list(targets)

    def __len__(self) -> int:
        return len(self.hooks)

    def check(self, model_cfg, key: str = "intervention.hooks") -> None:
        for i, h in enumerate(self.hooks):
            if hasattr(h, "check"):
                try:
                    h.check(model_cfg)
                except ValueError as e:
                    raise ValueError(f"{key}[{i}] ({self.targets[i]}): {e}") from None

    def attach(self, model) -> None:
        for h in self.hooks:
            if hasattr(h, "attach"):
                h.attach(model)

    def after_optimizer_step(self, step: int, model, metrics: Mapping[str, Any]) -> None:
        for h in self.hooks:
            h.after_optimizer_step(step, model, metrics)

    def state_dict(self) -> List[Dict[str, Any]]:
        return [{"target": t, "state": h.state_dict()} for t, h in zip(self.targets, self.hooks)]

    def load_state_dict(self, states: List[Dict[str, Any]], key: str = "resume") -> None:
        """Restore what state_dict() saved; the checkpoint must hold the same hooks, in the same order."""
        states = list(states or [])
        saved = [s["target"] for s in states]
        if saved != self.targets:
            raise ValueError(f"{key}: the checkpoint holds train hooks {saved}, this run has {self.targets}; "
                             f"allowed: the same intervention hooks as the checkpointed run")
        for h, s in zip(self.hooks, states):
            h.load_state_dict(s["state"])

    def final_metrics(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for h in self.hooks:
            if hasattr(h, "final_metrics"):
                out.update(h.final_metrics())
        return out


__all__ = ["TrainHook", "HookSet", "build"]
