"""models/embedding.py: the token embedding whose backward is aten's sorted kernel, eager and compiled."""
import os
import subprocess
import sys

import pytest
import torch

from flash_forensics.models.embedding import token_embedding


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(50, 8)
    idx = torch.randint(0, 5, (4, 16), generator=g)  # every id repeats
    grad = torch.randn(4, 16, 8, generator=g)
    return emb, idx, grad


def _grad(fn, emb, idx, grad):
    emb.weight.grad = None
    (fn(idx) * grad).sum().backward()
    return emb.weight.grad.clone()


def test_eager_gradient_has_nn_embeddings_bits():
    emb, idx, grad = _case()
    ref = _grad(emb, emb, idx, grad)
    mine = _grad(lambda i: token_embedding(i, emb.weight), emb, idx, grad)
    assert torch.equal(ref, mine)
    assert torch.equal(token_embedding(idx, emb.weight), emb(idx))


def test_compiled_backward_calls_aten_without_atomics_and_keeps_the_eager_bits():
    """Inductor's own lowering of an embedding backward adds atomically where threads share a row
    (tests/unit/test_determinism.py); through embedding_grad it calls aten's kernel instead, as eager does."""
    from torch._inductor.utils import run_and_get_code
    emb, idx, grad = _case(1)
    ref = _grad(emb, emb, idx, grad)  # eager nn.Embedding
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread a test process (tests/conftest.py): CPU code has no atomics there
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda i: token_embedding(i, emb.weight))
        emb.weight.grad = None
        code = "\n".join(run_and_get_code(lambda i: (fn(i) * grad).sum().backward(), idx)[1])
    finally:
        torch.set_num_threads(threads)
    assert "atomic_add" not in code and "embedding_grad" in code
    assert torch.equal(emb.weight.grad, ref)


def test_gpt_keeps_its_eager_bits_and_calls_embedding_grad_once_a_backward(monkeypatch):
    """The GPT's token embedding goes through embedding_grad (once per backward), and every gradient, the tied
    wte / lm_head weight's included, has the bits of the same GPT on nn.Embedding's own backward."""
    import torch.nn.functional as F

    from flash_forensics.models import embedding, gpt
    torch.manual_seed(0)
    model = gpt.GPT(gpt.ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    idx = torch.randint(0, 4, (2, 8))
    calls, real = [], embedding.embedding_grad

    def spy(grad, i, n):
        calls.append(n)
        return real(grad, i, n)
    monkeypatch.setattr(embedding, "embedding_grad", spy)

    def grads():
        model.zero_grad(set_to_none=True)
        model(idx, idx)[1].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    mine = grads()
    assert calls == [32]
    monkeypatch.setattr(gpt, "token_embedding", lambda i, w: F.embedding(i, w))
    ref = grads()
    assert calls == [32]  # the reference ran nn.functional's own backward
    assert mine.keys() == ref.keys() and all(torch.equal(mine[n], ref[n]) for n in ref)


def test_the_transformers_family_embeds_through_it_with_transformers_own_bits(monkeypatch):
    """HFModel hands transformers the embedded tokens (inputs_embeds): the logits and every gradient are those of
    the model embedding its input_ids itself, and the embedding's backward is embedding_grad's."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models import embedding
    from flash_forensics.models.gpt import ModelConfig
    from flash_forensics.models.hf import HFModel
    torch.manual_seed(0)
    m = HFModel(ModelConfig(family="llama", n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64),
                AttentionConfig(impl="flash", backend="emulator", recipe="paper_bf16"))
    idx = torch.randint(0, 8, (2, 16))
    calls, real = [], embedding.embedding_grad
    monkeypatch.setattr(embedding, "embedding_grad", lambda g, i, n: calls.append(n) or real(g, i, n))
    logits, loss = m(idx, idx)
    loss.backward()
    mine = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert calls == [64]
    m.zero_grad(set_to_none=True)
    ref_logits = m.hf(input_ids=idx).logits
    F.cross_entropy(ref_logits.float().view(-1, 64), idx.view(-1)).backward()
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(mine[n], p.grad) for n, p in m.named_parameters())


def test_train_deterministic_takes_three_values_and_names_the_key_otherwise():
    from flash_forensics.orchestrator.config.schema import TrainConfig
    from flash_forensics.orchestrator.config.validate import check_train
    for ok in ("auto", "true", "false", True, False, "True"):
        check_train(TrainConfig(deterministic=ok))
    with pytest.raises(ValueError, match=r"train\.deterministic='always'.*auto, true, false"):
        check_train(TrainConfig(deterministic="always"))


INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP, reason="runs in a child process with TRITON_INTERPRET=1 (see "
                            "test_the_triton_kernel_in_the_interpreter)")


def test_the_triton_kernel_in_the_interpreter():
    """kernels/triton_embedding.py on Triton's CPU interpreter (FP32 logic), in a child process."""
    if INTERP:
        pytest.skip("already inside the interpreter run")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter_case",
                          os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.split("passed")[-1], res.stdout[-500:]


FORMS = [dict(), dict(form="tiles"), dict(form="tiles", rb=4, block_c=16, key32=True)]


CASES = [(16, 8, 50, 5), (120, 40, 40, 3), (60, 300, 1000, 1000), (97, 70, 10, 1), (0, 16, 4, 4), (33, 5, 7, 2)]


@interp
@pytest.mark.parametrize("N,C,V,ids,form", [c + (FORMS[0],) for c in CASES]  # every case on the default form
                         + [c + (FORMS[1],) for c in ((16, 8, 50, 5), (97, 8, 10, 1), (0, 16, 4, 4))]
                         + [c + (FORMS[2],) for c in ((120, 40, 40, 3), (97, 20, 10, 1), (33, 5, 7, 2))])
def test_interpreter_case_sums_each_ids_rows_in_a_fixed_order(N, C, V, ids, form):
    """Against an FP64 sum: within FP32 rounding; a second call gives the same bits; an id seen once gets its row
    exactly; rows no id touches are zero. (97, C, 10, 1): one id's run across four tiles of RB rows (25 of 4 rows),
    C not a multiple of BLOCK_C; (33, 5, 7, 2): a run ending where a tile ends, the last tile one row. The tile form
    on fewer cases: the interpreter runs its scan slowly."""
    from flash_forensics.kernels import triton_embedding as te
    g = torch.Generator().manual_seed(N + C)
    idx = torch.randint(0, ids, (N,), generator=g)
    grad = torch.randn(N, C, generator=g)
    out = te.embedding_grad(grad, idx, V, **form)
    ref = torch.zeros(V, C, dtype=torch.float64).index_add_(0, idx, grad.double())
    assert out.shape == (V, C) and out.dtype == grad.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, te.embedding_grad(grad, idx, V, **form))
    counts = torch.bincount(idx, minlength=V)
    for r in torch.nonzero(counts == 1).flatten().tolist():
        assert torch.equal(out[r], grad[(idx == r).nonzero()[0, 0]])
    assert not out[counts == 0].any()


