"""Rounding forensics: one rounding bit by bit, and where a P̄V row's error comes from (the paper's Sec. 3.3.2).

    flash-forensics forensics add -2.4071154594421387 -2.296875 [--format bf16|fp16|e4m3|e5m2]
    flash-forensics forensics example --format e4m3    # the paper's worked example, P̄ = 1 and the bias, per format
    flash-forensics forensics pv-trace --out results/forensics/pv_trace.png
    flash-forensics forensics pv-trace --input row.pt      # {"p": P̄ row, "v": V column} or a (2, T) tensor

`add`: the exact sum of two FP32 operands (integer arithmetic on their significands), rounded once to BF16 (or
`--format`: FP16, e4m3, e5m2; FP8 saturating as kernels/formats.py casts) with round-to-nearest-even, every step
printed. In the paper's example the first operand is an FP32 partial sum of P̄V
(not a BF16 value: its low 16 bits are set), the second a BF16 V entry added with P̄ = 1.
`example`: the paper's worked example in one format (V rounded to it), where P̄ = 1 arises there (the P̄ window that
rounds to 1 and the score gap it means, with the FP8 recipes' P̄ scales) and where rounding on the P̄V path is biased.
`pv-trace`: the paper's Fig. 6: cumulative error of one row's P̄V along key positions, low precision minus FP64,
with the positions where P̄ = 1 marked, and how much of the error those positions carry.
Over 400 lines because the bit-level explanation, the per-format worked example and the P̄V trace share their
exact-arithmetic helpers (Fraction sums, round-to-format).
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
import struct
import sys
import zipfile
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from flash_forensics.kernels.checks import file_in_the_way
from flash_forensics.kernels.formats import PBAR_SCALES, cast, quantize

F32_FRAC = 23


@dataclass(frozen=True)
class Spec:
    """A target format for `explain_add`: stored fraction bits, smallest normal exponent, largest finite value,
    whether overflow saturates (FP8, kernels/formats.py) or goes to inf, its torch dtype and an int view dtype."""

    name: str
    frac: int
    emin: int
    max: float
    saturates: bool
    dtype: torch.dtype
    view: torch.dtype


SPECS = {"bf16": Spec("bf16", 7, -126, float(torch.finfo(torch.bfloat16).max), False, torch.bfloat16, torch.int16),
         "fp16": Spec("fp16", 10, -14, 65504.0, False, torch.float16, torch.int16),
         "e4m3": Spec("e4m3", 3, -6, 448.0, True, torch.float8_e4m3fn, torch.uint8),
         "e5m2": Spec("e5m2", 2, -14, 57344.0, True, torch.float8_e5m2, torch.uint8)}


# --------------------------------------------------------------------------------------------------- bit helpers
def f32_bits(x: float) -> int:
    return struct.unpack(">I", struct.pack(">f", x))[0]


def f32_from_bits(b: int) -> float:
    return struct.unpack(">f", struct.pack(">I", b))[0]


def parse_operand(text: str) -> float:
    """A decimal number, or 32 binary digits (FP32 bits, as the paper prints them), or 0x-hex FP32 bits."""
    t = text.strip().replace("_", "").replace(" ", "")
    if len(t) == 32 and set(t) <= {"0", "1"}:
        return f32_from_bits(int(t, 2))
    try:
        if t.lower().startswith("0x"):
            bits = int(t, 16)
            if bits >> 32:
                raise ValueError
            return f32_from_bits(bits)
        x = float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not an operand: expected a decimal number (-2.40), 32 binary digits (FP32 "
                         "bits) or 0x-hex FP32 bits (0xc01a0e2e)") from None
    if not math.isfinite(x) or abs(x) > FP32_MAX:  # the explanation starts from the FP32 bits
        raise ValueError(f"{text!r} is not an operand: expected a finite number within FP32's range "
                         f"(|x| <= {FP32_MAX:.8g})")
    return x


FP32_MAX = 3.4028234663852886e38


def _operand(name: str):
    """argparse type for operand `name`: the refusal names it (not Python's float error)."""
    def parse(text: str) -> float:
        try:
            return parse_operand(text)
        except ValueError as e:
            why = str(e).replace(" is not an operand", " is not allowed")
            raise argparse.ArgumentTypeError(f"{name}={why}") from None
    return parse


def split_bits(bits: int, frac: int) -> str:
    """'s | exponent | fraction' for a 32-bit (frac=23) or 16-bit (frac=7) pattern."""
    s = format(bits, f"0{frac + 9}b")
    return f"{s[0]} | {s[1:9]} | {s[9:]}"


def to_bf16(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).item()


def to_format(x: float, spec: Spec) -> float:
    """x rounded to `spec` as the emulator casts (FP8 saturating: kernels/formats.py)."""
    return cast(torch.tensor(x, dtype=torch.float32), spec.dtype).item()


def format_bits(x: float, spec: Spec) -> int:
    """The bit pattern of x (a value of `spec`)."""
    mask = (1 << (1 + spec.frac + (8 if spec.name == "bf16" else 5 if spec.name in ("fp16", "e5m2") else 4))) - 1
    return torch.tensor(x, dtype=torch.float32).to(spec.dtype).view(spec.view).item() & mask


def split_format(bits: int, spec: Spec) -> str:
    ebits = {"bf16": 8, "fp16": 5, "e4m3": 4, "e5m2": 5}[spec.name]
    s = format(bits, f"0{1 + ebits + spec.frac}b")
    return f"{s[0]} | {s[1:1 + ebits]} | {s[1 + ebits:]}"


def bf16_bits(x: float) -> int:
    return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _decompose(x: float):
    """FP32 x -> (sign, unbiased exponent e, 24-bit significand M) with |x| = M * 2**(e - 23); zero -> (s, None, 0)."""
    b = f32_bits(x)
    sign, ebits, frac = b >> 31, (b >> 23) & 0xFF, b & ((1 << 23) - 1)
    if ebits == 0xFF:
        raise ValueError(f"operand={x!r} is not allowed: expected a finite number")
    if ebits == 0:
        return sign, (None if frac == 0 else -126), frac  # zero or subnormal (no implicit 1)
    return sign, ebits - 127, frac | (1 << 23)


# --------------------------------------------------------------------------------------------------- add
@dataclass
class AddExplanation:
    a: float  # operands as FP32 values
    b: float
    a_bits: str
    b_bits: str
    a_bf16_bits: str  # each operand rounded to BF16 (shows whether it was a BF16 value)
    b_bf16_bits: str
    a_is_bf16: bool
    b_is_bf16: bool
    shift: int  # exponent alignment: the smaller operand's significand moves right by this many bits
    aligned_a: str
    aligned_b: str
    significand_sum: str  # binary, point after the larger operand's leading bit position
    overflow_shift: int  # right shifts to renormalise (1 when two same-sign significands carry out)
    exponent: int  # unbiased exponent of the exact result
    normalized: str  # 1.xxxxxxx|g r s...: kept BF16 significand, then the bits rounding looks at
    guard: int
    round: int
    sticky: int
    decision: str
    exact: float  # the exact sum (as a Python float; exact_is_float says whether that conversion was exact)
    exact_is_float: bool
    bf16: float
    bf16_bits: str
    bf16_bits_raw: str
    error: float  # bf16 - exact
    torch_fp32_then_bf16: float  # cross-checks: torch's own rounding
    torch_exact_to_bf16: float
    format: str = "bf16"  # the target format (SPECS); the bf16_* fields hold that format's values


def explain_add(a: float, b: float, fmt: str = "bf16") -> AddExplanation:
    """The BF16 (or `fmt`: SPECS) result of a + b (a, b FP32 values), computed exactly and rounded
    once, step by step. The field names say bf16 for every format (the JSON keeps one shape); `format` names it."""
    if fmt not in SPECS:
        raise ValueError(f"--format={fmt!r} is not allowed: expected one of {', '.join(SPECS)}")
    spec = SPECS[fmt]
    a, b = f32_from_bits(f32_bits(a)), f32_from_bits(f32_bits(b))  # as the FP32 values the hardware sees
    (sa, ea, ma), (sb, eb, mb) = _decompose(a), _decompose(b)
    exact = Fraction(a) + Fraction(b)
    # Alignment: work at the smaller exponent so that nothing shifted out is lost (the sticky bit remembers it).
    ea_, eb_ = (ea if ea is not None else -10**9), (eb if eb is not None else -10**9)
    e_hi = max(ea_, eb_)
    shift = abs(ea_ - eb_) if ea is not None and eb is not None else 0
    e_lo = min(e for e in (ea, eb) if e is not None) if (ea is not None or eb is not None) else 0
    ia = ma << ((ea - e_lo) if ea is not None else 0)
    ib = mb << ((eb - e_lo) if eb is not None else 0)
    total = (-ia if sa else ia) + (-ib if sb else ib)  # exact sum = total * 2**(e_lo - 23)
    frac_bits = F32_FRAC + shift

    def fixed(n: int) -> str:  # binary with the point placed for exponent e_hi
        s = format(abs(n), "b").rjust(frac_bits + 1, "0")
        return ("-" if n < 0 else "") + s[:-frac_bits] + "." + s[-frac_bits:]

    aligned_a, aligned_b = fixed(-ia if sa else ia), fixed(-ib if sb else ib)
    mag = abs(total)
    if mag == 0:
        e_res, normalized, g, r, st, decision, kept_mag, e_out = 0, "0", 0, 0, 0, "exact zero", 0, 0
        overflow_shift = 0
    else:
        nbits = mag.bit_length()
        e_res = (e_lo - 23) + nbits - 1  # |sum| in [2**e_res, 2**(e_res+1))
        overflow_shift = max(e_res - e_hi, 0)
        drop = nbits - (spec.frac + 1)  # bits below the kept significand (8 bits in BF16)
        if e_res < spec.emin:  # subnormal in the target format: fewer kept bits
            drop += spec.emin - e_res
        if drop > 0:
            kept = mag >> drop
            rest = mag & ((1 << drop) - 1)
            g = (rest >> (drop - 1)) & 1
            r = (rest >> (drop - 2)) & 1 if drop >= 2 else 0
            st = int(rest & ((1 << max(drop - 2, 0)) - 1) != 0)
            lsb = kept & 1
            up = g and (r or st or lsb)
            if not g:
                decision = "guard 0: below halfway -> truncate (magnitude kept)"
            elif r or st:
                decision = "guard 1 and round/sticky set: above halfway -> round up (magnitude + 1 ulp)"
            else:
                decision = f"exact tie: ties to even (last kept bit {lsb}) -> " + ("round up" if up else "truncate")
            kept_mag = kept + (1 if up else 0)
            bits = format(mag, "b")
            normalized = f"{bits[0]}.{bits[1:spec.frac + 1]} | g={g} r={r} s={st} | dropped {bits[spec.frac + 1:]}"
            e_out = e_lo - 23 + drop
        else:
            kept_mag, g, r, st, e_out = mag, 0, 0, 0, e_lo - 23
            decision = f"fits in {spec.name.upper()}: no rounding"
            bits = format(mag, "b")
            normalized = f"{bits[0]}.{bits[1:]}"
    bf = Fraction(kept_mag) * (Fraction(2) ** e_out) if mag else Fraction(0)
    bf = -bf if total < 0 else bf
    bf16 = float(bf) if abs(float(bf)) <= spec.max else math.copysign(spec.max if spec.saturates else math.inf,
                                                                       float(bf))
    if spec.saturates and abs(float(bf)) > spec.max:
        decision += f"; beyond {spec.max:g}: saturated to the max"
    t32 = to_format(float(torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)), spec)
    t64 = to_format(float(exact), spec) if fmt != "bf16" else \
        torch.tensor(float(exact), dtype=torch.float64).to(torch.bfloat16).item()
    nb = 1 + spec.frac + {"bf16": 8, "fp16": 5, "e4m3": 4, "e5m2": 5}[fmt]
    raw = format(format_bits(bf16, spec), f"0{nb}b")
    return AddExplanation(
        a=a, b=b, a_bits=split_bits(f32_bits(a), 23), b_bits=split_bits(f32_bits(b), 23),
        a_bf16_bits=split_format(format_bits(to_format(a, spec), spec), spec),
        b_bf16_bits=split_format(format_bits(to_format(b, spec), spec), spec),
        a_is_bf16=to_format(a, spec) == a, b_is_bf16=to_format(b, spec) == b, shift=shift, aligned_a=aligned_a,
        aligned_b=aligned_b, significand_sum=fixed(total), overflow_shift=overflow_shift, exponent=e_res,
        normalized=normalized, guard=g, round=r, sticky=st, decision=decision, exact=float(exact),
        exact_is_float=Fraction(float(exact)) == exact, bf16=bf16, bf16_bits=split_format(int(raw, 2), spec),
        bf16_bits_raw=raw, error=float(Fraction(bf16) - exact) if math.isfinite(bf16) else math.inf,
        torch_fp32_then_bf16=t32, torch_exact_to_bf16=t64, format=fmt)


