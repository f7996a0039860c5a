"""A drop-in for torch's scaled_dot_product_attention that computes with a precision recipe (the kernels' emulator).

`attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, recipe=...,
**knobs)` takes SDPA's arguments in SDPA's order (so positional calls keep their meaning) and SDPA's semantics:

- q (B, H, Tq, D), k and v (B, Hk, Tk, D); Tq != Tk as in a KV cache. 4-D only.
- attn_mask: bool (True = attend) or float (added to the scaled scores; -inf = masked), broadcastable to
  (B, H, Tq, Tk). A row with no key left returns 0 (as SDPA does) and passes no gradient.
- is_causal: torch's `ones(Tq, Tk).tril(diagonal=0)`, top-left aligned also when Tq != Tk.
- scale: None = 1/sqrt(D). enable_gqa: Hk divides H and key head j serves query heads j*H/Hk .. (j+1)*H/Hk - 1
  (repeat_interleave); without it Hk must equal H.
- The result has q's dtype, as SDPA's does (the recipe's own output dtype, BF16 for paper_bf16, cast exactly to
  FP32 for FP32 inputs; an fp32-recipe O on BF16 inputs is rounded to BF16 there, as SDPA would return it).
Refused, with the argument's name and what is allowed: dropout_p > 0 (the flash kernels have no dropout), is_causal
together with attn_mask, a mask that needs a gradient, and any knob the emulator does not compute (impl=standard or
sdpa, backend=triton: masks and Tq != Tk exist only in the emulator). On CUDA a plain causal call (is_causal=True,
no mask, Tq == Tk, the default scale) runs on the Triton kernels when they compute every knob (backend=auto, as
our GPT's layers route); everything else on the emulator.

Knobs are AttentionKnobs fields (kernels/knobs.py), validated there. `stats=` (an AttnStats of H heads) accumulates
the repeated-maxima counters and the max logit on the device. Each call is reported to flash_forensics.hooks.

`patch_sdpa(recipe=..., **knobs)`: a context manager that points torch.nn.functional.scaled_dot_product_attention at
this function (restored on exit, also on an exception or when nested blocks close out of order), so unchanged
nanoGPT-style code runs through the recipe.

torch.compile: a compiled emulator call computes the recipe bit for bit only when inductor rounds casts as eager
does (`torch._inductor.config.emulate_precision_casts`); patch_sdpa sets it inside its block, and everywhere else
(attention(), the transformers backend) a compiled emulator call is refused while dynamo traces it, naming the
setting; the emulator itself then runs eagerly inside the graph (a graph break per call). The Triton route is
opaque to inductor (torch.library operators) and needs neither.
Code that bound the function to another name before the patch (`from torch.nn.functional import
scaled_dot_product_attention`) keeps torch's.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch
import torch.nn.functional as F

import flash_forensics.kernels.knobs as knob_table
from flash_forensics import hooks
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import flash_attention
from flash_forensics.kernels.masking import Masking
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.models.attention import _triton_flash as triton_flash
from flash_forensics.models.attention import resolve_backend

_FIELDS = tuple(r.name for r in knob_table.KNOBS)


def shown(value) -> str:
    """A value in a refusal: a tensor by its shape and dtype only (never its values), anything else cut at 80."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_no_tensors(key: str, knobs) -> None:
    """Knob values are plain Python: a tensor is refused here, before a validator's message prints it in full."""
    for name, value in knobs.items():
        if isinstance(value, torch.Tensor):
            raise ValueError(f"{key}.{name}={shown(value)} is not allowed: expected a Python value (e.g. .item() "
                             "or .tolist() of it)")


