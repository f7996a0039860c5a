"""The stabilizers as interventions: gated attention (a model patch with new parameters: a fork is
refused), z-loss (a model patch without parameters: a fork is allowed), stochastic rounding of P̄V and the O
accumulator (an emulator knob: unbiased, only its points change, deterministic), the stabilizers sweeps, and the
stabilizers table."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.kernels import knobs as knob_table
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import capture_forward, flash_attention
from flash_forensics.kernels.stochastic import stochastic_round, uniform16
from flash_forensics.models.attention import resolve_backend, route_name
from flash_forensics.models.gpt import GPT, ModelConfig, z_loss_term
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.job import fork
from tests.helpers import jobs as _jobs

SMOKE = ["experiment=smoke", "train.early_stop=false", "train.eval_every=4", "train.ckpt_every=4",
         "optimizer.decay_steps=8"]
BF16_ULP_1 = 2.0 ** -7  # the BF16 spacing in [1, 2)


def compose_cfg(tmp_path, *overrides):
    return _jobs.compose_cfg(SMOKE, tmp_path, *overrides)


def validated(tmp_path, *overrides):
    return validate_config(*compose_cfg(tmp_path, *overrides), check_store=False)


def _others(obj, names):
    return {k: v for k, v in vars(obj).items() if k not in names}


# ------------------------------------------------------------------------------------------ gated attention
def test_gated_attn_changes_the_model_as_named(tmp_path):
    base, base_att = validated(tmp_path, "intervention=baseline")
    obj, att = validated(tmp_path, "intervention=gated_attn")
    assert base.model.attn_gate is False and obj.model.attn_gate is True
    assert _others(obj.model, {"attn_gate"}) == _others(base.model, {"attn_gate"})
    assert att == base_att and obj.intervention.hooks == []
    gated, plain = GPT(obj.model, att).state_dict(), GPT(base.model, base_att).state_dict()
    added = set(gated) - set(plain)
    assert (added == {f"transformer.h.{i}.attn.gate.weight" for i in range(obj.model.n_layer)}
            and not set(plain) - set(gated))
    cfg = obj.model
    assert all(tuple(gated[n].shape) == (cfg.n_head, cfg.n_embd) for n in added)  # W_g: n_embd -> n_head
    with pytest.raises(ConfigError, match=r"model.attn_gate=False contradicts intervention=gated_attn, which sets "
                                          r"model.attn_gate=True"):
        validated(tmp_path, "intervention=gated_attn", "model.attn_gate=false")
    with pytest.raises(Exception, match=r"model.attn_gate=maybe"):  # typed: refused when Hydra composes it
        validated(tmp_path, "model.attn_gate=maybe")


def _pre_proj(attn, x):
    """The attention layer's output before c_proj, (B, T, C)."""
    seen = {}
    h = attn.c_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("y", a[0].detach().clone()))
    try:
        out = attn(x)
    finally:
        h.remove()
    return out, seen["y"]