def format_add(x: AddExplanation) -> str:
    F, spec = x.format.upper(), SPECS[x.format]
    lines = [
        f"A = {x.a!r}", f"  FP32 bits  {x.a_bits}",
        f"  as {F:<7s} {x.a_bf16_bits}   (" + (f"A is a {F} value" if x.a_is_bf16 else
                                                  f"A is not a {F} value: an FP32 accumulator (low bits set)") + ")",
        f"B = {x.b!r}", f"  FP32 bits  {x.b_bits}",
        f"  as {F:<7s} {x.b_bf16_bits}   ({f'B is a {F} value' if x.b_is_bf16 else f'B is not a {F} value'})",
        f"1. align exponents: shift the smaller operand's significand right by {x.shift} bit(s) (nothing is lost yet)",
        f"     A  {x.aligned_a}", f"     B  {x.aligned_b}",
        f"2. add significands:  {x.significand_sum}",
        (f"3. significand overflow: carry out of the leading bit -> shift right by {x.overflow_shift}, exponent + "
         f"{x.overflow_shift}" if x.overflow_shift else "3. no significand overflow (no right shift)"),
        f"   normalised: {x.normalized}  x 2^{x.exponent}",
        f"4. round to {F} ({spec.frac + 1}-bit significand, {spec.frac} stored): guard={x.guard} round={x.round} "
        f"sticky={x.sticky}",
        f"   round-to-nearest-even: {x.decision}",
        f"exact sum   {x.exact!r}" + ("" if x.exact_is_float else "  (nearest double; the exact sum needs more bits)"),
        f"{F} result {x.bf16!r} = {x.bf16_bits_raw}  ({x.bf16_bits})",
        f"error ({F} - exact) {x.error!r}",
        f"cross-check: torch {x.format}(exact) = {x.torch_exact_to_bf16!r}; torch {x.format}(fp32(A + B)) = "
        f"{x.torch_fp32_then_bf16!r}" + ("" if x.torch_fp32_then_bf16 == x.bf16 else
                                         "  (differs: double rounding through FP32)"),
    ]
    if not math.isfinite(x.bf16) or abs(x.bf16) >= spec.max and abs(x.exact) > spec.max:
        lines.append(f"overflow: |exact sum| {abs(x.exact):.6g} rounds past {F}'s largest finite value {spec.max:.6g}: "
                     + (f"the result saturates at {spec.max:.6g}" if spec.saturates else "the result is inf")
                     + "; the steps above assume a finite result")
    elif 0 < abs(x.exact) < 2.0 ** spec.emin:
        lines.append(f"subnormal: |exact sum| {abs(x.exact):.6g} is below {F}'s smallest normal 2^{spec.emin}: the "
                     f"result rounds to a multiple of 2^{spec.emin - spec.frac} (fewer significant bits), not at the "
                     "bit step 4 names")
    if x.error < 0 < abs(x.exact) and x.exact < 0:
        lines.append("the rounding made a negative sum more negative: a negative error, the bias of claim 3")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- per format
