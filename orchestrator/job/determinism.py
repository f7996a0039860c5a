"""torch's deterministic algorithms around a compiled job (train.deterministic=true; off by default).

Inductor lowers nn.Embedding's backward (a scatter-add over the batch's token ids) to atomic adds, whose order varies
from run to run wherever a token repeats: on an H100 (2026-12-07, results/bench/gpu-h100-2026-12-07c) two
default-mode compiled runs of a 25-token text gave different losses from the first steps, and with
torch.use_deterministic_algorithms the same bits, CUDA graphs or not. The models now sort that backward and sum it in
a fixed order (models/embedding.py), and compiled runs reproduce without this scope (gpu-h100-2026-12-07d), which
then cost 6.6 ms of host time a GPT-2S step. What it still gives: an op without a deterministic form warns and is
named in the job's record. Eager training is left as it is (its recorded first steps and divergence steps are its
bits).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import List, Optional

import torch

# cuBLAS reproduces its results under deterministic algorithms only with a fixed workspace; 8 x 4 MiB is torch's
# default size on sm_90, so the choice of GEMM algorithm stays what it was
CUBLAS_WORKSPACE = ":4096:8"
NONDETERMINISTIC = " does not have a deterministic implementation"  # torch's warning, after the op's name


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True, seen: Optional[List[str]] = None):
    """torch.use_deterministic_algorithms(on) inside the block (warn_only: an op without a deterministic form warns,
    naming itself, instead of failing the job; `seen` collects those names, once each, so that the job's record says
    the run may not reproduce), without the NaN fill of new tensors that mode adds (every tensor the step allocates
    is written before it is read; the fill would cost memory bandwidth each step). Restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    show = warnings.showwarning
    set_env = on and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if set_env:  # read when cuBLAS starts (before a GEMM); unset again after, so that no later child inherits it
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    if on and seen is not None:
        def record(message, *args, **kwargs):
            op, hit, _ = str(message).partition(NONDETERMINISTIC)
            if hit and op.strip() not in seen:
                seen.append(op.strip())
            show(message, *args, **kwargs)
        warnings.showwarning = record
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = not on and before[2]
    try:
        yield
    finally:
        warnings.showwarning = show
        if set_env:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


__all__ = ["deterministic_algorithms", "CUBLAS_WORKSPACE", "NONDETERMINISTIC"]
