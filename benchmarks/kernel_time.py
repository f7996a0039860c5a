"""The GPU time of a call's kernels alone: the call captured once in a CUDA graph and the graph replayed under
triton.testing.do_bench, so the host's work per call (Python, launches, autograd) is not in the figure. Where the
host's work outlasts the kernels (T <= 1024 for the Triton attention), timing the call itself measures the host; the
tuner and the host-overhead benchmark need the kernels' own time. A capture that fails falls back to timing the call
as it is, and says so."""
from __future__ import annotations

import torch


def capture(fn, before=lambda: None):
    """fn captured in a CUDA graph, warmed up off the default stream first (as torch.cuda.graphs asks); `before`
    runs before the warm-up, before the capture and after it (benchmarks/attention.py resets its leaves' .grad)."""
    before()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    before()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
    finally:
        before()
    return g


def kernel_ms(fn, rep_ms: int = 60, graph: bool = True):
    """(median ms, "cuda_graph" | "eager"): fn's time on the GPU, from a CUDA graph of it where one can be captured."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            g = capture(fn)
            return triton.testing.do_bench(g.replay, warmup=20, rep=rep_ms, return_mode="median"), "cuda_graph"
        except Exception:  # (e.g. a host sync inside fn): timed as it is
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median"), "eager"


def kernel_split(fn, iters: int = 20, grads=()) -> dict:
    """Where fn's GPU time goes, kernel by kernel: fn run `iters` times under torch.profiler (CUDA activity only),
    each kernel's device time per call of fn. The profiler times kernels on the GPU's own clock, so the host's work
    per call is not in it, as in kernel_ms; unlike kernel_ms, each kernel is named (forward, delta, dK/dV, dQ, a
    copy, ...). `grads`: leaves whose .grad is reset before each call (as do_bench's grad_to_none), so a backward
    writes its gradients instead of adding them into the last call's. {"kernels": [{name, us, launches}],
    "total_us"}, longest first."""
    from torch.profiler import ProfilerActivity, profile

    def call():
        for g in grads:
            g.grad = None
        fn()
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    return split_events(prof.events(), iters)


def split_events(events, iters: int) -> dict:
    """kernel_split's aggregation over profiler events (FunctionEvent: .name, .device_type, .time_range): the
    device events' time per call of the profiled function, by kernel name."""
    from torch.autograd import DeviceType
    acc: dict = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        a = acc.setdefault(e.name, [0.0, 0])
        a[0] += e.time_range.elapsed_us()
        a[1] += 1
    rows = [dict(name=n, us=t / iters, launches=c / iters) for n, (t, c) in acc.items()]
    rows.sort(key=lambda r: -r["us"])
    return dict(kernels=rows, total_us=sum(r["us"] for r in rows))
