"""Training tokens/s of GPT-2S (12 layers, 12 heads, 768 wide): torch SDPA + torch.compile (the nanoGPT way) vs the
Triton flash kernels, eager and compiled, counters and monitors on, side by side in one process, round-robin.

    python benchmarks/train_step.py [--shapes 16x1024,32x256] [--steps 24] [--rounds 4] [--out results/bench/...json]
    python benchmarks/train_step.py --device cpu --model tiny --shapes 2x32 --variants sdpa,emulator_paper_bf16 ...

Each variant: flash_forensics.models.gpt.GPT, fused AdamW (CUDA), BF16 autocast, grad clipping, the run's Monitors (W_Q
norms every 50 steps, one host transfer every 10, counters and max logit per layer); the same token batches, in the
same order, for every variant. All variants are built first; `--warmup` steps each (compilation) come next; then
`--rounds` rounds, each timing `steps / rounds` steps of every variant in turn, the order rotated each round, so a
clock or thermal drift falls on all of them alike. A step's time is the host clock between synchronisations; the row
is the median over all timed steps; `host_ms` the median time to enqueue one (from its start to the end of the
optimizer and monitors' calls, before the synchronisation: the monitors' flush steps sync inside it). host_ms close to
step_ms means the GPU waits on the host. A sync per step makes the GPU wait, at every step's start, for the host to
enqueue its first kernels, and a variant with more host work waits longer; the training loop syncs only at the
monitors' flushes. So each round also runs `--stream-steps` steps of every variant back to back, synchronised only at
both ends (and at the flushes, as in training): `stream_step_ms` is the median of those windows' time per step,
`stream_tokens_per_s` its tokens/s, and the summary's `stream_vs_sdpa_compile` the ratio as training sees it.

Compiled variants: `+compile` is torch.compile of the model as the project's training compiles it
(orchestrator/job/train.py compile_casts, train.compile_casts=auto: inductor's `emulate_precision_casts` on only where
attention is torch code the compiler traces, the emulator's; off for SDPA and the Triton kernels, as nanoGPT
compiles; sdpa+compile is the number to beat). `+compilecasts` and
`+compilenocasts` compile with that setting forced on or off, so that a compiled variant's gap to sdpa+compile splits
into its attention's share and the setting's (`casts_cost` in the summary: tokens/s without it over with it, per
attention). Every `+compile` runs without torch's deterministic algorithms, as a compiled job does by default
(train.deterministic=auto); `+compiledet` / `+compilenondet` force them on or off (`determinism_cost`).
Every compiled variant's token embedding has the sorted backward, as a compiled job trains (models/embedding.py;
eager variants keep nn.Embedding's, as eager jobs do), but the compiled sdpa ones: nn.Embedding's, which inductor
lowers to an atomic scatter-add, as nanoGPT compiles (inside
torch's deterministic algorithms, sdpa+compiledet, to aten's index_put_); `sdpa+compilesorted` is the reference with
the sorted one and `ATTN+compilescatter` a flash variant with inductor's (train.deterministic=false)
(`sorted_embedding_cost`). A cost pairs two rows of one attention whose other settings are the same.
`+cudagraphs` (opt-in,
not in the default list) is torch.compile(mode="reduce-overhead"): CUDA graphs replay the step's launches, taking the
host off the critical path; each step is marked (cudagraph_mark_step_begin) and its loss copied out of the graph's
memory, which the next replay overwrites. Dynamo's recompile limit grows with the compiled variants (they share
GPT.forward), and a compiled variant whose first step compiles no graph (dynamo ran it eager) is an error, not a row.
`ATTN+tuned` runs eager with --tuned-table's launch configs (a benchmarks/tune.py JSON) during its steps only;
`tuned_vs_default` in the summary: its speed-up over ATTN and whether the losses agree bit for bit.
`ATTN+ftz` runs eager with every kernel's exp on ex2.approx.ftz (kernels/triton_launch.py exp_instruction);
`ftz_vs_tl_exp` in the summary: its speed-up over ATTN and whether the losses agree bit for bit.
`ATTN+ptxas` runs eager with no kernel's registers capped (the default caps those kernels/triton_launch.py
REGISTER_TABLE measured faster); `register_caps_vs_none`: the caps' speed-up and whether the losses agree bit for bit.
`ATTN+oldcounters` runs eager with the counters computed as before (kernels/triton_launch.py counter_form("count",
"acq_rel")); `counter_form_vs_old`: the default's speed-up over it and whether the losses agree bit for bit.
`ATTN+jitlaunch` runs eager with every Triton kernel launched through Triton's own fn[grid], not the launch cache
(kernels/launch_cache.py); `launch_cache_vs_jit` in the summary: its speed-up and whether the losses agree bit for bit.
`ATTN+streamcast` runs eager with O cast to the FP32 stream before c_proj, as models/gpt.py did before _c_proj_input;
`c_proj_input_vs_stream_cast`: the default's speed-up over it and whether the losses agree bit for bit.
`ATTN+acc32` runs eager with the kernels' accumulators in FP32 (kernels/triton_launch.py accumulator_form);
`bf16_accumulators_vs_fp32`: the default's speed-up over it and whether the losses agree bit for bit.
`ATTN+ahead` runs eager with the forward's QK^T of each key tile issued one tile ahead (kernels/triton_launch.py
score_gemm_form); `score_gemm_ahead_vs_inline`: its speed-up over ATTN and whether the losses agree bit for bit.
`ATTN+regs.KERNEL=N` runs eager with KERNEL's registers (fwd, dkdv or dq) capped at N per thread (or `none`: ptxas's
choice; kernels/triton_launch.py register_limit), the rest as the default launches them; `register_cap_vs_default`:
each cap's speed-up over ATTN and whether the losses agree bit for bit (a cap moves registers, not arithmetic).
`paper_1gpu_fp32` and `paper_1gpu_fp32_ieee` are the preset's FP32 reference fork (recipe fp32, its 128x128 tiles) with
3xTF32 GEMMs, as the paper table runs it, and with IEEE FP32 ones; `fp32_reference_vs_baseline`: their tokens/s as a
fraction of paper_1gpu's.
Each row records the attention route that ran and, for SDPA, the aten op that ran (flash, cuDNN, efficient or math).
`profile`, from one profiled step after the timed ones: on CUDA the GPU kernels' time, how much of the step's GPU span
they keep the GPU busy (busy_fraction well under 1: the GPU waits on the host), attention's kernels' share, and every
kernel by time (`top`); on a CPU the top ops by self time. `host_syncs` (CUDA), from one more step that is no monitors'
flush: where it synchronised the host with the GPU (torch.cuda.set_sync_debug_mode; [] = nowhere, as the training loop
means its hot path). Every variant's per-step losses are kept:
`compiled_vs_eager` in the summary says whether a compiled variant's losses equal its eager twin's bit for bit, the
first step where they differ and the largest difference.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
import types
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

ATTN = {
    "sdpa": dict(impl="sdpa", recipe="paper_bf16"),
    "triton_fa2": dict(impl="flash", backend="triton", recipe="fa2"),
    "triton_fa2_sfa": dict(impl="flash", backend="triton", recipe="fa2", softmax="stabilized"),
    # FlashAttention-2's softmax form (the scale folded into exp2's multiply): the forward's lever (issue 33)
    "triton_fa2_exp2": dict(impl="flash", backend="triton", recipe="fa2", exp_form="exp2_folded"),
    "triton_paper_bf16": dict(impl="flash", backend="triton", recipe="paper_bf16"),
    # experiment=paper_1gpu's attention (backend auto is Triton on CUDA; 128x128 tiles)
    "paper_1gpu": dict(impl="flash", backend="triton", recipe="paper_bf16", block_q=128, block_k=128),
    "emulator_paper_bf16": dict(impl="flash", backend="emulator", recipe="paper_bf16"),  # the CPU smoke's flash
    # the preset's FP32 reference (intervention=fp32) as the paper-table's forks run it (FORK_OVERRIDES:
    # attention.fp32_gemm=tf32x3), and with IEEE FP32 GEMMs (the knob's default): what its speed costs the table
    "paper_1gpu_fp32": dict(impl="flash", backend="triton", recipe="fp32", fp32_gemm="tf32x3", block_q=128,
                            block_k=128),
    "paper_1gpu_fp32_ieee": dict(impl="flash", backend="triton", recipe="fp32", block_q=128, block_k=128),
}
VARIANTS = ["sdpa+compile", "sdpa", "triton_fa2", "triton_fa2+compile", "triton_paper_bf16",
            "triton_paper_bf16+compile", "paper_1gpu", "paper_1gpu+compile", "triton_fa2_sfa+compile",
            "triton_fa2_exp2+compile"]
SDPA_OPS = ("flash", "cudnn", "efficient", "math")  # aten::_scaled_dot_product_<op>_attention[_for_cpu]
MODES = {"compile": None, "cudagraphs": "reduce-overhead", "compilecasts": None, "compilenocasts": None,
         "compiledet": None, "compilenondet": None, "compilesorted": None, "compilescatter": None}
# ATTN+MODE: torch.compile's mode. +compile: inductor's emulate_precision_casts as training sets it
# (orchestrator/job/train.py compile_casts, auto); +compilecasts and +compilenocasts force it on or off, so that a
# compiled step's difference splits into the attention's and the setting's
CASTS = {"compilecasts": True, "compilenocasts": False}
# torch's deterministic algorithms (orchestrator/job/determinism.py): +compile follows a compiled job's default
# (train.deterministic), +compiledet / +compilenondet force them on or off (`determinism_cost` in the summary)
DET = {"compiledet": True, "compilenondet": False}
# the token embedding's backward (models/gpt.py sorted_embedding_grad): the sorted one (models/embedding.py) in
# every compiled variant but the sdpa ones, which keep nn.Embedding's (inductor's scatter-add), as nanoGPT compiles;
# sdpa+compilesorted is the reference with the sorted one, ATTN+compilescatter a flash variant with inductor's
# (train.deterministic=false) (`sorted_embedding_cost` in the summary)
SORTED, SCATTER = "compilesorted", "compilescatter"
# ATTN+jitlaunch: eager, every Triton kernel launched through Triton's own fn[grid] instead of the launch cache
# (kernels/launch_cache.py): the cache's effect on a training step, side by side
JIT_LAUNCH = "jitlaunch"
# ATTN+tuned: eager, with --tuned-table's launch configs (a tune JSON) in SHAPE_TABLE during its steps only
TUNED = "tuned"
# ATTN+ftz: eager, every kernel's exp on ex2.approx.ftz (kernels/triton_launch.py exp_instruction) instead of tl.exp's
FTZ = "ftz"
# ATTN+ptxas: eager, no kernel's registers capped (kernels/triton_launch.py register_limit(...=None)), where the
# default caps the launches REGISTER_TABLE measured faster: the caps' speed-up in training, and their bits
PTXAS = "ptxas"
# ATTN+oldcounters: eager, the counters by counting with acq_rel atomics (counter_form("count", "acq_rel")), where
# the default picks the test by recipe (a tile's two largest scores; paper_bf16 counts) with relaxed atomics: the
# default's speed-up in training, and bits
OLD_COUNTERS = "oldcounters"
# ATTN+streamcast: eager, O cast to the FP32 stream before c_proj as before (models/gpt.py _c_proj_input), where
# the default hands autocast's c_proj a BF16 O as it is: the two copies' cost per layer, and bits
STREAM_CAST = "streamcast"
# ATTN+acc32: eager, the kernels' accumulators in FP32 (kernels/triton_launch.py accumulator_form("fp32")), where the
# default keeps those paper_bf16 stores in BF16 after every tile in BF16: their speed-up in training, and bits
ACC32 = "acc32"
# ATTN+ahead: eager, each key tile's QK^T issued a tile ahead of its softmax (score_gemm_form("ahead")): its speed-up
# in training over the default's inline GEMMs, and bits
AHEAD = "ahead"
BASELINE, FP32_REFERENCES = "paper_1gpu", ("paper_1gpu_fp32", "paper_1gpu_fp32_ieee")
EAGER_MODES = (JIT_LAUNCH, TUNED, FTZ, PTXAS, OLD_COUNTERS, STREAM_CAST, ACC32, AHEAD)
# ATTN+regs.KERNEL=N: eager, one kernel's register cap (register_limit(KERNEL=N), N or none) against the default's
# launches: a cap that fits one more program on an SM, timed in training before REGISTER_TABLE takes it
REGS_MODE = re.compile(r"regs\.(?P<kernel>[a-z0-9_]+)=(?P<n>\d+|none)")
COMPILE_BACKEND = "inductor"  # torch.compile's backend (a CPU test swaps in "eager": dynamo alone, no C++ build)
RECOMPILES_PER_VARIANT = 8  # dynamo's default recompile_limit is 8 per code object for the whole process
# GPU kernels that compute attention: this project's four Triton kernels, torch's flash / cuDNN / efficient ones
# cuDNN's backward also runs compute_dot_do_o (delta) and convert_dq_to_16bits, which name no attention: before
# 2026-12-07 the pattern missed them (about 64 us a layer at B16 T1024 on an H100), so rows' attention_ms until then
# undercount SDPA's cuDNN attention
ATTN_KERNELS = re.compile(
    r"(?i)(flash|fmha|sdpa|attention|dot_do_o|convert_dq|_fwd_kernel|_bwd_(delta|dkdv|dq)_kernel)")


def log(msg: str) -> None:
    print(msg, flush=True)


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a compiled variant's first step must add at least one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def raise_recompile_limit(n_compiled: int) -> int:
    """Every compiled variant compiles the same GPT.forward (one code object) for its own model, and dynamo's
    recompile limit (8 per code object, for the whole process) otherwise runs the later ones eager with only a log
    warning (2026-12-06: paper_1gpu+cudagraphs, the fifth, timed eager and kept as compiled). Returns the limit."""
    import torch._dynamo.config as dc
    need = RECOMPILES_PER_VARIANT * max(1, n_compiled)
    dc.recompile_limit = max(dc.recompile_limit, need)
    dc.accumulated_recompile_limit = max(dc.accumulated_recompile_limit, 4 * need)
    return dc.recompile_limit


# the SDPA backend a CUDA kernel's name belongs to: what ran where a CUDA graph's replay hides the aten op
SDPA_KERNELS = (("cudnn", "cudnn_generated_fort_native_sdpa"), ("flash", "pytorch_flash::flash_"),
                ("efficient", "fmha_cutlass"))


def sdpa_backends_of(kernel_names) -> list:
    """The SDPA backends (SDPA_OPS' names) whose kernels are among `kernel_names`."""
    return sorted({backend for backend, part in SDPA_KERNELS for n in kernel_names if part in n})


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


class Variant:
    """One training setup, its state kept across rounds: model, optimizer, monitors, the next batch's index."""

    def __init__(self, name, model_name, T, dev, tuned_table=None):
        import torch._inductor.config as inductor_config

        from flash_forensics.kernels.config import AttentionConfig
        from flash_forensics.models.gpt import GPT, ModelConfig
        from flash_forensics.orchestrator.config.schema import TrainConfig
        from flash_forensics.orchestrator.job.determinism import deterministic_algorithms
        from flash_forensics.orchestrator.job.train import compile_casts
        from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors
        self.name, self.dev = name, dev
        self.attn, mode = parse_variant(name)
        self.compiled, self.cudagraphs = mode in MODES, mode == "cudagraphs"
        from flash_forensics.kernels.triton_launch import (
            accumulator_form,
            counter_form,
            exp_instruction,
            register_limit,
            score_gemm_form,
            shape_table_scope,
            triton_own_launch,
        )
        self.launch_scope = (triton_own_launch if mode == JIT_LAUNCH else
                             (lambda: shape_table_scope(tuned_table)) if mode == TUNED else
                             (lambda: exp_instruction("ex2_approx_ftz")) if mode == FTZ else
                             (lambda: register_limit(fwd=None, dkdv=None, dq=None)) if mode == PTXAS else
                             (lambda: counter_form("count", "acq_rel")) if mode == OLD_COUNTERS else
                             stream_cast if mode == STREAM_CAST else
                             (lambda: accumulator_form("fp32")) if mode == ACC32 else
                             (lambda: score_gemm_form("ahead")) if mode == AHEAD else
                             register_limit_scope(mode) if is_regs_mode(mode) else
                             contextlib.nullcontext)
        torch.manual_seed(0)  # every variant starts from the same weights
        self.model = GPT(ModelConfig.preset(model_name, block_size=T), AttentionConfig(**ATTN[self.attn])).to(dev)
        # a casts mode differs from its +compile twin only in inductor's config, which dynamo does not guard on: it
        # would replay the twin's graph (GPT.forward's cache, parameters as inputs). A code object of its own compiles
        # as a job sets it (orchestrator/job/train.py): eager keeps nn.Embedding's
        self.model.sorted_embedding_grad = self.compiled and not (mode == SCATTER or self.attn == "sdpa"
                                                                  and mode != SORTED)
        fresh = mode in CASTS or mode in DET or mode in (SORTED, SCATTER)
        target = fresh_entry(self.model, name) if fresh else self.model
        self.fwd = (torch.compile(target, mode=MODES[mode], backend=COMPILE_BACKEND) if self.compiled
                    else self.model)
        # inductor reads the setting when it compiles (the first call): patched around every call, per variant
        self.emulate = self.compiled and CASTS.get(mode, compile_casts("auto", self.model.attention_routes()))
        self.config_scope = lambda: inductor_config.patch(emulate_precision_casts=self.emulate)
        # the whole step under it, as a compiled job's (an index_put_ fallback reads the setting when it runs)
        self.deterministic = self.compiled and DET.get(mode, str(TrainConfig.deterministic) == "true")
        # (off: the process's setting is off already, between steps and jobs; no toggling on the timed host path)
        self.det_scope = deterministic_algorithms if self.deterministic else contextlib.nullcontext
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0,
                                     fused=dev.type == "cuda")
        self.monitors = Monitors(self.model, MonitorConfig())
        self.i, self.losses, self.times, self.warmup_s, self.host = 0, [], [], 0.0, []
        self.stream = []  # ms per step of each streamed window (steps back to back, one sync at each end)
        self.last_host = 0.0

    def step(self, x, sync: bool = True):
        """One training step; its time between synchronisations (sync=False: none, as the training loop runs a
        step, the caller times a stream of them; the host's share is still kept in last_host)."""
        with self.det_scope():
            return self._step(x, sync)

    def _step(self, x, sync):
        model = self.model
        if self.attn == "sdpa":  # as orchestrator/job/train.py: sdpa pays its max-logit pass on the flush steps
            model.probe = (self.i + 1) % self.monitors.cfg.log_every == 0
        if sync:
            _sync(self.dev)
        graphs = dynamo_graphs() if self.compiled and self.i == 0 else None  # its first step compiles
        t0 = time.perf_counter()
        if self.cudagraphs:  # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with self.launch_scope(), self.config_scope(), torch.autocast(self.dev.type, dtype=torch.bfloat16):
            _, loss = self.fwd(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        with self.launch_scope(), self.config_scope():
            loss.backward()
        if self.cudagraphs:  # kept past the next replay (monitors, losses): out of the graph's memory
            loss = loss.detach().clone()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.monitors.step_end(self.i, loss.detach(), gn, 3e-4, x.shape[0] * (x.shape[1] - 1))
        self.last_host = time.perf_counter() - t0  # the step enqueued: the host's share (no sync on most steps)
        if sync:
            _sync(self.dev)
        dt = time.perf_counter() - t0
        if graphs is not None and dynamo_graphs() == graphs:  # never a row that says compiled and ran eager
            import torch._dynamo.config as dc
            raise RuntimeError(f"torch.compile compiled no graph in {self.name}'s first step: dynamo ran the model "
                               f"eager (recompile limit {dc.recompile_limit} reached? TORCH_LOGS=recompiles says)")
        self.i += 1
        self.losses.append(loss.detach())
        return dt

    def profiled(self, x):
        """One more step under the profiler (after the timed ones: it changes no recorded loss): the aten SDPA ops
        that ran, and `profile` (kernel_breakdown on CUDA, top_cpu_ops on a CPU)."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            self.step(x)
        self.losses.pop()
        names = {e.key for e in prof.key_averages()}
        self.ops = sorted({op for op in SDPA_OPS for n in names if n.startswith(f"aten::_scaled_dot_product_{op}")})
        if self.dev.type == "cuda":
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            self.ops = self.ops or sdpa_backends_of({e.key for e in kernels})  # a graph replay shows no aten op
            self.profile = kernel_breakdown(kernels, top=None)  # every kernel: two variants' lists diff
        else:
            self.profile = top_cpu_ops(prof.key_averages())

    def host_syncs(self, x):
        """Where one step that is no monitors' flush (nor W_Q probe) synchronises the host with the GPU (none is
        expected: the training loop's hot path never syncs): torch.cuda.set_sync_debug_mode("warn") around it, each
        warning's source line kept (CUDA only; steps before it bring the count to such a step, their losses dropped)."""
        import warnings
        cfg = self.monitors.cfg
        while (self.i + 1) % cfg.log_every == 0 or self.i % cfg.wq_every == 0:
            self.step(x)
            self.losses.pop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.step(x, sync=False)  # (the bench's own synchronize would count)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        _sync(self.dev)
        self.losses.pop()
        self.syncs = sync_sites(caught)

    def row(self, batch, T, warmup):
        timed = self.times
        med = statistics.median(timed) if timed else None
        smed = statistics.median(self.stream) / 1e3 if self.stream else None
        return dict(variant=self.name, attention=ATTN[self.attn], compiled=self.compiled,
                    emulate_precision_casts=self.emulate if self.compiled else None,
                    deterministic=self.deterministic if self.compiled else None,
                    sorted_embedding_grad=self.model.sorted_embedding_grad, batch=batch, T=T,
                    step_ms=med * 1e3 if med else None, tokens_per_s=batch * T / med if med else None,
                    host_ms=statistics.median(self.host) * 1e3 if self.host else None,
                    stream_step_ms=smed * 1e3 if smed else None,
                    stream_tokens_per_s=batch * T / smed if smed else None, stream_windows=len(self.stream),
                    steps_timed=len(timed), warmup_steps=warmup, warmup_s=round(self.warmup_s, 2),
                    losses=[float(v) for v in torch.stack(self.losses).cpu()] if self.losses else [],
                    routes=self.model.attention_routes()[:1], compile_mode=MODES.get(self.name.partition("+")[2]))


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's words for a sync under set_sync_debug_mode


def sync_sites(caught) -> list:
    """file:line of each warning that says a sync happened (not set_sync_debug_mode's own notice that the mode is a
    prototype, which the first switch-on shows: 2026-12-07 it was read as one sync of sdpa+compile)."""
    return [f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"
            for w in caught if SYNC_WARNING in str(w.message)]


def fresh_entry(model, tag: str):
    """A function calling `model` with a code object of its own (named after `tag`): torch.compile of it keeps its
    own dynamo cache, where compiling the module would share GPT.forward's with every variant of the same config."""
    def entry(*args, **kwargs):
        return model(*args, **kwargs)
    code = entry.__code__.replace(co_name="entry_" + re.sub(r"\W", "_", tag))
    return types.FunctionType(code, entry.__globals__, code.co_name, entry.__defaults__, entry.__closure__)


@contextlib.contextmanager
def stream_cast():
    """models/gpt.py as before _c_proj_input: O always cast to the stream's dtype before c_proj."""
    from flash_forensics.models import gpt
    saved = gpt._c_proj_input
    gpt._c_proj_input = lambda y, x: y.to(x.dtype)
    try:
        yield
    finally:
        gpt._c_proj_input = saved


def is_regs_mode(mode) -> bool:
    return mode is not None and REGS_MODE.fullmatch(mode) is not None


def register_caps(mode: str) -> dict:
    """register_limit's keyword of a `regs.KERNEL=N` mode, checked as register_limit checks it (ValueError naming
    --variants and what is allowed)."""
    from flash_forensics.kernels.triton_launch import REGISTER_KERNELS, register_limit
    m = REGS_MODE.fullmatch(mode)
    caps = {m["kernel"]: None if m["n"] == "none" else int(m["n"])}
    try:
        with register_limit(**caps):
            pass
    except ValueError as e:
        raise ValueError(f"--variants: mode {mode!r} is not allowed: {e} (regs.KERNEL=N, KERNEL one of "
                         f"{', '.join(REGISTER_KERNELS)})") from None
    return caps


def register_limit_scope(mode: str):
    """The launch scope of a `regs.KERNEL=N` variant: a context factory, entered around each of its steps."""
    from flash_forensics.kernels.triton_launch import register_limit
    caps = register_caps(mode)
    return lambda: register_limit(**caps)


SETTINGS = ("emulate_precision_casts", "deterministic", "sorted_embedding_grad")  # rows' compile settings


def _setting_cost(rs: dict, key: str) -> dict:
    """Per attention, tokens/s of its default-mode compiled row with the row's `key` False over the one with it True
    and every other setting (SETTINGS) the same (> 1: the setting costs that much), e.g. sdpa+compile over
    sdpa+compilecasts for emulate_precision_casts."""
    out = {}
    for a in sorted({v.partition("+")[0] for v in rs}):
        rows = [r for v, r in rs.items() if v.partition("+")[0] == a and r.get("compiled")
                and MODES.get(v.partition("+")[2], "?") is None]
        for on in (r for r in rows if r.get(key) is True):
            for off in (r for r in rows if r.get(key) is False):
                if all(on.get(k) == off.get(k) for k in SETTINGS if k != key):
                    out[a] = off["tokens_per_s"] / on["tokens_per_s"]
    return out


def parse_variant(name: str):
    """(ATTN, MODE or None) of ATTN[+MODE]; ValueError naming --variants otherwise."""
    attn, plus, mode = name.partition("+")
    if attn not in ATTN or (plus and mode not in (*MODES, *EAGER_MODES) and not is_regs_mode(mode)):
        raise ValueError(f"--variants: {name!r} is not allowed: expected ATTN or ATTN+MODE, ATTN one of "
                         f"{', '.join(ATTN)}, MODE one of {', '.join((*MODES, *EAGER_MODES))} or regs.KERNEL=N")
    if is_regs_mode(mode):
        register_caps(mode)
    return attn, (mode if plus else None)


def kernel_breakdown(kernels, top: Optional[int] = 10) -> dict:
    """GPU kernels of one step (profiler events: name, time_range in us): their total time, the union of their
    intervals (busy) against the span from the first start to the last end, attention's share, the `top` kernels by
    time (None: every kernel, so that two variants' lists can be compared kernel by kernel)."""
    ivs, per = [], {}
    for e in kernels:
        a, b = float(e.time_range.start), float(e.time_range.end)
        ivs.append((a, b))
        t, n = per.get(e.name, (0.0, 0))
        per[e.name] = (t + (b - a), n + 1)
    if not ivs:
        return dict(device="cuda", kernels=0, kernels_ms=0.0, busy_ms=0.0, span_ms=0.0, busy_fraction=None,
                    attention_ms=0.0, attention_pattern=ATTN_KERNELS.pattern, top=[])
    ivs.sort()
    busy, (cur_a, cur_b) = 0.0, ivs[0]
    for a, b in ivs[1:]:
        if a > cur_b:
            busy, cur_a, cur_b = busy + (cur_b - cur_a), a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    span = max(b for _, b in ivs) - ivs[0][0]
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])
    return dict(device="cuda", kernels=len(ivs), kernels_ms=sum(t for t, _ in per.values()) / 1e3,
                busy_ms=busy / 1e3, span_ms=span / 1e3, busy_fraction=busy / span if span > 0 else None,
                attention_ms=sum(t for k, (t, _) in per.items() if ATTN_KERNELS.search(k)) / 1e3,
                attention_pattern=ATTN_KERNELS.pattern,
                top=[dict(name=k[:160], ms=t / 1e3, calls=n) for k, (t, n) in ranked[:top]])


