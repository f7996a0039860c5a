"""The plain-PyTorch flash attention emulator: exactness in FP64, recipe rounding, knobs, counters, validation."""
import math

import pytest
import torch
import torch.nn.functional as F

import flash_forensics.kernels.emulator
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import capture_forward, flash_attention, reference_attention
from flash_forensics.kernels.recipes import resolve, round_to
from flash_forensics.kernels.stats import AttnStats

F64 = torch.float64


def rand_qkv(B=2, H=3, T=50, D=16, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(B, H, T, D, generator=g, dtype=F64)).to(dtype) for _ in range(3)]


def tie_qkv(B=1, H=2, T=40, D=8, seed=0):
    """Scores S[i, j] = s_i * x_j exactly (float64): many repeated maxima, positive and negative, plus causal masking.

    x_j from {-2, -1, 1, 2} (the first keys negative, so early rows have negative maxima),
    s_i from {-1.5, -0.5, 0.5, 1.5}.
    """
    g = torch.Generator().manual_seed(seed)
    xs = torch.tensor([-2.0, -1.0, 1.0, 2.0], dtype=F64)
    ss = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=F64)
    x = xs[torch.randint(0, 4, (B, H, T), generator=g)]
    x[..., :3] = torch.tensor([-1.0, -1.0, -2.0], dtype=F64)
    s = ss[torch.randint(0, 4, (B, H, T), generator=g)]
    q = torch.randn(B, H, T, D, generator=g, dtype=F64)
    k = torch.zeros(B, H, T, D, dtype=F64)
    q[..., 0] = s * math.sqrt(D)
    k[..., 0] = x
    q[..., 1:] = 0.0
    v = torch.randn(B, H, T, D, generator=g, dtype=F64)
    return q, k, v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def grads(q, k, v, cfg, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, cfg)
    o.backward(do.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------ FP64 exactness
TILINGS = [dict(tiling=False), dict(block_q=16, block_k=8), dict(block_q=8, block_k=16), dict(block_q=7, block_k=7)]


@pytest.mark.parametrize("tiling", TILINGS)
def test_fp64_matches_sdpa_and_softmaxes_agree_on_repeated_maxima(tiling):
    q, k, v = tie_qkv(B=2, H=2, T=40)
    cap = capture_forward(q, k, v, AttentionKnobs(recipe="fp32", **tiling))
    assert sum(int(t["rep"].sum()) for t in cap["tiles"]) > 0  # Algorithm 3 fires somewhere
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), -math.inf)
    rowmax = s.amax(-1)
    repeated = ((s == rowmax[..., None]).sum(-1) > 1)
    assert (repeated & (rowmax > 0)).any() and (repeated & (rowmax < 0)).any()
    safe = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", softmax="safe", **tiling))
    for beta in (1.5, 2.0, 8.0):
        stab = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", softmax="stabilized", beta=beta, **tiling))
        assert (stab - safe).abs().max().item() < 1e-12
    assert (safe - sdpa(q, k, v)).abs().max().item() < 1e-12


@pytest.mark.parametrize("softmax", ["safe", "stabilized"])
def test_fp64_deltas_agree_and_match_sdpa_gradients(softmax):
    q, k, v = tie_qkv(B=1, H=2, T=33, D=8)
    q = q + 0.3 * torch.randn_like(q)  # mix tied and generic rows
    do = torch.randn_like(q)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    sdpa(qr, kr, vr).backward(do)
    ref = (qr.grad, kr.grad, vr.grad)
    for delta in ("dO_O", "dP_P", "recompute_fp32"):
        _, *g = grads(q, k, v, AttentionKnobs(recipe="fp32", softmax=softmax, delta=delta, block_q=8, block_k=4), do)
        for a, b in zip(g, ref):
            assert (a - b).abs().max().item() < 1e-12, delta