def test_gated_attn_gates_each_head_by_its_sigmoid():
    """Forward shape, and the gate per head: head 0's output halves (gate logit 0), head 1's passes (logit 100,
    sigmoid = 1 in FP32), bit for bit against the same layer without the gate."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, bias=True)
    att = {"impl": "standard", "recipe": "fp32"}
    plain, gated = GPT(cfg, att), GPT(ModelConfig(**{**vars(cfg), "attn_gate": True}), att)
    gated.load_state_dict(plain.state_dict(), strict=False)
    g = gated.transformer.h[0].attn.gate
    with torch.no_grad():
        g.weight.zero_()
        g.bias.copy_(torch.tensor([0.0, 100.0]))
    idx = torch.randint(0, 64, (3, 8))
    logits, loss = gated(idx, idx)
    assert logits.shape == (3, 8, 64) and torch.isfinite(loss)
    x = torch.randn(3, 8, 16)
    _, y_plain = _pre_proj(plain.transformer.h[0].attn, x)
    _, y_gated = _pre_proj(gated.transformer.h[0].attn, x)
    D = cfg.head_dim
    assert torch.equal(y_gated[..., :D], 0.5 * y_plain[..., :D])  # sigmoid(0) = 0.5, exact
    assert torch.equal(y_gated[..., D:], y_plain[..., D:])
    assert not torch.equal(y_gated, y_plain)
    # the gate learns: W_g gets a gradient from the loss
    gated.zero_grad()
    gated(idx, idx)[1].backward()
    assert g.weight.grad is not None and g.weight.grad.abs().sum() > 0


def test_gated_attn_init_starts_near_half():
    torch.manual_seed(0)
    m = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=64, attn_gate=True))
    w = torch.stack([b.attn.gate.weight for b in m.transformer.h])
    assert abs(float(w.std()) - 0.02) < 0.005  # the model's std-0.02 init
    gate = torch.sigmoid(m.transformer.h[0].attn.gate(torch.randn(4, 8, 32)))
    assert (gate - 0.5).abs().max() < 0.1


# ------------------------------------------------------------------------------------------------ z-loss
def test_z_loss_term_value():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 3
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = targets[1, 4] = -1
    lse = torch.log(torch.exp(logits.double()).sum(-1))
    keep = targets != -1
    want = (lse[keep] ** 2).mean()
    assert abs(float(z_loss_term(logits, targets)) - float(want)) < 1e-5 * float(want)
    assert float(z_loss_term(logits + 2.0, targets)) > float(z_loss_term(logits, targets))  # it grows with the shift


def test_z_loss_adds_its_gradient_and_leaves_the_loss_value(tmp_path):
    obj, att = validated(tmp_path, "intervention=z_loss")
    assert obj.model.z_loss == 1e-4 and att == validated(tmp_path, "intervention=baseline")[1]
    assert _others(obj.model, {"z_loss"}) == _others(validated(tmp_path, "intervention=baseline")[0].model,
                                                     {"z_loss"})
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    att = {"impl": "standard", "recipe": "fp32"}
    torch.manual_seed(0)
    plain = GPT(cfg, att)
    coef = 0.05  # large, so its gradient stands out of FP32 noise
    zl = GPT(ModelConfig(**{**vars(cfg), "z_loss": coef}), att)
    zl.load_state_dict(plain.state_dict())
    assert set(zl.state_dict()) == set(plain.state_dict())  # no parameter
    idx = torch.randint(0, 64, (2, 8))
    tgt = idx.roll(-1, 1)
    logits, loss = zl(idx, tgt)
    _, ce = plain(idx, tgt)
    assert torch.equal(loss, ce)  # the logged value is the cross entropy
    loss.backward()
    # oracle: autograd of CE + coef * mean(lse^2), written out
    lo, _ = plain(idx, tgt)
    want = F.cross_entropy(lo.float().view(-1, 64), tgt.view(-1)) + \
        coef * torch.logsumexp(lo.float(), -1).square().mean()
    want.backward()
    for (n, a), (_, b) in zip(zl.named_parameters(), plain.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-8), n
    plain.zero_grad()
    plain(idx, tgt)[1].backward()
    assert not torch.allclose(zl.lm_head.weight.grad, plain.lm_head.weight.grad, rtol=1e-3, atol=0)
    # eval (validation loss): no z term, no gradient of it
    zl.eval()
    zl.zero_grad()
    zl(idx, tgt)[1].backward()
    assert torch.equal(zl.lm_head.weight.grad, plain.lm_head.weight.grad)
    with pytest.raises(ConfigError, match=r"model.z_loss=-1.0 is not allowed: expected a finite number >= 0"):
        validated(tmp_path, "intervention=z_loss", "intervention.model.z_loss=-1")


# ----------------------------------------------------------------------------------- stochastic rounding
def test_stochastic_round_unbiased_one_of_the_two_neighbours():
    """Each result is one of x's two BF16 neighbours; the mean of N draws equals x within 6 sigma (sigma <= ulp/2
    / sqrt N). Nearest-even misses that bound by far on the same values (the test can fail)."""
    frac = torch.tensor([0.03, 0.3, 0.5, 0.77, 0.999])
    x = torch.cat([1 + frac * BF16_ULP_1, -(1 + frac * BF16_ULP_1), (64 + frac * 64 * BF16_ULP_1)])
    ulp = torch.cat([torch.full((10,), BF16_ULP_1), torch.full((5,), 64 * BF16_ULP_1)])
    N = 4096
    xs = x.repeat(N, 1)
    bits = uniform16(torch.tensor(12345), 7, xs.shape, "cpu")
    y = stochastic_round(xs, bits)
    lo = x.to(torch.bfloat16).float()
    lo = torch.where(lo.abs() > x.abs(), torch.nextafter(lo.bfloat16(), torch.zeros_like(lo).bfloat16()).float(), lo)
    hi = torch.nextafter(lo.bfloat16(), (lo * 2).bfloat16()).float()  # the neighbour away from 0
    assert ((y == lo) | (y == hi)).all()
    assert torch.equal(y.bfloat16().float(), y)  # BF16 values
    bound = 6 * (ulp / 2) / math.sqrt(N)
    err = (y.double().mean(0) - x.double()).abs()
    assert (err <= bound).all(), (err / ulp).tolist()
    rne = (x.to(torch.bfloat16).float().double() - x.double()).abs()
    mid = ((frac > 0.1) & (frac < 0.9)).repeat(3)  # where nearest is off by > 0.1 ulp: far outside the bound
    assert (rne[mid] > bound[mid]).all()
    # the fraction of round-ups is the position between the neighbours
    up = (y == hi).double().mean(0)
    assert ((up[:5] - frac.double()).abs() < 6 * 0.5 / math.sqrt(N)).all()
    # non-finite values and `keep` are left alone
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.2345])
    out = stochastic_round(special, uniform16(torch.tensor(1), 0, (4,), "cpu"),
                           keep=torch.tensor([False, False, False, True]))
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 1.2345


def _qkv(T=128, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, T, D, generator=g).bfloat16() for _ in range(3)]


def test_stochastic_round_changes_only_its_points():
    """P̄ (every tile), the running max m and the row sum l are bit-identical to nearest rounding; the O
    accumulator and O change; fa2 (FP32 P̄V) is left bit-identical by the kernel and refused by validation."""
    q, k, v = _qkv()
    near = capture_forward(q, k, v, AttentionKnobs(block_q=32, block_k=32))
    sr = capture_forward(q, k, v, AttentionKnobs(block_q=32, block_k=32, stochastic_round=True))
    assert len(near["tiles"]) == len(sr["tiles"]) > 4
    for a, b in zip(near["tiles"], sr["tiles"]):
        assert torch.equal(a["p_bar"], b["p_bar"]) and torch.equal(a["p_bar_pv"], b["p_bar_pv"])
        assert torch.equal(a["m"], b["m"])
    assert torch.equal(near["l"], sr["l"]) and torch.equal(near["m"], sr["m"])
    assert not torch.equal(near["o_bar"], sr["o_bar"]) and not torch.equal(near["o"], sr["o"])
    assert torch.equal(sr["o_bar"].bfloat16().float(), sr["o_bar"])  # the accumulator still holds BF16 values
    assert (near["o"].float() - sr["o"].float()).abs().max() < 0.1
    fa2 = [capture_forward(q, k, v, AttentionKnobs(recipe="fa2", stochastic_round=s))["o"] for s in (False, True)]
    assert torch.equal(*fa2)


def test_stochastic_round_accumulator_is_unbiased():
    """One key tile (T = block): O_acc = SR(r(P̄) @ V). Its mean over N seeds equals the FP32 product within
    6 sigma per element; nearest rounding of the same product does not."""
    q, k, v = _qkv(T=32, D=8, seed=1)
    N = 256
    ref = None
    accs = []
    for seed in range(N):
        cap = capture_forward(q, k, v, AttentionKnobs(block_q=32, block_k=32, stochastic_round=True, sr_seed=seed))
        if ref is None:
            t = cap["tiles"][0]
            ref = t["p_bar_pv"].bfloat16().float() @ v.float()  # the exact product of the BF16 GEMM inputs
        accs.append(cap["o_bar"])
    acc = torch.stack(accs).double()
    ulp = torch.where(ref == 0, torch.zeros_like(ref),
                      2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)).double()
    bound = 6 * (ulp / 2) / math.sqrt(N) + 1e-12
    err = (acc.mean(0) - ref.double()).abs()
    assert (err <= bound).all(), float((err / bound).max())
    near = capture_forward(q, k, v, AttentionKnobs(block_q=32, block_k=32))["o_bar"].double()
    assert ((near - ref.double()).abs() > bound).float().mean() > 0.3  # nearest is biased per element


def test_stochastic_round_is_deterministic_for_replay():
    """Same inputs and seed: the same bits (forward, and a GPT step's gradients); another seed or other inputs:
    other bits."""
    q, k, v = _qkv()
    kn = AttentionKnobs(stochastic_round=True, sr_seed=3)
    a, b = capture_forward(q, k, v, kn)["o"], capture_forward(q, k, v, kn)["o"]
    assert torch.equal(a, b)
    assert not torch.equal(a, capture_forward(q, k, v, AttentionKnobs(stochastic_round=True, sr_seed=4))["o"])
    q2 = q.clone()
    q2[0, 0, 5, 0] = -q2[0, 0, 5, 0] + 0.5
    o2 = capture_forward(q2, k, v, kn)["o"]
    assert not torch.equal(a[1], o2[1])  # an input elsewhere in the call redraws every row's bits

    def grads():
        torch.manual_seed(0)
        m = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=64),
                {"stochastic_round": True})
        idx = torch.randint(0, 64, (2, 64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(idx, idx.roll(-1, 1))[1].backward()
        return [p.grad.clone() for p in m.parameters()]
    g1, g2 = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_stochastic_round_routes_by_the_table_and_is_refused_where_it_rounds_nothing(tmp_path):
    kn = AttentionKnobs(stochastic_round=True)
    assert knob_table.unsupported(kn, "triton") == []  # the Triton forward draws the emulator's bits (issue 34)
    assert [r.name for r in knob_table.unsupported(kn, "standard")] == ["stochastic_round"]
    assert knob_table.unsupported(AttentionKnobs(sr_seed=5), "triton") == []  # the seed alone asks nothing
    assert knob_table.unsupported(AttentionKnobs(impl="sdpa", sr_seed=5), "sdpa") == []
    backend = resolve_backend(kn, "cpu")
    assert backend == "emulator"  # a CPU: the emulator
    assert route_name(kn, backend) == "flash/emulator/paper_bf16+stoch_round(seed=0)"
    obj, att = validated(tmp_path, "intervention=stoch_round")
    assert att.for_layer(0).stochastic_round is True and att.for_layer(0).sr_seed == 0
    assert _others(att, {"stochastic_round"}) == _others(validated(tmp_path, "intervention=baseline")[1],
                                                         {"stochastic_round"})
    for extra, match in ((["attention=fa2"], r"stochastic_round=True is not allowed: recipe='fa2'"),
                         (["attention.pv_fp32=true"], r"stochastic_round=True is not allowed: pv_fp32=True"),
                         (["attention.impl=standard"], r"stochastic_round=True is not computed by "
                                                       r"attention.impl='standard'"),
                         (["intervention.sr_seed=-1"], r"intervention.sr_seed=-1 is not allowed")):
        with pytest.raises(ConfigError, match=match):
            validated(tmp_path, "intervention=stoch_round", *extra)
    # flash_attention runs it with autograd (the backward is nearest-even, from the stochastically rounded O)
    q, k, v = (t.requires_grad_() for t in _qkv(T=64))
    flash_attention(q, k, v, kn).float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ------------------------------------------------------------------------------------- forks and sweeps
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A baseline smoke run of 8 steps with its checkpoint at step 4 (its batch order covers forks to step 8)."""
    tmp = tmp_path_factory.mktemp("stab")
    res = _jobs.run_in(SMOKE, tmp, "source", "intervention=baseline", "train.max_steps=8")
    assert res["error"] is None, res["error"]
    return tmp, tmp / "source" / "checkpoints" / "step_4.pt"


def test_fork_refuses_gated_attn_and_allows_z_loss(source, tmp_path):
    tmp, ckpt = source
    with pytest.raises(ConfigError, match=r"from_checkpoint=.* belongs to another model shape \(model.attn_gate: "
                                          r"checkpoint False vs model True \(set by intervention=gated_attn: "
                                          r"intervention.model.attn_gate\)\)"):
        validated(tmp_path, "intervention=gated_attn", f"from_checkpoint={ckpt}", "train.max_steps=8")
    with pytest.raises(ConfigError, match=r"another model shape \(model.attn_gate: checkpoint False vs model True\)"):
        validated(tmp_path, "model.attn_gate=true", f"from_checkpoint={ckpt}", "train.max_steps=8")
    obj, _ = validated(tmp_path, "intervention=z_loss", f"from_checkpoint={ckpt}", "train.max_steps=8")
    assert obj.model.z_loss == 1e-4
    # and it runs: the checkpoint's parameters load into the z-loss model, which trains on from step 4
    res = _jobs.run_in(SMOKE, tmp, "z_fork", "intervention=z_loss", f"from_checkpoint={ckpt}", "train.max_steps=6")
    assert res["error"] is None and res["fork_step"] == 4 and res["steps_done"] == 6, res


def test_stabilizers_sweeps_fork_what_can_be_forked(source, tmp_path):
    """sweeps/stabilizers.yaml: every job validates as a fork of the baseline checkpoint (what
    `flash-forensics isolate --sweeps stabilizers` launches); sweeps/stabilizers_scratch.yaml holds the ones
    that change the model, which a fork refuses."""
    _, ckpt = source
    jobs = fork.sweep_file_jobs(["stabilizers"])
    names = [ov[0].split("=", 1)[1] for _, ov in jobs]
    assert names == ["qk_clip", "pbar_clamp", "sfa", "sfa_guarded", "stoch_round", "z_loss"]
    for _, ov in jobs:
        obj, _ = validated(tmp_path, *ov, f"from_checkpoint={ckpt}", "train.max_steps=8")
        assert obj.intervention.name in names
    scratch = [ov[0].split("=", 1)[1] for _, ov in fork.sweep_file_jobs(["stabilizers_scratch"])]
    assert scratch == ["baseline", "fp32", "qk_norm", "gated_attn"]
    for name in ("qk_norm", "gated_attn"):
        with pytest.raises(ConfigError,
                           match=rf"another model shape \(model.{name.replace('gated_attn', 'attn_gate')}"):
            validated(tmp_path, f"intervention={name}", f"from_checkpoint={ckpt}", "train.max_steps=8")
        validated(tmp_path, f"intervention={name}")  # from step 0: fine


# -------------------------------------------------------------------------------------- the stabilizers table
def _run(intervention, observed, divergence_step=None, fork_step=None, steps_done=300, final=3.0, **kw):
    return dict(job=f"forks/{intervention}", intervention=intervention, observed=observed,
                divergence_step=divergence_step, fork_step=fork_step, steps_done=steps_done, final_loss=final,
                error=kw.pop("error", None), **kw)


def test_stabilizers_table_from_constructed_rows(tmp_path):
    from flash_forensics.orchestrator.analysis import stabilizers
    sfa_dir = tmp_path / "jobs" / "sfa"
    sfa_dir.mkdir(parents=True)
    (sfa_dir / "result.json").write_text(json.dumps({"observed": "stable", "val_loss": 3.25}))  # read from its job
    forks = tmp_path / "forks" / "report"
    scratch = tmp_path / "scratch" / "report"
    for d, runs in ((forks, [_run("baseline", "diverged", 100, final=5.0),
                             _run("fp32", "stable", fork_step=50, final=3.0, val_loss=3.2),
                             _run("sfa", "stable", fork_step=50, final=3.1, job_dir=str(sfa_dir)),
                             _run("pbar_clamp", "diverged", 150, fork_step=50, final="NaN", val_loss=None),
                             _run("z_loss", "failed", fork_step=50, final=None, error="boom")]),
                    (scratch, [_run("baseline", "diverged", 120, final=5.5),
                               _run("qk_norm", "stable", final=2.9, val_loss=3.0),
                               _run("gated_attn", "diverged", 200, final=4.0)])):
        d.mkdir(parents=True)
        (d / "verdicts.json").write_text(json.dumps({"runs": runs}))
    bench = tmp_path / "bench.json"
    brow = lambda shape, v, tps, route="flash/triton/paper_bf16": dict(  # noqa: E731
        shape=shape, variant=v, tokens_per_s=tps, route_set=[route])
    bench.write_text(json.dumps({"command": "python benchmarks/stabilizers.py", "gpu": "NVIDIA H200", "rows": [
        brow("mini", "baseline", 1000.0), brow("mini", "sfa", 900.0), brow("mini", "fp32", 800.0),
        brow("mini", "pbar_clamp", 250.0, "flash/emulator (triton lacks: pbar_clamp)/paper_bf16+pbar_clamp"),
        brow("mini", "gated_attn", 950.0), brow("mini", "qk_norm", 1000.0),
        dict(shape="mini", variant="z_loss", error="OOM"),
        brow("gpt2s", "baseline", 2000.0), brow("gpt2s", "sfa", 1500.0)]}))
    paths = stabilizers.write([forks, scratch], bench, "stab_test", results=tmp_path / "results")
    assert {p.name for p in paths.values()} == {"stabilizers.md", "stabilizers.json", "stabilizers.png"}
    assert all(p.parent == tmp_path / "results" / "stab_test" and p.stat().st_size > 0 for p in paths.values())
    rows = {(r["report"].split("/")[-2], r["intervention"]): r
            for r in json.loads(paths["json"].read_text())["rows"]}
    sfa, clamp, z = rows[("forks", "sfa")], rows[("forks", "pbar_clamp")], rows[("forks", "z_loss")]
    assert (sfa["stable"], sfa["from_step"], sfa["steps_gained"], sfa["steps_gained_at_least"]) == (True, 50, 200, True)
    assert (clamp["steps_gained"], clamp["steps_gained_at_least"], clamp["final_loss"]) == (50, False, None)
    assert z["steps_gained"] is None and z["observed"] == "failed"
    assert abs(sfa["final_vs_fp32"] - 0.1) < 1e-9 and abs(sfa["val_vs_fp32"] - 0.05) < 1e-9
    assert abs(sfa["cost"]["mini"] - 0.1) < 1e-9 and abs(sfa["cost"]["gpt2s"] - 0.25) < 1e-9
    assert abs(clamp["cost"]["mini"] - 0.75) < 1e-9 and clamp["cost"]["gpt2s"] is None
    assert z["cost"] == {"mini": None, "gpt2s": None}
    qk, gate = rows[("scratch", "qk_norm")], rows[("scratch", "gated_attn")]
    assert (qk["steps_gained"], qk["steps_gained_at_least"]) == (180, True)  # its own report's baseline (120)
    assert gate["steps_gained"] == 80 and abs(qk["final_vs_fp32"] - (-0.1)) < 1e-9  # fp32 from the other report
    assert (qk["needs_model_change"], gate["needs_model_change"], sfa["needs_model_change"],
            z["needs_model_change"]) == (True, True, False, False)
    md = paths["md"].read_text()
    line = next(l for l in md.splitlines() if l.startswith("| forks/report | sfa |"))  # two reports: named
    assert ">= +200" in line and "+10.0%" in line and "+25.0%" in line and line.endswith("| no |")
    z_line = next(l for l in md.splitlines() if l.startswith("| forks/report | z_loss |"))
    assert z_line.count("not measured") == 2 and "z_loss (forks/z_loss) failed: boom" in md
    assert "pbar_clamp @ mini: flash/emulator (triton lacks: pbar_clamp)" in md
    assert "benchmark z_loss @ mini failed (not measured): OOM" in md
    with pytest.raises(ValueError, match=r"--reports .* expected a report folder with verdicts.json"):
        stabilizers.write([tmp_path / "nothing"], None, "x", results=tmp_path / "results")


def test_stabilizers_table_tells_rows_of_one_intervention_apart_and_flags_a_jump_at_the_fork(tmp_path):
    """A beta sweep and the controls: rows labelled by their own knobs and control, not by the layer and heads
    every row shares; a fork whose first loss jumped (fork_jump, the report's) is flagged in its own column."""
    from flash_forensics.orchestrator.analysis import stabilizers
    rep = tmp_path / "r" / "report"
    rep.mkdir(parents=True)
    common = ["experiment=paper_1gpu", "intervention.layer=1", "intervention.heads=[1]"]
    runs = [_run("baseline", "diverged", 100, final=5.0),
            dict(_run("sfa", "stable", fork_step=50, final=3.1), fork_jump=1.6,
                 overrides=[*common, "intervention=sfa", "intervention.beta=1.05"]),
            dict(_run("sfa", "stable", fork_step=50, final=3.2), fork_jump=0.1,
                 overrides=str([*common, "intervention=sfa", "intervention.beta=8"])),  # an older report's repr
            dict(_run("baseline", "stable", fork_step=50, final=3.0), overrides=[*common, "+control=fa2"])]
    (rep / "verdicts.json").write_text(json.dumps({"runs": runs}))
    paths = stabilizers.write([rep], None, "labels", results=tmp_path / "results")
    labels = [r["label"] for r in json.loads(paths["json"].read_text())["rows"]]
    assert labels == ["baseline", "sfa intervention.beta=1.05", "sfa intervention.beta=8", "baseline +control=fa2"]
    # beta=2 is what sfa's file sets: the beta sweep's beta=2 and the stabilizers sweep's plain sfa are one run
    runs += [dict(_run("sfa", "stable", fork_step=50, final=3.4), job="forks/beta-2",
                  overrides=[*common, "intervention=sfa", "intervention.beta=2"]),
             dict(_run("sfa", "stable", fork_step=50, final=3.4), job="forks/stab-0",
                  overrides=[*common, "intervention=sfa"])]
    (rep / "verdicts.json").write_text(json.dumps({"runs": runs}))
    rows = json.loads(stabilizers.write([rep], None, "labels2", results=tmp_path / "results")["json"].read_text())
    two = [r for r in rows["rows"] if r["label"] == "sfa"]
    assert [(r["job"], r.get("repeats")) for r in two] == [("forks/beta-2", ["forks/stab-0"])]
    md = paths["md"].read_text()
    assert "| sfa intervention.beta=1.05 |" in md and "+1.600 (not like-for-like)" in md
    beta8 = next(line for line in md.splitlines() if line.startswith("| sfa intervention.beta=8 |"))
    assert "+0.100" in beta8 and "like-for-like" not in beta8
    fa2 = next(r for r in json.loads(paths["json"].read_text())["rows"] if r["label"] == "baseline +control=fa2")
    assert fa2["cost"] == {}  # no benchmark here; with one, a control is never given the baseline's cost


def test_stabilizers_table_folds_a_run_repeated_in_each_sweep_into_one_row(tmp_path):
    """An isolate carries the baseline fork in each sweep: the same run twice, one row marked (x2); a run of the same
    intervention that ended differently (another final loss) keeps its own row."""
    from flash_forensics.orchestrator.analysis import stabilizers
    rep = tmp_path / "r" / "report"
    rep.mkdir(parents=True)
    runs = [_run("baseline", "diverged", 100, final=5.0),
            dict(_run("baseline", "diverged", 100, fork_step=50, final=5.0), job="forks/iso-0"),
            dict(_run("fp32", "stable", fork_step=50, final=3.0), job="forks/iso-1"),
            dict(_run("baseline", "diverged", 100, fork_step=50, final=5.0), job="forks/mech-0"),
            dict(_run("baseline", "diverged", 100, fork_step=50, final=5.25), job="forks/other-0")]
    (rep / "verdicts.json").write_text(json.dumps({"runs": runs}))
    paths = stabilizers.write([rep], None, "fold", results=tmp_path / "results")
    rows = json.loads(paths["json"].read_text())["rows"]
    assert [(r["job"], r["from_step"], r.get("repeats")) for r in rows] == [
        ("forks/baseline", 0, None), ("forks/iso-0", 50, ["forks/mech-0"]), ("forks/iso-1", 50, None),
        ("forks/other-0", 50, None)]  # fmt: skip
    md = paths["md"].read_text()
    assert sum(line.startswith("| baseline (x2: one outcome) | 50 |") for line in md.splitlines()) == 1


def test_stabilizers_table_reads_val_loss_of_a_report_copied_off_its_machine(tmp_path):
    """A lease's verdicts.json names job folders on the GPU machine (/tmp/paper/...); once the report and the job
    folders are copied side by side (<root>/report, <root>/forks/<job>), the val loss comes from there."""
    from flash_forensics.orchestrator.analysis import stabilizers
    root = tmp_path / "seed2"
    for job, val in (("baseline", 3.3), ("forks/fp32", 2.2), ("forks/qk_clip", 2.25)):
        (root / job).mkdir(parents=True)
        (root / job / "result.json").write_text(json.dumps({"observed": "stable", "val_loss": val}))
    gone = "/nonexistent/lease/machine"
    runs = [dict(_run("baseline", "diverged", 100, final=3.0), job="baseline", job_dir=f"{gone}/baseline"),
            _run("fp32", "stable", fork_step=50, final=1.8, job_dir=f"{gone}/forks/fp32"),
            _run("qk_clip", "stable", fork_step=50, final=1.9, job_dir=f"{gone}/forks/qk_clip"),
            _run("z_loss", "stable", fork_step=50, final=2.0, job_dir=f"{gone}/forks/z_loss")]  # no folder here
    (root / "report").mkdir()
    (root / "report" / "verdicts.json").write_text(json.dumps({"runs": runs}))
    rows = {r["intervention"]: r for r in stabilizers.table_rows(
        [{"path": root / "report", "runs": runs}], {})}
    assert rows["baseline"]["val_loss"] == 3.3 and rows["qk_clip"]["val_loss"] == 2.25
    assert abs(rows["qk_clip"]["val_vs_fp32"] - 0.05) < 1e-9
    assert rows["z_loss"]["val_loss"] is None and rows["z_loss"]["val_vs_fp32"] is None


def test_a_fork_cut_before_its_result_starts_where_its_checkpoint_says(tmp_path):
    """A fork with no result.json (cut by a lease's end, failed) has no fork_step in its row: its start is the step of
    the checkpoint its from_checkpoint override names (the last one given), not step 0."""
    from flash_forensics.orchestrator.analysis import stabilizers
    cut = dict(_run("pbar_clamp", "failed", None), fork_step=None, overrides=[
        "from_checkpoint=/x/step_500.pt", "intervention=pbar_clamp", "from_checkpoint=/tmp/runs/ckpts/step_7750.pt"])
    runs = [_run("baseline", "diverged", 8064, final=4.5), cut, _run("fp32", "stable", fork_step=7750, final=1.8)]
    rows = {r["intervention"]: r for r in stabilizers.table_rows([{"path": tmp_path, "runs": runs}], {})}
    assert (rows["pbar_clamp"]["from_step"], rows["pbar_clamp"]["observed"]) == (7750, "failed")
    assert rows["fp32"]["from_step"] == 7750 and rows["baseline"]["from_step"] == 0


def test_stabilizers_table_merges_one_bench_per_shape_and_refuses_a_shape_twice(tmp_path):
    from flash_forensics.orchestrator.analysis import stabilizers
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "verdicts.json").write_text(json.dumps({"runs": [_run("baseline", "diverged", 100, final=5.0),
                                                            _run("sfa", "stable", fork_step=50, final=3.1)]}))
    brow = lambda shape, v, tps: dict(shape=shape, variant=v, tokens_per_s=tps, route_set=["r"])  # noqa: E731
    mini, big, again = tmp_path / "mini.json", tmp_path / "gpt2s.json", tmp_path / "again.json"
    mini.write_text(json.dumps({"command": "bench mini", "gpu": "G1", "rows": [brow("mini", "baseline", 1000.0),
                                                                                 brow("mini", "sfa", 900.0)]}))
    big.write_text(json.dumps({"command": "bench gpt2s", "gpu": "G2", "rows": [brow("gpt2s", "baseline", 2000.0),
                                                                                 brow("gpt2s", "sfa", 1500.0)]}))
    again.write_text(json.dumps({"command": "bench mini again", "rows": [brow("mini", "baseline", 10.0)]}))
    paths = stabilizers.write([rep], [mini, big], "merged", results=tmp_path / "results")
    doc = json.loads(paths["json"].read_text())
    sfa = next(r for r in doc["rows"] if r["intervention"] == "sfa")
    assert abs(sfa["cost"]["mini"] - 0.1) < 1e-9 and abs(sfa["cost"]["gpt2s"] - 0.25) < 1e-9
    assert doc["meta"]["shapes"] == ["mini", "gpt2s"] and doc["meta"]["bench"] == [str(mini), str(big)]
    md = paths["md"].read_text()
    assert "- throughput (mini): `bench mini` on G1" in md and "- throughput (gpt2s): `bench gpt2s` on G2" in md
    with pytest.raises(ValueError, match=r"both measured shape 'mini'"):
        stabilizers.write([rep], [mini, again], "x", results=tmp_path / "results")
    assert stabilizers.main(["--reports", str(rep), "--bench", str(mini), str(big), "--name", "cli",
                             "--results", str(tmp_path / "results")]) == 0
    assert "cost gpt2s" in (tmp_path / "results" / "cli" / "stabilizers.md").read_text()


