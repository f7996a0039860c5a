"""The host's share of one Triton attention call (fwd+bwd): what Python does around the kernel launches.

    python benchmarks/host_overhead.py                      # CPU: the kernels stubbed, host work only
    python benchmarks/host_overhead.py --device cuda        # GPU: real launches; host enqueue time vs GPU time

At T <= 1024 a layer's kernels take a few hundred microseconds, so the host work per call (the op's arguments, the
knobs, the launchers' bookkeeping, autograd) decides whether the GPU waits. Methods, timed round-robin in one process:
  cached    the eager path (kernels/ops.py flash_attention, autograd): knobs and rows-seen count cached per call
  rebuilt   the same path with both rebuilt on every call (as before the cache), for the side-by-side difference
  dispatch  what a compiled graph runs: torch.ops.flash_forensics.flash_fwd then flash_bwd, through torch's dispatch
            of custom ops (the forward mutates the counters, so it takes the mutation bookkeeping path)
  jit       (CUDA only) the cached path with every kernel launched through Triton's own fn[grid], not the launch
            cache (kernels/launch_cache.py): the cache's gain is host_us_jit - host_us_cached
and where the cached path's host time goes (`launch_us`, apart from the side-by-side methods): each Triton kernel's
launch (`kernel[grid](...)`, Triton's argument binding and enqueue) timed on its own, and the rest of the call
(`host_us_outside_launches`: the op, knobs, allocations, autograd), so a host-bound shape says which to cut;
and (`host_profile`, --profile CALLS) the cached path under cProfile: the Python functions its host time goes to;
and, apart (`schema` rows, no kernel at all): two no-op mutating custom ops, one with the 18 arguments the forward op
had before its knobs became one string, one with its 8 now: torch's dispatch cost against the schema's length.
On the CPU the four Triton kernels are replaced by no-ops (`--device cpu`: triton's launcher is not timed; the figure
is the rest). On CUDA the kernels run: `host_us_<method>` is the time to enqueue one fwd+bwd (a burst of --iters
calls after a sync, shorter than the launch queue), `gpu_us` the kernels' time of one fwd+bwd, from a CUDA graph
of the call (benchmarks/kernel_time.py; `gpu_timing` "eager" where the capture failed and the call itself was timed,
host included; every result up to 2026-12-06 was timed that way); `host_bound` (host_us_cached > gpu_us) means the
GPU waits on the host at that shape.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
import types
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.envinfo import write_json  # noqa: E402

KNOBS = {  # name -> AttentionKnobs fields (counters: the layer's AttnStats is given)
    "fa2": dict(recipe="fa2", counters=False),
    "fa2_counters": dict(recipe="fa2", counters=True),
    "fa2_sfa_counters": dict(recipe="fa2", softmax="stabilized", counters=True),
    "paper_bf16_counters": dict(recipe="paper_bf16", counters=True),
}
METHODS = ("cached", "rebuilt", "dispatch", "jit")


class _NoLaunch:
    """A jit kernel's stand-in: `kernel[grid](*args)` does nothing (the CPU has no GPU to launch on)."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


from flash_forensics.kernels.triton_launch import KERNELS  # noqa: E402