@pytest.mark.parametrize("softmax", ["safe", "stabilized"])
@pytest.mark.parametrize("tiling", [dict(tiling=False), dict(block_q=4, block_k=3)])
@pytest.mark.parametrize("delta", ["dO_O", "dP_P", "recompute_fp32"])
def test_gradcheck(softmax, tiling, delta):
    q, k, v = tie_qkv(B=1, H=2, T=9, D=4, seed=1)
    q = q + 0.05 * torch.randn_like(q)
    cfg = AttentionKnobs(recipe="fp32", softmax=softmax, delta=delta, **tiling)
    inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, cfg), inputs, eps=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------ stabilized softmax
@pytest.mark.parametrize("recipe", ["fp32", "paper_bf16"])
@pytest.mark.parametrize("tiling", [dict(tiling=False), dict(block_q=8, block_k=8)])
def test_stabilized_removes_pbar_equal_one_in_repeated_rows(recipe, tiling):
    q, k, v = tie_qkv(B=2, H=2, T=40)
    dt = F64 if recipe == "fp32" else torch.bfloat16
    q, k, v = (x.to(dt) for x in (q, k, v))
    checked = 0
    for softmax in ("safe", "stabilized"):
        cap = capture_forward(q, k, v, AttentionKnobs(recipe=recipe, softmax=softmax, beta=2.0, **tiling))
        for t in cap["tiles"]:
            ones = (t["p_bar"] == 1.0).sum(-1, keepdim=True)  # per row of the tile
            rep = t["rep"]
            if softmax == "safe":  # repeated maxima that are the running max give several P̄ = 1
                assert (ones[rep & (t["rm"] == t["m"])] >= 2).all()
            else:
                assert (ones[rep] == 0).all()
            checked += int(rep.sum())
    assert checked > 0


# ------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2"])
def test_low_precision_recipes_agree_with_fp32(recipe):
    q, k, v = rand_qkv(B=2, H=3, T=100, D=32, seed=3)
    do = torch.randn_like(q)
    ref = grads(q, k, v, AttentionKnobs(recipe="fp32", block_q=32, block_k=32), do)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    for tiling in (dict(block_q=32, block_k=16), dict(tiling=False)):
        out = grads(qb, kb, vb, AttentionKnobs(recipe=recipe, **tiling), do)
        assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.bfloat16
        for a, b in zip(out, ref):
            assert 0 < rel(a, b) < 2e-2  # BF16 tolerance, and not accidentally exact


def test_tiling_changes_only_rounding():
    q, k, v = rand_qkv(B=1, H=2, T=70, D=32, seed=4)
    on = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", block_q=16, block_k=32))
    off = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", tiling=False))
    assert (on - off).abs().max().item() < 1e-13
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    on = flash_attention(qb, kb, vb, AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=32))
    off = flash_attention(qb, kb, vb, AttentionKnobs(recipe="paper_bf16", tiling=False))
    assert not torch.equal(on, off) and rel(on, off) < 1e-2


def test_paper_bf16_stores_bf16_values_and_fa2_rounds_once():
    q, k, v = rand_qkv(B=1, H=2, T=64, D=32, dtype=torch.bfloat16, seed=5)
    cap = capture_forward(q, k, v, AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16))
    for name in ("o_bar", "l", "m", "o_saved"):
        x = cap[name]
        assert torch.equal(round_to(x, torch.bfloat16), x), name  # stored in BF16
    cap = capture_forward(q, k, v, AttentionKnobs(recipe="fa2", block_q=16, block_k=16))
    assert not torch.equal(round_to(cap["o_bar"], torch.bfloat16), cap["o_bar"])  # FP32 accumulator
    assert resolve("fp32", F64).work == F64 and resolve("fp32", torch.bfloat16).work == torch.float32


