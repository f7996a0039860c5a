"""Interventions as typed plug-ins (orchestrator/interventions/): scope read from the files, a model patch (QK-norm),
a train hook with its own state (QK-clip), and validation that runs once per job, reads a checkpoint's header at
most once and refuses a fork that changes the model shape before launch."""
import math
from pathlib import Path

import pytest
import torch

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.models.gpt import GPT, ModelConfig
from flash_forensics.orchestrator import interventions
from flash_forensics.orchestrator.config import validate
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.interventions.qk_clip import QKClip
from flash_forensics.orchestrator.job import checkpoint, fork
from tests.helpers import jobs as _jobs

CONF = str(Path(__file__).resolve().parents[2] / "conf")
SMOKE = ["experiment=smoke", "train.early_stop=false", "train.eval_every=4", "train.ckpt_every=4",
         "optimizer.decay_steps=8"]


def compose_cfg(tmp_path, *overrides):
    return _jobs.compose_cfg(SMOKE, tmp_path, *overrides)


def job(tmp_path, name, *overrides):
    return _jobs.run_in(SMOKE, tmp_path, name, *overrides)


# ------------------------------------------------------------------------------------------------ the files
def test_scoped_reads_each_file(tmp_path, monkeypatch):
    assert interventions.scoped("layer") == ["flash_only_layer", "head_upcast", "standard_layer"]
    assert interventions.scoped("heads") == ["head_upcast"]
    assert interventions.scope("sfa") == ()
    # a new file that takes a layer is found without touching code
    for p in Path(CONF, "intervention").glob("*.yaml"):
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "my_layer.yaml").write_text("name: my_layer\nexpect: stable\nlayer: 0\nimpl: standard\n")
    monkeypatch.setattr(interventions.spec, "CONF_DIR", tmp_path)
    assert "my_layer" in interventions.scoped("layer") and "my_layer" not in interventions.scoped("heads")
    with pytest.raises(ValueError, match="kind='layers' is not allowed"):
        interventions.scoped("layers")


def test_every_intervention_file_loads_typed():
    for name in interventions.names():
        iv = interventions.load(name)
        assert iv.name == name and iv.expect in ("stable", "diverges") and iv.paper
    assert interventions.load("head_upcast", layer=0, heads=[2]).overrides[0].o_fp32_heads == [2]


# ----------------------------------------------------------------------------------------------- QK-norm
def test_qk_norm_changes_the_model_as_named(tmp_path):
    base, base_att = validate_config(*compose_cfg(tmp_path, "intervention=baseline"), check_store=False)
    obj, att = validate_config(*compose_cfg(tmp_path, "intervention=qk_norm"), check_store=False)
    assert base.model.qk_norm is False and obj.model.qk_norm is True
    assert {k: v for k, v in vars(obj.model).items() if k != "qk_norm"} == \
        {k: v for k, v in vars(base.model).items() if k != "qk_norm"}
    assert att == base_att  # attention untouched
    added = set(GPT(obj.model, att).state_dict()) - set(GPT(base.model, base_att).state_dict())
    assert added == {f"transformer.h.{i}.attn.{n}.weight" for i in range(obj.model.n_layer)
                     for n in ("q_norm", "k_norm")}
    with pytest.raises(ConfigError, match=r"model.qk_norm=False contradicts intervention=qk_norm, which sets "
                                          r"model.qk_norm=True"):
        validate_config(*compose_cfg(tmp_path, "intervention=qk_norm", "model.qk_norm=false"), check_store=False)


# ----------------------------------------------------------------------------------------------- QK-clip
def _head_max_logits(model, x, layer):
    """Per-head max of q.k/sqrt(D) over the causal positions of `layer`, from the weights (not by the hook)."""
    cfg = model.config
    with torch.no_grad():
        h = model.transformer.drop(model.transformer.wte(x) + model.transformer.wpe(torch.arange(x.shape[1])))
        for block in model.transformer.h[:layer]:
            h = block(h)
        attn = model.transformer.h[layer].attn
        q, k, _ = attn.c_attn(model.transformer.h[layer].ln_1(h)).split(cfg.n_embd, dim=2)
        B, T, _ = q.shape
        q, k = (t.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2) for t in (q, k))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.head_dim)
        return s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))


