"""Fork: replay an intervention from a checkpoint shortly before the divergence, with the source run's batches.

`python run.py -m from_checkpoint=PATH intervention=baseline,fp32,pv_fp32` loads the weights, optimizer state, RNG
states and step k of PATH (a step_<k>.pt or last.pt of any job) and trains the *current* config's attention and
intervention from step k to train.max_steps: a new MLflow run per job, tagged forked_from / fork_step /
forked_from_run, metrics at steps k, k+1, ... (0-based optimizer steps, as a resumed run logs them). The batches are
the source run's: its recorded batch_order.bin (named in the checkpoint, else beside its checkpoints/ folder), or
data.replay when given. Unless optimizer.decay_steps is set, the fork keeps the source's lr schedule (its
decay_steps, else its max_steps), so a fork that stops early still sees the learning rates the source saw.

Finding a checkpoint:
    flash-forensics fork list <job_dir>                           # checkpoints and their steps
    flash-forensics fork pick <job_dir> [--before STEP] [--margin N] [--at-min]
    flash-forensics fork jobs paper_isolation beta_sweep          # a sweep file's jobs, one per line
`pick` prints the newest checkpoint at least N steps before STEP (default: the job's divergence step from its
result.json; with --at-min the step of its lowest loss before the divergence).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from flash_forensics.models.hf import build_model
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.data.config import DataError
from flash_forensics.orchestrator.data.replay import OrderHeader, OrderReader, read_header
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.record import CKPT_DIR, ORDER_FILE


class ForkError(ValueError):
    """A fork that cannot run (no such checkpoint, no batch order, ...): the message says which key and why."""


# --------------------------------------------------------------------------------------------- the source
def order_candidates(ckpt_path: Path, state: Dict[str, Any]) -> List[Path]:
    """Where the source run's batch order may be: as the checkpoint records it, then the source job folder's."""
    out = []
    if state.get("batch_order"):
        out.append(Path(state["batch_order"]))
    ckpt_path = Path(ckpt_path).resolve()
    out.append(ckpt_path.parent.parent / ORDER_FILE)  # <job dir>/checkpoints/<file> -> <job dir>/batch_order.bin
    if state.get("job_dir"):
        out.append(Path(state["job_dir"]) / ORDER_FILE)
    return list(dict.fromkeys(out))


def resolve_order(ckpt_path, state: Dict[str, Any], replay: Optional[str] = None) -> Path:
    """The batch-order file a fork replays: data.replay when given, else the source run's."""
    if replay is not None:
        return Path(replay)
    cands = order_candidates(Path(ckpt_path), state)
    for p in cands:
        if p.is_file():
            return p
    raise ForkError(f"from_checkpoint={str(ckpt_path)!r}: the source run's batch order was not found (looked for "
                    f"{', '.join(str(p) for p in cands)}); allowed: a checkpoint of a run that recorded its batch "
                    f"order (train.record_batches=true), or data.replay=<its batch_order.bin>")


def source_decay(state: Dict[str, Any]) -> Optional[int]:
    """The step at which the source's cosine lr reached min_lr (its decay_steps, else its max_steps)."""
    if (state.get("fork") or {}).get("decay_steps"):  # a fork of a fork keeps the first source's schedule
        return int(state["fork"]["decay_steps"])
    cfg = state.get("config") or {}
    opt, train = cfg.get("optimizer") or {}, cfg.get("train") or {}
    value = opt.get("decay_steps") or train.get("max_steps")
    return int(value) if value else None


def fork_info(path, state: Dict[str, Any], decay_steps: Optional[int]) -> Dict[str, Any]:
    """What a fork records (result.json, MLflow tags, its own checkpoints, so a requeued fork still knows)."""
    return {"forked_from": str(path), "fork_step": int(state["step"]),
            "source_run_id": state.get("mlflow_run_id"), "decay_steps": decay_steps}


_HEADERS: Dict[Tuple[str, int, int], Dict[str, Any]] = {}