class _Timed:
    """A jit kernel's proxy: each `kernel[grid](*args)` runs the kernel and adds its host time to acc[name]."""

    def __init__(self, kernel, name: str, acc: dict):
        self.kernel, self.name, self.acc = kernel, name, acc

    def __getitem__(self, grid):
        def launch(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.kernel[grid](*a, **k)
            finally:
                self.acc[self.name] += time.perf_counter() - t0
        return launch


def host_profile(fn, calls: int, sync, top: int = 25) -> list:
    """fn() run `calls` times under cProfile (after a sync, in bursts of 10 so the launch queue never fills): its
    `top` functions by own time, each with its calls and own / cumulative microseconds per fn() call."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for i in range(0, calls, 10):
        sync()
        prof.enable()
        for _ in range(min(10, calls - i)):
            fn()
        prof.disable()
    sync()
    st = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    rows = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [dict(function=f"{os.path.relpath(f, ROOT) if f.startswith(ROOT) else os.path.basename(f)}:{ln}({name})",
                 calls_per_call=nc / calls, own_us=tt / calls * 1e6, cum_us=ct / calls * 1e6)
            for (f, ln, name), (_, nc, tt, ct, _) in rows]


@contextlib.contextmanager
def timed_launches(acc: dict):
    """The launcher's kernels wrapped in _Timed for the duration (acc: kernel name -> seconds, added to)."""
    from flash_forensics.kernels import triton_launch as tf
    saved = tf._k
    tf._k = types.SimpleNamespace(**{n: _Timed(getattr(saved, n), n, acc) for n in KERNELS})
    try:
        yield
    finally:
        tf._k = saved


@contextlib.contextmanager
def method(name):
    """`rebuilt`: the caches bypassed for the duration (their wrapped functions called directly)."""
    from flash_forensics.kernels import ops
    from flash_forensics.kernels import triton_launch as tf
    saved = (ops._knobs_cached, tf._rows_cached)
    if name == "rebuilt":
        ops._knobs_cached, tf._rows_cached = ops._knobs_cached.__wrapped__, tf._rows_per_head_of
    try:
        if name == "jit":
            with tf.triton_own_launch():
                yield
        else:
            yield
    finally:
        ops._knobs_cached, tf._rows_cached = saved


@functools.lru_cache(maxsize=None)  # an op name registers once per process
def _schema_ops():
    """Two no-op custom ops that mutate one argument: the forward op's old schema length (18) and its new one (8)."""
    import torch.library as L
    lib = "ff_host_overhead"

    @L.custom_op(f"{lib}::long", mutates_args=("a", "b", "c"))
    def long(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Optional[torch.Tensor], b: Optional[torch.Tensor],
             c: Optional[torch.Tensor], recipe: str, tiling: bool, block_q: int, block_k: int, softmax: str,
             beta: float, eps: float, pv_fp32: bool, fp32_heads: List[int], rounding: int, fp32_gemm: str,
             key_keep: Optional[torch.Tensor]) -> torch.Tensor:
        return q.new_empty(1)

    @L.custom_op(f"{lib}::short", mutates_args=("a", "b", "c"))
    def short(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Optional[torch.Tensor],
              b: Optional[torch.Tensor], c: Optional[torch.Tensor], key_keep: Optional[torch.Tensor],
              spec: str) -> torch.Tensor:
        return q.new_empty(1)

    return long, short


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default="16x12x1024x64,32x12x256x64", help="comma list of BxHxTxD")
    ap.add_argument("--knobs", default=",".join(KNOBS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=None, help="calls timed per (method, knobs, shape) and round "
                    "(default 300 on a CPU; 30 on CUDA: a burst well inside the launch queue, so the host never "
                    "waits for the GPU inside it)")
    ap.add_argument("--profile", type=int, default=60, metavar="CALLS",
                    help="then the first knobs' cached path under cProfile for CALLS calls (0: not): the Python "
                         "functions its host time goes to, in the JSON's host_profile")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    bad = [k for k in a.knobs.split(",") if k not in KNOBS]
    if bad:
        ap.error(f"--knobs: {bad[0]!r} is not allowed: expected names from {', '.join(KNOBS)}")
    if a.iters is None:
        a.iters = 30 if a.device == "cuda" else 300
    if a.rounds < 1 or a.iters < 1:
        ap.error("--rounds and --iters: expected integers >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU")
    from flash_forensics.kernels import ops
    from flash_forensics.kernels import triton_launch as tf
    from flash_forensics.kernels.config import AttentionKnobs
    from flash_forensics.kernels.stats import AttnStats
    dev = torch.device(a.device)
    if dev.type == "cpu":  # the launches stubbed: host work only
        tf._k = types.SimpleNamespace(**{n: _NoLaunch() for n in KERNELS})
    env = dict(command="python " + " ".join(["benchmarks/host_overhead.py", *argv]), torch=torch.__version__,
               python=platform.python_version(), processor=platform.processor() or platform.machine(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S"),
               gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (kernels stubbed)")
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    methods = METHODS if dev.type == "cuda" else tuple(m for m in METHODS if m != "jit")  # CPU: kernels stubbed
    out = dict(env, methods=list(methods), rounds=a.rounds, iters=a.iters, rows=[])
    path = a.out or os.path.join(ROOT, "results", "bench", f"host-overhead-{a.device}.json")

    cases = []
    for shape in a.shapes.split(","):
        B, H, T, D = (int(x) for x in shape.split("x"))
        dtype = torch.bfloat16
        q, k, v = [torch.randn(B, H, T, D, device=dev, dtype=dtype).requires_grad_() for _ in range(3)]
        do = torch.randn(B, H, T, D, device=dev, dtype=dtype)
        for kn in a.knobs.split(","):
            knobs = AttentionKnobs(backend="triton", **KNOBS[kn])
            stats = AttnStats(H, device=dev) if knobs.counters else None
            cases.append(dict(shape=shape, knobs=kn, q=q, k=k, v=v, do=do, kobj=knobs, stats=stats,
                              spec=ops.op_spec(knobs, H)))

    def eager(c):
        o = ops.flash_attention(c["q"], c["k"], c["v"], c["kobj"], c["stats"])
        torch.autograd.grad(o, (c["q"], c["k"], c["v"]), c["do"])

    def dispatch(c):
        st, spec = c["stats"], c["spec"]
        q, k, v = (c[x].detach() for x in "qkv")
        o, lse, ties = torch.ops.flash_forensics.flash_fwd(q, k, v, *(
            (st.repeated_max_rows, st.max_logit, st.underflow_rows, st.sfa_p1_rows) if st is not None
            else (None, None, None, None)), None, spec)
        torch.ops.flash_forensics.flash_bwd(c["do"], q, k, v, o, lse, None, ties, spec)

    def call(c, m="cached"):
        return dispatch(c) if m == "dispatch" else eager(c)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {(c["shape"], c["knobs"], m): [] for c in cases for m in methods}
    for c in cases:  # warm: Triton's compiles, the caches
        for m in methods:
            with method(m):
                call(c, m)
    sync()
    for r in range(a.rounds):
        for c in cases:
            for m in (methods if r % 2 == 0 else methods[::-1]):
                with method(m):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(a.iters):
                        call(c, m)
                    times[(c["shape"], c["knobs"], m)].append((time.perf_counter() - t0) / a.iters * 1e6)
                    sync()
        print(f"round {r + 1}/{a.rounds}", flush=True)
    split = {}  # (shape, knobs) -> (host us per call, {kernel: launch us per call}): the cached path, launches timed
    for c in cases:  # in bursts of --iters as above: a longer burst would fill the launch queue and wait on the GPU
        acc, total = dict.fromkeys(KERNELS, 0.0), 0.0
        with timed_launches(acc):
            for _ in range(a.rounds):
                sync()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    eager(c)
                total += time.perf_counter() - t0
                sync()
        n = a.rounds * a.iters
        split[(c["shape"], c["knobs"])] = (total / n * 1e6, {k: v / n * 1e6 for k, v in acc.items()})
    for c in cases:
        row = dict(shape=c["shape"], knobs=c["knobs"])
        for m in methods:
            row[f"host_us_{m}"] = statistics.median(times[(c["shape"], c["knobs"], m)])
        total, launches = split[(c["shape"], c["knobs"])]
        row["launch_us"] = launches  # the kernels a call launched (zeros: not launched by this recipe and knobs)
        row["host_us_outside_launches"] = total - sum(launches.values())
        if dev.type == "cuda":
            from benchmarks.kernel_time import kernel_ms
            ms, row["gpu_timing"] = kernel_ms(lambda c=c: eager(c), rep_ms=100)
            row["gpu_us"] = ms * 1e3
            row["host_bound"] = row["host_us_cached"] > row["gpu_us"]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if a.profile > 0:  # where the cached path's host time goes, function by function (cProfile's own cost included)
        out["host_profile"] = dict(shape=cases[0]["shape"], knobs=cases[0]["knobs"], calls=a.profile,
                                   top=host_profile(lambda: eager(cases[0]), a.profile, sync))
        print(json.dumps({"host_profile": out["host_profile"]["top"][:8]}), flush=True)
    # torch's dispatch against the schema's length: no-op ops, the same tensors, alternating
    long, short = _schema_ops()
    c = cases[0]
    t = torch.empty(1, device=dev)
    calls = {"schema_18_args": lambda: long(c["q"], c["k"], c["v"], t, t, t, "fa2", True, 64, 64, "safe", 2.0, 1e-3,
                                            False, [], -1, "ieee", None),
             "schema_8_args": lambda: short(c["q"], c["k"], c["v"], t, t, t, None, c["spec"])}
    got = {n: [] for n in calls}
    for r in range(a.rounds):
        for n, f in (calls.items() if r % 2 == 0 else list(calls.items())[::-1]):
            for _ in range(10):
                f()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                f()
            got[n].append((time.perf_counter() - t0) / a.iters * 1e6)
    out["schema"] = {n: statistics.median(v) for n, v in got.items()}
    print(json.dumps({"schema": out["schema"]}), flush=True)
    write_json(out, path, indent=2)
    return out


if __name__ == "__main__":
    main()