PAPER_A, PAPER_B = -2.4071154594421387, -2.296875  # the paper's Sec. 3.3.2 operands: an FP32 partial sum, a V entry


def unit_window(fmt: str, scale: float = 1.0) -> float:
    """The smallest P̄ (an FP32 value) that `fmt` with P̄ scale `scale` stores as exactly 1 (kernels/formats.py
    quantize); every P̄ in [it, 1] becomes 1. Found by bisection on FP32 values."""
    spec = SPECS[fmt]

    def one(p: float) -> bool:
        return quantize(torch.tensor([p], dtype=torch.float32), spec.dtype, scale).item() == 1.0

    lo, hi = 0.5, 1.0  # one(lo) is False, one(hi) is True for every format here
    for _ in range(40):
        mid = f32_from_bits(f32_bits((lo + hi) / 2))
        lo, hi = (lo, mid) if one(mid) else (mid, hi)
    return hi


def format_example(fmt: str) -> dict:
    """The paper's worked example in `fmt` (V rounded to it), the P̄ = 1 window and the bias, as a dict."""
    spec = SPECS[fmt]
    b = to_format(PAPER_B, spec)
    x = explain_add(PAPER_A, b, fmt)
    below = float(1.0 - float(torch.finfo(spec.dtype).eps) / 2)
    scales = {"none": 1.0} | ({k: v for k, v in PBAR_SCALES.items() if k != "none"} if fmt in ("e4m3", "e5m2") else {})
    windows = {}
    for name, sc in scales.items():
        w = unit_window(fmt, sc)
        windows[name] = dict(scale=sc, p_from=w, score_gap=-math.log(w), up_bias_max=1.0 - w)
    ulp = 2.0 ** (math.floor(math.log2(abs(x.exact))) - spec.frac)
    return dict(format=fmt, a=PAPER_A, b=b, b_exact_in_format=b == PAPER_B, sum=x.bf16, exact=x.exact,
                error=x.error, error_ulps=x.error / ulp, overflow_shift=x.overflow_shift, decision=x.decision,
                next_below_one=below, windows=windows, explanation=x)


