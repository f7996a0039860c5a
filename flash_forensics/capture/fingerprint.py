"""The kernel's fingerprint: which recipe and knob variant reproduces a captured O (and lse) bit for bit.

Candidates are built at run time from kernels.recipes.RECIPES (a recipe added there joins automatically) and the
knob table's variants the emulator computes: tile sizes (blocks 16/32/64/128, untiled), pv_fp32, the stabilized
softmaxes, and each forward rounding point lifted alone (keep_fp32) or rounded alone (round_bf16) where the recipe
allows it (kernels.recipes.points_problem), and the real-kernel rules at the capture's shape (kernels/real_kernels.py:
torch's FlashAttention-2, cuDNN, memory-efficient and the project's Triton kernels as knob settings). Candidates that
compute the same thing (same dtypes at every point, same tiles, same softmax and forms) are tried once. Each runs the
emulator's forward on the captured q, k, v; the integer count of O elements bit-identical to the captured O (NaN
equals NaN, -0.0 differs from +0.0) ranks them, then the count of identical lse, then the mean absolute difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import torch

import flash_forensics.kernels.recipes as recipes
from flash_forensics.capture.recorder import knobs_of
from flash_forensics.kernels import emulator, real_kernels
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.masking import Masking
from flash_forensics.kernels.recipes import for_knobs
from flash_forensics.models.attention import route_name

FWD_POINTS = ("scores", "shift", "stats", "pbar", "pv_out", "acc", "o_store")  # the points O depends on
REAL_FORMS = ("exp_form", "key_order", "normalize", "kv_split", "rowsum_order", "tensor_core")  # how, not what
BLOCKS = (64, 32, 128, 16)


@dataclass
class Candidate:
    label: str
    knobs: object  # flash_forensics.kernels.config.AttentionKnobs


def label(knobs) -> str:
    """The route name's recipe part, e.g. 'paper_bf16+blocks32x32' (models/attention.py route_name)."""
    return route_name(knobs, "emulator").split("/", 2)[-1]


def _key(knobs, T: int, dtype: torch.dtype):
    rc = for_knobs(knobs, dtype).describe()
    rc.pop("name")
    bq, bk = (min(knobs.block_q, T), min(knobs.block_k, T)) if knobs.tiling else (T, T)
    forms = tuple(getattr(knobs, f) for f in REAL_FORMS)
    return tuple(sorted(rc.items())), bq, bk, knobs.softmax, knobs.beta if knobs.softmax != "safe" else None, forms


def variants(rec: str, dtype: torch.dtype = torch.bfloat16) -> Iterable[dict]:
    """The knob variants tried on recipe `rec`: {} first, then one change each."""
    yield {}
    for b in BLOCKS[1:]:
        yield {"block_q": b, "block_k": b}
    yield {"tiling": False}
    yield {"pv_fp32": True}
    yield {"softmax": "stabilized"}
    yield {"softmax": "stabilized_guarded"}
    rc = recipes.resolve(rec, dtype)
    for pt in FWD_POINTS:
        if getattr(rc, pt) != recipes.BF16:
            yield {"round_bf16": [pt]}
        elif not (pt == "o_store" and rc.out == recipes.BF16):  # the returned O is rounded to BF16 anyway
            yield {"keep_fp32": [pt]}


def _merged(knobs, change: dict):
    """knobs with one more variant applied (point lists joined); None when it changes nothing."""
    from dataclasses import replace
    upd = {}
    for name, value in change.items():
        if name in ("keep_fp32", "round_bf16"):
            value = list(getattr(knobs, name)) + [pt for pt in value if pt not in getattr(knobs, name)]
        upd[name] = value
    new = replace(knobs, **upd)
    return None if new == knobs else new


def _distinct(pool, n_head: int, T: int, dtype, seen: set) -> List[Candidate]:
    out = []
    for item in pool:
        name, kn = item if isinstance(item, tuple) else (None, item)
        try:
            kn.validate(n_head=n_head)
            key = _key(kn, T, dtype)
        except (TypeError, ValueError):
            continue
        if key in seen:
            continue
        seen.add(key)
        out.append(Candidate(label(kn) if name is None else f"{name}: {label(kn)}", kn))
    return out


def rule_candidates(B: int, n_head: int, T: int, D: int) -> list:
    """(name, knobs) of each real-kernel rule (kernels/real_kernels.py) at this shape."""
    return [(name, AttentionKnobs(**real_kernels.rule_knobs(name, B, n_head, T, D))) for name in real_kernels.RULES]


def candidates(n_head: int, T: int, dtype: torch.dtype = torch.bfloat16, base=None,
               seen: Optional[set] = None, shape: Optional[tuple] = None) -> List[Candidate]:
    """Every distinct candidate for inputs of `dtype` and length T. `base` (AttentionKnobs, e.g. the file's own
    knobs) is tried first, so a capture of a known run is checked against what it says it ran. `shape` (B, H, T,
    D): the real-kernel rules at that shape join (labelled by the rule's name)."""
    pool = [base] if base is not None else []
    if shape is not None:
        pool += rule_candidates(shape[0], shape[1], shape[2], shape[3])
    for rec in recipes.RECIPES:  # read at run time: recipes added elsewhere join the fingerprint
        for v in variants(rec, dtype):
            try:
                pool.append(AttentionKnobs(recipe=rec, **v))
            except (TypeError, ValueError):
                continue
    return _distinct(pool, n_head, T, dtype, set() if seen is None else seen)


