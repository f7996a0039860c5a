"""The orchestrator on a transformers family (model.family=llama, models/hf.py): what the job and the monitors read,
and the configs refused before launch, naming the family."""
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.kernels.config import AttentionConfig, LayerOverride
from flash_forensics.models.gpt import GPT, ModelConfig
from flash_forensics.models.hf import HFModel, build_model
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors

pytest.importorskip("transformers")
CONF = str(Path(__file__).resolve().parents[2] / "conf")
SMALL = dict(name="t", family="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=256)


def _validate(tmp_path, *overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(CONF, version_base="1.3"):
            cfg = compose("config", overrides=["experiment=smoke", "model=llama_tiny", *overrides,
                                               f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])
        return validate_config(cfg, list(overrides), check_store=False)
    finally:
        GlobalHydra.instance().clear()


def test_llama_configs_validate_and_patches_of_our_gpt_are_refused_naming_the_family(tmp_path):
    obj, att = _validate(tmp_path, "intervention=fp32")
    assert obj.model.family == "llama" and att.recipe == "fp32"
    for overrides, needle in ((["intervention=qk_norm"], "model.qk_norm=True is not allowed: expected false for "
                                                         "model.family=llama"),
                              (["intervention=gated_attn"], "model.attn_gate=True"),
                              (["intervention=standard_layer"], "impl='standard'"),
                              (["attention.backend=triton"], "backend='triton'"),
                              (["model.n_kv_head=3"], "model.n_kv_head=3"),
                              (["intervention=qk_clip"], "intervention.hooks="),
                              (["monitor.probes.enabled=true"], "monitor.probes.enabled=True")):
        with pytest.raises(ConfigError) as e:
            _validate(tmp_path, *overrides)
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="model.n_kv_head=2 is not allowed: expected None for model.family=gpt"):
        ModelConfig(n_kv_head=2).validate()


def test_hf_model_gives_the_job_and_the_monitors_what_gpt_gives():
    torch.manual_seed(0)
    att = AttentionConfig(overrides=[LayerOverride(layers=[1], recipe="fp32")])
    model = build_model(ModelConfig(**SMALL), att)
    assert isinstance(model, HFModel) and isinstance(build_model(ModelConfig(n_layer=1)), GPT)
    assert model.attention_routes() == ["llama:flash/emulator/paper_bf16", "llama:flash/emulator/fp32"]
    x = torch.randint(0, 256, (2, 32))
    logits, loss = model(x, x)
    ref = torch.nn.functional.cross_entropy(model.hf(input_ids=x).logits.float().view(-1, 256), x.view(-1))
    assert torch.equal(loss, ref)
    loss.backward()
    mons = Monitors(model, MonitorConfig(log_every=1, wq_every=1))
    host = mons.step_end(0, loss.detach(), torch.tensor(1.0), 1e-3, 64)
    assert host and host[0][1] == pytest.approx(loss.item())
    assert mons.peak_wq > 0 and mons.peak_wq_where.startswith("L")
    assert all(int(s.rows_seen.sum()) == 0 for s in model.attention_stats())  # flushed and reset
    with torch.device("meta"):  # the GPT-2-Small-sized preset: ~114M parameters
        big = build_model(ModelConfig(name="llama_s", family="llama", n_layer=12, n_head=12, n_kv_head=4, n_embd=768,
                                      mlp_hidden=2048, block_size=1024))
    assert 100e6 < big.num_params() < 130e6
