"""Capturing calls: our GPT through flash_forensics.hooks (dO by a tensor hook on O, the layer's x and W_Q), a
transformers-like emitter (a fake one: the backend reports through the same hooks), and torch's own SDPA wrapped."""
import re

import pytest
import torch
import torch.nn.functional as F

import flash_forensics
from flash_forensics import hooks
from flash_forensics.capture import read
from flash_forensics.capture import snapshot as S
from flash_forensics.capture.analysis import AnalysisError, analyze
from flash_forensics.capture.recorder import Recorder, capture, wrapping_sdpa
from flash_forensics.capture.synthetic import random_inputs
from flash_forensics.models import attention as attention_mod
from flash_forensics.models.gpt import GPT, ModelConfig
from flash_forensics.orchestrator.monitor.capture_config import CaptureConfig


def _gpt(recipe="paper_bf16"):
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128),
               {"recipe": recipe, "block_q": 16, "block_k": 16})


def test_gpt_call_is_captured_with_its_do_x_and_wq(tmp_path):
    model = _gpt()
    idx = torch.randint(0, 128, (2, 32))
    kept = {}
    model.transformer.h[1].attn.probe_capture = lambda x, q, k, v, o: (o.retain_grad(), kept.update(x=x, o=o))
    rec = Recorder(tmp_path, layers=[1], heads=[0, 2], step=7, say=None)
    blocks = model.transformer.h
    with hooks.observing(rec):
        rec.inputs[1] = None  # set below by the pre-hook, as the job does
        h = blocks[1].attn.register_forward_pre_hook(
            lambda m, a: rec.inputs.__setitem__(1, (a[0], m.c_attn.weight[:64].view(4, 16, 64))))
        _, loss = model(idx, idx)
        loss.backward()
        h.remove()
    (path,) = rec.flush()
    snap = S.read(path)
    m = snap.meta
    assert (m["family"], m["layer"], m["heads"], m["step"], m["n_head"]) == ("gpt", 1, [0, 2], 7, 4)
    assert m["recipe"] == "paper_bf16" and m["knobs"]["block_q"] == 16 and m["has_do"]
    assert m["implementation"].startswith("flash/emulator/paper_bf16")
    assert torch.equal(snap.do, kept["o"].grad[:, [0, 2]])
    assert torch.equal(snap.o, kept["o"].detach()[:, [0, 2]])
    assert torch.equal(snap.x, kept["x"].detach())
    assert torch.equal(snap.w_q, blocks[1].attn.c_attn.weight[:64].view(4, 16, 64)[[0, 2]].detach())
    res = analyze(path, progress=False, attribute=False)
    assert res["fingerprint"]["exact"] and res["fingerprint"]["candidates"][0]["is_base"]
    assert all(r["wq_err_proj"] is not None for r in res["per_head"])
    blind = analyze(path, progress=False, attribute=False, blind=True)  # the file's recipe not trusted
    assert blind["fingerprint"]["exact"] and blind["fingerprint"]["best"] == "paper_bf16+blocks16x16"


def test_no_observer_no_report(monkeypatch):
    model = _gpt("fa2")

    def boom(*a, **k):
        raise AssertionError("reported without an observer")
    monkeypatch.setattr(attention_mod, "_report", boom)
    model(torch.randint(0, 128, (1, 32)))  # no capture active: attend never builds an AttentionCall


def test_public_capture_writes_on_exit_and_worst_heads(tmp_path):
    model = _gpt("fa2")
    idx = torch.randint(0, 128, (2, 32))
    with flash_forensics.capture(tmp_path, layers=[0], worst=1, say=None) as cap:
        _, loss = model(idx, idx)
        loss.backward()
        assert cap.paths == []  # nothing written inside the block
    assert len(cap.paths) == 1 and len(S.read(cap.paths[0]).meta["heads"]) == 1
    assert flash_forensics.analyze is analyze


def test_fake_transformers_backend_call(tmp_path):
    """What the transformers backend emits (family, layer, lse) lands in the file as is."""
    q, k, v, do = random_inputs(1, 4, 32, 16)
    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    lse = torch.zeros(1, 4, 32)
    with capture(tmp_path, layers=[3], heads=[1], say=None) as cap:
        hooks.emit(hooks.AttentionCall(q, k, v, o, lse, recipe="fa2", knobs={"recipe": "fa2"}, layer=3,
                                       family="llama", is_causal=True, implementation="flash_forensics"))
        hooks.emit(hooks.AttentionCall(q, k, v, o, None, recipe="fa2", layer=2, family="llama"))  # not chosen
    (path,) = cap.paths
    snap = S.read(path)
    assert snap.meta["family"] == "llama" and snap.meta["layer"] == 3 and snap.lse.shape == (1, 1, 32)
    assert not snap.meta["has_do"] and snap.do is None  # no backward: no dO, said in the meta