def print_example(fmt: str) -> None:
    e = format_example(fmt)
    F = fmt.upper()
    print(f"== the paper's worked example in {F} (Sec. 3.3.2): A = FP32 partial sum of P̄V, B = a V entry in {F}")
    if not e["b_exact_in_format"]:
        print(f"   B = {PAPER_B!r} is no {F} value: stored as {e['b']!r}")
    print(format_add(e["explanation"]))
    print(f"== where P̄ = 1 arises in {F}: the value below 1 is {e['next_below_one']!r}")
    for name, w in e["windows"].items():
        print(f"   P̄ scale {name} ({w['scale']:g}): every P̄ in [{w['p_from']!r}, 1] is stored as 1, i.e. every "
              f"score within {w['score_gap']:.4g} of the row max; rounding up there adds up to "
              f"+{w['up_bias_max']:.4g} to P̄")
    print(f"== where rounding of P̄V is biased in {F}")
    print(f"   a P̄ = 1 term adds V exactly; two same-sign terms of one binade carry out of the significand "
          f"(overflow shift {e['overflow_shift']}), and the rounding of that sum moves it by {e['error']!r} "
          f"({e['error_ulps']:+.3f} ulp of {F}): "
          + ("away from zero, with the sign of V (the bias of claim 3)." if e["error"] * e["exact"] > 0 else
             "toward zero: in this format the example does not show the bias (it depends on the dropped bits)."))
    print(f"   Such a rounding acts only where P̄V partial sums are stored in {F} (the pv_out / acc points: BF16 in "
          f"paper_bf16); fa2, fp16, fp8_fa3 and fp8_te accumulate P̄V in FP32 and store O once (fp8_te: O in "
          f"e4m3). P̄ itself is biased in every format: the window above rounds P̄ up to 1 (never down), in every "
          f"row whose max repeats within it, so those V enter P̄V exactly as in the paper's example.")