def test_o_fp32_heads_change_only_those_heads():
    q, k, v = rand_qkv(B=2, H=3, T=48, D=32, dtype=torch.bfloat16, seed=6)
    do = torch.randn(q.shape, dtype=F64)
    base_cfg = AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16)
    head_cfg = AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16, o_fp32_heads=[1])
    base = grads(q, k, v, base_cfg, do)
    head = grads(q, k, v, head_cfg, do)
    cb, ch = capture_forward(q, k, v, base_cfg), capture_forward(q, k, v, head_cfg)
    others = [0, 2]
    assert torch.equal(cb["lse"], ch["lse"])  # m and l untouched
    assert torch.equal(cb["o_saved"][:, others], ch["o_saved"][:, others])
    assert not torch.equal(cb["o_saved"][:, 1], ch["o_saved"][:, 1])
    assert not torch.equal(round_to(ch["o_saved"][:, 1], torch.bfloat16), ch["o_saved"][:, 1])  # stored FP32
    for a, b in zip(base, head):  # returned O and all gradients
        assert torch.equal(a[:, others], b[:, others])
    for a, b in zip(base[1:3], head[1:3]):  # dQ, dK see delta; dV = P^T dO does not
        assert not torch.equal(a[:, 1], b[:, 1])
    assert torch.equal(base[3], head[3])
    every = grads(q, k, v, AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16, o_fp32=True), do)
    assert torch.equal(every[1][:, 1], head[1][:, 1])


def test_pv_fp32_lifts_only_the_pv_path():
    q, k, v = rand_qkv(B=1, H=2, T=48, D=32, dtype=torch.bfloat16, seed=7)
    base = capture_forward(q, k, v, AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16))
    pv = capture_forward(q, k, v, AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16, pv_fp32=True))
    assert torch.equal(base["lse"], pv["lse"]) and torch.equal(base["m"], pv["m"])
    assert not torch.equal(round_to(pv["o_bar"], torch.bfloat16), pv["o_bar"])  # accumulator FP32
    assert torch.equal(round_to(pv["o_saved"], torch.bfloat16), pv["o_saved"])  # stored O still BF16
    assert not torch.equal(base["o"], pv["o"])