def make_knobs(recipe: str = "paper_bf16", key: str = "flash_forensics", n_head: Optional[int] = None,
               **knobs) -> AttentionKnobs:
    """AttentionKnobs for the emulator from keyword knobs: unknown names, bad values and knobs the emulator does not
    compute are refused (ValueError naming the knob, the value and what is allowed)."""
    unknown = sorted(set(knobs) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{key}: unknown knob(s) {unknown}; allowed: {', '.join(_FIELDS)}")
    if "recipe" in knobs:
        raise ValueError(f"{key}: give the recipe as recipe=..., not among the knobs")
    check_no_tensors(key, {"recipe": recipe, **knobs})
    cfg = AttentionKnobs(recipe=recipe, **knobs).validate(n_head, key=key)
    return check_emulated(cfg, key)


def check_emulated(cfg: AttentionKnobs, key: str = "flash_forensics") -> AttentionKnobs:
    """cfg, if the emulator computes every knob it sets; else a ValueError naming the first knob it would drop."""
    if cfg.impl != "flash":
        raise ValueError(f"{key}.impl={cfg.impl!r} is not allowed: expected 'flash' (flash_forensics computes "
                         "attention with the kernels' emulator; impl=standard/sdpa exist only inside our GPT)")
    if cfg.backend == "triton":
        raise ValueError(f"{key}.backend='triton' is not allowed: expected auto or emulator (masks, Tq != Tk and "
                         "GQA are computed by the emulator only)")
    lacking = knob_table.unsupported(cfg, "emulator")
    if lacking:
        row = lacking[0]
        raise ValueError(f"{key}.{row.name}={getattr(cfg, row.name)!r} is not allowed here: the emulator does not "
                         f"compute it (computed by: {knob_table.computed_by_words(row, getattr(cfg, row.name))})")
    return cfg


def _inductor_rounds_as_eager() -> bool:
    """Run by dynamo while it traces a call (its result is baked into the graph), so the refusal is raised then.

    Inductor fuses a chain of ops and, by default, keeps their BF16 intermediates in FP32: the recipe's rounding
    points would silently vanish. Its emulate_precision_casts rounds them as eager does (orchestrator/job/train.py
    sets it for the project's own training)."""
    import torch._inductor.config as inductor  # lazy: only while compiling (inductor's config is not light)

    if not hasattr(inductor, "emulate_precision_casts"):
        raise ValueError(f"torch.compile with torch {torch.__version__} is not allowed here: its inductor has no "
                         "emulate_precision_casts, so a compiled emulator would keep BF16 intermediates in FP32; "
                         "expected eager mode (or a torch that has the setting)")
    if not inductor.emulate_precision_casts:
        raise ValueError("torch._inductor.config.emulate_precision_casts=False is not allowed while compiling "
                         "flash_forensics attention: expected True (inductor otherwise keeps the recipe's BF16 "
                         "intermediates in FP32, and the compiled model computes another recipe); set "
                         "torch._inductor.config.emulate_precision_casts = True before the first compiled call, "
                         "or compute inside flash_forensics.patch_sdpa(), which sets it in its scope")
    return True


# torch.compiler's decorators are applied where dynamo traces (below), not at import: they import dynamo, about a
# second at the start of every command (a refused config took 5.3-6.0 s with them, 4.0-4.3 s without; a job that
# trains imports dynamo anyway, through torch.optim).


def check_compiled() -> None:
    """Refuse, while dynamo traces an emulator call, an inductor that would not round as eager does."""
    if torch.compiler.is_compiling():
        torch.compiler.assume_constant_result(_inductor_rounds_as_eager)()


def _emulator_in_graph(*args):
    """Inside a compiled graph the emulator runs eagerly (a graph break per call, its autograd node eager too):
    inductor would otherwise generate its FP32 steps (exp, row sums, rescales) with its own reduction order and
    contractions, which the fp32 recipe shows in the last bits and paper_bf16's roundings hide only by chance."""
    return torch.compiler.disable(flash_attention)(*args)


def recomputing() -> bool:
    """True while autograd's engine runs this forward: activation checkpointing recomputing it for the backward
    (torch.utils.checkpoint reads the same task id). A recomputed call is not counted again."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _masks(attn_mask, B: int, H: int, Tq: int, Tk: int, device: torch.device):
    """(keep, bias) as kernels/masking.py takes them, and the rows with no key (B or 1, H or 1, Tq, 1) or None."""
    if attn_mask is None:
        return None, None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask={type(attn_mask).__name__} is not allowed: expected a bool or float tensor "
                         "or None")
    if attn_mask.device != device:  # named as the caller passed it (the kernels would name their masking.keep)
        raise ValueError(f"attn_mask.device={attn_mask.device} is not allowed: expected q's device {device}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask requires grad: not allowed (no gradient flows to the mask here)")
    m = attn_mask
    if m.dim() > 4:
        raise ValueError(f"attn_mask.shape={tuple(m.shape)} is not allowed: expected at most 4 dims, broadcastable "
                         f"to (B, H, Tq, Tk) = {(B, H, Tq, Tk)}")
    while m.dim() < 4:
        m = m.unsqueeze(0)
    for got, want in zip(m.shape, (B, H, Tq, Tk), strict=True):
        if got not in (1, want):
            raise ValueError(f"attn_mask.shape={tuple(attn_mask.shape)} is not allowed: expected a shape "
                             f"broadcastable to (B, H, Tq, Tk) = {(B, H, Tq, Tk)}")
    m = m.expand(m.shape[0], m.shape[1], Tq, Tk)  # batch and head stay 1 where they are: no copy per head
    if m.dtype == torch.bool:
        keep, bias = m, None
    elif m.dtype.is_floating_point:
        keep = m != float("-inf")
        bias = torch.where(keep, m, torch.zeros((), dtype=m.dtype, device=m.device))
    else:
        raise ValueError(f"attn_mask.dtype={m.dtype} is not allowed: expected torch.bool or a float dtype")
    return keep, bias, ~keep.any(dim=-1, keepdim=True)


def attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
              enable_gqa: bool = False, *, recipe: str = "paper_bf16", stats: Optional[AttnStats] = None,
              layer: Optional[int] = None, family: str = "sdpa", **knobs) -> torch.Tensor:
    """SDPA with a precision recipe (module docstring); `layer` and `family` only label the hooks' AttentionCall."""
    cfg = make_knobs(recipe, **knobs)
    return attend(q, k, v, cfg, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  enable_gqa=enable_gqa, stats=stats, layer=layer, family=family)


def attend(q, k, v, cfg: AttentionKnobs, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
           enable_gqa: bool = False, stats: Optional[AttnStats] = None, layer: Optional[int] = None,
           family: str = "sdpa", key_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`attention` with knobs already built (make_knobs): what the transformers backend calls per layer.
    key_keep (B or 1, T) bool, with is_causal and no attn_mask: keys masked on top of causality (transformers'
    padded batches, flash_forensics/fast_path.key_padding); the Triton kernels take it on CUDA."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={shown(dropout_p)} is not allowed: expected 0.0 (the flash kernels have no "
                         "attention dropout; pass dropout_p=0.0, e.g. the model's attention dropout set to 0)")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal={shown(is_causal)} is not allowed: expected true or false")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True with attn_mask is not allowed: expected one of them (put causality into "
                         "the mask, or pass attn_mask=None)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}.shape={shape} is not allowed: expected 4 dims (B, H, T, D)")
    B, H, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    if stats is not None and recomputing():
        stats = None  # counted once, in the forward (gradient checkpointing's second pass would double every count)
    if v.shape[1] != Hk or v.shape[2] != Tk:
        raise ValueError(f"v.shape={tuple(v.shape)} is not allowed: expected k's heads and length {(Hk, Tk)}")
    if v.shape[3] != D or k.shape[3] != D:
        raise ValueError(f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)} are not allowed: expected the head dim "
                         f"of q ({D}) for both")
    if Hk != H:
        if not enable_gqa:
            raise ValueError(f"k.shape[1]={Hk} is not allowed with enable_gqa=False: expected q's {H} heads "
                             "(or enable_gqa=True)")
        if H % Hk:
            raise ValueError(f"k.shape[1]={Hk} is not allowed: expected a divisor of q's {H} heads (GQA)")
        k, v = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
    if key_keep is not None:
        if not is_causal or attn_mask is not None or Tq != Tk or key_keep.shape[-1] != Tk:
            given = "given" if attn_mask is not None else None
            raise ValueError(f"key_keep with is_causal={is_causal}, attn_mask={given}, Tq={Tq}, Tk={Tk} is not "
                             f"allowed: expected a causal call with no attn_mask and key_keep (B, {Tk})")
    padded = key_keep is not None and scale is None and q.is_cuda and resolve_backend(
        cfg, q.device, q=q, key="flash_forensics.backend") == "triton"
    if key_keep is not None and not padded:  # the emulator computes the mask it stands for
        tri = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
        attn_mask, is_causal = (tri & key_keep.to(torch.bool)[:, None, :])[:, None], False
    keep, bias, dead = _masks(attn_mask, B, H, Tq, Tk, q.device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):  # named as the caller typed it
        raise ValueError(f"scale={shown(scale)} is not allowed: expected a finite number > 0 or None (1/sqrt(D))")
    plain = is_causal and Tq == Tk and scale is None and keep is None  # the emulator's own path, op for op
    masking = None if plain else Masking(causal=is_causal, keep=keep, bias=bias, scale=scale)
    # plain causal calls (and causal calls with key padding) on CUDA go to the Triton kernels when they compute
    # every knob (backend=auto; the same routing as our GPT's layers); other masks, Tq != Tk and other scales exist
    # only in the emulator
    # (a padded call on Triton: no mask is built, and its rows with no key are 0 from the kernels)
    route = "triton" if padded else resolve_backend(cfg, q.device, q=q, key="flash_forensics.backend") \
        if plain and q.is_cuda else "emulator"
    if route == "triton":
        o = triton_flash.flash_attention_triton(q, k, v, cfg, stats, key_keep=key_keep if padded else None)
    else:
        check_compiled()  # the Triton route is opaque to inductor (torch.library ops): faithful as it is
        o = (_emulator_in_graph if torch.compiler.is_compiling() else flash_attention)(q, k, v, cfg, stats, masking)
    if dead is not None:  # rows with no key: 0, as SDPA (the emulator averages V there; its gradient is 0 already)
        o = torch.where(dead, torch.zeros((), dtype=o.dtype, device=o.device), o)
    o = o.to(q.dtype)
    if hooks.active():
        # a mask that is exactly the causal triangle (what transformers materialises without padding) is a causal
        # call for whoever observes it; checked only here, when someone observes (it reads the mask back)
        causal = (is_causal and not padded) or (keep is not None and bias is None and Tq == Tk and bool(
            torch.equal(keep.expand(B, H, Tq, Tk), torch.ones(Tq, Tk, dtype=torch.bool, device=keep.device)
                        .tril().expand(B, H, Tq, Tk))))
        hooks.emit(hooks.AttentionCall(q=q, k=k, v=v, o=o, lse=None, recipe=cfg.recipe, knobs=cfg.knob_values(),
                                       layer=layer, family=family, is_causal=causal,
                                       scale=float(scale) if scale is not None else D ** -0.5,
                                       implementation=route))
    return o


