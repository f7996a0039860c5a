"""The paper's isolation method end to end, one entry point (the paper, Sec. 3.2):

    flash-forensics isolate [--root DIR] [--out DIR] [--fork-steps N | --past-divergence N] [--margin N]
                            [--pick at-min|before-divergence] [--per-gpu N] [--fork-memory GIB] [--stop-after N]
                            [--keep-checkpoints K] [--fork-override KEY=VALUE ...] [--uri URI]
                            [hydra overrides for every run, e.g. train.seed=2 data.seed=2]

1. baseline: the BF16 flash baseline (experiment=mini_repro), batch order recorded, every checkpoint kept, no early
   stop (the forks replay its recorded batches, so it records as many steps as they may need), or with
   --stop-after N an early stop N steps after its divergence;
2. checkpoint: the newest one at or before its lowest loss preceding the divergence (fork.pick_step at_min), the
   last point where training was still at its best; or, --pick before-divergence, the newest one at least --margin
   steps before the divergence (the paper's regime: its lowest loss can lie 800 steps before a 10K-step divergence);
3. localization: the layer and heads its own W_Q growth and repeated maxima point at
   (flash_forensics.orchestrator.analysis.localize);
4. forks: every job of the sweep files (paper_isolation, beta_sweep) from that checkpoint on the same batches to the
   baseline's last step (or --fork-steps steps, or to the divergence + --past-divergence steps: past the baseline's
   end the batches continue its seeded order, data.replay_past_end), each its own run with the --fork-override
   settings, --per-gpu at a time on each visible GPU (default GPU memory / 16 GiB: one mini_repro fork holds ~12.5
   GiB; one at a time without a GPU); with --fork-memory, a fork starts only once its GPU has that much free, and
   the next one on that GPU waits until it has taken its memory;
5. report: one table over the baseline and the forks, <out>/verdicts.{md,json} + plots + localize.{json,png},
   logged to a parent MLflow run (role=sweep) with the counts as its metrics; when the sweeps include
   rounding_points, the third localization stage (orchestrator/analysis/localize/rounding.py) names the rounding
   point the divergence needs in BF16: <out>/rounding.{json,png}, a Cause section in verdicts.md, ff.cause.* tags on the
   baseline runs and the parent run.

State passes between the steps as Python objects (the run record, the picked step, the Localization). Each run is
its own `python run.py` process (its own GPU, its own failure: a fork that fails is the report's to show). The
report goes to <root>/report by default, never over the committed reproduction in results/paper_isolation/ unless
--out names it. scripts/paper_isolation.sh is a thin wrapper.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config (preflight_configs)
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize import (
    format_localization,
    load_history,
    localize,
    plot,
    resolve_source,
    rounding,
    rounding_io,
)
from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.config.keys import check_keys
from flash_forensics.orchestrator.config.validate import validate_config
from flash_forensics.orchestrator.job import fork
from flash_forensics.orchestrator.report.readback import client_for, retry
from flash_forensics.orchestrator.report.rows import rows_from_dirs
from flash_forensics.orchestrator.report.sweep import log_sweep_metrics, write_report
from flash_forensics.orchestrator.tracking.store import TrackingUnreachable, check_tracking
from flash_forensics.orchestrator.tracking.tracker import default_tracking_uri, get_or_create_experiment, git_info

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "paper_isolation"  # the MLflow experiment the pipeline's runs log to
FORK_MEMORY = 2 ** 34  # 16 GiB per fork slot (a mini_repro fork holds ~12.5 GiB)


def gpu_free_gib(gpu: str) -> Optional[float]:
    """Free memory of one GPU (its index or UUID as CUDA_VISIBLE_DEVICES names it), by nvidia-smi; None when it
    cannot tell (no nvidia-smi): the caller then does not wait."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", gpu],
                             capture_output=True, text=True, timeout=30)
        return float(out.stdout.strip().splitlines()[0]) / 1024 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class PipelineError(RuntimeError):
    """A step the rest depends on failed (baseline, checkpoint pick, localization): the message says which."""


