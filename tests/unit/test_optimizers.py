"""Small pieces of the orchestrator core: lr schedule, AdamW groups, Muon's orthogonalisation, atomic checkpoints."""
import math

import pytest
import torch

from flash_forensics.kernels.config import AttentionConfig
from flash_forensics.models.gpt import GPT, ModelConfig
from flash_forensics.orchestrator.config.schema import OptimizerConfig
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.optim import Combined, Muon, build_optimizer, lr_factor, newton_schulz, set_lr


def test_lr_schedule_warmup_then_cosine_to_min():
    f = [lr_factor(s, warmup_steps=10, decay_steps=110, min_ratio=0.01) for s in range(130)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # monotone decay after warmup
    assert f[60] == pytest.approx(0.01 + 0.5 * 0.99)  # half way: the cosine's midpoint
    assert f[110] == pytest.approx(0.01) and f[129] == pytest.approx(0.01)


def tiny():
    torch.manual_seed(0)
    return GPT(ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64),
               AttentionConfig(impl="sdpa", counters=False))


def test_adamw_groups_no_decay_on_gains_and_embeddings():
    model = tiny()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2 and "wte" not in name and "wpe" not in name), name
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == model.num_params()  # every parameter once (the tied head counted once)
    set_lr(opt, 0.5)
    assert all(g["lr"] == pytest.approx(0.5e-3) for g in opt.param_groups)


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    g = torch.randn(64, 32) @ torch.diag(torch.logspace(-1, 1, 32))  # condition number 100
    s = torch.linalg.svdvals(newton_schulz(g, steps=5))
    assert s.min() > 0.5 and s.max() < 1.3  # Jordan's quintic lands singular values in ~[0.7, 1.2], not exactly 1
    s_wide = torch.linalg.svdvals(newton_schulz(g.T.contiguous(), steps=5))
    assert torch.allclose(s, s_wide, atol=1e-4)


def test_muon_trains_hidden_matrices_adamw_the_rest():
    model = tiny()
    opt = build_optimizer(model, OptimizerConfig(name="muon", muon_lr=0.02))
    assert isinstance(opt, Combined) and isinstance(opt.optimizers[0], Muon)
    muon_ids = {id(p) for p in opt.optimizers[0].param_groups[0]["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in muon_ids) == (p.ndim == 2 and "wte" not in name and "wpe" not in name), name
    x = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(15):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.3
    state = opt.state_dict()
    opt2 = build_optimizer(tiny(), OptimizerConfig(name="muon"))
    opt2.load_state_dict(state)
    assert len(opt2.optimizers[0].state) == len(opt.optimizers[0].state)


def test_checkpoint_atomic_and_shape_checked(tmp_path):
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    path = checkpoint.save(tmp_path / "c" / "last.pt", {"step": 5, "model_shape": checkpoint.model_shape(cfg),
                                                        "rng": checkpoint.rng_state()})
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp files left
    assert checkpoint.check_compatible(path, cfg)["step"] == 5
    other = ModelConfig(name="t", n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    with pytest.raises(checkpoint.CheckpointError, match="n_layer: checkpoint 2 vs model 3"):
        checkpoint.check_compatible(path, other)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="not a readable checkpoint"):
        checkpoint.load(tmp_path / "junk.pt")
    # RNG round trip: the same draws after restoring
    state = checkpoint.rng_state()
    a = torch.rand(3)
    checkpoint.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
