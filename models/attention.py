"""Per-layer attention routing: which implementation computes a layer, at which precision, and its counters.

`attend(q, k, v, knobs, stats, probe)` is what a GPT layer calls with that layer's knobs
(`AttentionConfig.for_layer(i)`). Three implementations:

- `flash`: the tiled kernels (`flash_forensics.kernels.emulator.flash_attention`, the plain-PyTorch emulator; or
  `flash_forensics.kernels.triton_flash` on CUDA), chosen by `backend`.
- `standard`: materialised softmax attention, the paper's "standard attention" (nanoGPT's manual path under CUDA
  autocast, with every dtype written out so the CPU computes the same thing). The softmax is normalised in FP32 and
  its backward is autograd's, i.e. delta = rowsum(dP * P); o_fp32 / o_fp32_heads put the PV product in FP32.
- `sdpa`: torch's scaled_dot_product_attention (what nanoGPT trains with). No counters (stats stay zero); max_logit only
  on probe steps, from an extra QK^T pass without grad.

Which of them computes which knob is said once, by the knob table (`computed_by` in kernels/knobs.py): read here for
the backend and the route names, and by orchestrator/config/validate.py to refuse a knob where it would not be computed.

Every implementation runs with autocast disabled and casts q, k, v itself: CUDA autocast would run the softmax in
FP32 and CPU autocast in BF16, so relying on it would make the numerics depend on the device.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from flash_forensics import hooks
from flash_forensics.kernels import knobs as knob_table
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.stats import AttnStats

BF16 = torch.bfloat16
FP32 = torch.float32


# --------------------------------------------------------------------------------------------------- kernels access
# Imported once at module load, not per call: torch.compile (dynamo) refuses importlib.import_module (a graph break
# per layer). Attributes are still looked up at call time, so tests can monkeypatch `emulator.flash_attention`.
from flash_forensics.kernels import emulator as _emulator  # noqa: E402

try:
    import flash_forensics.kernels.triton_flash as _triton_flash  # noqa: E402
except ImportError:  # pragma: no cover - the module is part of kernels/; kept optional like triton itself
    _triton_flash = None


def _kernels():
    """The emulator module (read at call time so tests can monkeypatch `emulator.flash_attention`)."""
    return _emulator


def _triton_module():
    """flash_forensics.kernels.triton_flash when it exists and exposes the fast-path API, else None."""
    mod = _triton_flash
    if mod is not None and hasattr(mod, "supports") and hasattr(mod, "flash_attention_triton"):
        return mod
    return None


def new_stats(n_head: int, device) -> AttnStats:
    """An AttnStats for one layer: repeated_max_rows / rows_seen (H,) int64, max_logit () float32, on `device`.
    On CUDA each counter is marked a static address (torch._dynamo.mark_static_address): a compiled step under CUDA
    graphs then adds into the counters themselves, where it would otherwise skip graphs for mutating an input."""
    stats = AttnStats(n_head, device)
    if stats.device.type == "cuda":
        for t in stats.tensors():
            torch._dynamo.mark_static_address(t)
    return stats


def prepare_device(knobs: AttentionKnobs, n_head: int, device) -> None:
    """What a flash layer's Triton launches keep per device (dummy pointers, FP32-O head flags), made now: a model
    moved to CUDA calls it, so that they are made outside any CUDA graph. Nothing on other devices or routes."""
    device = torch.device(device)
    mod = _triton_module()
    if device.type == "cuda" and knobs.impl == "flash" and mod is not None:
        mod.prepare_device(knobs, n_head, device)


def compute_dtype(knobs: AttentionKnobs) -> torch.dtype:
    """The dtype q, k, v are cast to: FP32 for the fp32 recipe, BF16 otherwise."""
    return FP32 if knobs.recipe == "fp32" else BF16


def _example_q(knobs: AttentionKnobs, device, n_head: int, seq_len: int, head_dim: int) -> torch.Tensor:
    return torch.empty((1, n_head, seq_len, head_dim), device=torch.device(device), dtype=compute_dtype(knobs))


# ----------------------------------------------------------------------------------------------------- routing
def resolve_backend(knobs: AttentionKnobs, device, *, q: Optional[torch.Tensor] = None, n_head: int = 1,
                    seq_len: int = 64, head_dim: int = 64, key: str = "attention.backend") -> str:
    """Which code computes a `flash` layer on `device`: 'emulator' or 'triton'.

    auto: triton when on CUDA, Triton computes every set knob (the knob table) and kernels/triton_flash.py supports this
    input shape, else the emulator. triton: a ValueError (naming key, value, why) when it cannot, so the orchestrator
    can refuse before training. Non-flash impls return their own name. `q` (or n_head/seq_len/head_dim) is the input
    the decision is made for.
    """
    if knobs.impl != "flash":
        return knobs.impl
    if knobs.backend == "emulator":
        return "emulator"
    dev = torch.device(device if q is None else q.device)
    lacks = [r.name for r in knob_table.unsupported(knobs, "triton")]
    mod = None if lacks else _triton_module()
    ok = False
    if mod is not None and (dev.type == "cuda" or knobs.backend == "triton"):  # explicit triton: ask it (interpreter)
        ok = bool(mod.supports(knobs, q if q is not None else _example_q(knobs, dev, n_head, seq_len, head_dim)))
    if ok:
        return "triton"
    if knobs.backend == "triton":
        why = (f"Triton does not compute {', '.join(lacks)} (kernels/knobs.py)" if lacks else
               "needs a CUDA device" if dev.type != "cuda" else
               "flash_forensics.kernels.triton_flash is not importable" if mod is None else
               "flash_forensics.kernels.triton_flash does not support these knobs for this input")
        raise ValueError(f"{key}='triton' is not allowed here: {why} (device {dev}, recipe {knobs.recipe!r}, "
                         f"head_dim {head_dim if q is None else q.shape[-1]}); use backend=auto or emulator")
    return "emulator"


def route_name(knobs: AttentionKnobs, backend: str) -> str:
    """A short, parameter-friendly description of what computes a layer, e.g. 'flash/emulator/paper_bf16+sfa(2)'.

    `backend` is resolve_backend's answer. Each knob the implementation computes adds its label from the knob table
    (kernels/knobs.py); a knob it does not compute reads as off (sdpa: no-counters). A flash layer that backend=auto
    keeps on the emulator because Triton lacks some of its knobs says so, e.g. 'flash/emulator (triton lacks:
    exp_form)/paper_bf16+exp2_folded': it runs there on any device.
    """
    impl = knob_table.implementation(knobs, backend)
    if knobs.impl == "flash":
        lacks = [r.name for r in knob_table.unsupported(knobs, "triton")] if knobs.backend == "auto" else []
        fold = getattr(_triton_module(), "fold_supported", None)
        if knobs.backend == "auto" and knobs.exp_form == "exp2_folded" and fold is not None and not fold(knobs):
            lacks.append("exp_form")  # Triton folds it only on FP32 scores and statistics, with tiling
        base = f"flash/{backend}" + (f" (triton lacks: {', '.join(lacks)})" if lacks else "") + f"/{knobs.recipe}"
    elif knobs.impl == "standard":
        base = f"standard/{knobs.recipe}"
    else:
        base = f"sdpa/{'fp32' if knobs.recipe == 'fp32' else 'bf16'}"
    return ("/" if knobs.impl == "sdpa" else "+").join([base] + knob_table.route_labels(knobs, impl))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, knobs: AttentionKnobs, stats=None,
           probe: bool = False, layer: Optional[int] = None) -> torch.Tensor:
    """Causal attention for q, k, v of shape (B, H, T, D) as `knobs` says; returns O (B, H, T, D).

    When someone observes attention calls (flash_forensics.hooks, e.g. a capture), the call is reported there with
    q, k, v as the implementation saw them; otherwise that costs one list check."""
    o = _attend(q, k, v, knobs, stats, probe)
    if hooks.active():
        _report(q, k, v, o, knobs, layer)
    return o


def _report(q, k, v, o, knobs: AttentionKnobs, layer: Optional[int]) -> None:
    if knobs.impl == "flash":
        dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        backend = resolve_backend(knobs, q.device, q=q)
    else:
        dt, backend = compute_dtype(knobs), knobs.impl
    hooks.emit(hooks.AttentionCall(q.to(dt), k.to(dt), v.to(dt), o, None, recipe=knobs.recipe,
                                   knobs=knobs.knob_values(), layer=layer, family="gpt", is_causal=True,
                                   scale=None, implementation=route_name(knobs, backend)))


def _attend(q, k, v, knobs: AttentionKnobs, stats, probe: bool) -> torch.Tensor:
    with torch.autocast(device_type=q.device.type, enabled=False):
        if knobs.impl == "flash":
            if not q.dtype == k.dtype == v.dtype:  # e.g. FP32 q, k from QK-norm beside a BF16 v: promote (exact)
                dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
            backend = resolve_backend(knobs, q.device, q=q)
            if backend == "triton":
                return _triton_module().flash_attention_triton(q, k, v, knobs, stats)
            return _kernels().flash_attention(q, k, v, knobs, stats)
        if knobs.impl == "standard":
            return standard_attention(q, k, v, knobs, stats)
        if knobs.impl == "sdpa":
            return sdpa_attention(q, k, v, knobs, stats, probe)
    raise ValueError(f"attention.impl={knobs.impl!r} is not allowed: expected one of {', '.join(knob_table.IMPLS)}")


# ---------------------------------------------------------------------------------------------- implementations
def _causal_mask(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


@torch.no_grad()
def _update_stats(s: torch.Tensor, valid: torch.Tensor, knobs: AttentionKnobs, stats: AttnStats, count: bool) -> None:
    """Fold one call into the layer's stats: max_logit, and (if `count`) rows whose max is attained more than once
    within eps, per head, over the full row (the kernels count per key tile; untiled they agree).

    s: scaled scores (B, H, T, T), masked entries at -inf (never within eps). On the device: no .item(), no sync.
    """
    dt, s = s.dtype, s.detach().float()
    if count:
        rm = s.amax(dim=-1, keepdim=True)
        thr = (rm - knobs.eps).to(dt).float()  # threshold rounded to the scores' dtype, as in kernels/recipes.py
        ties = ((s >= thr) & valid).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        stats.update(ties > 1, rm)
    else:
        torch.maximum(stats.max_logit, s.amax(), out=stats.max_logit)


def standard_attention(q, k, v, knobs: AttentionKnobs, stats=None) -> torch.Tensor:
    """Materialised softmax attention with explicit dtypes.

    fp32 recipe: everything FP32. Otherwise (paper_bf16, fa2 alike): S = QK^T in BF16, scaled in BF16, masked, softmax
    in FP32 (CUDA autocast's choice, written out), P cast to BF16, PV in BF16 (FP32 accumulation inside the GEMM).
    pv_fp32 / o_fp32 / o_fp32_heads: P and V stay FP32 for the PV product of those heads (O returned in FP32 then).
    """
    dt = compute_dtype(knobs)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    B, H, T, D = q.shape
    scale = 1.0 / math.sqrt(D)
    s = (q @ k.transpose(-2, -1)) * scale  # BF16 (or FP32) GEMM output, scaled in the same dtype
    valid = _causal_mask(T, q.device)
    s = s.masked_fill(~valid, float("-inf"))
    if stats is not None:
        _update_stats(s, valid, knobs, stats, knobs.counters)
    p = torch.softmax(s.float(), dim=-1)  # FP32 softmax
    fp32_heads = list(range(H)) if knobs.pv_fp32 else knobs.fp32_o_heads(H)
    if dt == FP32 or not fp32_heads:
        return p.to(dt) @ v
    if len(fp32_heads) == H:
        return p @ v.float()
    # Mixed: the named heads' PV in FP32, the others in BF16; O is FP32 (BF16-rounded values for the other heads).
    head = torch.arange(H, device=q.device)
    hp = torch.stack([head == h for h in fp32_heads]).any(dim=0)  # built on the device: no host-to-device copy
    o_lp = (p.to(BF16) @ v).float()
    o_hp = p @ v.float()
    return torch.where(hp.view(1, H, 1, 1), o_hp, o_lp)


def sdpa_attention(q, k, v, knobs: AttentionKnobs, stats=None, probe: bool = False) -> torch.Tensor:
    """torch SDPA (causal) in BF16, or FP32 for the fp32 recipe. Counters unavailable; max_logit on probe steps."""
    dt = compute_dtype(knobs)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if probe and stats is not None:
        with torch.no_grad():  # extra QK^T pass, only on the steps that ask for it
            T = q.shape[-2]
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            valid = _causal_mask(T, q.device)
            _update_stats(s.masked_fill(~valid, float("-inf")), valid, knobs, stats, count=False)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


__all__ = ["attend", "resolve_backend", "route_name", "standard_attention", "sdpa_attention", "compute_dtype",
           "new_stats", "prepare_device"]
