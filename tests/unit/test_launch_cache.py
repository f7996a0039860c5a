"""kernels/launch_cache.py: which launches reuse a cached kernel, what reaches Triton's launcher, and the modes.

On the CPU a stand-in jit function and compiled kernel record the calls (Triton launches nothing without a GPU); the
GPU tests below run the real kernels through the cache and through Triton's own launch, in check mode."""
from __future__ import annotations

import types

import pytest
import torch

from flash_forensics.kernels import launch_cache as lc


class _Compiled:
    def __init__(self, tag):
        self.tag, self.launches = tag, []

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.launches.append((grid, args, stream))
        return runner


class _Fn:
    """A jit function's stand-in: runtime parameters a, b, n, x, then constexprs BLOCK, MODE. Triton's own launch
    (fn[grid]) compiles one kernel per `triton_key` of the arguments; `run(..., warmup=True)` returns it."""
    __name__ = "_fake_kernel"

    def __init__(self):
        names = [("a", False), ("b", False), ("n", False), ("x", False), ("BLOCK", True), ("MODE", True)]
        self.params = [types.SimpleNamespace(name=n, is_constexpr=c) for n, c in names]
        self.kernels, self.jit_calls = {}, []
        self.wrong = False

    def triton_key(self, args, kw):
        a, b, n, x = args
        return (a.dtype, a.data_ptr() % 16 == 0, b.dtype, b.data_ptr() % 16 == 0, n == 1, n % 16 == 0,
                tuple(sorted(kw.items())))

    def _kernel(self, args, kw):
        key = self.triton_key(args, kw)
        return self.kernels.setdefault(key, _Compiled(len(self.kernels)))

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            return self._kernel(args, kw)
        return launch

    def run(self, *args, grid, warmup, **kw):
        assert warmup
        return _Compiled("other") if self.wrong else self._kernel(args, kw)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(lc, "current_device", lambda: 0)
    monkeypatch.setattr(lc, "current_stream", lambda device: 7)
    monkeypatch.setattr(lc, "_hooked", lambda: False)
    return _Fn()


def _args(a, b, n):
    return a, b, n, 0.5


KW = dict(BLOCK=64, MODE="ieee", num_warps=4, num_stages=3)


def test_the_second_call_of_a_key_reaches_the_compiled_kernel_with_addresses_and_constexprs(fake):
    k = lc.CachedKernel(fake, "direct")
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    first = k[(3, 2)](*_args(a, b, 32), **KW)
    assert len(fake.jit_calls) == 1 and first is fake.kernels[fake.triton_key(_args(a, b, 32), {**KW})]
    k[(3, 2)](*_args(a, b, 48), **KW)  # 48: divisible by 16 as 32 is: the same kernel, no second jit launch
    assert len(fake.jit_calls) == 1
    (grid, args, stream), = first.launches
    # the grid padded to three dimensions, tensors as their addresses, the constexprs in the signature's order
    assert grid == (3, 2, 1) and stream == 7
    assert args == (a.data_ptr(), b.data_ptr(), 48, 0.5, 64, "ieee")


@pytest.mark.parametrize("change", ["misaligned", "one", "not16", "dtype", "constexpr", "warps"])
def test_every_property_triton_specializes_on_makes_a_new_key(fake, change):
    k = lc.CachedKernel(fake, "direct")
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    k[(1,)](*_args(a, b, 32), **KW)
    args, kw = list(_args(a, b, 32)), dict(KW)
    if change == "misaligned":  # 4 bytes into the storage: not 16-byte aligned
        args[0] = a[1:]
    elif change == "one":
        args[2] = 1
    elif change == "not16":
        args[2] = 33
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.float16)
    elif change == "constexpr":
        kw["BLOCK"] = 128
    else:
        kw["num_warps"] = 8
    k[(1,)](*args, **kw)
    assert len(fake.jit_calls) == 2  # through Triton again: its kernel for the new specialization


def test_jit_mode_hooks_and_unknown_argument_types_go_through_triton(fake, monkeypatch):
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    jit = lc.CachedKernel(fake, "jit")
    for _ in range(2):
        jit[(1,)](*_args(a, b, 32), **KW)
    assert len(fake.jit_calls) == 2
    direct = lc.CachedKernel(fake, "direct")
    direct[(1,)](a, b, 32, object(), **KW)  # a type spec_of does not know: never cached
    direct[(1,)](a, b, 32, object(), **KW)
    assert len(fake.jit_calls) == 4
    monkeypatch.setattr(lc, "_hooked", lambda: True)  # a profiler's launch hook: Triton's launch, always
    direct[(1,)](*_args(a, b, 32), **KW)
    direct[(1,)](*_args(a, b, 32), **KW)
    assert len(fake.jit_calls) == 6


def test_check_mode_raises_when_triton_would_pick_another_kernel(fake):
    k = lc.CachedKernel(fake, "check")
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    k[(1,)](*_args(a, b, 32), **KW)
    k[(1,)](*_args(a, b, 32), **KW)  # Triton agrees: launched from the cache
    fake.wrong = True
    with pytest.raises(AssertionError, match="_fake_kernel.*not the one Triton picks"):
        k[(1,)](*_args(a, b, 32), **KW)


def test_spec_of_reads_what_triton_specializes_on():
    t = torch.zeros(8)
    key, flat = lc.spec_of((t, 1, 2, 16, 2**40, 0.25, True, None))
    assert flat == [t.data_ptr(), 1, 2, 16, 2**40, 0.25, True, None]
    assert key == ((torch.float32, t.data_ptr() % 16 == 0), "one", ("i32", False), ("i32", True), ("i64", True),
                   "fp32", "u1", "none")
    assert lc.spec_of((t, "x")) is None


