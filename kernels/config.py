"""Attention knobs as typed configs, built from the one knob table (kernels/knobs.py).

The same dataclasses serve as Hydra structured configs (conf/attention, registered by the orchestrator) and as the
`cfg` the kernels take, so a knob has one name from the YAML file down to the tile loop. They are generated from the
table (dataclasses.make_dataclass): real dataclasses with annotations, so OmegaConf types and checks them.

- `AttentionKnobs`: how one attention layer computes (one field per row).
- `KnobPatch`: the same fields, Optional, None = leave alone (interventions, per-layer overrides).
- `LayerOverride(KnobPatch)`: knobs for some `layers` only.
- `AttentionConfig(AttentionKnobs)`: the run's knobs plus `overrides`; `for_layer(i)` gives layer i's knobs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field, make_dataclass, replace
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch

from flash_forensics.kernels.checks import bad, is_int
from flash_forensics.kernels.knobs import BACKENDS, DELTAS, IMPLS, KNOBS, RECIPES, SOFTMAXES, Knob
from flash_forensics.kernels.recipes import FP8_POINTS, for_knobs, formats_problem, points_problem

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _shown(value):
    """A value as an error message shows it (lists from OmegaConf or tuples as lists)."""
    if isinstance(value, Mapping):
        return dict(value)
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


class _Knobs:
    """Methods of AttentionKnobs (its fields come from the table)."""

    KNOB_ROWS: Tuple[Knob, ...] = ()

    def validate(self, n_head: Optional[int] = None, key: str = "attention"):
        """Raise ValueError naming key, value and what is allowed; return self."""
        for row in self.KNOB_ROWS:
            value = getattr(self, row.name)
            why = row.problem(value, n_head)
            if why:
                raise bad(f"{key}.{row.name}", _shown(value), why)
        names = {r.name for r in self.KNOB_ROWS}
        if {"keep_fp32", "round_bf16"} <= names:  # the rounding points must fit the recipe (kernels/recipes.py)
            problem = points_problem(self.recipe, self.keep_fp32, self.round_bf16, bool(self.pv_fp32))
            if problem:
                knob, value, why = problem
                raise bad(f"{key}.{knob}", value, why)
        if "formats" in names:
            problem = formats_problem(self.recipe, self.formats, self.keep_fp32, self.round_bf16, bool(self.pv_fp32))
            if problem:
                knob, value, why = problem
                raise bad(f"{key}.{knob}", _shown(value), why)
            self._check_scales(key)
        if {"exp_form", "kv_split"} <= names:
            self._check_real_kernel_forms(key)
        return self

    def _check_real_kernel_forms(self, key: str) -> None:
        """exp_form / kv_split model the safe softmax of real kernels: Algorithm 3's shift and the clamp read the
        scaled scores and one running state, so they do not combine with them."""
        for name, off in (("exp_form", "exp"), ("kv_split", 0)):
            value = getattr(self, name)
            if value == off:
                continue
            if self.softmax != "safe":
                raise bad(f"{key}.softmax", self.softmax, f"safe ({name}={value!r} models the safe softmax of real "
                          "kernels)")
            if self.pbar_clamp:
                raise bad(f"{key}.pbar_clamp", True, f"false ({name}={value!r} models kernels without the clamp)")
            if name == "kv_split" and self.stochastic_round:
                raise bad(f"{key}.stochastic_round", True, "false (kv_split has no per-tile stream ids across parts)")

    def _check_scales(self, key: str) -> None:
        """The FP8 scale knobs must have an FP8 store to scale (else they would change nothing, silently)."""
        if self.input_scaling == "recipe" and self.pbar_scale == "recipe":
            return
        rc = for_knobs(self)
        fp8_in = [f for f in ("inputs", "bwd_inputs", "do_in") if rc.operand(f) in (E4M3, E5M2)]
        if self.input_scaling != "recipe" and not fp8_in:
            raise bad(f"{key}.input_scaling", self.input_scaling, f"recipe (recipe {self.recipe} has no FP8 input "
                      "to scale: input_scaling is for fp8_fa3 / fp8_te)")
        fp8_p = [pt for pt in ("pbar", "bwd_gemm_in") if getattr(rc, pt) in (E4M3, E5M2)]
        if self.pbar_scale != "recipe" and not fp8_p:
            raise bad(f"{key}.pbar_scale", self.pbar_scale, f"recipe (P̄ is not FP8 in recipe {self.recipe}; FP8 "
                      f"points: {', '.join(FP8_POINTS)})")

    def fp32_o_heads(self, n_head: int) -> List[int]:
        """Heads whose forward O is FP32 (o_fp32 means all of them)."""
        return list(range(n_head)) if self.o_fp32 else sorted(set(self.o_fp32_heads))

    def knob_values(self) -> Dict[str, object]:
        """{knob: value} in table order (lists copied)."""
        return {r.name: _shown(getattr(self, r.name)) for r in self.KNOB_ROWS}


class _Patch:
    """Methods of KnobPatch."""

    KNOB_ROWS: Tuple[Knob, ...] = ()

    def set_knobs(self) -> dict:
        """{knob: value} of the knobs this patch sets (not None)."""
        return {r.name: getattr(self, r.name) for r in self.KNOB_ROWS if getattr(self, r.name) is not None}


class _Config:
    """Methods of AttentionConfig: the run's knobs plus per-layer overrides (applied in order; later ones win)."""

    KNOBS_CLASS: type = object
    OVERRIDE_CLASS: type = object

    def for_layer(self, layer: int):
        base = self.knob_values()
        for ov in self.overrides:
            if layer in ov.layers:
                base.update({k: _shown(v) for k, v in ov.set_knobs().items()})
        return self.KNOBS_CLASS(**base)

    def where_set(self, layer: int, key: str = "attention") -> Dict[str, str]:
        """{knob: the key that decides it in `layer`}: `key`, or `key.overrides[i]` for the last override setting it."""
        src = {r.name: key for r in self.KNOB_ROWS}
        for i, ov in enumerate(self.overrides):
            if layer in ov.layers:
                src.update({k: f"{key}.overrides[{i}]" for k in ov.set_knobs()})
        return src

    def validate(self, n_head: Optional[int] = None, key: str = "attention", n_layer: Optional[int] = None):
        _Knobs.validate(self, n_head, key)
        top = None if n_layer is None else n_layer - 1
        for i, ov in enumerate(self.overrides):
            if not all(is_int(layer, 0, top) for layer in ov.layers):
                raise bad(f"{key}.overrides[{i}].layers", list(ov.layers),
                          f"layer indices in {'>= 0' if top is None else f'0..{top}'}")
            merged = self.KNOBS_CLASS(**{**self.knob_values(), **ov.set_knobs()})
            merged.validate(n_head, f"{key}.overrides[{i}]")
        return self

    @classmethod
    def from_any(cls, cfg):
        """Build from a dataclass, a dict or an OmegaConf node (keys outside the schema are an error)."""
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, cls.KNOBS_CLASS):
            return cls(**cfg.knob_values())
        try:  # OmegaConf nodes become plain containers; kept optional so kernels/ runs without omegaconf
            from omegaconf import OmegaConf
            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:
            pass
        data = dict(cfg)
        names = tuple(r.name for r in cls.KNOB_ROWS)
        unknown = set(data) - set(names) - {"overrides"}
        if unknown:
            raise ValueError(f"attention: unknown keys {sorted(unknown)}; allowed: {sorted(names + ('overrides',))}")
        overrides = [o if isinstance(o, cls.OVERRIDE_CLASS) else cls.OVERRIDE_CLASS(**dict(o))
                     for o in data.pop("overrides", [])]
        return cls(**data, overrides=overrides)


