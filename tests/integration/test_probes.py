"""Mechanism probes (kernels/probes.py, orchestrator/monitor/probes/): the delta error's bias and where it comes from,
the tie classification, the cumulative sum across probes and checkpoints, the probe math against brute force, config
validation, and that a run with probes on trains bit-identically to one with probes off (CPU)."""
import itertools
import math

import pytest
import torch

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.kernels import emulator
from flash_forensics.kernels import probes as P
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.monitor.probes.config import ProbesConfig
from flash_forensics.orchestrator.monitor.probes.runner import Probes

F64 = torch.float64


def tied_inputs(B=8, H=4, T=256, D=64, seed=0, block=64, ties=True):
    """q, k, v (BF16). ties: in every key tile of `block` keys the first two keys are one shared key kk, and half the
    rows query 3 * kk, so their max repeats (P̄ = 1 twice per tile) with every other P̄ small but nonzero; the other
    rows (and all rows with ties=False) are random queries. V in [-2, -1): negative, one binade."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, H, T, D, generator=g)
    if ties:
        kk = torch.randn(B, H, 1, D, generator=g)
        k = torch.where((torch.arange(T) % block < 2)[:, None], kk, k)
        q = torch.where(torch.rand(B, H, T, 1, generator=g) < 0.5, 3 * kk.expand_as(q), q)
    v = -(1 + torch.rand(B, H, T, D, generator=g))
    return [t.bfloat16() for t in (q, k, v)]


def exact_do(shape, seed=9):
    """dO = -2^-j (j in 0..2): negative like O's error direction, and exact products dO * O in BF16, so delta_prod
    rounding adds nothing and e is the O error alone."""
    g = torch.Generator().manual_seed(seed)
    return -(2.0 ** -torch.randint(0, 3, shape, generator=g).double()).bfloat16()


def probe_stats(q, k, v, knobs):
    o = emulator.forward(q, k, v, knobs)[0]
    o64 = P.fp64_attention(q, k, v)[0]
    do = exact_do(o64.shape)
    e = P.delta_recipe(q, k, v, o, do, knobs) - (do.to(F64) * o64).sum(-1)
    tie, exact = P.tie_rows(q, k, knobs)
    return {name: float(t) for name, t in P.error_stats(e, tie, exact).items()}, tie


def test_delta_error_is_positive_and_comes_from_the_pbar_one_rows():
    q, k, v = tied_inputs()
    bf16, tie = probe_stats(q, k, v, AttentionKnobs(recipe="paper_bf16"))
    assert 0.4 < float(tie.float().mean()) < 0.7  # about half the rows tie, the rest do not
    assert bf16["delta_err_mean"] > 0 and bf16["delta_err_t"] > 5
    assert 0.9 < bf16["tie_share_signed"] < 1.1  # almost all of the signed error is in the P̄ = 1 rows
    assert bf16["tie_rows_exact"] > 0.9 * float(tie.sum())  # identical keys: ties exact in FP32
    # P̄V in FP32 removes the rounding of the P̄V sums and the accumulator: the bias drops by more than a third, but
    # does not vanish (the BF16 O store rounds the same half-ulp sums with the same sticky bits; README / report)
    pv, _ = probe_stats(q, k, v, AttentionKnobs(recipe="paper_bf16", pv_fp32=True))
    assert pv["delta_err_mean"] < 0.7 * bf16["delta_err_mean"]
    # O stored in FP32 as well (o_fp32): the bias vanishes
    o32, _ = probe_stats(q, k, v, AttentionKnobs(recipe="paper_bf16", o_fp32=True))
    assert abs(o32["delta_err_t"]) < 3 and abs(o32["delta_err_mean"]) < 0.1 * bf16["delta_err_mean"]


def test_without_ties_the_tie_share_is_about_zero():
    q, k, v = tied_inputs(B=4, ties=False)
    st, tie = probe_stats(q, k, v, AttentionKnobs(recipe="paper_bf16"))
    assert float(tie.float().mean()) < 0.05  # only near-ties that BF16 scores create
    # no bias without ties, so the signed share (a ratio over a sum near zero) is ill-conditioned: it is not checked;
    # the tie rows (near-ties found within and across key tiles) carry about their row share of |e|
    assert abs(st["delta_err_t"]) < 3
    assert st["tie_share_abs"] < 0.05
    assert st["tie_rows_exact"] == 0


def test_ties_exact_in_fp32_or_created_by_bf16_scores():
    # row 1 of head 0 sees keys scoring 200 and 200.5 (200.5 rounds to 200 in BF16: a created tie); head 1 sees two
    # identical keys (an exact tie); row 0 sees one key (no tie)
    q = torch.zeros(1, 2, 2, 4)
    q[..., 1, :2] = 1.0
    k = torch.zeros(1, 2, 2, 4)
    k[..., 0] = 200.0
    k[0, 0, 1, 1] = 0.5
    tie, exact = P.tie_rows(q.bfloat16(), k.bfloat16(), AttentionKnobs(recipe="paper_bf16"))
    assert tie.tolist() == [[[False, True], [False, True]]]
    assert exact.tolist() == [[[False, False], [False, True]]]
    # the fa2 recipe keeps scores in FP32: no created tie, the exact one stays
    tie32, exact32 = P.tie_rows(q.bfloat16(), k.bfloat16(), AttentionKnobs(recipe="fa2"))
    assert tie32.tolist() == exact32.tolist() == [[[False, False], [False, True]]]


def test_delta_recipe_follows_the_delta_mode():
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 2, 64, 16, generator=g).bfloat16() for _ in range(4))
    o64 = P.fp64_attention(q, k, v)[0]
    d64 = (do.to(F64) * o64).sum(-1)
    errs = {}
    for mode in ("dO_O", "dP_P", "recompute_fp32"):
        knobs = AttentionKnobs(recipe="fa2", delta=mode, block_q=16, block_k=16)  # FP32 scores and stats
        o = emulator.forward(q, k, v, knobs)[0]
        errs[mode] = float((P.delta_recipe(q, k, v, o, do, knobs) - d64).abs().max())
    # only dO_O reads the BF16 O; the other two build delta from P in FP32
    assert errs["recompute_fp32"] < 1e-4 and errs["dP_P"] < 1e-4 and errs["dO_O"] > 1e-3
    knobs = AttentionKnobs(recipe="fp32")
    o = emulator.forward(q.float(), k.float(), v.float(), knobs)[0]
    assert float((P.delta_recipe(q.float(), k.float(), v.float(), o, do.float(), knobs) - d64).abs().max()) < 1e-5


def test_probe_math_against_brute_force():
    g = torch.Generator().manual_seed(5)
    B, H, T, D, C = 2, 3, 6, 4, 5
    q, k, v, do = (torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(4))
    x = torch.randn(B, T, C, generator=g, dtype=F64)
    o, p, s = P.fp64_attention(q, k, v)
    # FP64 backward against autograd
    qq = q.clone().requires_grad_(True)
    (dq_auto,) = torch.autograd.grad(P.fp64_attention(qq, k, v)[0], qq, do)
    assert torch.allclose(P.fp64_dq(p, k, v, do, (do * o).sum(-1)), dq_auto, atol=1e-12)
    # PK-X similarity: the mean over pairs of distinct tokens of cos((PK)[T] x[T]^T, (PK)[T'] x[T']^T)
    pk = p @ k
    for h in range(H):
        vals = []
        for b in range(B):
            mats = [torch.outer(pk[b, h, t], x[b, t]).reshape(-1) for t in range(T)]
            vals += [float(mats[i] @ mats[j] / (mats[i].norm() * mats[j].norm()))
                     for i, j in itertools.permutations(range(T), 2)]
        assert math.isclose(float(P.pkx_similarity(p, k, x)[h]), sum(vals) / len(vals), rel_tol=1e-9)
    # max logit and entropy per head
    ml, ent = P.logit_entropy(p, s)
    assert torch.allclose(ml, torch.stack([s[:, h][torch.isfinite(s[:, h])].max() for h in range(H)]))
    want = torch.stack([torch.stack([-(r[r > 0] * r[r > 0].log()).sum() for r in p[:, h].reshape(-1, T)]).mean()
                        for h in range(H)])
    assert torch.allclose(ent, want)
    # E maps the dq difference through X per head; its projection on W_Q's top singular pair
    dq2 = dq_auto + torch.randn(B, H, T, D, generator=g, dtype=F64) * 1e-3
    E = P.wq_grad_error(x, dq2, dq_auto)
    assert torch.allclose(E[1], sum((dq2 - dq_auto)[b, 1].T @ x[b] for b in range(B)))
    w = torch.randn(H, D, C, generator=g, dtype=F64)
    u, sv, vh = torch.linalg.svd(w)
    assert torch.allclose(P.top_pair_projection(w, w), sv[:, 0])  # u1^T W v1 = sigma_1 > 0: the sign convention
    assert math.isclose(float(P.cosine(E, 2 * E)), 1.0, rel_tol=1e-12)


def _tiny_gpt(n_layer=2):
    from flash_forensics.models.gpt import GPT
    torch.manual_seed(0)
    return GPT(dict(name="tiny", n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=64),
               dict(recipe="paper_bf16", block_q=8, block_k=8))


def test_cumulative_sum_is_exact_on_a_scripted_sequence_and_survives_a_checkpoint(monkeypatch):
    script = [0.5, -0.25, 1.5e-3, 0.125, -2.0 ** -20, 7.0]  # per probe, layer 1 gets twice layer 0's value
    model = _tiny_gpt()

    def probes():
        pr = Probes(model, ProbesConfig(enabled=True, every=2), batch=None, device="cpu")
        it = iter(script)

        def compute():
            m = next(it)
            return {0: {"delta_err_mean": torch.tensor(m, dtype=F64)},
                    1: {"delta_err_mean": torch.tensor(2 * m, dtype=F64)}}
        monkeypatch.setattr(pr, "compute", compute)
        return pr, it

    pr, _ = probes()
    got = [pr.step_end(s) for s in range(12)]
    assert [s for s, m in enumerate(got) if m is not None] == [0, 2, 4, 6, 8, 10]  # no work on other steps
    sums = list(itertools.accumulate(script))
    assert [m[record.probe_name("delta_err_cumsum", 0)] for m in got if m] == sums  # exact: same float additions
    assert [m[record.probe_name("delta_err_cumsum", 1)] for m in got if m] == list(itertools.accumulate(
        2 * x for x in script))
    # a checkpoint after the third probe, restored into a fresh Probes, continues the same sums
    a, _ = probes()
    for s in range(5):
        a.step_end(s)
    state = a.state_dict()
    b, it = probes()
    for _ in range(3):
        next(it)
    b.load_state_dict(state)
    rest = [b.step_end(s) for s in range(5, 12)]
    assert [m[record.probe_name("delta_err_cumsum", 0)] for m in rest if m] == sums[3:]
    c = Probes(model, ProbesConfig(enabled=True, every=100), batch=None, device="cpu")
    assert c.due(7, checkpoint=True) and not c.due(7) and c.due(100)
    off = Probes(model, ProbesConfig(enabled=False), batch=None, device="cpu")
    assert not off.due(0, checkpoint=True) and off.step_end(0, checkpoint=True) is None


def test_probe_pass_touches_neither_grads_nor_rng_nor_counters():
    model = _tiny_gpt()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g))
    _, loss = model(*batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    counters = [s.snapshot() for s in model.attention_stats()]
    rng = torch.get_rng_state()
    pr = Probes(model, ProbesConfig(enabled=True, every=1), batch=batch, device="cpu", precision="bf16")
    m = pr.step_end(0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, g0) for p, g0 in zip(model.parameters(), grads))
    for s, snap in zip(model.attention_stats(), counters):
        assert all(torch.equal(a, b) for a, b in zip(_flat(s.snapshot()), _flat(snap)))
    assert model.training and all(b.attn.probe_capture is None for b in model.transformer.h)
    names = set(m)
    for layer in range(2):
        for kind in ("delta_err_mean", "delta_err_t", "delta_err_cumsum", "tie_share_abs", "tie_rows_exact"):
            assert record.probe_name(kind, layer) in names
        for kind in record.PROBE_HEAD_KINDS:
            assert {record.probe_name(kind, layer, h) for h in range(2)} <= names
    assert all(math.isfinite(m[record.probe_name(k, 0, 1)]) for k in ("max_logit", "entropy", "pkx_cos",
                                                                      "wq_err_proj"))
    # the second probe has a predecessor; with no update in between the probe is deterministic: E repeats, cos = 1
    m2 = pr.step_end(1)
    assert math.isclose(m2[record.probe_name("wq_err_cos", 1)], 1.0, rel_tol=1e-9)
    assert record.probe_name("wq_err_cos", 1) not in m


def _flat(snap):
    if torch.is_tensor(snap):
        return [snap]
    if isinstance(snap, dict):
        return [t for v in snap.values() for t in _flat(v)]
    if isinstance(snap, (list, tuple)):
        return [t for v in snap for t in _flat(v)]
    return [torch.tensor(snap)]


@pytest.mark.parametrize("override, key, allowed", [
    ("monitor.probes.every=0", "monitor.probes.every=0", "an integer > 0"),
    ("monitor.probes.batch=-1", "monitor.probes.batch=-1", "an integer > 0"),
    ("monitor.probes.layers=some", "monitor.probes.layers='some'", "'all' or a list"),
    ("monitor.probes.layers=[0,9]", "monitor.probes.layers=[0, 9]", "< model.n_layer=2"),
])
def test_config_errors_name_key_value_and_allowed(tmp_path, override, key, allowed):
    from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
    from tests.helpers.jobs import compose_cfg
    cfg, ov = compose_cfg(["experiment=smoke", "intervention=baseline", "monitor.probes.enabled=true"], tmp_path,
                          override)
    with pytest.raises((ConfigError, ValueError)) as err:
        validate_config(cfg, ov, check_store=False)
    assert key in str(err.value) and allowed in str(err.value) and "not allowed" in str(err.value)


def test_probes_on_leave_training_bit_identical(tmp_path):
    from mlflow.tracking import MlflowClient

    from tests.helpers.jobs import run_in
    base = ["experiment=smoke", "intervention=baseline", "train.max_steps=5", "train.ckpt_every=3",
            "train.eval_every=5", "model.n_layer=2"]
    off = run_in(base, tmp_path, "off")
    on = run_in(base, tmp_path, "on", "monitor.probes.enabled=true", "monitor.probes.every=2")
    assert off["error"] is None and on["error"] is None, (off["error"], on["error"])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")

    def hist(run, key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run["mlflow_run_id"], key),
                                                  key=lambda m: m.step)]
    for key in (record.LOSS, record.GRAD_NORM, record.VAL_LOSS, record.wq_sigma_name(1, 0),
                record.rmax_rows_name(0, 1)):
        assert hist(on, key) == hist(off, key), key
    assert on["final_loss"] == off["final_loss"]
    # probes at steps 0, 2, 4 (every 2) and at the checkpoint after step 2 and the last step 4
    assert [s for s, _ in hist(on, record.probe_name("delta_err_cumsum", 1))] == [0, 2, 4]
    assert not hist(off, record.probe_name("delta_err_mean", 0))
    state = torch.load(tmp_path / "on" / "checkpoints" / "last.pt", weights_only=False)
    cum = hist(on, record.probe_name("delta_err_cumsum", 1))[-1][1]
    assert math.isclose(state["probes"]["cumsum"][1], cum, rel_tol=1e-12)


def test_probe_plot_draws_runs_with_probes_and_skips_the_others(tmp_path):
    from flash_forensics.orchestrator.report import plots
    hist = {record.probe_name(kind, layer): [(s, (layer + 1) * 1e-4 * s) for s in (0, 100, 200)]
            for kind in record.PROBE_PLOTTED for layer in (0, 1)}
    path = plots.probes([("baseline", hist), ("no probes", {record.LOSS: [(0, 1.0)]})], tmp_path / "probes.png")
    assert path is not None and path.stat().st_size > 10_000
    assert plots.probes([("no probes", {record.LOSS: [(0, 1.0)]})], tmp_path / "none.png") is None
    assert all(name.startswith(record.HISTORY_PREFIXES) for name in hist)  # the report fetches what it plots
