"""Mechanism probes, the pure math (the paper, Sec. 3.3: Fig. 5a's delta error, the W_Q gradient error keeping one
direction; App. D): functions of one layer's own BF16 Q, K, V, returned O, upstream gradient dO and the run's dQ.
Scheduling and logging live in orchestrator/monitor/probes/.

All shapes are (B, H, T, D) for q, k, v, o, do, dq, (B, T, C) for the layer input x. The high-precision reference is
FP64 causal softmax(QK^T / sqrt(D)) V of the *same* BF16 values (no rounding anywhere), so every difference is the
recipe's rounding. Nothing reads a value back to the host: results are device tensors.

- delta error e = delta_recipe - delta_FP64 per row (B, H, T): delta_recipe through kernels/emulator.py `row_delta`
  (dO_O from the O the kernel returned; dP_P and recompute_fp32 as the emulator's backward computes them).
- ties: a row whose max repeats within a key tile of the recipe's block_k, in the recipe's `scores` dtype (the test
  the kernels' counters and Algorithm 3 use: S >= r(rm - eps, scores)); `exact` when the same entries also tie in
  FP32 scores of the same BF16 Q, K, else the tie was created by rounding S.
- coherence (claim 2): E = dW_Q(lp) - dW_Q(hp) = (dQ_lp - dQ_hp)^T X per head, both mapped through the same X;
  its projection u1^T E v1 on W_Q's top singular pair; cosine(E_t, E_{t-1}) is the caller's (it holds E_{t-1}).
- App. D: the rank-1 matrices (PK)[T]^T X[T] (D x C) have Frobenius cosine cos(PK_T, PK_T') * cos(X_T, X_T'), so the
  mean over all pairs of distinct tokens of a sequence is exact from two T x T Gram matrices (no sampling).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from flash_forensics.kernels import emulator
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.recipes import round_to

F64 = torch.float64


def _causal(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def fp64_attention(q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, P, S) of causal attention in FP64 from the given values: S scaled and masked to -inf, P = softmax(S)."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    s = s.masked_fill(~_causal(q.shape[-2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p @ v, p, s


def fp64_dq(p, k, v, do, delta) -> torch.Tensor:
    """dQ of FP64 attention (the hp backward): dS = P o (dO V^T - delta), dQ = scale * dS K."""
    k, v, do = k.to(F64), v.to(F64), do.to(F64)
    ds = p * (do @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k) * (k.shape[-1] ** -0.5)


def delta_recipe(q, k, v, o, do, knobs: AttentionKnobs) -> torch.Tensor:
    """delta (B, H, T) as the layer's flash recipe computes it. dO_O uses `o`, the O the kernel returned, except on
    heads whose stored O stays FP32 (o_fp32 / o_fp32_heads: the returned O is BF16 but delta reads the FP32 one)."""
    o_saved, lse = emulator.forward(q, k, v, knobs)[1:]
    if knobs.delta == "dO_O" and not knobs.fp32_o_heads(q.shape[1]):
        o_saved = o.to(o_saved.dtype)
    return emulator.row_delta(q, k, v, o_saved, lse, do, knobs).squeeze(-1).to(F64)


def tie_rows(q, k, knobs: AttentionKnobs) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tie, exact), (B, H, T) bool: rows with a repeated max in some key tile (recipe's scores dtype, block_k) or
    whose row max repeats across key tiles (two tiles each holding it: P̄ = 1 twice in the accumulated O, since the
    running max is that row max when the second tile comes), and those of them whose tied entries are equal in FP32
    scores too in every such tile and across them (the rest: created by BF16)."""
    p = emulator._plan(knobs, q)
    rc = p.rc
    T, dev = q.shape[2], q.device
    qw, kw = p.inputs((q, k), rc.inputs, (p.bq, p.bk), rotate=(0, 1))  # as the forward (FP8: with its scales)
    fill = -torch.finfo(rc.scores).max
    tie = torch.zeros(q.shape[:3], dtype=torch.bool, device=dev)
    created = torch.zeros_like(tie)
    tiles = []
    for ks in range(0, T, p.bk):
        ke = min(ks + p.bk, T)
        mask = emulator._causal_mask(0, T, ks, ke, dev)
        s = emulator._scores(p, qw, kw[:, :, ks:ke], mask, fill)
        s32 = (q.float() @ k[:, :, ks:ke].float().transpose(-1, -2)) * p.scale
        tiles.append((s, s32, mask))
        close = s >= round_to(s.amax(dim=-1, keepdim=True) - p.eps, rc.scores)  # as emulator._tile_max
        if mask is not None:
            close = close & ~mask
        rep = close.sum(dim=-1) > 1
        hi = s32.masked_fill(~close, -math.inf).amax(dim=-1)
        lo = s32.masked_fill(~close, math.inf).amin(dim=-1)
        tie |= rep
        created |= rep & (hi != lo)
    # across tiles: the row max, reached (within eps) in two or more tiles
    row_max = torch.stack([s.amax(dim=-1) for s, _, _ in tiles], -1).amax(dim=-1, keepdim=True)
    thr = round_to(row_max - p.eps, rc.scores)
    n_tiles = torch.zeros_like(tie, dtype=torch.int32)
    hi = torch.full(tie.shape, -math.inf, device=dev)
    lo = torch.full(tie.shape, math.inf, device=dev)
    for s, s32, mask in tiles:
        close = s >= thr
        if mask is not None:
            close = close & ~mask
        n_tiles += close.any(dim=-1).to(torch.int32)
        hi = torch.maximum(hi, s32.masked_fill(~close, -math.inf).amax(dim=-1))
        lo = torch.minimum(lo, s32.masked_fill(~close, math.inf).amin(dim=-1))
    across = n_tiles > 1
    tie |= across
    created |= across & (hi != lo)
    return tie, tie & ~created