def test_qk_clip_caps_each_heads_max_logit():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128), {"recipe": "fp32"})
    C, D = 64, 16
    with torch.no_grad():  # heads 0 and 2 of layer 0 get large logits
        for h in (0, 2):
            model.transformer.h[0].attn.c_attn.weight[h * D:(h + 1) * D] *= 40
    x = torch.randint(0, 128, (2, 32))
    before = _head_max_logits(model, x, 0)
    others = max(float(before[1]), float(before[3]), float(_head_max_logits(model, x, 1).max()))
    tau = 0.5 * (others + min(float(before[0]), float(before[2])))
    assert before[0] > tau and before[2] > tau and others < tau
    w0 = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    w1 = model.transformer.h[1].attn.c_attn.weight.detach().clone()
    hook = QKClip(tau=tau)
    hook.attach(model)
    model.train()
    model(x, x)  # the training step's forward: the observer measures it
    assert torch.allclose(hook.max_logit[0], before, rtol=1e-5)
    hook.after_optimizer_step(0, model, {})
    after = _head_max_logits(model, x, 0)
    assert (after <= tau * (1 + 1e-5)).all() and after[0] > 0.99 * tau and after[2] > 0.99 * tau
    w = model.transformer.h[0].attn.c_attn.weight.detach()
    for h in (1, 3):  # unclipped heads: W_Q, W_K and V rows bit-identical
        for part in (0, C, 2 * C):
            assert torch.equal(w[part + h * D:part + (h + 1) * D], w0[part + h * D:part + (h + 1) * D])
    for h in (0, 2):  # clipped heads: W_Q and W_K rows scaled by the same factor, V untouched
        f = math.sqrt(tau / float(before[h]))
        assert torch.allclose(w[h * D:(h + 1) * D], w0[h * D:(h + 1) * D] * f)
        assert torch.allclose(w[C + h * D:C + (h + 1) * D], w0[C + h * D:C + (h + 1) * D] * f)
        assert torch.equal(w[2 * C + h * D:2 * C + (h + 1) * D], w0[2 * C + h * D:2 * C + (h + 1) * D])
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, w1)
    assert hook.clips[0].tolist() == [1, 0, 1, 0] and hook.clips[1].tolist() == [0, 0, 0, 0]
    assert hook.max_logit.isneginf().all()  # reset for the next step
    model.eval()
    model(x, x)  # evaluation forwards are not measured
    assert hook.max_logit.isneginf().all()


def test_qk_clip_bad_arguments_are_refused_before_launch(tmp_path):
    cases = {("intervention.hooks.0.tau=-1",): r"intervention.hooks\[0\]._target_=.*QKClip.*tau=-1 is not allowed",
             ("intervention.hooks.0._target_=nope.Missing",): r"intervention.hooks\[0\]._target_='nope.Missing' could "
                                                              r"not be built",
             ("model.qk_norm=true",): r"intervention.hooks\[0\].*model.qk_norm=True is not allowed with QK-clip"}
    for extra, match in cases.items():
        with pytest.raises(ConfigError, match=match):
            validate_config(*compose_cfg(tmp_path, "intervention=qk_clip", *extra), check_store=False)


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    """QK-clip through the train loop: 8 steps in one go, and 4 + a resume to 8 (tau low enough to fire: the smoke
    model's logits start near 0.1)."""
    tmp = tmp_path_factory.mktemp("qk_clip")
    args = ("intervention=qk_clip", "intervention.hooks.0.tau=0.05")
    full = job(tmp, "full", *args, "train.max_steps=8")
    first = job(tmp, "first", *args, "train.max_steps=4")
    second = job(tmp, "second", *args, "train.max_steps=8", f"resume={tmp / 'first' / 'checkpoints' / 'last.pt'}")
    return tmp, full, first, second


def test_qk_clip_state_is_saved_and_restored_on_resume(clipped):
    tmp, full, first, second = clipped
    for r in (full, first, second):
        assert r["error"] is None, r["error"]
    at4 = checkpoint.load(tmp / "first" / "checkpoints" / "last.pt")["hooks"]
    end_full = checkpoint.load(tmp / "full" / "checkpoints" / "last.pt")["hooks"]
    end_resumed = checkpoint.load(tmp / "second" / "checkpoints" / "last.pt")["hooks"]
    assert (at4[0]["target"] == "flash_forensics.orchestrator.interventions.qk_clip.QKClip"
            and at4[0]["state"]["tau"] == 0.05)
    assert 0 < int(at4[0]["state"]["clips"].sum()) < int(end_full[0]["state"]["clips"].sum())  # it fired, and counts
    assert torch.equal(end_resumed[0]["state"]["clips"], end_full[0]["state"]["clips"])  # restored, then continued
    assert second["final_loss"] == full["final_loss"]
    from mlflow.tracking import MlflowClient
    run = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db").get_run(full["mlflow_run_id"])
    assert run.data.metrics["qk_clip/clipped_steps"] == float(end_full[0]["state"]["clips"].sum())