@dataclass
class Plan:
    root: Path
    out: Path
    uri: str
    overrides: List[str] = field(default_factory=list)
    experiment: str = "mini_repro"
    sweeps: Tuple[str, ...] = ("paper_isolation", "beta_sweep")
    localized_sweeps: Tuple[str, ...] = ("paper_isolation",)  # their layer/head interventions take the target
    fork_steps: int = 0  # 0: to the end of the baseline's recorded batches
    margin: int = 0  # steps between the picked checkpoint and the lowest-loss step
    per_gpu: Optional[int] = None
    stop_after: Optional[int] = None  # the baseline stops this many steps after its divergence (None: no early stop)
    pick_rule: str = "at-min"  # at-min | before-divergence (the checkpoint rule, step 2)
    past_divergence: Optional[int] = None  # forks end at the divergence + this many steps (beats fork_steps)
    keep_checkpoints: int = 0  # the baseline's train.keep_checkpoints (0: all; a GPT-2S checkpoint is ~1.5 GB)
    fork_overrides: List[str] = field(default_factory=list)  # Hydra overrides of the forks only
    fork_memory_gib: Optional[float] = None  # GPU memory a fork needs free before it starts (None: no check)
    settle_s: float = 25.0  # with fork_memory_gib: how long a started fork has to take its memory


@dataclass
class Fork:
    name: str
    overrides: List[str]
    gpu: Optional[str] = None
    returncode: Optional[int] = None
    log: Optional[Path] = None