# --------------------------------------------------------------------------------------------------- pv-trace
@dataclass
class PVTrace:
    """One row of P̄V along key positions t: err[t] = lp(sum_{t'<=t} P̄ V) - fp64(sum_{t'<=t} P̄ V)."""

    err: np.ndarray  # (T,) cumulative error
    step: np.ndarray  # (T,) err[t] - err[t-1]: what position t added
    is_one: np.ndarray  # (T,) bool, P̄[t] == 1
    accumulate: str

    def summary(self) -> dict:
        ones, rest = self.step[self.is_one], self.step[~self.is_one]
        total = float(self.err[-1]) if len(self.err) else 0.0
        s1, s0 = float(ones.sum()), float(rest.sum())
        a1, a_all = float(np.abs(ones).sum()), float(np.abs(self.step).sum())
        # shares: ones_share = |error| added at P̄ = 1 positions / |error| added anywhere, in [0, 1];
        # ones_share_signed = s1 / (|s1| + |s0|), in [-1, 1] (negative: the P̄ = 1 positions pulled the other way).
        # s1 / total is no share: when the others' error has the opposite sign it exceeds 1 (1.895 was printed).
        return dict(
            accumulate=self.accumulate, positions=int(len(self.err)), total_error=total,
            ones_sum=s1, ones_count=int(ones.size), ones_mean=float(ones.mean()) if ones.size else 0.0,
            others_sum=s0, others_count=int(rest.size), others_mean=float(rest.mean()) if rest.size else 0.0,
            ones_share=(a1 / a_all) if a_all else float("nan"),
            ones_share_signed=(s1 / (abs(s1) + abs(s0))) if (s1 or s0) else float("nan"))


