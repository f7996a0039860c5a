"""The CUDA fast path of the transformers backend (flash_forensics/fast_path.py): a call whose mask is the bare
causal triangle runs as a plain causal call (the Triton kernels' route); padded masks stay on the emulator. The
detection and its once-per-mask cache on CPU; the Triton route itself in the gpu-marked tests."""
import copy
from dataclasses import replace

import pytest
import torch

from flash_forensics import fast_path, hooks
from flash_forensics.hf_backend import NAME, use
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import flash_attention
from flash_forensics.kernels.masking import Masking

transformers = pytest.importorskip("transformers")
V = 128


def _llama(device="cpu", dtype=torch.bfloat16, layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).to(device,
                                                                                                         dtype)


def _masks(model, **batch):
    """The mask object each layer's call got."""
    seen = []
    orig = fast_path.causal_only

    def spy(mask, Tq, Tk):
        seen.append(mask)
        return orig(mask, Tq, Tk)

    fast_path.causal_only, cuda = spy, torch.Tensor.is_cuda
    try:
        torch.Tensor.is_cuda = property(lambda self: True)  # the CUDA branch of attention_forward, on CPU tensors
        with torch.no_grad():
            model(**batch)
    finally:
        fast_path.causal_only, torch.Tensor.is_cuda = orig, cuda
    return seen


def test_causal_only_masks_are_told_from_padded_ones_once_per_forward():
    model = _llama(dtype=torch.float32)
    use(model)
    ids = torch.randint(0, V, (2, 12))
    plain = _masks(model, input_ids=ids)
    assert len(plain) == 2 and plain[0] is plain[1]  # one mask object for every layer: one sync per forward
    assert fast_path.causal_only(plain[0], 12, 12) and fast_path.cached(plain[0]) is True
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0
    padded = _masks(model, input_ids=ids, attention_mask=am)
    assert not fast_path.causal_only(padded[0], 12, 12)
    tri = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    assert fast_path.causal_only(tri, 5, 5)
    tri[0, 0, 4, 0] = False  # changed in place: answered again, not from the cache
    assert not fast_path.causal_only(tri, 5, 5)
    assert not fast_path.causal_only(tri[..., :4], 5, 4) and not fast_path.causal_only(None, 5, 5)
    assert fast_path.plain_scale(64 ** -0.5, 64) is None and fast_path.plain_scale(0.5, 64) == 0.5


def test_key_padded_masks_give_their_key_vector_once_per_forward_and_others_none():
    model = _llama(dtype=torch.float32)
    use(model)
    ids = torch.randint(0, V, (3, 12))
    am = torch.ones(3, 12, dtype=torch.long)
    am[0, :4] = 0  # left
    am[1, 9:] = 0  # right
    padded = _masks(model, input_ids=ids, attention_mask=am)
    assert padded[0] is padded[1]
    kk = fast_path.key_padding(padded[0], 12, 12)
    assert torch.equal(kk, am.bool()) and fast_path.key_padding(padded[0], 12, 12) is kk  # cached: no second sync
    tri = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    assert torch.equal(fast_path.key_padding(tri, 6, 6), torch.ones(1, 6, dtype=torch.bool))
    window = tri & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # a sliding window: not key padding
    assert fast_path.key_padding(window, 6, 6) is None
    assert fast_path.key_padding(None, 6, 6) is None and fast_path.key_padding(tri.float(), 6, 6) is None


def test_attend_with_key_keep_is_the_same_call_as_its_mask():
    """On the emulator (CPU) a key_keep call is the causal & padding mask it stands for, bit for bit, O and counts;
    rows with no key are 0 either way. A key_keep beside a mask, or without causality, is refused."""
    from flash_forensics.kernels.stats import AttnStats
    from flash_forensics.sdpa import attend
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=g) for _ in range(3))
    keep = torch.ones(2, 24, dtype=torch.bool)
    keep[0, :5] = False
    keep[1, 20:] = False
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16, counters=True)
    m = (torch.ones(24, 24, dtype=torch.bool).tril() & keep[:, None, :])[:, None]
    s1, s2 = AttnStats(4), AttnStats(4)
    a = attend(q, k, v, knobs, is_causal=True, key_keep=keep, stats=s1)
    b = attend(q, k, v, knobs, attn_mask=m, stats=s2)
    assert torch.equal(a, b) and (a[0, :, :5] == 0).all()
    assert torch.equal(s1.repeated_max_rows, s2.repeated_max_rows) and torch.equal(s1.rows_seen, s2.rows_seen)
    with pytest.raises(ValueError, match="key_keep with is_causal=False"):
        attend(q, k, v, knobs, key_keep=keep)
    with pytest.raises(ValueError, match="attn_mask=given"):
        attend(q, k, v, knobs, attn_mask=m, is_causal=False, key_keep=keep)


