"""The CPU default's `train.precision: fp32` (conf/experiment/default.yaml): FP32 outside attention, attention still
the recipe's own BF16 rounding, and the job says which precision computes what."""
import pytest
import torch

from flash_forensics.kernels.config import AttentionConfig
from flash_forensics.models.attention import attend
from flash_forensics.orchestrator.config import schema  # noqa: F401  (registers base_config for compose)
from flash_forensics.orchestrator.job.step import precision_line
from tests.helpers.jobs import compose_cfg


def test_default_preset_runs_fp32_outside_a_bf16_flash_baseline(tmp_path):
    cfg, _ = compose_cfg([], tmp_path)  # what `python run.py` composes
    assert cfg.name == "default" and cfg.train.device == "cpu"
    assert cfg.train.precision == "fp32"
    assert cfg.attention.recipe == "paper_bf16" and cfg.intervention.name == "baseline"
    # the GPU presets keep the paper's AMP
    for preset in ("gpt2s_paper", "mini_repro"):
        assert compose_cfg([f"experiment={preset}"], tmp_path)[0].train.precision == "bf16", preset


@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2"])
def test_flash_emulator_rounds_the_same_with_or_without_cpu_autocast(recipe):
    """What the FP32 default relies on: the same q, k, v give bit-identical O whether they arrive as FP32
    (train.precision=fp32) or as BF16 under CPU autocast (bf16), since the emulator casts them itself. Gradients
    leave in the inputs' dtype: the FP32 ones, rounded to BF16, are the BF16 ones."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16).bfloat16().float() * 3 for _ in range(3))
    knobs = AttentionConfig(recipe=recipe, block_q=16, block_k=16).for_layer(0)
    outs = []
    for autocast in (False, True):
        x = [t.clone().to(torch.bfloat16 if autocast else torch.float32).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = attend(*x, knobs)
        o.float().square().sum().backward()
        outs.append([o, *(t.grad for t in x)])
    (o32, *g32), (o16, *g16) = outs
    assert o32.dtype == o16.dtype and torch.equal(o32, o16)
    for a, b in zip(g32, g16):
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
        assert torch.equal(a.bfloat16(), b)


def test_precision_line_names_both_sides():
    routes = ["flash/emulator/paper_bf16", "flash/emulator/paper_bf16"]
    fp32, bf16 = precision_line("fp32", routes), precision_line("bf16", routes)
    assert fp32.startswith("train.precision=fp32: ") and "no autocast" in fp32
    assert bf16.startswith("train.precision=bf16: ") and "BF16 autocast" in bf16
    assert fp32.endswith("attention routes: flash/emulator/paper_bf16, flash/emulator/paper_bf16")