def top_cpu_ops(averages, top: int = 10) -> dict:
    """A CPU step: the ops with the most self time (a smoke run's profile: no GPU kernels to break down)."""
    ranked = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]
    return dict(device="cpu", top=[dict(name=e.key[:160], ms=e.self_cpu_time_total / 1e3, calls=e.count)
                                   for e in ranked])


def _write(out, path):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, path)  # a reader, or a kill mid-write, sees the previous file or this one


def where(e: BaseException, frames: int = 4) -> str:
    """The innermost frames of e's traceback, one line each (file:line in function): an error with an empty message
    (an assert in torch) still says where it came from."""
    import traceback
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    def name(path):  # torch's files by their package path, the tree's by their path in it
        return path.split("site-packages/")[-1] if "site-packages/" in path else path.removeprefix(ROOT + os.sep)
    return " <- ".join(f"{name(f.filename)}:{f.lineno} in {f.name}" for f in reversed(tb))


def run_shape(names, batch, T, args, dev, errors):
    g = torch.Generator(device="cpu").manual_seed(0)
    per = max(1, args.steps // args.rounds)
    n_data = args.warmup + args.steps + args.stream_steps * args.rounds
    data = [torch.randint(0, 50257, (batch, T + 1), generator=g).to(dev) for _ in range(n_data)]
    live = []
    for name in names:
        try:
            live.append(Variant(name, args.model, T, dev, args.tuned))
        except Exception as e:  # recorded, the other variants still run
            errors.append(dict(variant=name, batch=batch, T=T, error=f"{type(e).__name__}: {e}"[:600]))
            log(f"[{batch}x{T}] {name}: {errors[-1]['error']}")

    def guarded(v, fn):
        try:
            return fn()
        except Exception as e:
            errors.append(dict(variant=v.name, batch=batch, T=T, error=f"{type(e).__name__}: {e}"[:600],
                               where=where(e)))
            log(f"[{batch}x{T}] {v.name}: {errors[-1]['error']}\n  raised at: {errors[-1]['where']}")
            live.remove(v)

    for v in list(live):
        def warm(v=v):
            for _ in range(args.warmup):
                v.warmup_s += v.step(data[v.i])
        guarded(v, warm)
        if v in live:
            log(f"[{batch}x{T}] {v.name}: warmup {v.warmup_s:.1f} s, route {v.model.attention_routes()[:1]}")
    yield -1, live, []  # warmed up (compiled): the JSON says so before the first timed round
    for r in range(args.rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for v in order:
            def timed(v=v):
                for _ in range(per):
                    if len(v.times) < args.steps:
                        v.times.append(v.step(data[v.i]))
                        v.host.append(v.last_host)
                n = min(args.stream_steps, len(data) - v.i)
                if n > 0:  # as the training loop runs: no sync between steps but the monitors' flushes
                    _sync(v.dev)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        v.step(data[v.i], sync=False)
                    _sync(v.dev)
                    v.stream.append((time.perf_counter() - t0) * 1e3 / n)
            guarded(v, timed)
        yield r, live, [v.name for v in order]
    for v in list(live):
        guarded(v, lambda v=v: v.profiled(data[0]))
        if v in live and dev.type == "cuda":
            guarded(v, lambda v=v: v.host_syncs(data[0]))


def _against(rs, mode: str, mode_first: bool) -> dict:
    """{variant: speed-up and bit_identical} for every variant whose `variant+mode` row ran: the speed-up is mode's
    over the default's (mode_first) or the default's over mode's."""
    out = {}
    for v in rs:
        m = rs.get(f"{v}+{mode}")
        if m is not None:
            a, b = (m, rs[v]) if mode_first else (rs[v], m)
            out[v] = dict(speedup=a["tokens_per_s"] / b["tokens_per_s"], bit_identical=rs[v]["losses"] == m["losses"])
    return out


def summarize(rows) -> dict:
    """Per shape: tokens/s and the ratio to sdpa+compile; compiled vs its eager twin, loss by loss."""
    out = {}
    ok = [r for r in rows if r.get("tokens_per_s")]
    for key in sorted({(r["batch"], r["T"]) for r in ok}):
        rs = {r["variant"]: r for r in ok if (r["batch"], r["T"]) == key}
        base = rs.get("sdpa+compile")
        d = dict(tokens_per_s={v: r["tokens_per_s"] for v, r in rs.items()})
        if base:
            d["vs_sdpa_compile"] = {v: r["tokens_per_s"] / base["tokens_per_s"] for v, r in rs.items()}
        streamed = {v: r["stream_tokens_per_s"] for v, r in rs.items() if r.get("stream_tokens_per_s")}
        if streamed:  # the steps back to back, as the training loop runs them
            d["stream_tokens_per_s"] = streamed
            if "sdpa+compile" in streamed:
                d["stream_vs_sdpa_compile"] = {v: t / streamed["sdpa+compile"] for v, t in streamed.items()}
        d["compiled_vs_eager"] = {}
        for v in rs:  # keyed ATTN for +compile (the training's mode), ATTN+cudagraphs for the other
            for mode, name in (("compile", v), ("cudagraphs", v + "+cudagraphs")):
                if "+" in v or f"{v}+{mode}" not in rs:
                    continue
                a, b = rs[v]["losses"], rs[f"{v}+{mode}"]["losses"]
                n = min(len(a), len(b))
                diff = [i for i in range(n) if a[i] != b[i]]
                d["compiled_vs_eager"][name] = dict(
                    steps=n, bit_identical=not diff, first_diff_step=diff[0] if diff else None,
                    max_abs_loss_diff=max((abs(a[i] - b[i]) for i in range(n)), default=None))
        # each eager mode against the default, side by side: the speed-up of the one named first (> 1: faster) and
        # whether the steps' losses kept every bit. The launch cache against Triton's own launch (the same kernels);
        # a tuned table against the default one; ftz exp against tl.exp's; the default's register caps against none
        # (a cap moves registers, not arithmetic); the counters' default form against the old one (same counts)
        # inductor's emulate_precision_casts: per attention, a default-mode compiled row without it over one with it
        # (tokens/s; > 1: the setting costs that much), e.g. sdpa+compile over sdpa+compilecasts
        d["casts_cost"] = _setting_cost(rs, "emulate_precision_casts")
        # torch's deterministic algorithms: the same, a default-mode compiled row without them over one with them
        d["determinism_cost"] = _setting_cost(rs, "deterministic")
        # the token embedding's sorted backward (models/embedding.py) against inductor's scatter-add
        d["sorted_embedding_cost"] = _setting_cost(rs, "sorted_embedding_grad")
        d["launch_cache_vs_jit"] = _against(rs, JIT_LAUNCH, mode_first=False)
        d["tuned_vs_default"] = _against(rs, TUNED, mode_first=True)
        d["ftz_vs_tl_exp"] = _against(rs, FTZ, mode_first=True)
        d["register_caps_vs_none"] = _against(rs, PTXAS, mode_first=False)
        d["counter_form_vs_old"] = _against(rs, OLD_COUNTERS, mode_first=False)
        d["c_proj_input_vs_stream_cast"] = _against(rs, STREAM_CAST, mode_first=False)
        d["bf16_accumulators_vs_fp32"] = _against(rs, ACC32, mode_first=False)
        d["score_gemm_ahead_vs_inline"] = _against(rs, AHEAD, mode_first=True)
        d["register_cap_vs_default"] = {m: _against(rs, m, mode_first=True)
                                        for m in sorted({v.partition("+")[2] for v in rs} - {""}) if is_regs_mode(m)}
        # the preset's FP32 reference forks against its BF16 baseline (both eager, 128x128 tiles): their speed,
        # as a fraction of the baseline's tokens/s (the paper table's forks train at this pace)
        d["fp32_reference_vs_baseline"] = {v: rs[v]["tokens_per_s"] / rs[BASELINE]["tokens_per_s"]
                                           for v in FP32_REFERENCES if v in rs and BASELINE in rs}
        out[f"B{key[0]}_T{key[1]}"] = d
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="16x1024,32x256", help="comma list of BATCHxT")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream-steps", type=int, default=6,
                    help="per round and variant, after its timed steps: this many steps back to back, synced only at "
                         "both ends and at the monitors' flushes, as the training loop runs (stream_tokens_per_s); 0: "
                         "none")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model", default="gpt2_s", help="models/gpt.py preset (tiny for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run, not a speed")
    ap.add_argument("--launch-table", default=None, help="tune JSON (benchmarks/tune.py) whose shape_table to use")
    ap.add_argument("--tuned-table", default=None, help="tune JSON whose shape_table the ATTN+tuned variants use "
                    "during their steps (the others keep the default launch)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for k in ("steps", "rounds", "warmup", "stream_steps"):
        low = 1 if k in ("steps", "rounds") else 0
        if getattr(args, k) < low:
            ap.error(f"--{k.replace('_', '-')}={getattr(args, k)} is not allowed: expected an integer >= {low}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/train_step.py needs a CUDA GPU (--device cpu: a smoke run)")
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from benchmarks.attention import environment
        env = environment(argv, script=__file__)
    else:
        import platform
        env = dict(command="python " + " ".join(["benchmarks/train_step.py"] + list(argv)), gpu="cpu",
                   torch=torch.__version__, python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    from flash_forensics.kernels.triton_launch import load_shape_table
    if args.launch_table:
        load_shape_table(args.launch_table)
    names = [v for v in args.variants.split(",") if v]
    args.tuned = None
    if any(v.endswith(f"+{TUNED}") for v in names):  # read before anything is built: a bad file stops the run here
        if not args.tuned_table:
            ap.error(f"--variants: a '+{TUNED}' variant needs --tuned-table (a benchmarks/tune.py JSON)")
        from flash_forensics.kernels import triton_launch
        saved = dict(triton_launch.SHAPE_TABLE)
        try:
            args.tuned = load_shape_table(args.tuned_table)
        except ValueError as e:
            ap.error(f"--tuned-table: {e}")
        finally:  # only the +tuned variants' steps see it
            triton_launch.SHAPE_TABLE.clear()
            triton_launch.SHAPE_TABLE.update(saved)
    for v in names:  # every name checked before anything is built
        try:
            parse_variant(v)
        except ValueError as e:
            ap.error(str(e))
        if v.endswith("+cudagraphs") and dev.type != "cuda":
            ap.error(f"--variants: {v!r} is not allowed with --device {dev.type}: CUDA graphs need --device cuda")
    if not names:
        ap.error("--variants: empty")
    raise_recompile_limit(sum(parse_variant(v)[1] in MODES for v in names))
    out = dict(env, model=args.model, optimizer="AdamW" + ("(fused)" if dev.type == "cuda" else ""),
               precision="bf16 autocast", order="round-robin", rounds=args.rounds, order_by_round={}, rows=[],
               errors=[], partial=True)
    path = args.out or os.path.join(ROOT, "results", "bench", f"train-step-{out['gpu'].split()[-1].lower()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log(f"train_step: {out['gpu']}, {len(names)} variants, shapes {args.shapes}, {args.warmup} warmup + "
        f"{args.steps} timed steps each in {args.rounds} rounds, writing {path}")
    done = []
    for shape in args.shapes.split(","):
        batch, T = (int(x) for x in shape.split("x"))
        live = []
        for r, live, order in run_shape(names, batch, T, args, dev, out["errors"]):
            out["rows"] = done + [v.row(batch, T, args.warmup) for v in live]
            if r < 0:
                _write(out, path)
                log(f"[{batch}x{T}] warmed up: {len(live)} variants")
                continue
            out["order_by_round"].setdefault(shape, []).append(order)
            _write(out, path)
            log(f"[{batch}x{T}] round {r + 1}/{args.rounds}: " + ", ".join(
                f"{v.name} {statistics.median(v.times) * 1e3:.1f} ms" for v in live if v.times))
        rows = [dict(v.row(batch, T, args.warmup), sdpa_ops=getattr(v, "ops", None),
                     host_syncs=getattr(v, "syncs", None), profile=getattr(v, "profile", None)) for v in live]
        done += rows
        out["rows"] = done
        _write(out, path)
        for row in rows:
            log(json.dumps({k: v for k, v in row.items() if k != "losses"}))
        del live, rows
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["summary"], out["partial"] = summarize(out["rows"]), False
    _write(out, path)
    log(json.dumps(out["summary"], indent=1))
    log(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