def test_resume_with_other_hooks_is_refused(clipped):
    tmp, *_ = clipped
    cfg, ov = compose_cfg(tmp, "intervention=baseline", "train.max_steps=8",
                          f"resume={tmp / 'first' / 'checkpoints' / 'last.pt'}")
    with pytest.raises(ConfigError, match=r"resume=.*holds train hooks "
                                          r"\['flash_forensics.orchestrator.interventions.qk_clip.QKClip'\], "
                                          r"this run has \[\] \(intervention=baseline\)"):
        validate_config(cfg, ov, check_store=False)


# ------------------------------------------------------------------------------------ validation, forks
def test_fork_that_changes_the_model_shape_is_refused_before_launch(clipped, tmp_path):
    tmp, *_ = clipped
    ckpt = tmp / "full" / "checkpoints" / "step_4.pt"
    with pytest.raises(ConfigError, match=r"from_checkpoint=.* belongs to another model shape \(model.qk_norm: "
                                          r"checkpoint False vs model True \(set by intervention=qk_norm: "
                                          r"intervention.model.qk_norm\)\)"):
        validate_config(*compose_cfg(tmp_path, "intervention=qk_norm", f"from_checkpoint={ckpt}", "train.max_steps=8"),
                        check_store=False)
    with pytest.raises(ConfigError, match=r"another model shape \(model.qk_norm: checkpoint False vs model True\)"):
        validate_config(*compose_cfg(tmp_path, "intervention=baseline", "model.qk_norm=true",
                                     f"from_checkpoint={ckpt}", "train.max_steps=8"), check_store=False)
    with pytest.raises(ConfigError, match=r"resume=.* belongs to another model shape \(model.qk_norm"):
        validate_config(*compose_cfg(tmp_path, "intervention=qk_norm", f"resume={ckpt}"), check_store=False)
    validate_config(*compose_cfg(tmp_path, "intervention=sfa", f"from_checkpoint={ckpt}", "train.max_steps=8"),
                    check_store=False)


def test_parameter_backstop_names_the_tensors():
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    head = {"param_shapes": {n: tuple(t.shape) for n, t in GPT(cfg).state_dict().items()}}

    class Obj:  # a model whose parameters differ in a way no model key names
        model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, qk_norm=True)
    with pytest.raises(fork.ForkError, match=r"holds other parameters .*q_norm.weight: checkpoint None vs "
                                             r"model \(8,\)"):
        fork._check_parameters(head, Obj, "from_checkpoint", "x.pt")
    Obj.model = cfg
    fork._check_parameters(head, Obj, "from_checkpoint", "x.pt")


def test_validation_runs_once_and_reads_the_header_once(clipped, tmp_path, monkeypatch):
    tmp, *_ = clipped
    ckpt = tmp / "full" / "checkpoints" / "step_4.pt"
    monkeypatch.setattr(fork, "_HEADERS", {})
    monkeypatch.setattr(validate, "_VALIDATED", {})
    calls = {"header": 0, "full": 0, "validate": 0}
    real_header, real_load, real_validate = checkpoint.read_header, checkpoint.load, validate._validate

    def header(*a, **k):
        calls["header"] += 1
        return real_header(*a, **k)

    def load(*a, **k):
        calls["full"] += 1
        return real_load(*a, **k)

    def once(*a, **k):
        calls["validate"] += 1
        return real_validate(*a, **k)
    monkeypatch.setattr(checkpoint, "read_header", header)
    monkeypatch.setattr(validate, "_validate", once)
    cfg, ov = compose_cfg(tmp_path, "intervention=sfa", f"from_checkpoint={ckpt}", "train.max_steps=8")
    a, _ = validate_config(cfg, ov, check_store=False)  # the sweep callback ...
    monkeypatch.setattr(checkpoint, "load", load)
    b, _ = validate_config(cfg, ov, check_store=False)  # ... and the job, in the same process
    assert calls == {"header": 1, "full": 0, "validate": 1}
    assert a == b and a is not b  # a fresh copy: the job may change its own
    validate_config(*compose_cfg(tmp_path, "intervention=pv_fp32", f"from_checkpoint={ckpt}", "train.max_steps=8"),
                    check_store=False)
    assert calls == {"header": 1, "full": 0, "validate": 2}  # another fork of the same source: header not read again
