"""The Triton kernels compiled for a GPU on any machine (no GPU needed), and their instruction mix: what a knob adds to
a kernel's inner loop, before a lease times it.

    python scripts/kernel_sass.py                                   # fa2 against fa2 + exp_form=exp2_folded, sm_90
    python scripts/kernel_sass.py --variants "fa2;fa2:counters=true;paper_1gpu" --kernels fwd,dkdv --shape 16,12,1024,64
    python scripts/kernel_sass.py --tune-family paper_1gpu          # benchmarks/tune.py's candidates, before a GPU

Each variant's launch is recorded from the real launchers (kernels/triton_launch.py _forward / _backward: the same
arguments, block sizes, warps, stages and constexprs a CUDA call would launch, the tensors made on the CPU), then
compiled ahead of time by Triton for --arch (its bundled ptxas), and the SASS counted with Triton's cuobjdump (and
the registers and stack: a stack means spilled registers), with the shared memory Triton gives the kernel and, for
sm_90, how many of its programs an SM holds at once and which limit sets that (`ctas_per_sm`). The
counts are per kernel, over the whole kernel (prologue, the masked and the unmasked key loop). They say which
instructions a change adds or removes; only a GPU says what that costs. Triton's CPU interpreter never compiles, so
this is also the one CPU check that a kernel edit still compiles for the GPU.
A variant: `fa2`, `paper_bf16`, `fp32` or `paper_1gpu` (paper_bf16 at 128x128 tiles), then `:knob=value` pairs of
AttentionKnobs (`counters=true`: the counters on, as a run's monitors have them) and `:regs.<kernel>=N` caps
(kernels/triton_launch.py register_limit: at most N registers per thread for fwd, dkdv or dq; `none`: no cap,
not even REGISTER_TABLE's default one), and `:form=top2|count` / `:atomics=relaxed|acq_rel`, the counters' form
(kernels/triton_launch.py counter_form; default: the test by recipe, relaxed atomics), and `:acc=fp32`, the
accumulators in FP32 (accumulator_form; default bf16 where the recipe stores them in BF16), and `:max=raw`, an
unmasked tile's row max on the unscaled scores, scaled once (score_max_form; default scaled: the max of the scaled
scores), and `:delta_form=kernel`, delta in its own kernel (delta_form; default fused into the dQ kernel where it can),
and `:p1=scores`, sfa_p1_rows' test on every P̄ rounded again (p1_form; default max: the row's largest, rounded once),
and `:gemm=ahead`, the forward's QK^T of each key tile issued one tile ahead (score_gemm_form; default inline), and
`:fwd_launch=BM,BN,W,S`, the forward launched with those tiles, warps and stages at --shape's length (a SHAPE_TABLE
entry for the scope, as benchmarks/tune.py would time it).
`wgmma_groups` counts the kernel's HGMMA commit groups: where it equals HGMMA, ptxas serialized every wgmma (its
C7511/C7512 "wgmma.mma_async instructions are serialized"), each waited for before the next instruction, so no GEMM
overlaps anything (`wgmma_serialized`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

OPS = ("HGMMA", "MUFU.EX2", "FMUL", "FADD", "FFMA", "FMNMX", "FSETP", "FSEL", "F2FP", "SEL", "IADD3", "SHFL",
       "LDG", "STG", "LDS", "STS", "BAR", "ATOM", "RED", "HMMA")
KERNEL_OF = {"fwd": "_fwd_kernel", "delta": "_bwd_delta_kernel", "dkdv": "_bwd_dkdv_kernel", "dq": "_bwd_dq_kernel"}
PRESETS = {"paper_1gpu": dict(recipe="paper_bf16", block_q=128, block_k=128)}


def register_caps(text: str) -> dict:
    """A variant's `regs.<kernel>=N|none` pairs ('fa2:counters=true:regs.fwd=128'): kernels/triton_launch.py
    register_limit's caps, under which its launches are recorded and compiled."""
    caps = {}
    for pair in text.split(":")[1:]:
        key, _, value = pair.partition("=")
        if key.startswith("regs."):
            if not value.isdigit() and value != "none":
                raise SystemExit(f"variant {text!r}: {key}={value!r} is not allowed: expected a register count or "
                                 f"none")
            caps[key[5:]] = None if value == "none" else int(value)
    return caps