def test_stabilizers_scratch_report_without_a_baseline_borrows_the_same_regimes_only(tmp_path):
    """qk_norm and gated_attn run from step 0 without a baseline beside them: their steps gained are against another
    report's from-step-0 baseline with the same trajectory-deciding overrides, said under the table; never another
    seed's, another lr's or a control's, whatever the order of the reports."""
    from flash_forensics.orchestrator.analysis import stabilizers

    def ov(s, *more, iv="baseline"):  # as the real runs write them: run-management keys differ, the regime does not
        return dict(overrides=["experiment=paper_1gpu", f"intervention={iv}", f"train.seed={s}", f"data.seed={s}",
                               "train.max_steps=20000", "train.keep_last=false", "train.ckpt_start=0",
                               f"sweep_name=s{s}", "tracking.uri=sqlite:////x.db", *more])
    scr = lambda iv: dict(overrides=["experiment=paper_1gpu", "train.seed=1", "data.seed=1",  # noqa: E731
                                     "train.max_steps=2598", "train.ckpt_every=0", "attention.fp32_gemm=tf32x3",
                                     f"intervention={iv}", "sweep_name=paper_scratch"])
    lr, ctl, seed2, seed1, scratch = (tmp_path / n / "report" for n in ("lr", "ctl", "seed2", "seed1", "scratch"))
    for d, runs in ((lr, [_run("baseline", "stable", steps_done=2598, final=3.1, **ov(1, "optimizer.lr=5e-4"))]),
                    (ctl, [_run("baseline", "stable", steps_done=2598, final=2.3, **ov(1, "+control=fa2"))]),
                    (seed2, [_run("baseline", "diverged", 4342, final=3.0, **ov(2))]),
                    (seed1, [_run("baseline", "diverged", 2288, final=3.2, **ov(1)),
                             _run("fp32", "stable", fork_step=2000, final=2.2, **ov(1, iv="fp32"))]),
                    (scratch, [_run("qk_norm", "stable", steps_done=2598, final=2.3, **scr("qk_norm")),
                               _run("gated_attn", "diverged", 2400, final=4.0, **scr("gated_attn"))])):
        d.mkdir(parents=True)
        (d / "verdicts.json").write_text(json.dumps({"runs": runs}))
    paths = stabilizers.write([lr, ctl, seed2, seed1, scratch], None, "t", results=tmp_path / "results")
    rows = {r["intervention"]: r for r in json.loads(paths["json"].read_text())["rows"] if "scratch" in r["report"]}
    assert (rows["qk_norm"]["steps_gained"], rows["qk_norm"]["steps_gained_at_least"]) == (310, True)
    assert rows["gated_attn"]["steps_gained"] == 2400 - 2288  # seed 1's baseline, not the lr's, control's or seed 2's
    assert rows["qk_norm"]["baseline_from"] == str(seed1)
    md = paths["md"].read_text()
    assert "- scratch/report: it ran no baseline; its steps gained are against the from-step-0 baseline of " \
           "seed1/report" in md
    # only a baseline at another lr, or another seed: nothing borrowed, no steps gained
    for others in ([lr], [seed2], [ctl]):
        rows = json.loads(stabilizers.write([*others, scratch], None, "t2", results=tmp_path / "results")["json"]
                          .read_text())["rows"]
        qk = next(r for r in rows if r["intervention"] == "qk_norm")
        assert qk["steps_gained"] is None and qk["baseline_from"] is None, others
    # two matching baselines that disagree: none chosen
    other = tmp_path / "seed1b" / "report"
    other.mkdir(parents=True)
    (other / "verdicts.json").write_text(json.dumps({"runs": [_run("baseline", "diverged", 2290, final=3.2,
                                                                   **ov(1))]}))
    rows = json.loads(stabilizers.write([seed1, other, scratch], None, "t3", results=tmp_path / "results")["json"]
                      .read_text())["rows"]
    assert next(r for r in rows if r["intervention"] == "qk_norm")["baseline_from"] is None
    # the same seed on another GPU model is another trajectory (seed 1: 2,288 on an H200, none by 7,610 on an H100)
    gpu = lambda name: {"setup": {"device.name": name}}  # noqa: E731
    for d, runs in ((seed1, [_run("baseline", "diverged", 2288, final=3.2, **ov(1), **gpu("NVIDIA H200"))]),
                    (scratch, [_run("qk_norm", "stable", steps_done=2598, final=2.3, **scr("qk_norm"),
                                    **gpu("NVIDIA H100 80GB HBM3"))])):
        (d / "verdicts.json").write_text(json.dumps({"runs": runs}))
    rows = json.loads(stabilizers.write([seed1, scratch], None, "t4", results=tmp_path / "results")["json"]
                      .read_text())["rows"]
    assert next(r for r in rows if r["intervention"] == "qk_norm")["baseline_from"] is None
    (scratch / "verdicts.json").write_text(json.dumps({"runs": [_run("qk_norm", "stable", steps_done=2598, final=2.3,
                                                                     **scr("qk_norm"), **gpu("NVIDIA H200"))]}))
    rows = json.loads(stabilizers.write([seed1, scratch], None, "t5", results=tmp_path / "results")["json"]
                      .read_text())["rows"]
    assert next(r for r in rows if r["intervention"] == "qk_norm")["baseline_from"] == str(seed1)