def test_sdpa_wrapper_records_the_real_call_and_restores(tmp_path):
    real = F.scaled_dot_product_attention
    q, k, v, _ = random_inputs(1, 4, 32, 16)
    kv = k[:, :2].clone().requires_grad_(), v[:, :2].clone().requires_grad_()  # GQA: 2 kv heads for 4 q heads
    qq = q.clone().requires_grad_()
    with capture(tmp_path, sdpa=True, say=None) as cap:
        o = F.scaled_dot_product_attention(qq, *kv, is_causal=True, enable_gqa=True)
        o.float().pow(2).sum().backward()
        mask = torch.ones(32, 32, dtype=torch.bool).tril()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # the causal triangle as a mask: causal
        F.scaled_dot_product_attention(q, k, v)  # not causal
    assert F.scaled_dot_product_attention is real
    a, b, c = (S.read(p) for p in cap.paths)
    assert a.meta["family"] == "sdpa" and a.meta["is_causal"] and a.k.shape == (1, 4, 32, 16)
    assert torch.equal(a.k[:, 1], k[:, 0]) and torch.equal(a.do, 2 * o.detach().float().to(a.do.dtype))
    assert b.meta["is_causal"] and not c.meta["is_causal"]
    with pytest.raises(AnalysisError, match="not causal"):
        analyze(cap.paths[2], progress=False)
    res = analyze(cap.paths[0], progress=False, attribute=False)
    best = res["fingerprint"]["candidates"][0]
    assert 0.0 <= best["o_identical"] <= 1.0 and res["recipe"] == best["label"]
    assert any("fingerprint's best match" in n for n in res["notes"])


def test_wrapping_is_harmless_without_observers():
    q, k, v, _ = random_inputs(1, 2, 16, 8)
    with wrapping_sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.gpu
def test_cuda_capture_analyzed_on_the_cpu(tmp_path):
    """Captured on the GPU (our GPT, backend auto: Triton where it computes the knobs), read and analyzed on the
    CPU. The CPU emulator's GEMMs may sum in another order than the GPU's, so the fingerprint need not be exact:
    it must name a candidate of the model's recipe and come close."""
    model = _gpt("fa2").cuda()
    idx = torch.randint(0, 128, (2, 32), device="cuda")
    with capture(tmp_path, layers=[0], say=None) as cap:
        _, loss = model(idx, idx)
        loss.backward()
    snap = S.read(cap.paths[0])
    assert snap.meta["device"].startswith("cuda") and snap.q.device.type == "cpu" and snap.meta["has_do"]
    res = analyze(cap.paths[0], progress=False, attribute=False, blind=True)
    best = res["fingerprint"]["candidates"][0]
    assert best["recipe"] == "fa2" and best["o_identical"] > 0.9


def test_batch_keeps_the_first_sequences_of_every_tensor(tmp_path):
    """monitor.capture.batch: q, k, v, o and dO hold the first N sequences, exactly as the call saw them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 3, 8, 16, requires_grad=True) for _ in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rec = Recorder(tmp_path, heads=[1], batch=2, say=None)
    with hooks.observing(rec):
        hooks.emit(hooks.AttentionCall(q, k, v, o, None, "fp32", {}, layer=0, is_causal=True))
    do = torch.randn_like(o)
    o.backward(do)
    (path,) = rec.flush()
    snap = read(path)
    assert snap.tensors["q"].shape == (2, 1, 8, 16) and snap.meta["shape"]["B"] == 2 and snap.meta["batch_of"] == 4
    assert torch.equal(snap.tensors["q"], q.detach()[:2, 1:2]) and torch.equal(snap.tensors["do"], do[:2, 1:2])
    with pytest.raises(ValueError, match=r"monitor.capture.batch=0 is not allowed"):
        CaptureConfig(steps=[1], batch=0).validate()


def test_bad_selections_are_refused_and_an_empty_capture_is_said(tmp_path):
    for kw, needle in ((dict(layers="x"), "layers='x' is not allowed"), (dict(heads=[-1]), "heads=[-1]"),
                       (dict(worst=0), "worst=0 is not allowed")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            with flash_forensics.capture(tmp_path, **kw):
                pass
    said = []
    q = torch.randn(1, 2, 8, 4)
    with flash_forensics.capture(tmp_path, layers=[0], sdpa=True, say=said.append) as cap:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert cap.paths == [] and "1 attention call(s) ran, none in layers=[0]" in said[-1]
    with flash_forensics.capture(tmp_path, say=said.append):
        pass
    assert "no attention call ran through flash_forensics" in said[-1]