def counter_form_of(text: str) -> dict:
    """A variant's `form=TEST` and `atomics=SEM` pairs ('paper_bf16:counters=true:form=top2'): kernels/triton_launch.py
    counter_form's arguments, under which its launches are recorded (the default: by recipe, relaxed)."""
    out = {}
    for pair in text.split(":")[1:]:
        key, _, value = pair.partition("=")
        if key in ("form", "atomics"):
            out["test" if key == "form" else "atomics"] = value
    return out


def _pair(text: str, key: str, default: str) -> str:
    """The value of a variant's `key=value` pair ('fa2:acc=fp32', key acc), else `default`."""
    return dict(p.partition("=")[::2] for p in text.split(":")[1:]).get(key, default)


def accumulators_of(text: str) -> str:
    """A variant's `acc=bf16|fp32` (kernels/triton_launch.py accumulator_form; default bf16)."""
    return _pair(text, "acc", "bf16")


def score_max_of(text: str) -> str:
    """A variant's `max=raw|scaled` (kernels/triton_launch.py score_max_form; default scaled)."""
    return _pair(text, "max", "scaled")


def p1_of(text: str) -> str:
    """A variant's `p1=max|scores` (kernels/triton_launch.py p1_form; default max)."""
    return _pair(text, "p1", "max")


def delta_of(text: str) -> str:
    """A variant's `delta_form=fused|kernel` (kernels/triton_launch.py delta_form; default fused)."""
    return _pair(text, "delta_form", "fused")


def gemm_of(text: str) -> str:
    """A variant's `gemm=inline|ahead` (kernels/triton_launch.py score_gemm_form; default inline)."""
    return _pair(text, "gemm", "inline")


def fwd_launch_table(text: str, knobs, shape) -> dict:
    """A variant's `fwd_launch=BM,BN,W,S` as the SHAPE_TABLE entry that launches the forward so at `shape` ({} without
    one); a malformed value names the variant."""
    value = _pair(text, "fwd_launch", "")
    if not value:
        return {}
    from flash_forensics.kernels import triton_launch as tl_
    parts = value.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"variant {text!r}: fwd_launch={value!r} is not allowed: expected BLOCK_M,BLOCK_N,"
                         f"num_warps,num_stages (four positive ints, e.g. 64,64,4,2)")
    fam = tl_.table_family(tl_.fwd_family(knobs), knobs)
    return {f"fwd/{fam}/{shape[3]}/{tl_.length_class(shape[2])}": tuple(int(p) for p in parts)}


def _gemm_scope(tl_, form: str):
    """score_gemm_form(form); inline also where the kernels predate it (--against an older checkout)."""
    if form == "inline" and not hasattr(tl_, "score_gemm_form"):
        return contextlib.nullcontext()
    return tl_.score_gemm_form(form)


def parse_variant(text: str):
    """'fa2:counters=true:exp_form=exp2_folded' -> AttentionKnobs (backend triton); a bad knob or value names it
    (`regs.<kernel>=N` pairs are register_caps', not knobs)."""
    from flash_forensics.kernels.config import AttentionKnobs
    name, *pairs = (p for p in text.split(":")
                    if not p.startswith(("regs.", "form=", "atomics=", "acc=", "max=", "delta_form=", "p1=", "gemm=",
                                           "fwd_launch=")))
    kw = dict(PRESETS.get(name, dict(recipe=name)), backend="triton", counters=False)
    fields = {f.name: f for f in dataclasses.fields(AttentionKnobs)}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"variant {text!r}: {key!r} is not an AttentionKnobs field (e.g. counters, exp_form)")
        default = getattr(AttentionKnobs(), key)
        kw[key] = (value.lower() in ("1", "true", "yes") if isinstance(default, bool) else
                   type(default)(value) if isinstance(default, (int, float)) else value)
    try:
        return AttentionKnobs(**kw).validate()
    except ValueError as e:
        raise SystemExit(f"variant {text!r}: {e}") from None