def test_plot_says_the_common_fork_step_once_and_keeps_the_legend_off_the_bars(tmp_path, monkeypatch):
    """'(from 2000)' was on every bar label and the shape legend sat over the last run's bars."""
    import matplotlib.pyplot as plt

    from flash_forensics.orchestrator.analysis import stabilizers as S
    got = {}
    real = plt.Figure.savefig

    def keep(fig, path, **kw):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        a, m, b = fig.axes[:3]
        got.update(labels=[t.get_text() for t in a.get_yticklabels()], title=fig._suptitle.get_text(),
                   legend_y0=b.get_legend().get_window_extent(r).y0, axes_y1=b.get_window_extent(r).y1,
                   words=[t.get_text() for t in b.texts], loss_words=[t.get_text().strip() for t in m.texts],
                   gaps=[p.get_width() for p in m.patches], gap_colors=[p.get_facecolor()[:3] for p in m.patches])
        return real(fig, path, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    row = dict(intervention="sfa", label="sfa intervention.beta=2", from_step=2000, steps_gained=310, stable=True,
               observed="stable", steps_gained_at_least=True, cost={"mini": 0.0, "gpt2s": 0.01})
    rows = [row, dict(row, intervention="fp32", label="fp32", cost={})]
    assert S.plot(rows, ["mini", "gpt2s"], tmp_path / "s.png").is_file()
    assert got["labels"] == ["sfa intervention.beta=2", "fp32"] and "forked at step 2000" in got["title"]
    assert got["legend_y0"] >= got["axes_y1"] - 1 and got["words"] == ["not measured"]
    assert got["loss_words"] == ["no val loss", "no val loss"]  # neither row has a validation loss: said, not a 0
    jumped = dict(row, label="jumped", val_vs_fp32=0.4, fork_jump=1.6)
    S.plot([dict(row, val_vs_fp32=0.05), jumped], ["mini"], tmp_path / "u.png")
    assert got["gaps"] == [0.05, 0.4] and got["loss_words"] == ["not like-for-like"]
    assert got["gap_colors"][0] != got["gap_colors"][1]  # the jumped fork's bar is told apart, not only labelled
    S.plot([row, dict(row, label="late", from_step=2100)], ["mini"], tmp_path / "t.png")
    assert got["labels"] == ["sfa intervention.beta=2 (from 2000)", "late (from 2100)"]


def test_only_keeps_the_named_stabilizers_the_baselines_and_the_reference(tmp_path):
    """An isolate report holds isolation rows and controls beside the stabilizers; --only leaves those out, keeps the
    baselines (a control's baseline row is not one) and the fp32 rows, and refuses a name with no intervention file."""
    from flash_forensics.orchestrator.analysis import stabilizers as S
    rep = tmp_path / "seed" / "report"
    rep.mkdir(parents=True)
    runs = [_run("baseline", "diverged", 100, final=5.0),
            _run("baseline", "stable", fork_step=50, final=3.05, overrides=["+control=fa2"]),
            _run("fp32", "stable", fork_step=50, final=3.0), _run("tiling_off", "stable", fork_step=50, final=3.2),
            _run("pbar_clamp", "stable", fork_step=50, final=3.1), _run("qk_clip", "stable", fork_step=50, final=3.3)]
    (rep / "verdicts.json").write_text(json.dumps({"runs": runs}))
    paths = S.write([rep], None, "only", results=tmp_path / "out", only=["pbar_clamp", "qk_clip"])
    doc = json.loads(paths["json"].read_text())
    assert [r["label"] for r in doc["rows"]] == ["baseline", "fp32", "pbar_clamp", "qk_clip"]
    assert doc["meta"]["only"] == ["pbar_clamp", "qk_clip"]
    assert len(json.loads(S.write([rep], None, "all", results=tmp_path / "out")["json"].read_text())["rows"]) == 6
    with pytest.raises(ValueError, match=r"--only 'pbar_clamb' is not allowed: expected intervention names, one of: .*"
                                         r"pbar_clamp"):
        S.write([rep], None, "bad", results=tmp_path / "out", only=["pbar_clamb"])
    assert not (tmp_path / "out" / "bad").exists()  # refused before anything is written
    assert S.main(["--reports", str(rep), "--only", "nope", "--name", "cli", "--results", str(tmp_path / "out")]) == 1
