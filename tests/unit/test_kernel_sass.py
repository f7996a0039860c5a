"""scripts/kernel_sass.py: the Triton forward compiled for sm_90 on a CPU, from the launchers' own arguments. Triton's
interpreter never compiles a kernel, so this is the CPU's one check that the GPU code still compiles; the counts say
what exp_form=exp2_folded removes: tl.exp's denormal fix-up (a compare and two predicated multiplies around each
MUFU.EX2) and the scale's multiply."""
import importlib.util
import os
from pathlib import Path

import pytest

from flash_forensics.kernels.triton_launch import REGISTER_TABLE

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "scripts" / "kernel_sass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _have_tools():
    try:
        import triton.backends.nvidia as nv
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"))


pytestmark = pytest.mark.skipif(not _have_tools() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs Triton's NVIDIA backend (ptxas, cuobjdump), as its wheel ships them")


def test_the_forward_compiles_for_sm90_and_exp2_folded_drops_the_exp_fixups():
    ks = _script()
    compile_counts, parse_variant, record_launches = ks.compile_counts, ks.parse_variant, ks.record_launches
    got = {}
    for text in ("fa2", "fa2:exp_form=exp2_folded"):
        calls = record_launches(parse_variant(text), (2, 2, 256, 64))
        assert [c[0] for c in calls] == ["_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"]  # delta fused in dQ
        name, fn, args, kw = calls[0]
        assert kw["FOLD"] is (text != "fa2") and kw["BLOCK_N"] == 64
        got[text] = compile_counts(fn, args, kw, 90)
    exp, fold = got["fa2"], got["fa2:exp_form=exp2_folded"]
    assert exp["HGMMA"] > 0 and exp["MUFU.EX2"] == fold["MUFU.EX2"] > 0  # wgmma, one exp2 per score either way
    assert exp["exp_denormal_fixups"] == exp["MUFU.EX2"] and fold["exp_denormal_fixups"] == 0
    assert fold["FMUL"] + fold["FSETP"] < exp["FMUL"] + exp["FSETP"] and fold["instructions"] < exp["instructions"]


def test_ex2_approx_ftz_drops_tl_exps_fixups_in_every_kernel_it_reaches():
    """exp_instruction("ex2_approx_ftz") reaches every launch (FTZ), and in the forward and dQ kernels compiled
    for sm_90 leaves one MUFU.EX2 per exp without tl.exp's denormal fix-up, in fewer instructions."""
    from flash_forensics.kernels.triton_launch import exp_instruction
    ks = _script()
    default = ks.record_launches(ks.parse_variant("paper_bf16:counters=true"), (2, 2, 256, 64))
    with exp_instruction("ex2_approx_ftz"):
        ftz = ks.record_launches(ks.parse_variant("paper_bf16:counters=true"), (2, 2, 256, 64))
    assert [c[3]["FTZ"] for c in default] == [False] * 3 and [c[3]["FTZ"] for c in ftz] == [True] * 3
    for i in (0, 1):  # _fwd_kernel, _bwd_dq_kernel
        a, b = (ks.compile_counts(c[i][1], c[i][2], c[i][3], 90) for c in (default, ftz))
        assert a["MUFU.EX2"] == b["MUFU.EX2"] > 0 and a["exp_denormal_fixups"] == a["MUFU.EX2"]
        assert b["exp_denormal_fixups"] == 0 and b["instructions"] < a["instructions"]


def test_a_bad_variant_names_the_knob():
    parse_variant = _script().parse_variant
    with pytest.raises(SystemExit, match="'exp_fom' is not an AttentionKnobs field"):
        parse_variant("fa2:exp_fom=exp2_folded")
    with pytest.raises(SystemExit, match="exp_form"):
        parse_variant("fa2:exp_form=exp10")


def test_compare_sets_argument_offsets_aside_and_names_what_differs():
    """--against: two kernels whose SASS differs only in where their arguments live (a new argument moves every
    constant-bank offset) are identical; another opcode, register or float immediate differs; a kernel the other
    tree lacks is missing."""
    ks = _script()
    a = ["FMUL R50, R41, 1.4426950216293334961", "LDC R2, c[0x0][0x3a0]", "IADD3 R4, P0, R2, 0x10, RZ"]
    moved = ["FMUL R50, R41, 1.4426950216293334961", "LDC R2, c[0x0][0x3a8]", "IADD3 R4, P0, R2, 0x10, RZ"]
    other_op = ["FMUL.FTZ R50, R41, 1.4426950216293334961", "LDC R2, c[0x0][0x3a0]", "IADD3 R4, P0, R2, 0x10, RZ"]
    rows = [dict(variant="fa2", kernel="fwd", sass=a), dict(variant="fa2", kernel="dq", sass=a),
            dict(variant="fa2", kernel="dkdv", sass=a)]
    other = [dict(variant="fa2", kernel="fwd", sass=moved), dict(variant="fa2", kernel="dq", sass=other_op)]
    assert ks.compare(rows, other) == [("fa2", "fwd", "identical"), ("fa2", "dq", "differs (3 vs 3 instructions)"),
                                       ("fa2", "dkdv", "missing")]
    sass = "        /*0040*/                   FMUL R50, R41, 1.4426950216293334961 ;   /* 0x3fb8aa3b29327820 */\n" \
           "        /*10000*/                  EXIT ;                                    /* 0x000000000000794d */\n"
    assert ks.sass_instructions(sass) == ["FMUL R50, R41, 1.4426950216293334961", "EXIT"]


def test_the_launch_order_reaches_every_kernel_and_leaves_their_arithmetic():
    """kernels/triton_launch.py launch_order: every kernel gets LPT (longest first by default, on the grid (heads of
    a section, tiles, sections); off under `linear`); the compiled forward differs between the two orders, by the
    program index only: the same GEMMs, exps and multiplies."""
    from flash_forensics.kernels import triton_launch
    ks = _script()
    knobs, shape = ks.parse_variant("fa2:counters=true"), (2, 2, 256, 64)
    default = ks.record_launches(knobs, shape)
    with triton_launch.launch_order("linear"):
        linear = ks.record_launches(knobs, shape)
    assert all(c[3]["LPT"] is True for c in default) and len(default) == 3
    assert all(c[3]["LPT"] is False for c in linear) and len(linear) == 3
    a, b = (ks.compile_counts(*calls[0][1:], 90) for calls in (default, linear))
    assert ks.normalized(a["sass"]) != ks.normalized(b["sass"])
    for op in ("HGMMA", "MUFU.EX2", "FMUL", "FFMA", "FMNMX", "FSETP", "SHFL"):
        assert a[op] == b[op], op


def test_programs_per_sm_by_each_sm90_limit():
    """ctas_per_sm: the sm_90 occupancy of a kernel from its registers (per warp, in units of 256), shared memory
    (+1 KB a program), warps and programs; `by` names the limit that sets it."""
    occ = _script().ctas_per_sm
    assert occ(137, 57344, 4) == dict(registers=3, shared=4, warps=16, programs=32, ctas=3, by="registers")
    assert occ(122, 57344, 4)["ctas"] == 4  # 122 registers round up to 128 a thread: 16K a program
    assert occ(64, 120000, 4) == dict(registers=8, shared=1, warps=16, programs=32, ctas=1, by="shared")
    assert occ(32, 0, 8) == dict(registers=8, shared=228, warps=8, programs=32, ctas=8, by="registers")


def test_tune_family_lists_each_distinct_launch_of_tune_py_once():
    """--tune-family: benchmarks/tune.py's candidates for a family, each with the launch it makes once the knobs'
    fixed block sizes apply (paper_1gpu: the forward's key tile stays 128) and the SHAPE_TABLE entry selecting it;
    configs that launch the same kernel as an earlier one are left out; a family tune.py lacks is refused."""
    ks = _script()
    from benchmarks import tune
    knobs, cands = ks.tune_candidates("paper_1gpu", (16, 12, 1024, 64))
    assert knobs == tune.FAMILIES["paper_1gpu"]
    fwd = [c for c in cands if c[0] == "fwd"]
    bwd = [c for c in cands if c[0] == "bwd"]
    assert [c[1] for c in fwd] == [tuple(x) for x in tune.FWD["paper_1gpu"][64]]
    assert all(c[2][1] == 128 for c in fwd)  # BLOCK_N is block_k, whatever the candidate says
    assert all(c[3] == {"fwd/paper_bf16_128x128/64/long": c[1]} for c in fwd)
    assert len({c[2] for c in bwd}) == len(bwd) and 0 < len(bwd) <= len(tune.BWD["paper_1gpu"][64])
    assert all(c[2][0] == (128, c[1][1]) and c[2][1] == (c[1][2], 128) for c in bwd)  # dK/dV BLOCK_M, dQ BLOCK_N
    _, fa2 = ks.tune_candidates("fa2_exact", (16, 12, 1024, 64))
    assert {c[0] for c in fa2} == {"fwd"}  # tune.py times fa2_exact's forward only
    with pytest.raises(SystemExit, match="--tune-family='fa3' is not allowed: expected one of fa2, "):
        ks.tune_candidates("fa3", (16, 12, 1024, 64))


def test_register_caps_reach_the_launches_and_ptxas_keeps_to_them():
    """The counters' forward at D64 launches with maxnreg=128 by default (REGISTER_TABLE), with none under
    register_limit(fwd=None) (`regs.fwd=none`), and `regs.fwd=N` caps it at N, compiled for sm_90 within it. The other
    launches keep ptxas's choice."""
    ks = _script()
    assert ks.register_caps("fa2:counters=true:regs.fwd=96:regs.dq=none") == dict(fwd=96, dq=None)
    with pytest.raises(SystemExit, match=r"regs.fwd='x' is not allowed: expected a register count or none"):
        ks.register_caps("fa2:regs.fwd=x")
    from flash_forensics.kernels.triton_launch import register_limit
    knobs = ks.parse_variant("fa2:counters=true:regs.fwd=96")
    assert knobs == ks.parse_variant("fa2:counters=true")
    default = ks.record_launches(knobs, (2, 2, 256, 64))
    with register_limit(fwd=None):
        free = ks.record_launches(knobs, (2, 2, 256, 64))
    with register_limit(fwd=96):
        capped = ks.record_launches(knobs, (2, 2, 256, 64))
    assert [c[3].get("maxnreg") for c in default] == [128, None, None]
    assert [c[3].get("maxnreg") for c in free] == [None] * 3
    assert [c[3].get("maxnreg") for c in capped] == [96, None, None]
    c = ks.compile_counts(*capped[0][1:], 90)  # (the default cap against none: the test below, per table entry)
    assert c["registers"] <= 96 and c["maxnreg"] == 96 and ks.fp_ops(c["sass"])["MUFU.EX2"] > 0
    assert ks.fp_ops(["FFMA.FTZ R1, R2, R3, R4", "@!P0 FMUL R1, R1, 2", "MUFU.EX2 R5, R5", "IADD3 R1, R2, R3, RZ"]) == {
        "FFMA.FTZ": 1, "FMUL": 1, "MUFU.EX2": 1}


def test_the_counter_form_pairs_reach_the_forwards_launch_and_leave_the_knobs():
    """`form=TEST` / `atomics=SEM` record the launches in counter_form(TEST, SEM)'s scope: the forward's TOP2 and
    RELAXED constexprs follow them (default: by recipe, relaxed), and the knobs are the variant's without them."""
    ks = _script()
    assert ks.counter_form_of("paper_bf16:counters=true:form=top2:atomics=acq_rel") == dict(test="top2",
                                                                                           atomics="acq_rel")
    assert ks.counter_form_of("fa2:counters=true:regs.fwd=96") == {}
    assert ks.parse_variant("paper_bf16:counters=true:form=top2") == ks.parse_variant("paper_bf16:counters=true")
    def fwd_flags(text):
        kw = [c[3] for c in ks.record_variant(text, (2, 2, 256, 64)) if c[0] == "_fwd_kernel"][0]
        return kw["TOP2"], kw["RELAXED"]
    assert fwd_flags("paper_bf16:counters=true") == (False, True)  # paper_bf16 counts by default
    assert fwd_flags("paper_bf16:counters=true:form=top2:atomics=acq_rel") == (True, False)
    assert fwd_flags("fa2:counters=true:form=count") == (False, True)
    with pytest.raises(SystemExit, match="variant 'fa2:counters=true:form=sum': counter test 'sum' is not allowed"):
        fwd_flags("fa2:counters=true:form=sum")


@pytest.mark.parametrize("variant,D", [("fa2", 64), ("fa2:counters=true", 64), ("fa2", 128)])
def test_the_raw_score_max_drops_a_multiply_per_score_and_keeps_the_ffma(variant, D):
    """`max=raw` records the forward in score_max_form("raw")'s scope (RAWMAX on; the default: off). Compiled for
    sm_90, raw takes an unmasked tile's max on the unscaled scores: one FMUL per score of that loop fewer (BLOCK_M
    x BLOCK_N / threads, less the two per-row multiplies that scale the max), and the same number of FFMAs: P̄'s
    argument S scale - m stays one FFMA in both forms, which is what keeps every bit (the GPU test compares them)."""
    ks = _script()
    assert ks.score_max_of("fa2:max=raw") == "raw" and ks.score_max_of("fa2") == "scaled"
    assert ks.parse_variant("fa2:max=raw") == ks.parse_variant("fa2")
    got = {}
    for form in ("raw", "scaled"):
        text = variant if form == "scaled" else f"{variant}:max=raw"
        name, fn, args, kw = [c for c in ks.record_variant(text, (2, 2, 256, D)) if c[0] == "_fwd_kernel"][0]
        assert kw["RAWMAX"] is (form == "raw")
        got[form] = ks.compile_counts(fn, args, kw, 90)
    per_thread = kw["BLOCK_M"] * kw["BLOCK_N"] // (32 * kw["num_warps"])
    raw, scaled = got["raw"], got["scaled"]
    assert raw["FFMA"] == scaled["FFMA"] > 0
    assert per_thread - 4 <= scaled["FMUL"] - raw["FMUL"] <= per_thread
    assert raw["instructions"] < scaled["instructions"]


# each REGISTER_TABLE entry's kernel and the variant whose launch it caps (paper_1gpu: the preset's 128x128 tiles)
CAPPED = {("fwd", "paper_bf16", "safe", 64, (64, 128, 4, 2)): ("fwd", "paper_1gpu:counters=true")}
# the shape at which an entry's launch is the default one: paper_bf16's 3-stage backward launches at T <= 256 only
# since SHAPE_TABLE gave longer sequences 2 stages
SHAPE_OF = {("dkdv", "paper_bf16", "safe", 64, ((64, 64), (64, 64), 4, 3)): (32, 12, 256, 64)}


@pytest.mark.parametrize("key", list(REGISTER_TABLE), ids=lambda k: "/".join(map(str, k[:3])) + f"/{k[4]}")
def test_every_register_cap_keeps_the_kernels_floating_point_instructions(key):
    """Each REGISTER_TABLE cap, compiled for sm_90 at the shape it was measured at, against the same launch with no
    cap: within the cap, and the same floating-point instructions (opcodes and modifiers, counted), so the cap moves
    registers and not arithmetic (the GPU's kernel-bits cases check the bits themselves)."""
    from flash_forensics.kernels import triton_launch as tl_
    ks = _script()
    cap = tl_.REGISTER_TABLE[key]
    kernel, recipe, softmax = key[:3]
    kernel, variant = CAPPED.get(key, (kernel, f"{recipe}:counters=true:softmax={softmax}"))
    knobs = ks.parse_variant(variant)
    name = ks.KERNEL_OF[kernel]
    shape = SHAPE_OF.get(key, (16, 12, 1024, 64))
    default = [c for c in ks.record_launches(knobs, shape) if c[0] == name][0]
    with tl_.register_limit(**{kernel: None}):
        free = [c for c in ks.record_launches(knobs, shape) if c[0] == name][0]
    assert default[3]["maxnreg"] == cap and "maxnreg" not in free[3]
    assert default[3]["num_stages"] == key[4][-1]  # the launch compiled is the one the entry names
    a, b = ks.compile_counts(*free[1:], 90), ks.compile_counts(*default[1:], 90)
    assert b["registers"] <= cap < a["registers"]
    assert ks.fp_ops(a["sass"]) == ks.fp_ops(b["sass"])


def _arithmetic(ops: dict) -> dict:
    """fp_ops without each kernel's own program-index prologue (a reciprocal and a conversion for its integer
    division, a constant moved by HFMA2.MMA), BF16 multiplies counted as such on either pipe (ptxas issues a packed
    RN product as HMUL2.BF16 or as HFMA2.MMA.BF16 with a -0 addend, to balance its pipes: the same rounded product)."""
    out: dict = {}
    for op, n in ops.items():
        if op in ("MUFU.RCP", "HFMA2.MMA") or op.startswith("F2I."):
            continue
        op = "bf16 multiply" if op in ("HMUL2.BF16", "HFMA2.MMA.BF16") else op
        out[op] = out.get(op, 0) + n
    return out


def test_the_p1_test_on_the_rounded_row_max_drops_a_conversion_per_two_scores():
    """`p1=scores` records the stabilized forward with counters in p1_form("scores")'s scope (P1MAX off; the default:
    on). Compiled for sm_90, the default rounds each row's largest P̄ once, where the old form rounded every P̄ again
    beside the GEMM's own conversion: at least one packed conversion (F2FP, two scores) per two scores of a key
    loop fewer, and fewer instructions in all."""
    ks = _script()
    variant = "fa2:softmax=stabilized:counters=true"
    assert ks.p1_of(f"{variant}:p1=scores") == "scores" and ks.p1_of(variant) == "max"
    assert ks.parse_variant(f"{variant}:p1=scores") == ks.parse_variant(variant)
    got = {}
    for form in ("max", "scores"):
        text = variant if form == "max" else f"{variant}:p1=scores"
        name, fn, args, kw = [c for c in ks.record_variant(text, (2, 2, 256, 64)) if c[0] == "_fwd_kernel"][0]
        assert kw["P1MAX"] is (form == "max")
        got[form] = ks.compile_counts(fn, args, kw, 90)
    per_thread = kw["BLOCK_M"] * kw["BLOCK_N"] // (32 * kw["num_warps"])
    assert got["scores"]["F2FP"] - got["max"]["F2FP"] >= per_thread // 2, (got["scores"]["F2FP"], got["max"]["F2FP"])
    assert got["max"]["instructions"] < got["scores"]["instructions"]


@pytest.mark.parametrize("variant,D", [("fa2", 64), ("paper_bf16:counters=true", 64), ("paper_1gpu:counters=true", 64),
                                       ("fa2", 128)])
def test_the_fused_delta_adds_the_delta_kernels_arithmetic_to_dq_and_keeps_its_occupancy(variant, D):
    """delta_form fused (the default): no delta launch, the dQ kernel launched before dK/dV with FUSE_DELTA; compiled
    for sm_90 at GPT-2S's shape (D64; D128 at T2048), its floating-point instructions (opcodes with modifiers,
    counted) are exactly the unfused dQ kernel's plus the delta kernel's (the same products and sums, contracted
    alike), its row sum of dO*O is laid out as the delta kernel's (the same order of summation: the same bits), and
    as many of its programs fit on an SM (the same registers' and shared memory's limit)."""
    ks = _script()
    assert ks.delta_of("fa2:delta_form=kernel") == "kernel" and ks.delta_of("fa2") == "fused"
    assert ks.parse_variant(f"{variant}:delta_form=kernel") == ks.parse_variant(variant)
    shape = (16, 12, 1024, 64) if D == 64 else (8, 16, 2048, 128)
    fused = {c[0]: c for c in ks.record_variant(variant, shape)}
    apart = {c[0]: c for c in ks.record_variant(f"{variant}:delta_form=kernel", shape)}
    assert list(fused) == ["_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"]
    assert list(apart) == ["_fwd_kernel", "_bwd_delta_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"]
    assert fused["_bwd_dq_kernel"][3]["FUSE_DELTA"] is True and apart["_bwd_dq_kernel"][3]["FUSE_DELTA"] is False
    got = {k: ks.compile_counts(*c[1:], 90) for k, c in (("fused", fused["_bwd_dq_kernel"]),
                                                          ("dq", apart["_bwd_dq_kernel"]),
                                                          ("delta", apart["_bwd_delta_kernel"]))}
    ops = {k: _arithmetic(ks.fp_ops(v["sass"])) for k, v in got.items()}
    want = {op: ops["dq"].get(op, 0) + ops["delta"].get(op, 0) for op in set(ops["dq"]) | set(ops["delta"])}
    assert ops["fused"] == want and ops["delta"]  # (the delta kernel has arithmetic to add)
    assert got["fused"]["ctas_per_sm"]["ctas"] == got["dq"]["ctas_per_sm"]["ctas"]
    layouts = ks.reduce_layouts(*fused["_bwd_dq_kernel"][1:])
    assert layouts == ks.reduce_layouts(*apart["_bwd_delta_kernel"][1:]) and len(layouts) == 1
    assert ks.reduce_layouts(*apart["_bwd_dq_kernel"][1:]) == []  # (the unfused dQ kernel sums no FP32 row)


@pytest.mark.parametrize("variant", ["fa2", "paper_bf16:counters=true", "fa2:softmax=stabilized:counters=true"])
def test_the_scores_ahead_form_reorders_the_forward_and_keeps_its_arithmetic(variant):
    """`gemm=ahead` records the forward in score_gemm_form("ahead")'s scope (AHEAD on; the default: off). Compiled
    for sm_90 (B2 H2 T256 D64), the ahead form issues the same GEMMs (HGMMA count) and the same floating-point
    instructions, counted with their modifiers, as inline: it moves each QK^T a tile earlier and computes nothing
    else (whether ptxas then overlaps the GEMM or serializes it, wgmma_groups, depends on its version)."""
    ks = _script()
    assert ks.gemm_of(f"{variant}:gemm=ahead") == "ahead" and ks.gemm_of(variant) == "inline"
    assert ks.parse_variant(f"{variant}:gemm=ahead") == ks.parse_variant(variant)
    got = {}
    for form in ("inline", "ahead"):
        name, fn, args, kw = [c for c in ks.record_variant(f"{variant}:gemm={form}", (2, 2, 256, 64))
                              if c[0] == "_fwd_kernel"][0]
        assert kw["AHEAD"] is (form == "ahead") and kw["BLOCK_M"] == kw["BLOCK_N"]
        got[form] = ks.compile_counts(fn, args, kw, 90)
    assert got["ahead"]["HGMMA"] == got["inline"]["HGMMA"] > 0
    assert ks.fp_ops(got["ahead"]["sass"]) == ks.fp_ops(got["inline"]["sass"])
    assert got["ahead"]["sass"] != got["inline"]["sass"]  # the form reached the kernel


def test_wgmma_groups_tells_a_serialized_kernel_apart_and_counts_the_exps_a_gemm_overlaps():
    """Four k-steps of one GEMM in one commit group: overlappable; each HGMMA closing its own group (ptxas's
    C7511 serialization): serialized; no HGMMA at all: neither. ex2_under_wgmma: the MUFU.EX2s between a group's
    first HGMMA and the next wait, none before or after."""
    ks = _script()
    one = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"] + ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"] * 2 \
        + ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert ks.wgmma_groups(["MUFU.EX2 R1, R2"] + one + ["FMUL R1, R2, R3", "MUFU.EX2 R1, R2"]) == dict(
        wgmma_groups=1, wgmma_serialized=False, ex2_under_wgmma=0)
    overlapped = one[:2] + ["MUFU.EX2 R1, R2", "FMUL R1, R2, R3", "MUFU.EX2 R3, R4"] + one[2:]
    assert ks.wgmma_groups(overlapped) == dict(wgmma_groups=1, wgmma_serialized=False, ex2_under_wgmma=2)
    each = [x for h in one[:4] for x in ((h if h.endswith("gsb0") else h + ", gsb0"), "WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert ks.wgmma_groups(each) == dict(wgmma_groups=4, wgmma_serialized=True, ex2_under_wgmma=0)
    assert ks.wgmma_groups(["FFMA R1, R2, R3, R4"]) == dict(wgmma_groups=0, wgmma_serialized=False, ex2_under_wgmma=0)


def test_fwd_launch_records_the_forward_with_those_tiles_warps_and_stages_and_refuses_a_malformed_one():
    ks = _script()
    name, fn, args, kw = [c for c in ks.record_variant("fa2:fwd_launch=64,64,4,2", (2, 2, 1024, 64))
                          if c[0] == "_fwd_kernel"][0]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (64, 64, 4, 2)
    assert ks.fwd_launch_table("fa2", ks.parse_variant("fa2"), (2, 2, 1024, 64)) == {}
    with pytest.raises(SystemExit, match=r"fwd_launch='64,64' is not allowed: expected BLOCK_M,BLOCK_N,num_warps,"):
        ks.record_variant("fa2:fwd_launch=64,64", (2, 2, 1024, 64))
