"""The GPU time of a call's kernels alone: the call captured once in a CUDA graph and the graph replayed under
triton.testing.do_bench, so the host's work per call (Python, launches, autograd) is not in the figure. Where the
host's work outlasts the kernels (T <= 1024 for the Triton attention), timing the call itself measures the host; the
tuner and the host-overhead benchmark need the kernels' own time. A capture that fails falls back to timing the call
as it is, and says so."""
from __future__ import annotations

import torch


def kernel_ms(fn, rep_ms: int = 60, graph: bool = True):
    """(median ms, "cuda_graph" | "eager"): fn's time on the GPU, from a CUDA graph of it where one can be captured."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return triton.testing.do_bench(g.replay, warmup=20, rep=rep_ms, return_mode="median"), "cuda_graph"
        except Exception:  # (e.g. a host sync inside fn): timed as it is
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median"), "eager"