class Pipeline:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.t0 = time.monotonic()
        self.times: Dict[str, float] = {}

    def say(self, msg: str) -> None:
        print(f"[paper_isolation {int(time.monotonic() - self.t0)}s] {msg}", flush=True)

    def _cmd(self, overrides: Sequence[str]) -> List[str]:
        p = self.plan
        return [sys.executable, "run.py", f"experiment={p.experiment}", *overrides, f"tracking.uri={p.uri}",
                f"tracking.experiment={EXPERIMENT}"]

    def _run_py(self, overrides: Sequence[str], log: Optional[Path] = None, gpu: Optional[str] = None) -> int:
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
        if log is None:
            return subprocess.run(self._cmd(overrides), cwd=REPO, env=env).returncode
        with open(log, "w") as f:
            return subprocess.run(self._cmd(overrides), cwd=REPO, env=env, stdout=f,
                                  stderr=subprocess.STDOUT).returncode

    def _start_py(self, overrides: Sequence[str], log: Path, gpu: Optional[str]) -> subprocess.Popen:
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
        with open(log, "w") as f:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(self._cmd(overrides), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_for_memory(self, gpu: Optional[str], name: str) -> None:
        """With --fork-memory: block until `gpu` has that much free (nvidia-smi; at most 15 minutes, then say so
        and go on: the fork's own out-of-memory error is then its report's to show)."""
        need = self.plan.fork_memory_gib
        if need is None or gpu is None:
            return
        deadline, said = time.monotonic() + 900, False
        while True:
            free = gpu_free_gib(gpu)
            if free is None or free >= need:
                return
            if time.monotonic() > deadline:
                self.say(f"  {name}: GPU {gpu} still has only {free:.0f} GiB free after 15 min; starting it anyway")
                return
            if not said:
                self.say(f"  {name}: waiting for {need:g} GiB free on GPU {gpu} ({free:.0f} GiB now)")
                said = True
            time.sleep(3)

    # ---------------------------------------------------------------------------------------------- steps
    def baseline(self) -> Tuple[Path, record.RunRecord]:
        job = self.plan.root / "baseline"
        self.say(f"1/5 baseline -> {job}")
        # stop_after: early stop N steps past the divergence, so the forks have batches to replay past it and no
        # GPU time goes on a run that has already blown up; without it, every batch of max_steps is recorded
        rc = self._run_py([*baseline_overrides(self.plan),
                           f"sweep_name={EXPERIMENT}_runs/baseline", f"hydra.run.dir={job}"])
        try:
            rec = record.read(job)
        except (OSError, ValueError) as e:
            raise PipelineError(f"the baseline left no readable {record.RESULT_FILE} in {job} (exit {rc}): {e}") from e
        if rec.observed == "failed":
            raise PipelineError(f"the baseline failed (exit {rc}): {rec.error}")
        return job, rec

    def pick(self, job: Path, rec: record.RunRecord) -> Tuple[int, Path, int]:
        """(fork step, checkpoint, the forks' last step)."""
        p = self.plan
        if rec.divergence_step is None:  # fork.pick_step's answer ("give --before STEP") names no flag of this tool
            raise PipelineError(f"the baseline ({job}) did not diverge in its {rec.steps_done} steps: there is no "
                                "divergence to isolate; train it longer (train.max_steps) or check the recipe")
        step, ckpt = fork.pick_step(job, at_min=p.pick_rule == "at-min", margin=p.margin)
        fs = p.fork_steps
        if p.past_divergence is not None:
            if rec.divergence_step is None:
                raise PipelineError(f"--past-divergence {p.past_divergence}: the baseline did not diverge")
            end = int(rec.divergence_step) + p.past_divergence
        else:
            end = step + fs if fs > 0 and step + fs < rec.steps_done else rec.steps_done
        past = (f"; past the baseline's {rec.steps_done} recorded steps its seeded batch order continues"
                if end > rec.steps_done else "")
        self.say(f"2/5 fork from {ckpt} (step {step}, rule {p.pick_rule}, margin {p.margin}) to step {end}{past}")
        return step, ckpt, end

    def localize(self, job: Path):
        src = resolve_source(str(job), self.plan.uri)
        history = load_history(src["run_id"], src["tracking_uri"])
        loc = localize(history, divergence_step=src["divergence_step"])
        loc.source = src
        self.plan.out.mkdir(parents=True, exist_ok=True)
        (self.plan.out / "localize.json").write_text(record.dumps(loc.to_dict()))
        plot(loc, history, self.plan.out / "localize.png")
        print(format_localization(loc), flush=True)
        self.say(f"3/5 localized: {' '.join(loc.sweep_overrides())} ({loc.target()[2]}; details: "
                 f"{self.plan.out / 'localize.json'})")
        return loc

    def slots(self) -> Tuple[List[Optional[str]], int, int]:
        """(one GPU id per slot, GPUs, forks per GPU): PER_GPU slots on each visible GPU, or PER_GPU on the CPU."""
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per = self.plan.per_gpu or (max(1, torch.cuda.get_device_properties(0).total_memory // FORK_MEMORY)
                                    if n else 1)
        if not n:
            return [None] * per, 0, per
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")][:n] if visible else [str(i) for i in range(n)]
        return [g for _ in range(per) for g in ids], n, per  # interleaved: the first n jobs take distinct GPUs

    def forks(self, ckpt: Path, end: int, loc_overrides: Sequence[str]) -> List[Fork]:
        p = self.plan
        jobs = [Fork(name, ov + (list(loc_overrides) if name.rsplit("-", 1)[0] in p.localized_sweeps else []))
                for name, ov in fork.sweep_file_jobs(p.sweeps)]
        slots, n_gpu, per = self.slots()
        forks_dir = p.root / "forks"
        forks_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"4/5 {len(jobs)} forks, {len(slots)} at a time ({n_gpu} GPU(s) x {per}); logs: "
                 f"{forks_dir}/<job>.log")
        free: "queue.Queue[Optional[str]]" = queue.Queue()
        for g in slots:
            free.put(g)
        starting = {g: threading.Lock() for g in set(slots)}  # one fork at a time takes its memory on a GPU

        def go(job: Fork) -> Fork:
            job.gpu = free.get()  # a free slot, on the GPU it belongs to
            try:
                job.log = forks_dir / f"{job.name}.log"
                overrides = [*job.overrides, *p.overrides, *p.fork_overrides, f"from_checkpoint={ckpt}",
                             f"train.max_steps={end}", "train.ckpt_every=0", f"sweep_name={EXPERIMENT}_runs/{job.name}",
                             f"hydra.run.dir={forks_dir / job.name}"]
                if p.fork_memory_gib is None:
                    job.returncode = self._run_py(overrides, log=job.log, gpu=job.gpu)
                else:
                    with starting[job.gpu]:
                        self.wait_for_memory(job.gpu, job.name)
                        proc = self._start_py(overrides, job.log, job.gpu)
                        try:
                            proc.wait(timeout=p.settle_s)
                        except subprocess.TimeoutExpired:
                            pass
                    job.returncode = proc.wait()
            finally:
                free.put(job.gpu)
            self.say(f"  {job.name} done" if job.returncode == 0 else
                     f"  {job.name} FAILED (exit {job.returncode}): {job.log}")
            return job

        with ThreadPoolExecutor(max_workers=len(slots)) as pool:
            return list(pool.map(go, jobs))

    def report(self, baseline: Path, step: int, ckpt: Path, loc) -> Dict[str, Path]:
        p = self.plan
        self.say(f"5/5 report -> {p.out}")
        rows = rows_from_dirs([baseline, p.root / "forks"])
        result, cause = self.rounding(rows, loc)
        parent = self._parent_run()
        meta = {"command": "flash-forensics isolate " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                "fork_checkpoint": str(ckpt), "fork_step": str(step), "localized": " ".join(loc.sweep_overrides()),
                "wall_s": int(time.monotonic() - self.t0), **{f"{k}_s": round(v) for k, v in self.times.items()},
                "experiment_id": parent[0] if parent else None}
        paths = write_report(rows, p.out, p.uri, meta=meta, sweep=EXPERIMENT,
                             parent_run_id=parent[1] if parent else None, cause=cause)
        if result is not None:
            self.tag_cause(result, parent[1] if parent else None)
        if parent:
            client = client_for(p.uri)
            log_sweep_metrics(p.uri, parent[1], rows)
            for name in ("localize.json", "localize.png"):
                if (p.out / name).is_file():
                    retry(client.log_artifact, parent[1], str(p.out / name), "report")
            retry(client.set_terminated, parent[1])
        return paths

    def rounding(self, rows, loc):
        """(RoundingResult, the report's Cause) when the sweeps include rounding_points, else (None, None)."""
        if rounding.SWEEP not in self.plan.sweeps:
            return None, None
        result = rounding.analyze(rows, loc.to_dict() if loc is not None else None, str(self.plan.root))
        files = rounding_io.write(result, self.plan.out)
        print(result.format(), flush=True)
        self.say(f"cause: {result.verdict()} (details: {files['json']})")
        return result, rounding_io.cause(result, files)

    def tag_cause(self, result, parent_run_id: Optional[str]) -> None:
        """ff.cause.* on the baseline runs and the parent run; a store that fails is said, the files stand."""
        try:
            rounding_io.tag_runs(self.plan.uri, rounding_io.baseline_run_ids(result)
                                 + ([parent_run_id] if parent_run_id else []), rounding_io.tags(result))
        except Exception as e:
            print(f"[paper_isolation] ff.cause.* tags not set in {self.plan.uri}: {type(e).__name__}: {e}",
                  flush=True)

    def _parent_run(self) -> Optional[Tuple[str, str]]:
        """(experiment id, run id) of the pipeline's parent run (role=sweep: holds the table, no training)."""
        try:
            client = client_for(self.plan.uri)
            exp = get_or_create_experiment(client, EXPERIMENT, self.plan.uri)
            run = retry(client.create_run, exp, run_name=f"{EXPERIMENT}@{self.plan.root.name}",
                        tags={**git_info(), "role": "sweep", "sweep": EXPERIMENT, "sweep_dir": str(self.plan.root)})
            return exp, run.info.run_id
        except Exception as e:  # the table on disk is still worth writing
            print(f"[paper_isolation] no MLflow parent run: {type(e).__name__}: {e}")
            return None

    def _timed(self, name: str, fn, *args):
        t = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.times[name] = time.monotonic() - t

    def run(self) -> Dict[str, Path]:
        job, rec = self._timed("baseline", self.baseline)
        step, ckpt, end = self._timed("pick", self.pick, job, rec)
        loc = self._timed("localize", self.localize, job)
        self._timed("forks", self.forks, ckpt, end, loc.sweep_overrides())
        paths = self._timed("report", self.report, job, step, ckpt, loc)
        self.say(f"done: the full table in {int(time.monotonic() - self.t0)} s")
        return paths


def preflight(plan: Plan) -> None:
    """Every name the pipeline will use, checked before the baseline trains for hours: the experiment preset, the
    sweep files and each of their jobs' interventions. PipelineError names the first wrong one and what exists."""
    conf = REPO / "conf"

    def known(group: str, name: str, what: str) -> None:
        if not (conf / group / f"{name}.yaml").is_file():
            have = ", ".join(sorted(p.stem for p in (conf / group).glob("*.yaml")))
            raise PipelineError(f"{what}={name!r} is not allowed: no conf/{group}/{name}.yaml; expected one of {have}")

    known("experiment", plan.experiment, "--experiment")
    # the folders and the store the runs write: else the baseline's run.py refused them and the pipeline went on to
    # read a result.json that could not exist, or trained the baseline and found --out a file at the report
    try:
        check_folder("--root", str(plan.root), "the baseline's and the forks' job folders")
        check_folder("--out", str(plan.out), "the report: verdicts.{md,json}, plots")
        check_tracking(plan.uri)
    except ValueError as e:  # ConfigError, TrackingUnreachable
        raise PipelineError(f"--uri: {e}" if isinstance(e, TrackingUnreachable) else str(e)) from None
    # a typo'd key gets run.py's answer (the closest fields), not Hydra's '+key=...' hint from the composition below
    bad = check_keys([*plan.overrides, *plan.fork_overrides])
    if bad:
        raise PipelineError("; ".join(bad))
    for o in [*plan.overrides, *plan.fork_overrides]:
        if o.split("=", 1)[0].lstrip("+~") == "intervention":
            raise PipelineError(f"{o!r}: the pipeline chooses the interventions (baseline, then the sweeps' forks)")
    for job, overrides in fork.sweep_file_jobs(plan.sweeps):  # ForkError (a ValueError) for a missing sweep file
        for o in overrides:
            if o.split("=", 1)[0].lstrip("+~") == "intervention":
                for name in o.split("=", 1)[1].split("+"):
                    known("intervention", name, f"{job}: intervention")


def _run_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def baseline_overrides(plan: Plan) -> List[str]:
    """The baseline's own overrides (the job folder and sweep name aside): what run.py gets and preflight checks."""
    n = plan.stop_after
    stop = ["train.early_stop=false"] if n is None else ["train.early_stop=true", f"verdict.early_stop_after={n}"]
    return ["intervention=baseline", *plan.overrides, f"train.keep_checkpoints={plan.keep_checkpoints}", *stop]


def preflight_configs(plan: Plan) -> int:
    """Compose and validate every run's config (the baseline's, each fork's with the fork overrides) the way run.py
    will, before the baseline trains: a knob a fork's implementation cannot compute, a bad value in a sweep file or
    --fork-override, is a PipelineError naming the job, not a failed row after the baseline's hours. The fork's own
    checks (its checkpoint, batch order) wait for the checkpoint. Returns the number of configs checked."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    runs = [("baseline", baseline_overrides(plan))]
    # as forks() launches them, less from_checkpoint and the end step, which the baseline decides
    runs += [(name, [*ov, *plan.overrides, *plan.fork_overrides, "train.ckpt_every=0"])
             for name, ov in fork.sweep_file_jobs(plan.sweeps)]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
            for name, ov in runs:
                ov = [o for o in ov if not _run_key(o).startswith("hydra.")]
                try:
                    cfg = compose(config_name="config", overrides=[f"experiment={plan.experiment}", *ov])
                    validate_config(cfg, ov, check_resume=False, check_store=False)
                except Exception as e:  # ConfigError, Hydra's override errors: the message names the key
                    raise PipelineError(f"{name} ({' '.join(ov)}): {e}") from None
    finally:
        GlobalHydra.instance().clear()
    return len(runs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics isolate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (baseline and forks)")
    ap.add_argument("--root", type=Path, default=None,
                    help="run folder (default results/runs/paper_isolation/<date>)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default <root>/report)")
    ap.add_argument("--uri", default=None, help="MLflow store (default sqlite:///<repo>/results/mlflow.db)")
    ap.add_argument("--experiment", default="mini_repro",
                    help="the experiment preset of every run (default: %(default)s)")
    ap.add_argument("--sweeps", nargs="+", default=["paper_isolation", "beta_sweep"],
                    help="sweep files to fork (default: %(default)s)")
    ap.add_argument("--fork-steps", type=int, default=0, help="steps per fork (default 0: to the baseline's end)")
    ap.add_argument("--margin", type=int, default=0, help="steps between the fork checkpoint and the step --pick names "
                    "(the lowest loss, or the divergence; default: %(default)s)")
    ap.add_argument("--per-gpu", type=int, default=None, help="forks at once per GPU (default GPU memory / 16 GiB)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop the baseline N steps after its divergence (default: run to train.max_steps)")
    ap.add_argument("--pick", choices=("at-min", "before-divergence"), default="at-min",
                    help="the fork checkpoint: the newest at or before the lowest loss before the divergence "
                         "(at-min), or the newest --margin steps before the divergence")
    ap.add_argument("--past-divergence", type=int, default=None,
                    help="forks run to the baseline's divergence + N steps (past its end: its seeded order)")
    ap.add_argument("--keep-checkpoints", type=int, default=0,
                    help="checkpoints the baseline keeps (its train.keep_checkpoints; 0 = all)")
    ap.add_argument("--fork-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for the forks only (repeatable), e.g. attention.fp32_gemm=tf32x3")
    ap.add_argument("--fork-memory", type=float, default=None, metavar="GIB",
                    help="start a fork only when its GPU has this much memory free")
    a = ap.parse_args(argv)
    for key in ("fork_steps", "margin", "keep_checkpoints") + tuple(
            k for k in ("stop_after", "past_divergence") if getattr(a, k) is not None):
        if getattr(a, key) < 0:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not allowed: expected an integer >= 0")
    if a.per_gpu is not None and a.per_gpu < 1:
        ap.error(f"--per-gpu={a.per_gpu} is not allowed: expected an integer >= 1")
    if a.fork_memory is not None and not a.fork_memory > 0:
        ap.error(f"--fork-memory={a.fork_memory} is not allowed: expected a number of GiB > 0")
    for o in a.fork_override:
        if "=" not in o:
            ap.error(f"--fork-override={o!r} is not allowed: expected KEY=VALUE (a Hydra override)")
    root = (a.root or REPO / "results" / "runs" / EXPERIMENT / _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    root = root.resolve()
    plan = Plan(root=root, out=(a.out or root / record.REPORT_DIR).resolve(), uri=a.uri or default_tracking_uri(),
                overrides=list(a.overrides), experiment=a.experiment, sweeps=tuple(a.sweeps),
                fork_steps=a.fork_steps, margin=a.margin, per_gpu=a.per_gpu, stop_after=a.stop_after,
                pick_rule=a.pick, past_divergence=a.past_divergence, keep_checkpoints=a.keep_checkpoints,
                fork_overrides=list(a.fork_override), fork_memory_gib=a.fork_memory)
    try:
        preflight(plan)
        n = preflight_configs(plan)
        print(f"[paper_isolation] preflight: {n} run configs composed and validated", flush=True)
        Pipeline(plan).run()
    except (PipelineError, ValueError) as e:  # ForkError is a ValueError: no checkpoint to fork from, ...
        print(f"[paper_isolation] stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