# ------------------------------------------------------------------------------------------ claim 3: the bias
def bias_inputs(B=2, H=2, T=256, D=64, hot=3, seed=0):
    """Rows with `hot` exact maxima (P̄ = 1) among the first T/4 keys, the other scores 9-14 below (P̄ tiny),
    V mostly negative (85%), V at the maxima in [-2.5, -2) (same binade: their sums overflow the significand)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, T, D, dtype=F64)
    q[..., 0] = math.sqrt(D)  # S = x exactly, also in BF16
    x = 3.0 - (9.0 + 5.0 * torch.rand(B, H, T, generator=g, dtype=F64))
    hot_idx = torch.stack([torch.randperm(T // 4, generator=g)[:hot] for _ in range(B * H)]).view(B, H, hot)
    x.scatter_(-1, hot_idx, 3.0)
    k = torch.zeros(B, H, T, D, dtype=F64)
    k[..., 0] = x.to(torch.bfloat16).double()
    sign = torch.where(torch.rand(B, H, T, D, generator=g) < 0.85, -1.0, 1.0).double()
    v = sign * (0.2 + 2.3 * torch.rand(B, H, T, D, generator=g, dtype=F64))
    hv = -(2.0 + 0.5 * torch.rand(B, H, T, D, generator=g, dtype=F64))
    hm = torch.zeros(B, H, T, 1, dtype=torch.bool)
    hm.scatter_(2, hot_idx.unsqueeze(-1), True)
    v = torch.where(hm, hv, v).to(torch.bfloat16).double()
    return q, k, v, T // 4


@pytest.mark.parametrize("hot", [2, 4])
def test_claim3_negative_bias_from_pbar_ones_and_pv_fp32_removes_it(hot):
    q, k, v, r0 = bias_inputs(hot=hot)
    hp = capture_forward(q, k, v, AttentionKnobs(recipe="fp32", tiling=False))
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    lp = capture_forward(qb, kb, vb, AttentionKnobs(recipe="paper_bf16", tiling=False))
    pv = capture_forward(qb, kb, vb, AttentionKnobs(recipe="paper_bf16", tiling=False, pv_fp32=True))
    rows = slice(r0, None)  # rows that see all the maxima
    err_o = (lp["o"].double() - hp["o"])[:, :, rows].mean().item()
    err_obar = (lp["o_bar"].double() - hp["o_bar"])[:, :, rows].mean().item()
    err_obar_pv = (pv["o_bar"].double() - hp["o_bar"])[:, :, rows].mean().item()
    assert err_o < 0 and err_obar < 0
    assert abs(err_obar_pv) < abs(err_obar) / 100


# ------------------------------------------------------------------------------------------ counters
def counter_inputs(T=48, D=16, hot=((5, 9), (0, 30), (20, 21))):
    """Head h: key scores -(1 + j/16) (distinct, also in BF16) except two keys at +1: row i has a repeated maximum
    exactly when it sees both, so head h has T - hot[h][1] such rows."""
    H = len(hot)
    x = -(1.0 + torch.arange(T, dtype=F64) / 16).repeat(1, H, 1)
    for h, (a, b) in enumerate(hot):
        x[0, h, [a, b]] = 1.0
    q = torch.zeros(1, H, T, D, dtype=F64)
    q[..., 0] = math.sqrt(D)
    k = torch.zeros(1, H, T, D, dtype=F64)
    k[..., 0] = x
    v = torch.randn(1, H, T, D, dtype=F64)
    return q, k, v, [T - b for _, b in hot]


@pytest.mark.parametrize("recipe", ["fp32", "fa2", "paper_bf16"])
@pytest.mark.parametrize("softmax", ["safe", "stabilized"])
def test_counters_count_repeated_maxima_rows(recipe, softmax):
    q, k, v, expect = counter_inputs()
    if recipe != "fp32":
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    st = AttnStats(3)
    flash_attention(q, k, v, AttentionKnobs(recipe=recipe, softmax=softmax, tiling=False), st)
    assert st.repeated_max_rows.tolist() == expect
    assert st.max_logit.item() == 1.0
    flash_attention(q, k, v, AttentionKnobs(recipe=recipe, softmax=softmax, tiling=False), st)  # accumulates
    assert st.repeated_max_rows.tolist() == [2 * e for e in expect]
    st.reset()
    # tiled: the hot pair of head 0 (5, 9) shares key tile 0 with block 16: rows 9..47 count in that tile only;
    # head 1's keys (0, 30) never share a tile; head 2's (20, 21) share tile 1: rows 21..47.
    flash_attention(q, k, v, AttentionKnobs(recipe=recipe, softmax=softmax, block_q=16, block_k=16), st)
    assert st.repeated_max_rows.tolist() == [48 - 9, 0, 48 - 21]
    assert st.rows_seen.tolist() == [16 * 1 + 16 * 2 + 16 * 3] * 3
    st.reset()
    assert st.repeated_max_rows.tolist() == [0, 0, 0] and st.max_logit.item() == -math.inf


def test_counters_off_leaves_stats_untouched():
    q, k, v, _ = counter_inputs()
    st = AttnStats(3)
    flash_attention(q, k, v, AttentionKnobs(recipe="fp32", counters=False), st)
    assert st.repeated_max_rows.tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------------------ validation
BAD = [
    (dict(recipe="bf16"), "recipe", "bf16"),
    (dict(softmax="stabilized", beta=1.0), "beta", "1.0"),
    (dict(eps=0.0), "eps", "0.0"),
    (dict(o_fp32_heads=[3]), "o_fp32_heads", "[3]"),
    (dict(block_q=0), "block_q", "0"),
    (dict(block_k=-4), "block_k", "-4"),
    (dict(delta="dOO"), "delta", "dOO"),
]


@pytest.mark.parametrize("knobs,key,value", BAD)
def test_bad_knobs_rejected_before_computing(monkeypatch, knobs, key, value):
    def boom(*a, **k):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(flash_forensics.kernels.emulator, "forward", boom)
    q, k, v = rand_qkv(B=1, H=3, T=8, D=8)
    with pytest.raises(ValueError) as e:
        flash_attention(q, k, v, AttentionKnobs(**knobs))
    msg = str(e.value)
    assert key in msg and value in msg and "expected" in msg


@pytest.mark.parametrize("case", ["k_shape", "v_dtype", "q_dims", "int_dtype", "stats_heads"])
def test_bad_inputs_rejected(monkeypatch, case):
    monkeypatch.setattr(flash_forensics.kernels.emulator, "forward",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    q, k, v = rand_qkv(B=1, H=3, T=8, D=8)
    stats, name = None, None
    if case == "k_shape":
        k, name = k[:, :, :5], "k.shape"
    elif case == "v_dtype":
        v, name = v.float(), "v.dtype"
    elif case == "q_dims":
        q, name = q[0], "q.shape"
    elif case == "int_dtype":
        q, k, v, name = q.long(), k.long(), v.long(), "q.dtype"
    else:
        stats, name = AttnStats(2), "stats"
    with pytest.raises(ValueError) as e:
        flash_attention(q, k, v, AttentionKnobs(recipe="fp32"), stats)
    assert name in str(e.value) and "expected" in str(e.value)


def test_autocast_does_not_change_the_recipe():
    q, k, v = rand_qkv(B=1, H=2, T=40, D=32, dtype=torch.bfloat16, seed=8)
    cfg = AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16)
    plain = flash_attention(q, k, v, cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = flash_attention(q, k, v, cfg)
    assert torch.equal(plain, auto)
    o, lse, dq, dk, dv = reference_attention(q, k, v, cfg, do=torch.ones_like(q))
    assert torch.equal(o, plain) and lse.shape == (1, 2, 40) and dq.dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_matches_cpu_up_to_accumulation_order():
    q, k, v = rand_qkv(B=2, H=4, T=200, D=64, dtype=torch.bfloat16, seed=9)
    do = torch.randn(q.shape, dtype=F64)
    for recipe in ("paper_bf16", "fa2", "fp32"):
        cfg = AttentionKnobs(recipe=recipe, block_q=64, block_k=64)
        cpu = grads(q, k, v, cfg, do)
        st = AttnStats(4, "cuda")
        qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
        o = flash_attention(qc, kc, vc, cfg, st)
        o.backward(do.cuda().to(o.dtype))
        for a, b in zip(cpu, (o, qc.grad, kc.grad, vc.grad)):
            assert rel(b.detach().cpu(), a) < 1e-2


def autocast_transcription(q, k, v):
    """The paper's untiled forward written op by op with native BF16 tensors, each op in the dtype CUDA autocast
    gives it (GEMMs BF16 in/out, exp and sum FP32, in-place buffers BF16): an independent check of the emulator."""
    T = q.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # BF16 GEMM, then a BF16 op
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.finfo(torch.bfloat16).max)
    m = s.amax(-1, keepdim=True)
    p = torch.exp((s - m).float())  # BF16 subtraction, exp on autocast's FP32 list
    l = p.sum(-1, keepdim=True).clamp(min=1e-10).bfloat16()  # FP32 sum copied into the BF16 row-sum buffer
    o = torch.matmul(p.bfloat16(), v)  # autocast casts P̄ to BF16 for the GEMM
    return o / l


def test_paper_bf16_matches_an_op_by_op_autocast_transcription():
    q, k, v = rand_qkv(B=2, H=2, T=96, D=64, dtype=torch.bfloat16, seed=10, scale=1.5)
    ours = flash_attention(q, k, v, AttentionKnobs(recipe="paper_bf16", tiling=False))
    ref = autocast_transcription(q, k, v)
    same = (ours == ref).double().mean().item()
    ulp = (ours.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)
    assert same > 0.98 and ulp.max().item() <= 2 ** -7 + 1e-9  # equal up to GEMM summation order (<= 1 ulp)