# The open patch_sdpa blocks, in the order entered: [its function, the function it replaced]. Blocks may close out
# of order (ExitStack, a generator closed late): a block closed under another one hands that one what it replaced,
# so torch's function comes back when the last one closes, and no open block computes with torch's meanwhile.
_OPEN: List[list] = []
_CASTS: list = []  # inductor's emulate_precision_casts before the first open block (restored when the last closes)


@contextmanager
def patch_sdpa(recipe: str = "paper_bf16", stats: Optional[AttnStats] = None, **knobs) -> Iterator[AttentionKnobs]:
    """Route torch.nn.functional.scaled_dot_product_attention through `attention` inside the block; yields the knobs.

    Knobs are validated once, on entry. Restored on exit, also when the block raises; nested blocks may close in
    any order. Inside any open block inductor's emulate_precision_casts is on (code compiled there rounds as eager).
    """
    cfg = make_knobs(recipe, key="patch_sdpa", **knobs)

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return attend(query, key, value, cfg, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa, stats=stats)

    entry = [patched, F.scaled_dot_product_attention]
    if not _OPEN:
        _CASTS[:] = [_set_casts(True)]
    _OPEN.append(entry)
    F.scaled_dot_product_attention = patched
    try:
        yield cfg
    finally:
        i = next(j for j, e in enumerate(_OPEN) if e is entry)
        del _OPEN[i]
        if i < len(_OPEN):  # a block entered inside this one is still open: it restores what this one replaced
            _OPEN[i][1] = entry[1]
        else:
            F.scaled_dot_product_attention = entry[1]
        if not _OPEN:
            _set_casts(_CASTS.pop())


def _set_casts(value):
    """Set inductor's emulate_precision_casts (None: leave it); returns its value before (None on an older torch:
    a compiled call is refused there by check_compiled, naming why)."""
    import torch._inductor.config as inductor  # lazy: inductor's config is not light, and only patch_sdpa needs it

    if not hasattr(inductor, "emulate_precision_casts"):
        return None
    before = inductor.emulate_precision_casts
    if value is not None:
        inductor.emulate_precision_casts = value
    return before


__all__ = ["attention", "attend", "patch_sdpa", "make_knobs", "check_emulated", "check_no_tensors", "shown",
           "recomputing"]