class _Recorder:
    """Stands in for kernels/launch_cache.py's Kernels: records each launch's (kernel, args, kwargs)."""

    def __init__(self, jit):
        self.jit, self.calls = jit, []

    def __getattr__(self, name):
        fn = getattr(self.jit, name)

        class _Grid:
            def __getitem__(_, grid):
                return lambda *args, **kw: self.calls.append((name, fn, args, kw))
        return _Grid()


def record_launches(knobs, shape):
    """The launches one fwd+bwd of `knobs` at `shape` makes, from the launchers themselves (CPU tensors)."""
    from flash_forensics.kernels import triton_launch as tl_
    from flash_forensics.kernels.stats import AttnStats
    B, H, T, D = shape
    dt = torch.float32 if knobs.recipe == "fp32" else torch.bfloat16
    q, k, v, do = (torch.zeros(B, H, T, D, dtype=dt) for _ in range(4))
    rec, saved = _Recorder(tl_._jit), tl_._k
    tl_._k = rec
    try:
        st = AttnStats(H, "cpu") if knobs.counters else None
        rep, maxl = (st.repeated_max_rows, st.max_logit) if st else (None, None)
        o, lse, _, _ = tl_._forward(q, k, v, knobs, rep, maxl, under=getattr(st, "underflow_rows", None),
                                    p1=getattr(st, "sfa_p1_rows", None))
        tl_._backward(do, q, k, v, o, lse, knobs)
    finally:
        tl_._k = saved
    return rec.calls


def record_variant(text: str, shape):
    """record_launches of a --variants entry: its knobs, under its register caps, counter form and accumulator
    form; a bad value names the variant."""
    from flash_forensics.kernels import triton_launch as tl_
    knobs = parse_variant(text)
    try:
        with tl_.register_limit(**register_caps(text)), tl_.counter_form(**counter_form_of(text)), \
                tl_.accumulator_form(accumulators_of(text)), tl_.score_max_form(score_max_of(text)), \
                tl_.delta_form(delta_of(text)), tl_.p1_form(p1_of(text)), _gemm_scope(tl_, gemm_of(text)), \
                tl_.shape_table_scope(fwd_launch_table(text, knobs, shape)):
            return record_launches(knobs, shape)
    except ValueError as e:
        raise SystemExit(f"variant {text!r}: {e}") from None


def tune_candidates(family: str, shape):
    """(knobs, [(kind, config, launch, table entry)]) of benchmarks/tune.py's candidates for `family` at `shape`:
    each forward and backward config it would time, with the launch it makes (block sizes the knobs fix applied)
    and the SHAPE_TABLE entry (kernels/triton_launch.py shape_table_scope) that selects it. A config whose launch
    repeats an earlier one is left out, as tune.py skips it."""
    from benchmarks import tune  # (ROOT is on sys.path: see the imports above)
    from flash_forensics.kernels import triton_launch as tl_
    if family not in tune.FAMILIES:
        raise SystemExit(f"--tune-family={family!r} is not allowed: expected one of {', '.join(tune.FAMILIES)}")
    knobs = tune.FAMILIES[family]
    _, _, T, D = shape
    kind = family if family in tune.FWD else "fp32" if family == "fp32" else "bf16"
    lc, out = tl_.length_class(T), []
    for what, table, fam_of, blocks in (("fwd", tune.FWD, tl_.fwd_family, tl_._fwd_blocks),
                                        ("bwd", tune.BWD, tl_.bwd_family, tl_._bwd_blocks)):
        if what == "bwd" and family not in ("fa2", "paper_bf16", "fp32", "paper_1gpu"):
            continue  # tune.py times the backward of these only (SFA and the counters leave it alone)
        key = "/".join(map(str, (what, tl_.table_family(fam_of(knobs), knobs), D, lc)))
        seen = set()
        for cfg in table[kind].get(D, []):
            with tl_.shape_table_scope({key: cfg}):
                launch = blocks(knobs, D, T)
            if launch in seen:
                continue
            seen.add(launch)
            out.append((what, tuple(cfg), launch, {key: cfg}))
    return knobs, out