def source_header(path, key: str = "from_checkpoint") -> Dict[str, Any]:
    """The checkpoint's header (checkpoint.read_header: no tensor data), read at most once per process and file
    version (path, mtime, size): validating 15 forks of one source reads its header once."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return checkpoint.read_header(p, key=key)  # raises the checkpoint module's own "no such file" error
    cache_key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if cache_key not in _HEADERS:
        _HEADERS[cache_key] = checkpoint.read_header(p, key=key)
    return _HEADERS[cache_key]


# model fields that decide the parameters a checkpoint must hold (SHAPE_KEYS: the tensor shapes; bias, qk_norm and
# attn_gate: which tensors exist). A fork or resume keeps the checkpoint's parameters, so each must match. Fields
# outside it (dropout, z_loss) change no parameter: a fork may change them.
MODEL_KEYS = tuple(checkpoint.SHAPE_KEYS) + ("bias", "qk_norm", "attn_gate")


def check_model(header: Dict[str, Any], obj, key: str, path) -> None:
    """The model the job builds (obj.model, the intervention's model patch applied) against the checkpoint's.
    The message names each key, the checkpoint's value and the job's, and the intervention when it set the key."""
    src = dict((header.get("config") or {}).get("model") or {})
    src.update(header.get("model_shape") or {})
    patch = obj.intervention.model.set_fields()
    diffs = []
    for k in MODEL_KEYS:
        want, got = getattr(obj.model, k), src.get(k)
        if got is None and k not in checkpoint.SHAPE_KEYS:
            continue  # an older checkpoint without its config: the parameter check below decides
        if got != want:
            who = f" (set by intervention={obj.intervention.name}: intervention.model.{k})" if k in patch else ""
            diffs.append(f"model.{k}: checkpoint {got} vs model {want}{who}")
    if diffs:
        raise ForkError(f"{key}={str(path)!r} belongs to another model shape ({'; '.join(diffs)}); allowed: a "
                        f"checkpoint of model {checkpoint.model_shape(obj.model)} with bias={obj.model.bias}, "
                        f"qk_norm={obj.model.qk_norm}, attn_gate={obj.model.attn_gate}, or the checkpoint's values")
    _check_parameters(header, obj, key, path)


def check_resume_hooks(header: Dict[str, Any], obj, path) -> None:
    """A resume continues the same run: its train hooks (by _target_, in order) must be the checkpoint's, whose
    state they restore. (A fork starts its own hooks fresh.)"""
    saved = [h.get("target") for h in header.get("hooks") or []]
    mine = [str(h.get("_target_")) for h in obj.intervention.hooks]
    if saved != mine:
        raise ForkError(f"resume={str(path)!r}: the checkpoint holds train hooks {saved}, this run has {mine} "
                        f"(intervention={obj.intervention.name}); allowed: the same intervention hooks as the "
                        f"checkpointed run")


def _check_parameters(header: Dict[str, Any], obj, key: str, path) -> None:
    """Backstop: the parameters the job's model has (built on the meta device: no memory, no compute) against the
    ones the checkpoint holds, so that no field outside MODEL_KEYS can make load_state_dict fail after launch."""
    shapes = header.get("param_shapes")
    if not shapes:
        return
    import torch


    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in build_model(obj.model).state_dict().items()}
    have = {n: tuple(s) for n, s in shapes.items()}
    bad = sorted(set(want) ^ set(have)) + sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if bad:
        detail = ", ".join(f"{n}: checkpoint {have.get(n)} vs model {want.get(n)}" for n in bad[:4])
        raise ForkError(f"{key}={str(path)!r} holds other parameters than this job's model ({detail}"
                        f"{', ...' if len(bad) > 4 else ''}); allowed: a checkpoint of the same model")


def check_fork(obj) -> Dict[str, Any]:
    """Validate cfg.from_checkpoint before launch against everything a fork changes: the model (shape, bias,
    qk_norm, with the intervention's model patch), the optimizer, the steps, the verdict baseline and the batch
    order. Reads the checkpoint's header once per process; returns it. Raises ForkError / CheckpointError."""
    path = obj.from_checkpoint
    if obj.resume is not None:
        raise ForkError(f"resume={obj.resume!r} and from_checkpoint={path!r} are both set; allowed: one of them "
                        f"(resume continues the same run, from_checkpoint forks a new run from it)")
    state = source_header(path, key="from_checkpoint")
    check_model(state, obj, key="from_checkpoint", path=path)
    k = int(state["step"])
    if obj.train.max_steps <= k:
        raise ForkError(f"train.max_steps={obj.train.max_steps} is not allowed with from_checkpoint={path!r}: "
                        f"expected an integer > {k}, the checkpoint's step")
    src_opt = ((state.get("config") or {}).get("optimizer") or {}).get("name")
    if src_opt is not None and src_opt != obj.optimizer.name:
        raise ForkError(f"optimizer.name={obj.optimizer.name!r} cannot load the optimizer state of "
                        f"from_checkpoint={path!r}; allowed: {src_opt!r}, the source run's optimizer")
    if obj.verdict.fork_baseline == "source":
        det = state.get("detector")
        if not det:
            raise ForkError(f"verdict.fork_baseline='source' is not allowed with from_checkpoint={path!r}: the "
                            f"checkpoint holds no detector state; allowed: fresh")
        if det.get("divergence_step") is not None:
            raise ForkError(f"verdict.fork_baseline='source' is not allowed with from_checkpoint={path!r}: the "
                            f"source had already diverged at step {det['divergence_step']}, before the fork step "
                            f"{k}; allowed: fresh, or a checkpoint before the divergence")
    order = resolve_order(path, state, obj.data.replay)
    check_order(order, obj, "data.replay" if obj.data.replay is not None else f"batch order of {path}")
    return state


def check_order(order: Path, obj, what: str) -> None:
    """The order file exists, was recorded for this run shape, and covers train.max_steps steps."""

    t = obj.train
    try:
        have = read_header(order)
        want = OrderHeader(obj.model.block_size, t.batch_size, t.grad_accum, 1, 0, obj.data.seed, have.n_tokens)
        OrderReader(order, want, obj.data.replay_past_end).check_covers(t.max_steps)
    except FileNotFoundError:
        raise ForkError(f"{what}: {order} does not exist") from None
    except DataError as e:
        raise ForkError(f"{what}: {e}; allowed: train.max_steps <= the steps it holds (or past them with "
                        f"data.replay_past_end=regenerate on a seeded order), with the source's block_size, "
                        f"batch_size and grad_accum") from None


# ------------------------------------------------------------------------------------------ list and pick
def checkpoints(job_dir) -> List[Tuple[int, Path]]:
    """(step, path) of a job's checkpoints, oldest first: step_<k>.pt files, and last.pt when it is not one of them."""
    d = Path(job_dir) / CKPT_DIR
    if not d.is_dir():
        raise ForkError(f"{job_dir}: no {CKPT_DIR}/ folder (is it a job output folder?)")
    found = {s: p for s, p in checkpoint.step_files(d).items()}
    last = d / "last.pt"
    if last.is_file():
        try:
            step = int(checkpoint.read_header(last, key="last.pt")["step"])
        except (checkpoint.CheckpointError, OSError, RuntimeError, ValueError, KeyError) as e:
            print(f"[fork] passing over {last}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        else:
            found.setdefault(step, last)
    return sorted(found.items())


def _result_field(job_dir, key: str) -> Optional[int]:
    """A field of the job's run record (None without one); one that cannot be read is named (json's own words were
    all a user saw: 'Expecting value: line 1 column 1')."""
    path = record.result_path(job_dir)
    if not path.is_file():
        return None
    try:
        return getattr(record.read_named(job_dir), key)
    except ValueError as e:
        raise ForkError(f"{e} (fork pick --before STEP picks without it)") from None


def _job_dir(value: str) -> str:
    """JOB_DIR exists and is a folder (a missing one was said as 'no divergence step in result.json')."""
    if not Path(value).is_dir():
        raise ForkError(f"JOB_DIR={value!r} is not allowed: " + ("it is a file" if Path(value).exists() else
                        "no such folder") + "; expected a job output folder (result.json, checkpoints/)")
    return value


def divergence_step(job_dir) -> Optional[int]:
    return _result_field(job_dir, "divergence_step")


def pick(job_dir, before: Optional[int] = None, margin: int = 0, at_min: bool = False) -> Path:
    """The newest checkpoint with step <= before - margin. before: the job's divergence step by default; with
    at_min, the step of its lowest loss before the divergence (where training was last at its best)."""
    return pick_step(job_dir, before, margin, at_min)[1]


def pick_step(job_dir, before: Optional[int] = None, margin: int = 0, at_min: bool = False) -> Tuple[int, Path]:
    """pick(), with the checkpoint's step: (step, path)."""
    if before is None:
        key = "min_loss_step" if at_min else "divergence_step"
        if _result_field(job_dir, "divergence_step") is None:
            raise ForkError(f"{job_dir}: no divergence step in result.json (the run did not diverge, or has no "
                            f"result yet); give --before STEP")
        before = _result_field(job_dir, key)
        if before is None:
            raise ForkError(f"{job_dir}: result.json has no {key} (a run from before it was recorded); give "
                            f"--before STEP")
    limit = int(before) - int(margin)
    ok = [(s, p) for s, p in checkpoints(job_dir) if s <= limit]
    if not ok:
        raise ForkError(f"{job_dir}: no checkpoint at step <= {limit} (before {before}, margin {margin}); have "
                        f"{[s for s, _ in checkpoints(job_dir)]}. Keep more (train.ckpt_every, "
                        f"train.keep_checkpoints=0) or lower --margin")
    for s, p in reversed(ok):  # the newest intact one: a damaged file is passed over, and said
        why = damaged(p)
        if why is None:
            return s, p
        print(f"[fork] passing over {p}: {why}", file=sys.stderr)
    raise ForkError(f"{job_dir}: every checkpoint at step <= {limit} is damaged (sha256 or format): "
                    f"{[s for s, _ in ok]}")


def damaged(path: Path) -> Optional[str]:
    """Why a checkpoint cannot be forked from (its sha256 or format), None when it verifies."""
    try:
        checkpoint.read_header(path, key="checkpoint")
    except (checkpoint.CheckpointError, OSError, RuntimeError, ValueError) as e:
        return str(e).splitlines()[0][:200]
    return None


def sweep_file_jobs(names, root: Optional[Path] = None) -> List[Tuple[str, List[str]]]:
    """The jobs of sweep files as (name-index, overrides), to launch them as separate runs
    (scripts/paper_isolation.sh): hydra.sweeper.params expanded by Hydra's own parser and BasicSweeper (lists,
    range(), glob(), ...), each job also carrying the file's other settings (e.g. data.seed: ${train.seed}) as
    overrides; sweep_name is left to the caller."""
    import yaml
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    root = Path(root) if root is not None else Path(__file__).resolve().parents[2] / "sweeps"
    parser = OverridesParser.create()
    out = []
    names = [n[:-5] if n.endswith(".yaml") else n for n in names]  # a file name is a sweep's name too
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:  # its jobs would be named (and launched into folders) twice: the second over the first
        raise ForkError(f"sweep {twice[0]!r} is given twice: expected each sweep once")
    for name in names:
        path = root / f"{name}.yaml"
        if not path.is_file():
            raise ForkError(f"sweep {name!r}: no {path}; allowed: "
                            f"{', '.join(sorted(p.stem for p in root.glob('*.yaml')))}")
        # a file that is not YAML, or no hydra.sweeper.params mapping: named (it was yaml's ParserError or an
        # AttributeError naming no file, and an empty file gave one job with no overrides, exit 0)
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ForkError(f"sweep {name!r}: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        sweeper = (doc.get("hydra") or {}).get("sweeper") if isinstance(doc, dict) else None
        params = sweeper.get("params") if isinstance(sweeper, dict) else None
        if not isinstance(params, dict) or not params:
            raise ForkError(f"sweep {name!r}: {path} has no hydra.sweeper.params; expected a sweep file whose jobs "
                            "are listed there (as in sweeps/beta_sweep.yaml)")
        rest = {k: v for k, v in doc.items() if k not in ("hydra", "sweep_name", "defaults")}
        fixed = [f"{k}={v}" for k, v in _flat(OmegaConf.to_container(OmegaConf.create(rest), resolve=False))]
        try:
            parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()])
        except Exception as e:  # Hydra's OverrideParseException: its message names the override
            raise ForkError(f"sweep {name!r}: {path}: hydra.sweeper.params: {str(e).splitlines()[0]}") from None
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        out += [(f"{name}-{i}", list(job) + fixed) for i, job in enumerate(jobs)]
    return out


def _flat(d, prefix: str = ""):
    """Nested settings -> (dotted key, value) pairs, values as Hydra override text."""
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flat(v, key + ".")
        elif isinstance(v, str) and "${" in v:
            yield key, f"'{v}'"  # an interpolation: quoted so that Hydra keeps it as one
        else:
            yield key, json.dumps(v) if isinstance(v, (list, bool)) or v is None else v


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics fork", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="print a job's checkpoints with their steps")
    ls.add_argument("job_dir")
    pk = sub.add_parser("pick", help="print the newest checkpoint at least --margin steps before --before")
    pk.add_argument("job_dir")
    pk.add_argument("--before", type=int, default=None, help="a step (default: the job's divergence step)")
    pk.add_argument("--margin", type=int, default=0, help="steps between the checkpoint and --before (default 0)")
    pk.add_argument("--with-step", action="store_true", help="print STEP<TAB>PATH (for scripts)")
    pk.add_argument("--at-min", action="store_true",
                    help="--before defaults to the step of the lowest loss before the divergence, not the divergence")
    jb = sub.add_parser("jobs", help="print the jobs of sweep files (sweeps/NAME.yaml), one per line: "
                                     "NAME-INDEX<TAB>overrides")
    jb.add_argument("sweeps", nargs="+")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command: "required: {a,b}", not "required: cmd"
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            try:
                div = divergence_step(_job_dir(args.job_dir))
            except ForkError as e:  # the checkpoints are still listed, without the divergence marks
                if not record.result_path(args.job_dir).is_file():
                    raise
                print(f"[fork] {e}; listing without the divergence step", file=sys.stderr)
                div = None
            found = checkpoints(args.job_dir)
            if not found:  # an empty listing with exit 0 read as success
                raise ForkError(f"{args.job_dir}: no checkpoint in its {CKPT_DIR}/ folder (step_<k>.pt or last.pt); "
                                "a run keeps them with train.ckpt_every")
            for step, path in found:
                note = "  (before the divergence)" if div is not None and step <= div else ""
                bad = damaged(path)
                print(f"{step:>8}  {path}{note}" + (f"  DAMAGED: {bad}" if bad else ""))
        elif args.cmd == "jobs":
            for name, overrides in sweep_file_jobs(args.sweeps):
                print(name + "\t" + " ".join(overrides))
        else:
            if args.margin < 0:
                raise ValueError(f"--margin={args.margin} is not allowed: expected an integer >= 0 (steps before "
                                 "--before; a negative margin would pick a checkpoint after it)")
            if args.before is not None and args.before < 1:
                raise ValueError(f"--before={args.before} is not allowed: expected a step >= 1")
            if args.before is not None and args.at_min:
                raise ValueError("--at-min with --before is not allowed: --at-min chooses --before (the lowest "
                                 "loss before the divergence); give one of them")
            step, path = pick_step(_job_dir(args.job_dir), args.before, args.margin, args.at_min)
            print(f"{step}\t{path}" if args.with_step else path)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ForkError", "check_fork", "check_model", "check_resume_hooks", "source_header", "MODEL_KEYS",
           "resolve_order", "source_decay", "fork_info", "checkpoints", "pick", "pick_step",
           "sweep_file_jobs", "main"]
