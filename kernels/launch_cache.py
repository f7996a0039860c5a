"""Launching the Triton kernels without Triton's per-call binding: each compiled kernel cached under the
specialization Triton gives the arguments, then launched through Triton's own CompiledKernel[grid] entry.

Why: at T <= 1024 one fwd+bwd of the attention is four launches whose host time, not the GPU's, bounds the layer
(results/bench/gpu-h200-2026-12-06/host_overhead.json: 863 us of host time against 803 us on the GPU). Triton's
`fn[grid](...)` binds ~60 arguments, builds and hashes the specialization key, checks the kernel's globals, and its
launcher calls `data_ptr()` and cuPointerGetAttribute for every tensor argument. Here the key is computed from the
same properties Triton specializes on (an argument's type, 16-byte alignment, divisibility by 16, the value 1), and
the tensors travel as their device addresses (Triton's launcher takes an int as a pointer as it is). On an H100
(results/bench/gpu-h100-2026-12-06c/) this took fa2's fwd+bwd from 751-809 to 620-625 us of host time.

The kernel that runs is always one Triton compiled for these arguments: the first call of a key goes through
`fn[grid]` (Triton binds, compiles, launches and returns it). `FF_TRITON_LAUNCH`:
  direct  (default) the cache above;
  jit     every launch through `fn[grid]`, as before this module;
  check   the cache, and every launch also asks Triton (`fn.run(..., warmup=True)`, no launch) for its kernel:
          a different one raises (the GPU tests run in this mode).
A launch hook (Triton's profilers: knobs.runtime.launch_enter_hook) sends every launch through `fn[grid]`.
"""
from __future__ import annotations

import os

import torch

try:  # read once here, not per launch (a function-level import costs on the hot path this module exists for)
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # pragma: no cover - no triton: nothing launches
    _knobs = _driver = None

MODES = ("direct", "jit", "check")


def launch_mode() -> str:
    """FF_TRITON_LAUNCH, validated: a wrong value names the variable, the value and what is allowed."""
    mode = os.environ.get("FF_TRITON_LAUNCH", "direct")
    if mode not in MODES:
        raise ValueError(f"FF_TRITON_LAUNCH={mode!r} is not allowed: expected one of {', '.join(MODES)}")
    return mode


def spec_of(args):
    """(specialization key, the arguments as the launcher takes them) of a launch's runtime arguments, or None for
    an argument of a type not handled here (that launch then goes through fn[grid]). Per argument, what Triton's
    specialization reads: a tensor's dtype and whether its address is 16-byte aligned (the address replaces it); an
    int's width (i32 / i64 / u64), whether it is 1 (Triton makes it a constant) and whether 16 divides it; floats,
    bools and None by their type alone."""
    key, out = [], []
    for a in args:
        t = type(a)
        if t is int:  # (tags are strings: True == 1 and 1.0 == 1 would share a key)
            if a == 1:
                key.append("one")
            else:
                width = "i32" if -0x80000000 <= a <= 0x7FFFFFFF else "u64" if a >= 1 << 63 else "i64"
                key.append((width, a % 16 == 0))
            out.append(a)
        elif t is float:
            key.append("fp32")
            out.append(a)
        elif isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            key.append((a.dtype, ptr % 16 == 0))
            out.append(ptr)
        elif t is bool or a is None:
            key.append("u1" if t is bool else "none")
            out.append(a)
        else:
            return None
    return tuple(key), out


def current_device() -> int:
    """The device Triton launches on: its driver's current one (what fn[grid] reads)."""
    return _driver.active.get_current_device()


def current_stream(device: int):
    return _driver.active.get_current_stream(device)


def _hooked() -> bool:
    """Whether a launch hook is set (a HookChain with calls since Triton 3.4; None or a function before)."""
    rt = _knobs.runtime
    return any(h is not None and bool(getattr(h, "calls", True)) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


class CachedKernel:
    """A jit kernel's stand-in with its launch syntax, `kernel[grid](*runtime_args, num_warps=, num_stages=,
    [maxnreg=,] **constexprs)`: the runtime arguments positional, in the signature's order, the constexprs by name."""

    def __init__(self, fn, mode: str):
        self.fn, self.mode = fn, mode
        self.const_names = [p.name for p in fn.params if p.is_constexpr]
        self.n_runtime = len(fn.params) - len(self.const_names)
        if any(p.is_constexpr for p in fn.params[:self.n_runtime]):
            raise TypeError(f"{fn.__name__}: launch_cache needs the constexpr parameters last")
        self.cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args, kw):
        if self.mode == "jit" or _hooked():
            return self.fn[grid](*args, **kw)
        got = spec_of(args) if len(args) == self.n_runtime else None
        if got is None:
            return self.fn[grid](*args, **kw)
        spec, flat = got
        tail = tuple(kw[n] for n in self.const_names)
        device = current_device()
        key = (device, kw.get("num_warps"), kw.get("num_stages"), kw.get("maxnreg"), tail, spec)
        kernel = self.cache.get(key)
        if kernel is None:  # Triton binds, compiles (or finds) and launches: its kernel for this key
            kernel = self.cache[key] = self.fn[grid](*args, **kw)
            return kernel
        if self.mode == "check":
            theirs = self.fn.run(*args, grid=grid, warmup=True, **kw)
            if theirs is not kernel:
                raise AssertionError(f"{self.fn.__name__}: the launch cache's kernel for {spec} is not the one "
                                     f"Triton picks for these arguments")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        kernel[grid](*flat, *tail, stream=current_stream(device))
        return kernel


class Kernels:
    """The module's jit kernels by name, each launched through CachedKernel (mode: launch_mode() at import)."""

    def __init__(self, module, names, mode: str):
        for name in names:
            fn = getattr(module, name)
            setattr(self, name, fn if mode == "jit" else CachedKernel(fn, mode))