def _signature(fn, args, kw):
    """Triton's (signature, constexprs, attrs) for these arguments, specialized as a launch specializes them: the
    launch cache's key (kernels/launch_cache.py spec_of: the value 1 a constant, divisibility by 16, 16-byte
    alignment) and Triton's own type names (triton.runtime.jit.mangle_type)."""
    from triton.runtime.jit import mangle_type

    from flash_forensics.kernels.launch_cache import spec_of
    got = spec_of(args)
    if got is None:
        raise TypeError(f"{fn.__name__}: an argument of a type the launch cache does not specialize")
    sig, const, attrs = {}, {}, {}
    names = fn.arg_names
    for i, (name, a, tag) in enumerate(zip(names, args, got[0])):  # the runtime arguments come first
        if tag == "one":
            sig[name], const[(i,)] = "constexpr", 1
            continue
        sig[name] = mangle_type(a)
        if isinstance(tag, tuple) and tag[1]:  # a 16-byte aligned address or an int 16 divides
            attrs[(i,)] = [["tt.divisibility", 16]]
    for i, name in enumerate(names[len(args):], start=len(args)):
        sig[name], const[(i,)] = "constexpr", kw[name]
    return sig, const, attrs


def _tools():
    import triton.backends.nvidia as nv
    d = os.path.join(os.path.dirname(nv.__file__), "bin")
    return os.path.join(d, "cuobjdump")


def compile_counts(fn, args, kw, arch: int) -> dict:
    """{op: count} of the kernel's SASS, and its registers, compiled ahead of time for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    launch = {k: v for k, v in kw.items() if k in ("num_warps", "num_stages", "maxnreg")}
    consts = {k: v for k, v in kw.items() if k not in launch}
    sig, const, attrs = _signature(fn, args, consts)
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    # FP fusion on, as a launch compiles (Triton's default through 3.9; stated, so a later default does not move it)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch, enable_fp_fusion=True))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        sass = subprocess.run([_tools(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tools(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    instr = sass_instructions(sass)
    counts = {op: sum(1 for i in instr if re.search(r"(^|\s|\})" + re.escape(op) + r"(\.|\s|$)", i)) for op in OPS}
    m, st = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    regs, shared = int(m.group(1)) if m else None, int(ck.metadata.shared)
    return dict(counts, instructions=len(instr), registers=regs, sass=instr,
                stack_bytes=int(st.group(1)) if st else None,  # > 0: registers spilled to local memory
                exp_denormal_fixups=sum(1 for i in instr if "FSETP.GEU" in i and "-126" in i), shared_bytes=shared,
                **wgmma_groups(instr),
                ctas_per_sm=ctas_per_sm(regs, shared, launch.get("num_warps", 4)) if arch == 90 and regs else None,
                **launch)


_HGMMA = re.compile(r"(^|\s)HGMMA\.")


def wgmma_groups(instr: list) -> dict:
    """The kernel's wgmma commit groups (an HGMMA that closes one carries gsb0); whether ptxas serialized every
    wgmma: one group per HGMMA, each waited for at once (only where the kernel has more HGMMAs than it has GEMMs of
    one k-step each); and ex2_under_wgmma, the MUFU.EX2s placed while a group runs (from its first HGMMA to the
    next WARPGROUP.DEPBAR, in program order): the softmax's exps a GEMM overlaps, where ptxas issued it early."""
    hg = [i for i in instr if _HGMMA.search(i)]
    groups = sum(1 for i in hg if "gsb0" in i)
    under, running = 0, False
    for i in instr:
        if _HGMMA.search(i):
            running = True
        elif "WARPGROUP.DEPBAR" in i:
            running = False
        elif running and "MUFU.EX2" in i:
            under += 1
    return dict(wgmma_groups=groups, wgmma_serialized=bool(hg) and groups == len(hg), ex2_under_wgmma=under)