def pv_trace(p_row, v_col, accumulate: str = "fp32", fmt: str = "bf16") -> PVTrace:
    """Cumulative error of one row's P̄V (P̄ rounded to BF16 as the GEMM input; V as given, taken to be BF16).

    fmt (SPECS: bf16, fp16, e4m3, e5m2): the format P̄, V and the partial sums are stored in (FP8 saturating, no
    scale: FA3's 2^8 changes only P̄ below e4m3's normal range); BF16 is the paper's case. `is_one`: the P̄ as fed
    is 1, so FP8's rounded-up P̄ count.

    accumulate="fp32": the paper's definition: an FP32 running sum (tensor-core accumulation), each partial sum
    rounded to BF16 (the (.)_lp of Sec. 3.3.2). accumulate="bf16": the running sum itself is stored in BF16 after
    every addition (a BF16 accumulator, as paper_bf16's O accumulator between tiles), so errors compound.
    The reference is the FP64 running sum of P̄ V with P̄ unrounded.
    """
    if accumulate not in ("fp32", "bf16"):
        raise ValueError(f"accumulate={accumulate!r} is not allowed: expected fp32 or bf16 (bf16: the running sum "
                         "stored in `fmt`)")
    if fmt not in SPECS:
        raise ValueError(f"--format={fmt!r} is not allowed: expected one of {', '.join(SPECS)}")
    spec = SPECS[fmt]
    p = torch.as_tensor(np.asarray(p_row), dtype=torch.float64).flatten()
    v = torch.as_tensor(np.asarray(v_col), dtype=torch.float64).flatten()
    if p.shape != v.shape or p.numel() == 0:
        raise ValueError(f"p_row/v_col shapes {tuple(p.shape)}/{tuple(v.shape)} are not allowed: expected two "
                         "non-empty vectors of one length")
    if fmt == "bf16":
        fed, vv = p.to(torch.bfloat16).to(torch.float32), v.to(torch.float32)
        rnd = to_bf16
    else:
        fed, vv = cast(p.to(torch.float32), spec.dtype), cast(v.to(torch.float32), spec.dtype)

        def rnd(x: float) -> float:
            return to_format(x, spec)
    terms = (fed * vv).numpy()  # exact in FP32: products of two <= 11-bit significands
    acc, lp = np.float32(0.0), np.empty(len(terms), dtype=np.float64)
    for t, x in enumerate(terms):  # sequential, as one dot-product lane accumulates
        acc = np.float32(acc + x)
        if accumulate == "bf16":
            acc = np.float32(rnd(float(acc)))
        lp[t] = rnd(float(acc))
    hp = np.cumsum((p * v).numpy())
    err = lp - hp
    step = np.diff(err, prepend=0.0)
    return PVTrace(err=err, step=step, is_one=(fed == 1.0).numpy(), accumulate=accumulate)


MAX_LENGTH = 1 << 20  # key positions of a generated row: one attention row, traced element by element


def example_row(length: int = 1024, ones: int = 16, seed: int = 0):
    """A row like the failing head's: several P̄ = 1 (repeated maxima), the rest small, V mostly negative.

    Scores: `ones` positions at the row max, the others 7-14 below it (P̄ = exp(S - max) <= 9e-4); V in BF16,
    85% negative, the P̄ = 1 entries around -2.2 (same binade, so their sums overflow the significand).
    """
    g = torch.Generator().manual_seed(seed)
    gap = 7.0 + 7.0 * torch.rand(length, generator=g, dtype=torch.float64)
    idx = torch.randperm(length, generator=g)[:ones]
    gap[idx] = 0.0
    p = torch.exp(-gap)
    sign = torch.where(torch.rand(length, generator=g) < 0.85, -1.0, 1.0).double()
    v = sign * (0.2 + 2.3 * torch.rand(length, generator=g, dtype=torch.float64))
    v[idx] = -(2.0 + 0.5 * torch.rand(ones, generator=g, dtype=torch.float64))
    return p, v.to(torch.bfloat16).double()


_WRITERS = {".pt": "torch.save", ".npy": "np.save", ".npz": "np.savez"}