@interp
@pytest.mark.parametrize("form", FORMS, ids=["runs", "tiles", "tiles_rb4"])
def test_interpreter_case_a_nan_stays_in_its_own_ids_row(form):
    """A diverging run's NaN gradient row reaches only its token's row, as aten's kernel keeps it: the tile form
    sums each id's rows alone (a segmented scan), never multiplying other ids' rows by zero."""
    from flash_forensics.kernels import triton_embedding as te
    idx = torch.tensor([3, 1, 3, 2, 1, 3, 2, 2, 0, 1] * 3)
    grad = torch.randn(idx.numel(), 6, generator=torch.Generator().manual_seed(0))
    grad[4, 2] = float("nan")  # token 1's
    out = te.embedding_grad(grad, idx, 5, **form)
    ref = torch.ops.aten.embedding_dense_backward(grad, idx, 5, -1, False)
    assert torch.isnan(out).nonzero().tolist() == [[1, 2]] == torch.isnan(ref).nonzero().tolist()
    torch.testing.assert_close(out[[0, 2, 3, 4]], ref[[0, 2, 3, 4]])


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["runs", "tiles"])
def test_gpu_triton_embedding_grad_is_atens_sum_in_a_fixed_order_without_a_sync(form):
    """At GPT-2S's shape with text-like ids (Zipf: the most frequent id over a thousand times in 16K): the Triton
    kernel gives aten's sums within FP32 rounding, the same bits twice, and never syncs the host; the op routes CUDA
    tensors to it."""
    from flash_forensics.kernels import triton_embedding as te
    from flash_forensics.models import embedding
    V, C, N = 50304, 768, 16384
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(1.0 / torch.arange(1, V + 1, dtype=torch.float64), N, replacement=True,
                            generator=g).cuda()
    grad = torch.randn(N, C, generator=g).cuda()
    te.embedding_grad(grad, idx, V, form=form)  # compiled outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = te.embedding_grad(grad, idx, V, form=form)
        b = te.embedding_grad(grad, idx, V, form=form)
        op = embedding.embedding_grad(grad, idx, V)  # the op's route: the default form
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(a, b)
    assert torch.equal(op, a) or form != "runs"
    ref = torch.ops.aten.embedding_dense_backward(grad, idx, V, -1, False)
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-4)
    assert int(torch.bincount(idx).max()) > 1000


def test_an_unknown_form_is_refused_by_name():
    te = pytest.importorskip("flash_forensics.kernels.triton_embedding")
    with pytest.raises(ValueError, match=r"form='rows' is not allowed: expected one of runs, tiles"):
        te.embedding_grad(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 4, form="rows")