def _field(row: Knob, patch: bool):
    if patch:
        return row.name, Optional[row.type], field(default=None, metadata={"knob": row})
    if isinstance(row.default, (list, dict)):  # a mutable default: one fresh copy per instance
        return row.name, row.type, field(default_factory=partial(type(row.default), row.default),
                                         metadata={"knob": row})
    return row.name, row.type, field(default=row.default, metadata={"knob": row})


def _make(name: str, spec, bases, doc: str, **attrs):
    # __module__ / __qualname__ make the classes importable by name (pickle, OmegaConf's messages)
    return make_dataclass(name, spec, bases=bases,
                          namespace={"__module__": __name__, "__qualname__": name, "__doc__": doc, **attrs})


def build(rows: Tuple[Knob, ...]):
    """(AttentionKnobs, KnobPatch, LayerOverride, AttentionConfig) for a table; the module's own are built from
    flash_forensics.kernels.knobs.KNOBS (tests build others, e.g. with a knob Triton lacks)."""
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"knob table: a name appears twice in {names}")
    knobs = _make("AttentionKnobs", [_field(r, False) for r in rows], (_Knobs,),
                  "How one attention layer computes; one field per row of kernels/knobs.py.", KNOB_ROWS=rows)
    patch = _make("KnobPatch", [_field(r, True) for r in rows], (_Patch,),
                  "A partial set of knobs: None leaves the value it is applied to alone.", KNOB_ROWS=rows)
    override = _make("LayerOverride", [("layers", List[int], field(default_factory=list))], (patch,),
                     "Knobs for some layers only; None inherits the run's value. E.g. flash only in layer 2.")
    config = _make("AttentionConfig", [("overrides", List[override], field(default_factory=list))], (_Config, knobs),
                   "The run's knobs plus per-layer overrides (applied in order; later ones win).",
                   KNOBS_CLASS=knobs, OVERRIDE_CLASS=override)
    return knobs, patch, override, config


AttentionKnobs, KnobPatch, LayerOverride, AttentionConfig = build(KNOBS)

__all__ = ["AttentionKnobs", "AttentionConfig", "KnobPatch", "LayerOverride", "IMPLS", "BACKENDS", "RECIPES",
           "SOFTMAXES", "DELTAS", "replace", "build"]