def reduce_layouts(fn, args, kw, arch: int = 90) -> list:
    """[(shape, layout)] of the kernel's row reductions (tt.reduce) on FP32 tiles, as Triton laid them out for
    sm_<arch> (its TTGIR): a reduction's order of summation is its layout's (each thread's elements in turn, then
    the lanes' butterfly), so two reductions of the same values in the same layout give the same bits."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    launch = {k: v for k, v in kw.items() if k in ("num_warps", "num_stages", "maxnreg")}
    consts = {k: v for k, v in kw.items() if k not in launch}
    sig, const, attrs = _signature(fn, args, consts)
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                        target=GPUTarget("cuda", arch, 32), options=dict(launch, enable_fp_fusion=True))
    ir = ck.asm["ttgir"]
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, re.M))
    out = []
    for m in re.finditer(r'"tt\.reduce"\(([^)]*)\)', ir):
        tail = ir[m.end():m.end() + 4000]
        t = re.search(r"\}\) : \(tensor<(\d+x\d+)xf32, (#\w+)>", tail)
        if t:
            out.append((t.group(1), defs.get(t.group(2), t.group(2))))
    return out


def ctas_per_sm(registers: int, shared: int, num_warps: int) -> dict:
    """How many of these programs an sm_90 SM (H100 / H200) holds at once, by each of its limits: 64K registers
    (allocated per warp in units of 256), 228 KB of shared memory (1 KB more reserved per program), 64 warps, 32
    programs. The smallest (`ctas`) is the occupancy the GPU can reach; which limit sets it is `by`."""
    per_warp = -(-registers * 32 // 256) * 256
    limits = dict(registers=65536 // (per_warp * num_warps), shared=233472 // (shared + 1024), warps=64 // num_warps,
                  programs=32)
    by = min(limits, key=limits.get)
    return dict(limits, ctas=limits[by], by=by)


def sass_instructions(sass: str) -> list:
    """The instructions of cuobjdump -sass output, one string each (offsets and encodings dropped)."""
    return [ln.split("*/", 1)[1].split(";")[0].strip() for ln in sass.splitlines()
            if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]


_FP_OP = re.compile(r"^(?:@!?U?P\w+\s+)?((?:F[A-Z0-9]+|MUFU|HFMA2|HMUL2|HADD2)(?:\.[A-Z0-9.]+)?)")


def fp_ops(instr: list) -> dict:
    """{floating-point opcode with its modifiers: count} of a kernel's instructions. Two compilations of one PTX with
    the same counts made the same contractions (an FFMA where a FMUL and an FADD were), so a change that moves only
    registers (a maxnreg cap) shows here as no change at all."""
    out: dict = {}
    for i in instr:
        m = _FP_OP.match(i)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def normalized(instr: list) -> list:
    """Instructions with what moves when only the kernel's argument list changes taken out: constant-bank offsets
    (where each argument lives) and hex immediates (addresses). Opcodes, registers, predicates and float immediates
    stay: two kernels equal here run the same arithmetic in the same order."""
    return [re.sub(r"0x[0-9a-f]+", "HEX", re.sub(r"c\[0x[0-9a-f]+\]\[0x[0-9a-f]+\]", "c[ARG]", i)) for i in instr]


def compare(rows: list, other: list) -> list:
    """(variant, kernel, verdict) per row of `rows` against the same row of `other`: 'identical' (normalized SASS
    equal), 'differs (n vs m instructions)', or 'missing' there."""
    theirs = {(r["variant"], r["kernel"]): r for r in other}
    out = []
    for r in rows:
        o = theirs.get((r["variant"], r["kernel"]))
        if o is None:
            out.append((r["variant"], r["kernel"], "missing"))
        elif normalized(r["sass"]) == normalized(o["sass"]):
            out.append((r["variant"], r["kernel"], "identical"))
        else:
            out.append((r["variant"], r["kernel"], f"differs ({len(o['sass'])} vs {len(r['sass'])} instructions)"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fa2;fa2:exp_form=exp2_folded",
                    help="';'-separated: recipe or preset, then :knob=value pairs")
    ap.add_argument("--kernels", default="fwd", help="comma list of: " + ", ".join(KERNEL_OF))
    ap.add_argument("--shape", default="16,12,1024,64", help="B,H,T,D")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100 / H200)")
    ap.add_argument("--out", default=None, help="JSON path (nothing written without it)")
    ap.add_argument("--against", default=None, metavar="DIR",
                    help="another checkout (e.g. `git worktree add /tmp/base main`): its kernels compiled the same "
                         "way, each kernel's SASS compared with this tree's (argument offsets aside); exit 1 when any "
                         "differs. A refactor that must keep every bit should leave them identical")
    ap.add_argument("--tune-family", default=None, metavar="FAMILY",
                    help="instead of --variants: every launch config benchmarks/tune.py would time for FAMILY "
                         "(fa2, fa2_exact, paper_bf16, fp32, paper_1gpu) at --shape, compiled: registers, spills "
                         "and programs per SM of each before a GPU times it")
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)  # --against's child: import the kernels from here
    ap.add_argument("--keep-sass", action="store_true", help=argparse.SUPPRESS)  # --against's child: rows with SASS
    args = ap.parse_args(argv)
    if args.root:
        sys.path.insert(0, os.path.abspath(args.root))
    shape = tuple(int(x) for x in args.shape.split(","))
    kernels = args.kernels.split(",")
    bad = [k for k in kernels if k not in KERNEL_OF]
    if bad:
        raise SystemExit(f"--kernels={bad[0]!r} is not allowed: expected one of {', '.join(KERNEL_OF)}")
    rows = []
    if args.tune_family:
        if args.against:
            raise SystemExit("--against compares --variants, not --tune-family")
        knobs, cands = tune_candidates(args.tune_family, shape)
        from flash_forensics.kernels import triton_launch as tl_
        for what, cfg, launch, entry in cands:
            with tl_.shape_table_scope(entry):
                calls = record_launches(knobs, shape)
            for kern in (("fwd",) if what == "fwd" else ("dkdv", "dq")):
                for name, fn, a, kw in calls:
                    if name == KERNEL_OF[kern]:
                        rows.append(dict(variant=f"{args.tune_family}:{what}={','.join(map(str, cfg))}",
                                         kernel=kern, config=list(cfg), launch=str(launch),
                                         **compile_counts(fn, a, kw, args.arch)))
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "sass"}), flush=True)
    for text in [] if args.tune_family else args.variants.split(";"):
        calls = record_variant(text, shape)
        for kern in kernels:
            for name, fn, a, kw in calls:
                if name == KERNEL_OF[kern]:
                    rows.append(dict(variant=text, kernel=kern, **compile_counts(fn, a, kw, args.arch)))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "sass"}), flush=True)
    verdicts = None
    if args.against:
        if not os.path.isdir(os.path.join(args.against, "kernels")):
            raise SystemExit(f"--against={args.against!r} is not allowed: expected a checkout (a folder with kernels/)")
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "other.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--root", args.against, "--variants", args.variants,
                   "--kernels", args.kernels, "--shape", args.shape, "--arch", str(args.arch), "--out", dump,
                   "--keep-sass"]
            r = subprocess.run(cmd, cwd=args.against, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"compiling {args.against}'s kernels failed:\n{r.stderr[-2000:]}")
            with open(dump) as f:
                verdicts = compare(rows, json.load(f)["rows"])
    cols = ("instructions", "registers", "stack_bytes", "shared_bytes", "HGMMA", "wgmma_groups", "ex2_under_wgmma",
            "HMMA", *OPS[1:10], "exp_denormal_fixups")
    print("| variant | kernel | " + " | ".join(cols) + " | programs per SM (limit) |\n|" + "---|" * (len(cols) + 3))
    for r in rows:
        occ = r.get("ctas_per_sm")
        print(f"| {r['variant']} | {r['kernel']} | " + " | ".join(str(r[c]) for c in cols)
              + (f" | {occ['ctas']} ({occ['by']}) |" if occ else " | - |"))
    if verdicts is not None:
        print(f"\nSASS against {args.against}:")
        for v, k, verdict in verdicts:
            print(f"  {v} {k}: {verdict}")
    if args.out:
        import triton
        with open(args.out, "w") as f:
            json.dump(dict(command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])), arch=args.arch,
                           shape=shape, triton=triton.__version__, torch=torch.__version__,
                           rows=rows if args.keep_sass else [{k: v for k, v in r.items() if k != "sass"} for r in rows],
                           against=None if verdicts is None else dict(tree=args.against, kernels=[
                               dict(variant=v, kernel=k, verdict=x) for v, k, x in verdicts])), f, indent=1)
    if verdicts is not None and any(x != "identical" for _, _, x in verdicts):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
