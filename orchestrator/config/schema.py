"""The root structured config: every knob of a job, typed, registered in Hydra's ConfigStore.

conf/config.yaml starts its defaults list with `base_config` (the `Config` below), so every group file merged on top
of it is type-checked by OmegaConf (a string where an int belongs fails at compose time, naming the key). Ranges and
cross-field rules live in orchestrator/config/validate.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore

from flash_forensics.kernels.config import AttentionConfig
from flash_forensics.models.gpt import ModelConfig
from flash_forensics.orchestrator.data import DataConfig
from flash_forensics.orchestrator.interventions.spec import InterventionConfig  # what an intervention file declares
from flash_forensics.orchestrator.job.distributed import DistConfig
from flash_forensics.orchestrator.monitor.monitors import MonitorConfig
from flash_forensics.orchestrator.tracking.tracker import TrackingConfig
from flash_forensics.orchestrator.verdict import VerdictConfig

RESULTS_DIR = str(Path(__file__).resolve().parents[2] / "results")  # beside the default MLflow store


def _gpu_count() -> int:
    """`${ff_gpu_count:}`: the CUDA GPUs this process sees (0 without any). The local launcher gives every job all of
    them; a single-process job then takes GPU (job number % count), so concurrent jobs spread over the machine."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


try:
    from omegaconf import OmegaConf
    OmegaConf.register_new_resolver("ff_gpu_count", _gpu_count, use_cache=True)
except ValueError:  # already registered (module reloaded)
    pass
EXPECTS = ("stable", "diverges")
PRECISIONS = ("bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("adamw", "muon")
COMPILES = ("auto", "true", "false", "cudagraphs")
COMPILE_CASTS = ("auto", "true", "false")
DETERMINISTIC = ("auto", "true", "false")


@dataclass
class OptimizerConfig:
    """AdamW (all parameters) or Muon (2-D hidden weights) + AdamW (embeddings, head, gains)."""

    name: str = "adamw"
    lr: float = 1e-3  # peak lr of the AdamW groups (warmup, then cosine to min_lr)
    min_lr: float = 1e-5
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0  # never applied to gains, biases or embeddings
    eps: float = 1e-8
    decay_steps: Optional[int] = None  # cosine reaches min_lr here; None = train.max_steps
    muon_lr: float = 0.02  # peak lr of the Muon group (same schedule shape)
    muon_momentum: float = 0.95
    ns_steps: int = 5  # Newton-Schulz iterations


@dataclass
class TrainConfig:
    batch_size: int = 8  # micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step, summed over ranks (global batch = batch_size * grad_accum)
    max_steps: int = 100
    warmup_steps: int = 10
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    precision: str = "bf16"  # bf16: AMP (FP32 master weights, BF16 autocast); fp32: no autocast
    device: str = "auto"
    seed: int = 1337
    eval_every: int = 50  # val loss every N steps (and at the end); 0 = only at the end
    eval_batches: int = 4
    ckpt_every: int = 0  # checkpoint every N steps (always at the end); 0 = only at the end
    # periodic checkpoints only from this step on (the end is always saved): a GPT-2S checkpoint is 1.5 GB of disk
    # and of write bandwidth, so a run whose forks start near a known step need not write the early ones
    ckpt_start: int = 0
    # periodic checkpoints written by a thread while training goes on; the loop pays only for a copy to host memory
    # (orchestrator/job/ckpt_writer.py). false: written in the loop, as before
    ckpt_async: bool = True
    early_stop: bool = True  # stop verdict.early_stop_after steps after divergence
    record_batches: bool = True  # record the batch order (replay file, logged to MLflow)
    auto_resume: bool = True  # resume from <job dir>/checkpoints/last.pt when it exists (requeued jobs)
    keep_checkpoints: int = 3  # step_<k>.pt files kept (newest, plus the last one before a divergence); 0 = all
    # torch.compile the model: auto (CUDA without emulator layers) | true | false | cudagraphs (CUDA only: compiled
    # with mode="reduce-overhead", each step's launches replayed from CUDA graphs, taking the host off the GPU's path)
    compile: str = "auto"
    # a compiled model's BF16 casts outside and inside attention rounded where eager rounds them (inductor's
    # emulate_precision_casts): auto (on where a layer's attention is torch code the compiler traces: the emulator,
    # impl=standard; off where it is one opaque kernel, Triton or SDPA, as nanoGPT compiles) | true | false
    compile_casts: str = "auto"
    # what makes a compiled job reproduce its bits (eager jobs are left as they are): auto: the token embedding's
    # backward sorted, in a fixed order (models/embedding.py), where inductor's is an atomic scatter-add whose order
    # varies wherever a token repeats | true: that, and torch's deterministic algorithms (orchestrator/job/
    # determinism.py), which name an op without a deterministic form in the record (6.6 ms of host time a GPT-2S
    # step on an H100) | false: inductor's own embedding backward (two runs may differ; fa2 GPT-2S trained 0.8% more
    # tokens/s with it on an H100)
    deterministic: str = "auto"
    keep_last: bool = True  # false: a finished run drops last.pt (a copy of its final step_<k>.pt): half the disk
    # the most the steps left may take, judged once past the warm-up from the measured tokens/s (the speed is
    # not known before); null: no limit. 720 h = 30 days: max_steps=10^7 on a CPU (~1 year) stops there
    max_hours: Optional[float] = 720.0


@dataclass
class DebugConfig:
    nan_at_step: Optional[int] = None  # force a NaN loss at this step (0-based) to exercise the verdict path
    raise_at_step: Optional[int] = None  # raise an exception at this step to exercise failure handling
    kill_at_step: Optional[int] = None  # SIGKILL the job at this step (fault-injection tests), at kill_where:
    kill_where: str = "step"  # step_start | step (after the batch is read) | after_checkpoint | checkpoint_write


@dataclass
class Config:
    name: str = "default"  # experiment preset name
    sweep_name: str = "${name}"  # folder under results_dir (not `sweep`: that is the config group of sweeps/)
    results_dir: str = RESULTS_DIR  # <repo>/results wherever run.py is started from; relative = to the cwd
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="tiny", n_layer=4, n_head=4, n_embd=128,
                                                                   block_size=128))
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    intervention: InterventionConfig = field(default_factory=InterventionConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: Optional[str] = None  # checkpoint path to continue from (the same run, same MLflow run)
    # checkpoint path to FORK from: weights, optimizer, RNG and step k of another run, this config's attention and
    # intervention from step k on, the source run's batch order, a new MLflow run (orchestrator/job/fork.py)
    from_checkpoint: Optional[str] = None
    debug: DebugConfig = field(default_factory=DebugConfig)
    dist: DistConfig = field(default_factory=DistConfig)


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


register()