def test_the_plain_route_computes_what_the_triangle_mask_computes():
    """On the emulator the two routes agree bit for bit, so taking the plain route changes nothing but the code
    that computes it (the Triton kernels on CUDA)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    knobs = AttentionKnobs(recipe="paper_bf16", block_q=16, block_k=16)
    tri = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 4, 40, 40)
    assert torch.equal(flash_attention(q, k, v, knobs),
                       flash_attention(q, k, v, knobs, None, Masking(keep=tri, scale=64 ** -0.5)))


def _calls(model, **batch):
    calls = []
    with hooks.observing(calls.append), torch.no_grad():
        model(**batch)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["paper_bf16", "fp32"])
def test_cuda_plain_calls_run_on_our_triton_kernels_and_agree_with_the_emulator(recipe):
    """The plain route is our Triton kernel, bit for bit (the same launch on the same inputs). Against the emulator
    the kernels are not bit-identical in general (tl.dot's accumulation order is not torch's GEMMs'): within the
    tolerances tests/unit/test_triton.py holds them to (fp32 1e-4; BF16 2 ulps of |O|)."""
    from flash_forensics.kernels.triton_flash import flash_attention_triton  # lazy: needs triton, CUDA tests only

    model = _llama("cuda", torch.float32 if recipe == "fp32" else torch.bfloat16)
    use(model, recipe=recipe, block_q=64, block_k=64)
    knobs = AttentionKnobs(recipe=recipe, block_q=64, block_k=64)
    ids = torch.randint(0, V, (2, 128), device="cuda")
    calls = _calls(model, input_ids=ids)
    assert [c.implementation for c in calls] == ["triton", "triton"]
    for c in calls:
        assert torch.equal(c.o, flash_attention_triton(c.q, c.k, c.v, knobs).to(c.o.dtype))
        ref = flash_attention(c.q, c.k, c.v, replace(knobs, backend="emulator")).double()
        tol = 1e-4 if recipe == "fp32" else 2 * 2 ** -7 * ref.abs().max().item()
        assert (c.o.double() - ref).abs().max().item() <= tol
    am = torch.ones(2, 128, dtype=torch.long, device="cuda")
    am[1, :10] = 0  # left padding: the Triton kernels with key_keep, within the same tolerances on rows with a key
    padded = _calls(model, input_ids=ids, attention_mask=am)
    assert [c.implementation for c in padded] == ["triton", "triton"]
    m = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()[None, None] & am.bool()[:, None, None, :]
    live = m.any(-1, keepdim=True).expand(2, 4, 128, 16)
    for c in padded:
        assert torch.equal(c.o, flash_attention_triton(c.q, c.k, c.v, knobs, key_keep=am.bool()).to(c.o.dtype))
        ref = flash_attention(c.q, c.k, c.v, replace(knobs, backend="emulator"), None,
                              Masking(keep=m.expand(2, 4, 128, 128))).double()
        tol = 1e-4 if recipe == "fp32" else 2 * 2 ** -7 * ref.abs().max().item()
        assert (c.o.double() - ref)[live].abs().max().item() <= tol and (c.o[~live] == 0).all()


def test_the_llama_speed_benchmark_runs_its_plumbing_on_cpu(tmp_path):
    """benchmarks/hf_llama.py --device cpu: one model per method with the same weights, each call's route read from
    the backend's hooks, the JSON written (a smoke run: its timings are not speeds; the GPU task is own-model)."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import hf_llama
    out = tmp_path / "hf.json"
    assert hf_llama.main(["--device", "cpu", "--batch", "2", "--seq", "32", "--layers", "1", "--hidden", "64",
                          "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--rounds", "1",
                          "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["smoke"] is True and set(doc["methods"]) == {"sdpa", "eager", "emulator"}
    assert doc["methods"]["emulator"]["routes"] == ["emulator"]
    # the same weights and batch: the paper_bf16 emulator's loss is within BF16's reach of transformers' SDPA
    assert abs(doc["methods"]["emulator"]["loss"] - doc["methods"]["sdpa"]["loss"]) < 0.05
    assert abs(doc["methods"]["eager"]["loss"] - doc["methods"]["sdpa"]["loss"]) < 0.05
    assert "eager_vs_sdpa" in doc["summary"]
    assert all(row["spread"] == max(row["ms_rounds"]) / min(row["ms_rounds"]) >= 1.0 for row in doc["methods"].values())
    with pytest.raises(SystemExit):
        hf_llama.main(["--device", "cpu", "--heads", "5", "--out", str(out)])