def test_a_wrong_mode_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("FF_TRITON_LAUNCH", "fast")
    with pytest.raises(ValueError, match=r"FF_TRITON_LAUNCH='fast' is not allowed: expected one of direct, jit, check"):
        lc.launch_mode()
    monkeypatch.setenv("FF_TRITON_LAUNCH", "check")
    assert lc.launch_mode() == "check"


def test_the_project_kernels_take_their_constexprs_last():
    """CachedKernel passes the runtime arguments positionally and the constexprs after them, by name."""
    pytest.importorskip("triton")
    from flash_forensics.kernels import triton_kernels, triton_launch
    for name in triton_launch.KERNELS:
        k = lc.CachedKernel(getattr(triton_kernels, name), "direct")
        assert k.n_runtime > 10 and "HEAD_DIM" in k.const_names


# ------------------------------------------------------------------------------------------------------ the GPU


def _fwd_bwd(q, k, v, do, knobs):
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attention_triton(q, k, v, knobs)
    o.backward(do)
    return [o, q.grad, k.grad, v.grad]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the kernels launch")
@pytest.mark.parametrize("recipe", ["fa2", "paper_bf16", "fp32"])
def test_the_cache_runs_the_kernel_triton_picks_bit_for_bit(recipe):
    """Shapes whose strides and addresses change the specialization (odd T, a fused-QKV view, an offset start):
    the cache in check mode (every launch: Triton's kernel is the cached one) and Triton's own launch give the same
    bits."""
    from flash_forensics.kernels import triton_launch as tl_
    from flash_forensics.kernels.config import AttentionKnobs
    knobs = AttentionKnobs(recipe=recipe, backend="triton")
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for B, H, T, D in [(2, 3, 128, 64), (1, 2, 77, 64), (2, 2, 200, 32)]:
        cases.append([torch.randn(B, H, T, D, device="cuda", dtype=dt, generator=g) for _ in range(4)])
    B, H, T, D = 2, 4, 96, 64  # views of one fused projection, (B, T, H, D)-ordered, one element in: misaligned
    qkv = torch.randn(B * T * 3 * H * D + 1, device="cuda", dtype=dt, generator=g)[1:].view(B, T, 3 * H * D)
    cases.append([t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
                 + [torch.randn(B, H, T, D, device="cuda", dtype=dt, generator=g)])
    saved = tl_._k
    try:
        tl_._k = lc.Kernels(tl_._jit, tl_.KERNELS, "check")
        for _ in range(2):  # the second pass launches from the cache, checked against Triton's pick
            cached = [_fwd_bwd(*c, knobs) for c in cases]
        with tl_.triton_own_launch():
            own = [_fwd_bwd(*c, knobs) for c in cases]
    finally:
        tl_._k = saved
    for i, (a, b) in enumerate(zip(cached, own)):
        for name, x, y in zip(("O", "dQ", "dK", "dV"), a, b):
            assert torch.equal(x, y), f"case {i}: {name} differs between the launch cache and Triton's launch"


def test_the_key_is_at_least_as_fine_as_triton_s_own_specialization():
    """Arguments that share a spec_of key share Triton's specialization (native_specialize_impl, as its binder
    calls it for the CUDA backend): the cache never hands one specialization's kernel to another's arguments."""
    pytest.importorskip("triton")
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError as e:  # pragma: no cover - a Triton build without them
        pytest.skip(f"this Triton has no native specialization to compare with: {e}")
    t = torch.zeros(64, dtype=torch.bfloat16)
    values = [0, 1, 2, 8, 15, 16, 17, 32, 1024, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63, 2**63 + 16,
              -2**31, -2**31 - 1, 0.5, 1.0, True, False, None, t, t[1:], t[8:], torch.zeros(4, dtype=torch.int64),
              torch.zeros(3)]
    theirs = {}
    for v in values:
        theirs.setdefault(lc.spec_of((v,))[0], set()).add(repr(native_specialize_impl(CUDABackend, v, False, True,
                                                                                        True)))
    assert all(len(s) == 1 for s in theirs.values()), {k: s for k, s in theirs.items() if len(s) > 1}


def test_t4096_takes_its_own_tuned_entry_and_t1024_keeps_the_default():
    """benchmarks/tune.py fills SHAPE_TABLE per length class: a T = 4096 choice must not move T = 1024's launch."""
    from flash_forensics.kernels import triton_launch as tl_
    from flash_forensics.kernels.config import AttentionKnobs
    knobs = AttentionKnobs(recipe="fa2", backend="triton", counters=False)
    assert [tl_.length_class(T) for T in (256, 1024, 2048, 4096, 8192)] == ["short", "long", "long", "xlong", "xlong"]
    before = tl_._fwd_blocks(knobs, 64, 1024)
    key = ("fwd", "fa2", 64, "xlong")
    try:
        tl_.SHAPE_TABLE[key] = (128, 64, 8, 4)
        assert tl_._fwd_blocks(knobs, 64, 1024) == before
        if not tl_._interpret():
            assert tl_._fwd_blocks(knobs, 64, 4096) == (128, 64, 8, 4)
        else:  # the interpreter's blocks are its own; the warps and stages still come from the entry
            assert tl_._fwd_blocks(knobs, 64, 4096)[2:] == (8, 4)
    finally:
        tl_.SHAPE_TABLE.pop(key, None)