def load_row(path: str, p_key: str = "p", v_key: str = "v"):
    """P̄ row and V column from .pt ({p_key, v_key} dict or a (2, T) tensor), .npy ((2, T)) or .npz (keys); checked:
    two finite vectors of one length, P̄ in [0, 1] (a softmax numerator exp(s - max))."""
    f = Path(path)
    if f.suffix not in (".pt", ".npz", ".npy"):
        raise ValueError(f"--input={path!r} is not allowed: expected a .pt, .npy or .npz file")
    if not f.is_file():
        raise ValueError(f"--input={path!r}: no such file")
    try:
        if f.suffix == ".pt":
            obj = torch.load(f, map_location="cpu", weights_only=True)
            p, v = (obj[p_key], obj[v_key]) if isinstance(obj, dict) else _pair(obj, path)
        elif f.suffix == ".npz":
            z = np.load(f)
            p, v = z[p_key], z[v_key]
        else:
            p, v = _pair(np.load(f), path)
    except KeyError as e:
        raise ValueError(f"--input={path!r} has no entry {e} (name them with --p-key / --v-key)") from None
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        if str(e).startswith("--input"):
            raise
        # torch's and numpy's own words for a garbage or truncated file advise loading it unsafely (weights_only=False,
        # allow_pickle=True: wrong for a text file) or run on for lines: say what the file should be, with their
        # first sentence cut short where it is not that advice
        why = "" if "pickl" in f"{type(e).__name__} {e}" else f" ({type(e).__name__}: {str(e).split('. ')[0][:120]})"
        raise ValueError(f"--input={path!r} is not readable as {f.suffix}: expected a file "
                         f"{_WRITERS[f.suffix]} wrote, whole{why}") from None
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    if p.size == 0 or p.shape != v.shape:  # checked here to name --input (pv_trace names only its own arguments)
        raise ValueError(f"--input={path!r} is not allowed: P̄ has {p.size} and V {v.size} values; expected two "
                         "non-empty vectors of one length")
    if not (np.isfinite(p).all() and np.isfinite(v).all()):
        raise ValueError(f"--input={path!r} is not allowed: it holds non-finite values (NaN or inf)")
    if p.size and (p.min() < 0 or p.max() > 1):
        raise ValueError(f"--input={path!r} is not allowed: P̄ is outside [0, 1] ({p.min():g}..{p.max():g}); expected "
                         "a softmax numerator exp(s - max)")
    return p, v


def _pair(a, path: str):
    """The two rows of a (2, T) array or tensor."""
    if getattr(a, "ndim", None) != 2 or a.shape[0] != 2:
        raise ValueError(f"--input={path!r} is not allowed: shape {tuple(getattr(a, 'shape', ()))}, expected (2, T) "
                         "(P̄ row, V column)")
    return a[0], a[1]


PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # what pv-trace --out writes (matplotlib's format from the suffix)


