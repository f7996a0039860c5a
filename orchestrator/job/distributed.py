"""Data-parallel setup: who am I (rank), how many are we, where do we meet.

A job spans N processes either through torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by it) or
through SLURM tasks (submitit's tasks_per_node, or srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with the
rendezvous host taken from SLURM_JOB_NODELIST and a port derived from the job id so concurrent jobs on one node
do not collide. One process needs no process group at all (world_size 1 is the plain path).

The global batch is batch_size * grad_accum whatever the world size: each rank runs grad_accum / world_size
micro-steps, so a 2-GPU run and a 1-GPU run with grad_accum 2 see the same batches (the data layer indexes
micro-batch `micro * world_size + rank`, see `global_micro`).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

BACKENDS = ("auto", "nccl", "gloo")


class DistError(ValueError):
    """A distributed setting that cannot work; the message names the key, the value and what is allowed."""


@dataclass
class DistConfig:
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    master_port: Optional[int] = None  # None: MASTER_PORT from the env, else 20000 + SLURM job id % 20000
    timeout_s: int = 600  # collective / rendezvous timeout
    preempt_check_every: int = 1  # steps between the ranks' agreement on a preemption request (CPU collective)

    def validate(self, key: str = "dist") -> "DistConfig":
        if self.backend not in BACKENDS:
            raise DistError(f"{key}.backend={self.backend!r} is not allowed: expected one of {', '.join(BACKENDS)}")
        if self.master_port is not None and not (1024 <= int(self.master_port) <= 65535):
            raise DistError(f"{key}.master_port={self.master_port!r} is not allowed: expected a port in 1024..65535")
        if int(self.timeout_s) <= 0:
            raise DistError(f"{key}.timeout_s={self.timeout_s!r} is not allowed: expected seconds > 0")
        if int(self.preempt_check_every) < 1:
            raise DistError(f"{key}.preempt_check_every={self.preempt_check_every!r} is not allowed: expected >= 1")
        return self


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None  # None when no process group was created (world_size 1)
    source: str = "single"  # single | torchrun | slurm | submitit_local
    cpu_group: object = None  # a gloo group for small host-side agreements (preemption flag) without device syncs
    owns_group: bool = False  # init_distributed created the process group, so the job's end destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def detect_env() -> dict:
    """rank/local_rank/world_size and the launcher that set them, from torchrun first, then SLURM tasks."""
    if _env_int("WORLD_SIZE") is not None and _env_int("RANK") is not None:
        return {"rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK") or 0,
                "world_size": _env_int("WORLD_SIZE"), "source": "torchrun"}
    ntasks = _env_int("SLURM_NTASKS")
    if ntasks is not None and ntasks > 1 and _env_int("SLURM_PROCID") is not None and os.environ.get("SLURM_STEP_ID"):
        # inside an srun step (submitit runs every task through srun); the batch script itself is not a rank
        return {"rank": _env_int("SLURM_PROCID"), "local_rank": _env_int("SLURM_LOCALID") or 0,
                "world_size": ntasks, "source": "slurm"}
    ntasks = _env_int("SUBMITIT_LOCAL_NTASKS")
    if ntasks is not None and ntasks > 1:  # hydra/launcher=local with tasks_per_node > 1: one node, N processes
        return {"rank": _env_int("SUBMITIT_LOCAL_GLOBALID") or 0, "local_rank": _env_int("SUBMITIT_LOCAL_LOCALID") or 0,
                "world_size": ntasks, "source": "submitit_local"}
    return {"rank": 0, "local_rank": 0, "world_size": 1, "source": "single"}


def slurm_master_addr(nodelist: Optional[str] = None) -> str:
    """First host of the job's node list (scontrol expands 'gpu[01-04]' style lists)."""
    nodelist = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return nodelist.split(",")[0].split("[")[0]