def refinements(best, n_head: int, T: int, dtype, seen: set) -> List[Candidate]:
    """The best candidate combined with each variant of its recipe (e.g. untiled + pv_fp32): a greedy step for a
    kernel that no single variant reproduces."""
    pool = [m for m in (_merged(best, v) for v in variants(best.recipe, dtype)) if m is not None]
    return _distinct(pool, n_head, T, dtype, seen)


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def identical_count(ref: torch.Tensor, got: torch.Tensor) -> tuple:
    """(elements of `got` bit-identical to `ref`, elements), integers. `got` is cast to ref's dtype first (exact for
    a BF16 value into FP32). Bits, not `==`: -0.0 differs from +0.0; every NaN equals every NaN (payloads vary)."""
    got = got.to(ref.dtype).contiguous()
    ref = ref.contiguous()
    as_int = _INT_OF[ref.element_size()]
    eq = (ref.view(as_int) == got.view(as_int)) | (torch.isnan(ref) & torch.isnan(got))
    return int(eq.sum()), eq.numel()


def identical_share(ref: torch.Tensor, got: torch.Tensor) -> float:
    """identical_count as a share (a Python float of two integers: a near miss of 2^25 elements stays < 1)."""
    n, total = identical_count(ref, got)
    return n / total if total else 1.0


def _score(q, k, v, o, lse, c: Candidate, base, default: dict, masking=None) -> dict:
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        oc, _, lc = emulator.forward(q, k, v, c.knobs, masking=masking)
    d = (oc.double() - o.double()).abs()
    d = torch.where(torch.isnan(d), torch.zeros_like(d), d)
    n_o, tot = identical_count(o, oc)
    n_l = identical_count(lse.float(), lc.squeeze(-1).float()) if lse is not None else None
    return {"label": c.label, "recipe": c.knobs.recipe, "knobs": c.knobs.knob_values(),
            "o_identical": n_o / tot, "o_differ": tot - n_o, "o_elements": tot,
            "lse_identical": None if n_l is None else n_l[0] / n_l[1],
            "lse_differ": None if n_l is None else n_l[1] - n_l[0],
            "o_mean_abs_diff": float(d.mean()), "o_max_abs_diff": float(d.max()),
            "is_base": base is not None and c.knobs is base,
            "changes": sum(1 for n, x in c.knobs.knob_values().items()
                           if n not in ("recipe", "counters", "backend") and x != default[n])}


def is_exact(row: dict) -> bool:
    """Whether a scored candidate reproduces every O (and lse, when captured) element bit for bit (integer counts)."""
    return row["o_differ"] == 0 and row.get("lse_differ") in (None, 0)


def backward_shares(q, k, v, o, do, grads: dict, knobs, causal: bool = True) -> dict:
    """{dq, dk, dv: share of the kernel's own gradient (grads) bit-identical to the emulator's backward under
    `knobs`}, from the captured O (what a kernel's backward reads) and the candidate's lse."""
    masking = None if causal else Masking(causal=False)
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        _, o_saved, lse = emulator.forward(q, k, v, knobs, masking=masking)
        mine = emulator.backward(q, k, v, o.to(o_saved.dtype), lse, do, knobs, masking=masking)
    return {n: identical_share(grads[n], g) for n, g in zip(("dq", "dk", "dv"), mine, strict=True) if n in grads}


def _rank(rows: List[dict]) -> List[dict]:
    # integer counts of differing elements; equal: the file's own knobs first, then the plainest variant
    return sorted(rows, key=lambda r: (r["o_differ"], r["lse_differ"] or 0, r["o_mean_abs_diff"],
                                       not r["is_base"], r["changes"]))


def run(q, k, v, o, lse=None, base=None, progress: Optional[Callable] = None, refine_rounds: int = 2,
        causal: bool = True, rules: bool = True) -> List[dict]:
    """The ranked fingerprint (best first): one dict per candidate with label, knobs, o_identical, o_differ and
    o_elements (integers), lse_identical (None without a captured lse), o_mean_abs_diff, o_max_abs_diff. When no
    candidate reproduces O bit for bit, up to `refine_rounds` greedy rounds combine the best one with each variant
    of its recipe (`refined`: True). causal False: the call attended to every key. rules: the real-kernel rules
    join the candidates."""
    default = AttentionKnobs().knob_values()
    masking = None if causal else Masking(causal=False)
    seen: set = set()
    rows = []
    for c in candidates(q.shape[1], q.shape[2], q.dtype, base, seen, tuple(q.shape) if rules else None):
        rows.append(_score(q, k, v, o, lse, c, base, default, masking))
        if progress is not None:
            progress(1)
    rows = _rank(rows)
    for _ in range(refine_rounds):
        best = rows[0]
        if is_exact(best):
            break
        more = [dict(_score(q, k, v, o, lse, c, base, default, masking), refined=True)
                for c in refinements(knobs_of(best["knobs"]), q.shape[1], q.shape[2], q.dtype, seen)]
        rows = _rank(rows + more)
        if rows[0] is best:
            break
    return rows


__all__ = ["Candidate", "candidates", "refinements", "variants", "run", "identical_share", "identical_count",
           "is_exact", "label", "rule_candidates", "backward_shares", "FWD_POINTS", "REAL_FORMS",
           "BLOCKS"]