def plot_trace(tr: PVTrace, out: str, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    t = np.arange(len(tr.err))
    ax.plot(t, tr.err, lw=1.0, label=f"cumulative error (BF16 of {tr.accumulate} sum) - FP64")
    ax.scatter(t[tr.is_one], tr.err[tr.is_one], color="red", s=14, zorder=3, label="P̄ = 1")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("key position t")
    ax.set_ylabel("error")
    ax.set_title(title or "P̄V cumulative error along key positions (cf. paper Fig. 6)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_p, dpi=120)
    plt.close(fig)
    return out_p


# --------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flash-forensics forensics",
        description="BF16 forensics for flash attention (Qiu & Yao, Sec. 3.3.2).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  flash-forensics forensics add -2.4071154594421387 -2.296875\n"
               "  flash-forensics forensics add 11000000000110100000111000101110 11000000000100110000000000000000\n"
               "  flash-forensics forensics example --format e4m3\n"
               "  flash-forensics forensics pv-trace --out results/forensics/pv_trace.png")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="explain one addition rounded to BF16, bit by bit",
                       description="Exact sum of two FP32 operands rounded once to BF16 (round to nearest even), "
                                   "with alignment, significand overflow, guard/round/sticky bits and the error.")
    a.add_argument("a", type=_operand("a"), help="first operand: decimal, 32 binary digits (FP32 bits) or 0x-hex "
                                                  "FP32 bits")
    a.add_argument("b", type=_operand("b"), help="second operand, same forms")
    a.add_argument("--json", action="store_true", help="print the explanation as JSON")
    a.add_argument("--format", choices=tuple(SPECS), default="bf16",
                   help="the format the sum is rounded to (default bf16; FP8 saturates as kernels/formats.py)")
    e = sub.add_parser("example", help="the paper's worked example, P̄ = 1 and the P̄V bias in one format",
                       description="The paper's worked BF16 addition redone in --format (V rounded to it), the P̄ "
                                   "window that rounds to 1 (with the FP8 recipes' P̄ scales) and where the "
                                   "rounding of P̄V is biased.")
    e.add_argument("--format", choices=tuple(SPECS), default="bf16", help="bf16 (default), fp16, e4m3 or e5m2")
    e.add_argument("--json", action="store_true", help="print the numbers as JSON")
    t = sub.add_parser("pv-trace", help="cumulative P̄V error of one row along key positions (paper Fig. 6)",
                       description="Cumulative error of one row's P̄V (low precision minus FP64) along key "
                                   "positions, P̄ = 1 positions marked; writes a PNG and prints a summary. Without "
                                   "--input a seeded example row is generated.")
    t.add_argument("--input", help=".pt (dict with P̄ row and V column, or a (2, T) tensor), .npy (2, T) or .npz")
    t.add_argument("--p-key", default="p", help="key of the P̄ row in a .pt dict / .npz (default: p)")
    t.add_argument("--v-key", default="v", help="key of the V column in a .pt dict / .npz (default: v)")
    t.add_argument("--length", type=int, default=1024, help="generated example: key positions (default 1024)")
    t.add_argument("--ones", type=int, default=16, help="generated example: positions with P̄ = 1 (default 16)")
    t.add_argument("--seed", type=int, default=0, help="generated example: seed (default 0)")
    t.add_argument("--accumulate", choices=("fp32", "bf16"), default="fp32",
                   help="fp32: FP32 running sum, each partial sum rounded to BF16 (the paper's definition); "
                        "bf16: the running sum stored in BF16 after each addition")
    t.add_argument("--format", choices=tuple(SPECS), default="bf16",
                   help="format of P̄, V and the stored partial sums (default bf16, the paper's)")
    t.add_argument("--out", default="results/forensics/pv_trace.png", help="PNG path (default: %(default)s)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command: "required: {a,b}", not "required: cmd"
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "add":
        x = explain_add(args.a, args.b, args.format)
        print(json.dumps(asdict(x), indent=2) if args.json else format_add(x))
        return 0
    if args.cmd == "example":
        if args.json:
            e = format_example(args.format)
            print(json.dumps({**e, "explanation": asdict(e["explanation"])}, indent=2))
        else:
            print_example(args.format)
        return 0
    out = Path(args.out)  # checked first: matplotlib would add .png to a bare name and refuse .txt in its own words
    if out.is_dir() or out.suffix.lower() not in PLOT_SUFFIXES:
        raise SystemExit(f"--out={args.out!r} is not allowed: expected a file path ending in "
                         f"{', '.join(PLOT_SUFFIXES)}" + (" (it is a folder)" if out.is_dir() else ""))
    under = file_in_the_way(out)
    if under is not None:  # else mkdir's FileExistsError after the trace, naming no flag
        raise SystemExit(f"--out={args.out!r} is not allowed: {under} is a file; expected a file path in a folder")
    if args.input:
        try:
            p, v = load_row(args.input, args.p_key, args.v_key)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        title = f"P̄V cumulative error: {args.input}"
    else:
        if not 0 < args.length <= MAX_LENGTH or not 0 <= args.ones <= args.length:
            raise SystemExit(f"--length={args.length} --ones={args.ones}: expected 0 < length <= {MAX_LENGTH} (one "
                             "attention row) and 0 <= ones <= length")
        p, v = example_row(args.length, args.ones, args.seed)
        title = f"P̄V cumulative error: generated row (seed {args.seed}, {args.ones} x P̄ = 1)"
    tr = pv_trace(p, v, args.accumulate, args.format)
    png = plot_trace(tr, args.out, title)
    s = dict(tr.summary(), png=str(png))
    if args.json:  # strict JSON: an undefined share (no error anywhere) is null, not NaN
        print(json.dumps({k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in s.items()},
                         indent=2))
    else:
        print(f"positions {s['positions']}, accumulation {s['accumulate']}, total error {s['total_error']!r}")
        print(f"{'':12s}{'sum':>14s}{'count':>8s}{'mean':>14s}")
        print(f"{'P̄ = 1':12s}{s['ones_sum']:>14.6g}{s['ones_count']:>8d}{s['ones_mean']:>14.6g}")
        print(f"{'others':12s}{s['others_sum']:>14.6g}{s['others_count']:>8d}{s['others_mean']:>14.6g}")
        if not math.isfinite(s["ones_share"]):  # it printed 'nan' and '+nan', unexplained, as if shares
            print("share of the error at P̄ = 1 positions: undefined: no error was added anywhere (|error| added "
                  "anywhere is 0)")
        else:
            print(f"share of the error at P̄ = 1 positions: {s['ones_share']:.3f} (|error| added there / |error| "
                  f"added anywhere, in [0, 1]); signed share {s['ones_share_signed']:+.3f} (sum there / (|sum there| "
                  f"+ |sum elsewhere|), in [-1, 1])")
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
