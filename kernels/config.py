"""Attention knobs: the one typed description of how an attention layer computes.

The same dataclasses serve as Hydra structured configs (conf/attention, registered by the orchestrator) and as the
`cfg` the kernels take, so a knob has one name from the YAML file down to the tile loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import List, Optional

IMPLS = ("flash", "standard", "sdpa")  # flash: tiled kernels below; standard: materialised softmax; sdpa: torch
BACKENDS = ("auto", "emulator", "triton")  # auto: triton on CUDA when it supports the knobs, else the emulator
RECIPES = ("paper_bf16", "fa2", "fp32")
SOFTMAXES = ("safe", "stabilized", "stabilized_guarded")  # kernels/emulator.py: the two stabilized variants
DELTAS = ("dO_O", "dP_P", "recompute_fp32")


def _bad(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"{key}={value!r} is not allowed: expected {allowed}")


@dataclass
class AttentionKnobs:
    """How one attention layer computes. Field names follow the paper (Algorithms 1-3)."""

    impl: str = "flash"
    backend: str = "auto"
    recipe: str = "paper_bf16"
    tiling: bool = True  # False: one block spans the whole sequence (block size = T)
    block_q: int = 64
    block_k: int = 64
    softmax: str = "safe"  # stabilized = Algorithm 3 (beta, eps); stabilized_guarded = its bounded shift (emulator)
    beta: float = 2.0
    eps: float = 1e-3  # also the tolerance of the repeated-maxima counters
    delta: str = "dO_O"  # delta = rowsum(dO*O) | rowsum(dP*P) | rowsum(dO*O) with O recomputed as PV in FP32
    pv_fp32: bool = False  # P̄V product (and the O accumulator it feeds) in FP32
    o_fp32: bool = False  # O in FP32 in the forward for every head
    o_fp32_heads: List[int] = field(default_factory=list)  # ... or only for these heads (0-based)
    counters: bool = True  # count repeated-maxima rows per head on the device

    def validate(self, n_head: Optional[int] = None, key: str = "attention") -> "AttentionKnobs":
        """Raise ValueError naming key, value and what is allowed; return self."""
        for name, allowed in (("impl", IMPLS), ("backend", BACKENDS), ("recipe", RECIPES),
                              ("softmax", SOFTMAXES), ("delta", DELTAS)):
            value = getattr(self, name)
            if value not in allowed:
                raise _bad(f"{key}.{name}", value, "one of " + ", ".join(allowed))
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _bad(f"{key}.{name}", value, "an integer > 0")
        if not self.beta > 1:
            raise _bad(f"{key}.beta", self.beta, "a number > 1 (beta = 1 is the safe softmax)")
        if not self.eps > 0:
            raise _bad(f"{key}.eps", self.eps, "a number > 0")
        for h in self.o_fp32_heads:
            if isinstance(h, bool) or not isinstance(h, int) or h < 0 or (n_head is not None and h >= n_head):
                top = f"0..{n_head - 1}" if n_head is not None else ">= 0"
                raise _bad(f"{key}.o_fp32_heads", list(self.o_fp32_heads), f"head indices in {top}")
        return self

    def fp32_o_heads(self, n_head: int) -> List[int]:
        """Heads whose forward O is FP32 (o_fp32 means all of them)."""
        return list(range(n_head)) if self.o_fp32 else sorted(set(self.o_fp32_heads))


_KNOB_NAMES = tuple(f.name for f in fields(AttentionKnobs))


@dataclass
class KnobPatch:
    """A partial set of knobs: None leaves the value it is applied to alone."""

    impl: Optional[str] = None
    backend: Optional[str] = None
    recipe: Optional[str] = None
    tiling: Optional[bool] = None
    block_q: Optional[int] = None
    block_k: Optional[int] = None
    softmax: Optional[str] = None
    beta: Optional[float] = None
    eps: Optional[float] = None
    delta: Optional[str] = None
    pv_fp32: Optional[bool] = None
    o_fp32: Optional[bool] = None
    o_fp32_heads: Optional[List[int]] = None
    counters: Optional[bool] = None

    def set_knobs(self) -> dict:
        return {n: getattr(self, n) for n in _KNOB_NAMES if getattr(self, n) is not None}


@dataclass
class LayerOverride(KnobPatch):
    """Knobs for some layers only; None inherits the run's value. E.g. flash only in layer 2."""

    layers: List[int] = field(default_factory=list)


@dataclass
class AttentionConfig(AttentionKnobs):
    """The run's knobs plus per-layer overrides (applied in order; later ones win)."""

    overrides: List[LayerOverride] = field(default_factory=list)

    def for_layer(self, layer: int) -> AttentionKnobs:
        base = {n: getattr(self, n) for n in _KNOB_NAMES}
        for ov in self.overrides:
            if layer in ov.layers:
                base.update(ov.set_knobs())
        base["o_fp32_heads"] = list(base["o_fp32_heads"])
        return AttentionKnobs(**base)

    def validate(self, n_head: Optional[int] = None, key: str = "attention",
                 n_layer: Optional[int] = None) -> "AttentionConfig":
        AttentionKnobs.validate(self, n_head, key)
        for i, ov in enumerate(self.overrides):
            for layer in ov.layers:
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or (
                        n_layer is not None and layer >= n_layer):
                    top = f"0..{n_layer - 1}" if n_layer is not None else ">= 0"
                    raise _bad(f"{key}.overrides[{i}].layers", list(ov.layers), f"layer indices in {top}")
            merged = AttentionKnobs(**{**{n: getattr(self, n) for n in _KNOB_NAMES}, **ov.set_knobs()})
            merged.validate(n_head, f"{key}.overrides[{i}]")
        return self

    @classmethod
    def from_any(cls, cfg) -> "AttentionConfig":
        """Build from a dataclass, a dict or an OmegaConf node (keys outside the schema are an error)."""
        if isinstance(cfg, AttentionConfig):
            return cfg
        if isinstance(cfg, AttentionKnobs):
            return cls(**{n: getattr(cfg, n) for n in _KNOB_NAMES})
        try:  # OmegaConf nodes become plain containers; kept optional so kernels/ runs without omegaconf
            from omegaconf import OmegaConf
            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:
            pass
        data = dict(cfg)
        unknown = set(data) - set(_KNOB_NAMES) - {"overrides"}
        if unknown:
            raise ValueError(f"attention: unknown keys {sorted(unknown)}; allowed: {sorted(_KNOB_NAMES + ('overrides',))}")
        overrides = [o if isinstance(o, LayerOverride) else LayerOverride(**dict(o)) for o in data.pop("overrides", [])]
        return cls(**data, overrides=overrides)


__all__ = ["AttentionKnobs", "AttentionConfig", "KnobPatch", "LayerOverride", "IMPLS", "BACKENDS", "RECIPES", "SOFTMAXES",
           "DELTAS", "replace"]