def error_stats(e: torch.Tensor, tie: torch.Tensor, exact: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Summary of a layer's delta error e (B, H, T) FP64: mean, t-statistic (mean / (std / sqrt(n))), the share of
    sum(e) and of sum|e| from tie rows, and the tie-row counts (exact in FP32, created by BF16). 0-d device tensors;
    a share is NaN when its denominator is 0."""
    n = e.numel()
    mean = e.mean()
    std = e.std(unbiased=True) if n > 1 else torch.zeros_like(mean)
    t = mean / (std / math.sqrt(n))
    tf = tie.to(e.dtype)
    return dict(delta_err_mean=mean, delta_err_t=t, tie_share_signed=(e * tf).sum() / e.sum(),
                tie_share_abs=(e.abs() * tf).sum() / e.abs().sum(), tie_rows_exact=exact.sum().to(e.dtype),
                tie_rows_bf16=(tie & ~exact).sum().to(e.dtype))


def wq_grad_error(x, dq_lp, dq_hp) -> torch.Tensor:
    """E (H, D, C) FP64: dW_Q(lp) - dW_Q(hp) per head, both mapped through the same X (q = X W_Q^T, so
    dW_Q[h] = sum over batch and tokens of dq[h]^T x)."""
    diff = dq_lp.to(F64) - dq_hp.to(F64)  # (B, H, T, D)
    return torch.einsum("bhtd,btc->hdc", diff, x.to(F64))


def top_pair_projection(w_q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """u1^T E v1 per head (H,), (u1, v1) the top singular pair of each head's W_Q block w_q (H, D, C): u1 the top
    eigenvector of the D x D Gram matrix W W^T (a batched eigh of H small matrices, much cheaper than an SVD of
    D x C), v1 = W^T u1 / |W^T u1|, so u1^T W v1 = sigma_1 > 0 fixes the pair's sign. A descent step -lr * E then
    changes sigma_1 by about -lr * u1^T E v1: a negative projection is an error that grows sigma_1."""
    w = w_q.to(F64)
    g = w @ w.transpose(-1, -2)
    finite = torch.isfinite(g).flatten(1).all(dim=1)  # a head whose W_Q holds NaN/inf gets a NaN projection
    g = torch.where(finite[:, None, None], g, torch.eye(g.shape[-1], dtype=F64, device=g.device))
    u1 = torch.linalg.eigh(g)[1][..., :, -1]  # eigenvalues ascending: the last is sigma_1^2
    v1 = torch.einsum("hd,hdc->hc", u1, w)
    v1 = v1 / v1.norm(dim=-1, keepdim=True)
    out = torch.einsum("hd,hdc,hc->h", u1, e.to(F64), v1)
    return torch.where(finite, out, torch.full_like(out, float("nan")))


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine between two tensors flattened (0-d; NaN when either is zero)."""
    a, b = a.reshape(-1).to(F64), b.reshape(-1).to(F64)
    return (a @ b) / (a.norm() * b.norm())


def pkx_similarity(p, k, x) -> torch.Tensor:
    """Mean cosine similarity of (PK)[T]^T X[T] over all pairs of distinct tokens of each sequence, per head (H,).
    p (B, H, T, T) FP64 softmax, k (B, H, T, D), x (B, T, C)."""
    a = p @ k.to(F64)  # (B, H, T, D): (PK)[T]
    a = a / a.norm(dim=-1, keepdim=True)
    xn = x.to(F64) / x.to(F64).norm(dim=-1, keepdim=True)
    g = (a @ a.transpose(-1, -2)) * (xn @ xn.transpose(-1, -2)).unsqueeze(1)  # (B, H, T, T)
    T = g.shape[-1]
    off = ~torch.eye(T, dtype=torch.bool, device=g.device)
    return g.masked_select(off.expand_as(g)).view(*g.shape[:2], -1).mean(dim=(0, 2))


def logit_entropy(p, s) -> Tuple[torch.Tensor, torch.Tensor]:
    """(max scaled logit, mean attention entropy in nats) per head (H,), from FP64 P and masked S."""
    max_logit = s.amax(dim=(0, 2, 3))
    ent = -(p * torch.log(p.clamp_min(torch.finfo(F64).tiny))).sum(dim=-1)  # p = 0 entries contribute 0
    return max_logit, ent.mean(dim=(0, 2))


def layer_probe(x, q, k, v, o, do, dq_lp, w_q, knobs: AttentionKnobs, flash: bool,
                coherence: bool = True) -> Dict[str, torch.Tensor]:
    """Every probe of one layer on one batch. Per layer (0-d): delta_err_mean, delta_err_t, tie shares and counts
    (flash layers only: the delta and tile semantics are the flash recipe's); per head (H,): max_logit, entropy,
    pkx_cos, and (coherence) wq_err_proj; plus "E" (H, D, C), the W_Q gradient error for the caller's cosine.
    w_q (H, D, C) is the layer's W_Q per head; dq_lp None skips coherence."""
    with torch.no_grad():
        o64, p64, s64 = fp64_attention(q, k, v)
        delta64 = (do.to(F64) * o64).sum(dim=-1)
        out: Dict[str, torch.Tensor] = {}
        if flash:
            e = delta_recipe(q, k, v, o, do, knobs) - delta64
            tie, exact = tie_rows(q, k, knobs)
            out.update(error_stats(e, tie, exact))
        out["max_logit"], out["entropy"] = logit_entropy(p64, s64)
        out["pkx_cos"] = pkx_similarity(p64, k, x)
        if coherence and dq_lp is not None:
            E = wq_grad_error(x, dq_lp, fp64_dq(p64, k, v, do, delta64))
            out["wq_err_proj"] = top_pair_projection(w_q, E)
            out["E"] = E
    return out


__all__ = ["fp64_attention", "fp64_dq", "delta_recipe", "tie_rows", "error_stats", "wq_grad_error",
           "top_pair_projection", "cosine", "pkx_similarity", "logit_entropy", "layer_probe"]