def slurm_master_port(job_id: Optional[str] = None) -> int:
    job_id = job_id or os.environ.get("SLURM_JOB_ID") or "0"
    digits = "".join(c for c in str(job_id) if c.isdigit()) or "0"
    return 20000 + int(digits) % 20000


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise DistError(f"train.device={device!r} is not allowed: expected auto, cpu or cuda")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistError(f"train.device={device!r} but CUDA is not available: use train.device=cpu or auto")
    if device.startswith("cuda:"):
        return torch.device(device)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(cfg: Optional[DistConfig] = None, device: str = "auto", slot: int = 0) -> DistInfo:
    """Find rank/world from torchrun or SLURM env, pick the device, create the process group when world_size > 1.

    slot: for a single-process job, which of the visible GPUs `cuda`/`auto` means (slot % count); the job passes
    its Hydra job number, so the local launcher's concurrent jobs spread over a machine's GPUs.
    """
    cfg = (cfg or DistConfig())
    if not isinstance(cfg, DistConfig):  # an OmegaConf node or a dict
        cfg = DistConfig(**{k: cfg[k] for k in ("backend", "master_port", "timeout_s", "preempt_check_every")
                            if k in cfg})
    cfg.validate()
    env = detect_env()
    dev = resolve_device(device, env["local_rank"] if env["world_size"] > 1 else int(slot))
    if env["world_size"] == 1:
        return DistInfo(device=dev, source=env["source"])

    import torch.distributed as dist

    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise DistError("dist.backend='nccl' is not allowed on CPU: expected gloo or auto")
    if env["source"] == "slurm":
        os.environ.setdefault("MASTER_ADDR", slurm_master_addr())
    if cfg.master_port is not None:
        os.environ["MASTER_PORT"] = str(cfg.master_port)
    elif env["source"] == "slurm":
        os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))
    elif env["source"] == "submitit_local":
        os.environ.setdefault("MASTER_PORT", str(slurm_master_port(os.environ.get("SUBMITIT_LOCAL_JOB_ID"))))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()  # a caller's own group is left to the caller
    if owns:
        dist.init_process_group(backend=backend, init_method="env://", rank=env["rank"],
                                world_size=env["world_size"], timeout=timedelta(seconds=int(cfg.timeout_s)),
                                **({"device_id": dev} if dev.type == "cuda" else {}))
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistInfo(rank=env["rank"], local_rank=env["local_rank"], world_size=env["world_size"], device=dev,
                    backend=backend, source=env["source"], cpu_group=cpu_group, owns_group=owns)


def is_main(info: Optional[DistInfo] = None) -> bool:
    """Rank 0 (or no process group at all): the only one that logs, writes checkpoints and result.json."""
    if info is not None:
        return info.is_main
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def micro_steps_per_rank(grad_accum: int, world_size: int) -> int:
    """grad_accum is the global number of micro-batches per optimizer step; each rank runs its share."""
    if grad_accum % world_size:
        raise DistError(f"train.grad_accum={grad_accum} is not allowed with {world_size} ranks: expected a multiple "
                        f"of the world size (the global batch is batch_size * grad_accum)")
    return grad_accum // world_size


def global_micro(micro: int, rank: int, world_size: int) -> int:
    """The global micro-batch index rank `rank` consumes at its local micro-step `micro` (interleaved)."""
    return micro * world_size + rank


def barrier(info: DistInfo) -> None:
    if info.distributed:
        import torch.distributed as dist

        dist.barrier(group=info.cpu_group)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when any rank's host-side flag is set (a gloo all-reduce: no device sync)."""
    if not info.distributed:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.cpu_group)
    return bool(t.item())


def cleanup(info: Optional[DistInfo] = None) -> None:
    """Destroy the process group (the one `info` owns; with no info, whatever group is up).

    A gloo process left to the interpreter's exit can abort there ("terminate called without an active exception",
    SIGABRT): its worker threads outlive the interpreter's teardown. A finished rank then fails its torchrun.
    """
    import torch.distributed as dist

    if info is not None and not info.owns_group:
        return
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # never in place of the job's own error (a peer that died, a broken store)
            print(f"[dist] rank {info.rank if info else '?'}: the process group could not be destroyed: {e}",
                  flush=True)
