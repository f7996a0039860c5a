"""The paper regime's first training steps, bit for bit against the losses recorded on each GPU.

Seed 1 diverged at step 2,288 on an H200 and had not by 7,610 on an H100; the two runs' losses differ from step 1
(results/paper_1gpu/h100-2026-12-05/). Whether the GPU or a commit moved the bits is settled by a few steps:

    python scripts/first_steps.py run [--seed 1] [--steps 3] [--out DIR] [--ref FILE] [-- OVERRIDES...]
        trains `python run.py experiment=paper_1gpu train.seed=S data.seed=S` (plus OVERRIDES) for N steps (a NaN
        forced at step N stops it: max_steps and the lr schedule stay the preset's), reads its train/loss and
        compares every step with each record of the same seed in FILE: "bit for bit as <gpu> <commit>", or the
        first step that differs. Writes DIR/first_steps.json. Exit 0 when it ran.
    python scripts/first_steps.py check sqlite:///STORE --seed S [--steps 3] [--run-prefix baseline]
        the same comparison for a run already training (its store, read while it writes): what `gpu.sh paper-table`
        prints once its baseline has logged the steps, so a lease knows in its first minutes whether the divergence
        step recorded for this seed applies on its GPU. Exit 2 while the run has fewer steps.
    python scripts/first_steps.py known [--gpu NAME] [--ref FILE]
        what FILE records of each seed on this GPU model (nvidia-smi's name, or NAME): the step it diverged at, or
        how far it went without; `gpu.sh paper-table start` prints it before its plan starts.
    python scripts/first_steps.py ckpt-start --seeds "1337 1" [--gpu NAME] [--lead 1000] [--every 250] [--ref FILE]
        the step a one-lease plan keeps its baselines' checkpoints from on this GPU model: LEAD steps before the
        earliest divergence FILE records here for these seeds, down to a multiple of EVERY (the preset's ckpt_every);
        0 (every checkpoint) when a seed's divergence here is unknown. The number alone on stdout, why on stderr:
        `gpu.sh paper-table` and `baseline-time` take it where CKPT_START is not given (8,500 for seed 1337 on an
        H200, which diverges at 9,697 there; 7,000 on an H100, where it diverges at 8,064: a fixed 8,500 left no
        checkpoint to fork from).
    python scripts/first_steps.py record EXPORT.json.gz --gpu NAME --commit SHA --source PATH [--run-prefix baseline]
                                         [--steps 10] [--ref FILE]
        adds a record (a run's first losses, from a compact export: scripts/mlflow_export.py) to FILE.

FILE defaults to results/bench/first-steps-paper_1gpu.json (results/bench/ stays in the tree during a lease:
scripts/lease_aside.sh). `bash scripts/gpu.sh first-steps` runs `run` on a lent GPU.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "results" / "bench" / "first-steps-paper_1gpu.json"
LOSS = "train/loss"


def losses_of(runs: Sequence[Dict], prefix: str = "", steps: Optional[int] = None) -> List[float]:
    """The train/loss of the one run from step 0 (forks start later) whose name starts with prefix, steps 0, 1, ...
    in order (a gap is an error)."""
    got = [r for r in runs if str(r.get("name") or "").startswith(prefix)
           and min((int(p[0]) for p in r.get("metrics", {}).get(LOSS) or []), default=None) == 0]
    if len(got) != 1:
        raise SystemExit(f"first_steps: expected one run named {prefix!r}... with {LOSS} from step 0, found "
                         f"{len(got)}: {[r.get('name') for r in got]}")
    pts = sorted((int(p[0]), float("nan") if p[1] is None else float(p[1]))  # the export writes NaN as null
                 for p in got[0]["metrics"][LOSS])
    out = []
    for i, (s, v) in enumerate(pts[:steps] if steps else pts):
        if s != i:
            raise SystemExit(f"first_steps: {LOSS} of {got[0].get('name')!r} has no step {i} (next logged: {s})")
        out.append(v)
    return out


def compare(losses: Sequence[float], record: Dict) -> str:
    """One line: the same bits as the record at every shared step, or the first step that differs."""
    ref = record["losses"]
    n = min(len(losses), len(ref))
    who = f"{record['gpu']} {record.get('commit', '?')}"
    for i in range(n):
        if losses[i] != ref[i]:
            return f"differs from {who} at step {i}: {losses[i]!r} against {ref[i]!r}"
    return f"bit for bit as {who} at steps 0-{n - 1}"


def _load_ref(path: Path) -> Dict:
    if not path.is_file():
        return {"what": "the paper regime's first train/loss values per seed and GPU (scripts/first_steps.py)",
                "records": []}
    return json.loads(path.read_text())


def cmd_record(a) -> int:
    with gzip.open(a.export, "rt") as f:
        runs = json.load(f)["runs"]
    losses = losses_of(runs, a.run_prefix, a.steps)
    ref = _load_ref(a.ref)
    rec = {"gpu": a.gpu, "commit": a.commit, "seed": a.seed, "source": a.source, "divergence": a.divergence,
           "note": a.note, "losses": losses}
    ref["records"] = [r for r in ref["records"] if (r["gpu"], r.get("commit"), r.get("seed")) !=
                      (a.gpu, a.commit, a.seed)] + [rec]
    a.ref.parent.mkdir(parents=True, exist_ok=True)
    a.ref.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"first_steps: {len(losses)} losses of seed {a.seed} on {a.gpu} ({a.commit}) -> {a.ref}")
    return 0


def _gpu() -> str:
    """The first GPU's name from nvidia-smi (no CUDA context beside a training run), else torch's, else 'cpu'."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        if names[0].strip():
            return names[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as e:  # noqa: BLE001 (a name for the record; the run itself says what failed)
        return f"unknown ({e})"


def _against(losses: Sequence[float], seed: int, ref: Path) -> List[str]:
    recs = _load_ref(ref)["records"]
    return [compare(losses, r) + (f" (that run diverged at step {r['divergence']})" if r.get("divergence") else "")
            + (f" ({r['note']})" if r.get("note") else "")
            for r in recs if r.get("seed") == seed] or [f"no record of seed {seed} in {ref}"]


def cmd_check(a) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from mlflow_export import export
    runs = export(a.store)["runs"]
    try:
        losses = losses_of(runs, a.run_prefix, a.steps)
    except SystemExit as e:
        print(f"first_steps: {e}")
        return 2
    if len(losses) < a.steps:
        print(f"first_steps: {len(losses)} of {a.steps} steps logged so far")
        return 2
    print(f"first_steps: seed {a.seed}, steps 0-{a.steps - 1} on {_gpu()}:")
    for line in _against(losses, a.seed, a.ref):
        print("  " + line)
    return 0


def cmd_run(a, overrides: Sequence[str]) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from mlflow_export import export
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("mlflow.db", "run", "run.log", "first_steps.json"):  # an earlier run's: run.py would resume into it
        if (out / old).exists():
            print(f"first_steps: replacing the earlier {out / old}")
            shutil.rmtree(out / old) if (out / old).is_dir() else (out / old).unlink()
    uri = f"sqlite:///{out / 'mlflow.db'}"
    # max_steps and the warmup stay the preset's (the lr at a step depends on both); a NaN forced at step N ends the
    # run there (the verdict path: diverged, stopped 0 steps after), after N steps computed as in a full run
    cmd = [sys.executable, str(ROOT / "run.py"), "experiment=paper_1gpu", f"train.seed={a.seed}",
           f"data.seed={a.seed}", f"debug.nan_at_step={a.steps}", "train.early_stop=true",
           "verdict.early_stop_after=0", "train.ckpt_every=0", f"tracking.uri={uri}", "sweep_name=first_steps",
           f"hydra.run.dir={out / 'run'}", *overrides]
    print("first_steps:", " ".join(cmd), flush=True)
    with open(out / "run.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode
    if rc != 0:
        tail = (out / "run.log").read_text()[-2000:]
        raise SystemExit(f"first_steps: the run failed (exit {rc}); the end of {out / 'run.log'}:\n{tail}")
    losses = losses_of(export(uri)["runs"], steps=a.steps)
    gpu = _gpu()
    lines = _against(losses, a.seed, a.ref)
    doc = {"gpu": gpu, "seed": a.seed, "command": " ".join(cmd), "losses": losses, "against": lines,
           "launch_table": os.environ.get("FF_LAUNCH_TABLE")}  # a tune JSON's launch configs, if the run had one
    (out / "first_steps.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"first_steps: seed {a.seed} on {gpu}: " + ", ".join(repr(x) for x in losses))
    for line in lines:
        print("  " + line)
    return 0


def known(gpu: str, ref: Path) -> List[str]:
    """What the records say of each seed on this GPU model: where it diverged, or how far it went without."""
    recs = [r for r in _load_ref(ref)["records"] if r.get("gpu") == gpu]
    if not recs:
        return [f"no paper_1gpu run is recorded on {gpu}: no seed's divergence step is known on it (RACE=1 races "
                "seeds; the first to diverge keeps the GPU)"]
    out = []
    for seed in sorted({r["seed"] for r in recs}):
        mine = [r for r in recs if r["seed"] == seed]
        div = sorted({r["divergence"] for r in mine if r.get("divergence") is not None})
        where = ", ".join(str(r.get("commit", "?")) for r in mine)
        if div:
            out.append(f"seed {seed}: diverged at step {', '.join(f'{d:,}' for d in div)} ({where})")
        else:
            notes = "; ".join(r["note"] for r in mine if r.get("note"))
            out.append(f"seed {seed}: no divergence recorded ({notes or 'no note'}; {where})")
    return out


def ckpt_start(gpu: str, seeds: Sequence[int], ref: Path, lead: int = 1000, every: int = 250):
    """(step, reasons): where a one-lease plan on this GPU model starts keeping checkpoints for these seeds. The
    plan forks from the newest checkpoint MARGIN (150) steps before a baseline's divergence; the checkpoints before
    cost lease time and are never forked from. So: `lead` steps before the earliest divergence recorded here (the
    lowest, where one seed's records disagree), down to a multiple of `every`; 0 when any seed's is unknown here."""
    recs = [r for r in _load_ref(ref)["records"] if r.get("gpu") == gpu]
    steps, reasons = [], []
    for seed in seeds:
        div = sorted({r["divergence"] for r in recs if r["seed"] == seed and r.get("divergence") is not None})
        if not div:
            reasons.append(f"seed {seed}: no divergence recorded on {gpu}: every checkpoint (0)")
            steps.append(0)
            continue
        step = max(0, (div[0] - lead) // every * every)
        reasons.append(f"seed {seed} diverged at step {div[0]:,} on {gpu}: checkpoints from {step:,} "
                       f"({lead} steps before, a multiple of {every})")
        steps.append(step)
    return min(steps), reasons


def cmd_ckpt_start(a) -> int:
    try:
        seeds = [int(s) for s in a.seeds.split()]
    except ValueError:
        seeds = []
    if not seeds:
        raise SystemExit(f"first_steps: --seeds {a.seeds!r} is not allowed: expected seeds as integers, "
                         f"space-separated (e.g. \"1337 1\")")
    for name, least in (("lead", 0), ("every", 1)):
        if getattr(a, name) < least:
            raise SystemExit(f"first_steps: --{name} {getattr(a, name)} is not allowed: expected an integer >= {least}")
    step, reasons = ckpt_start(a.gpu or _gpu(), seeds, a.ref, a.lead, a.every)
    for line in reasons:
        print(f"first_steps: {line}", file=sys.stderr)
    print(step)
    return 0


def cmd_known(a) -> int:
    gpu = a.gpu or _gpu()
    print(f"first_steps: the records of {gpu} ({a.ref.name}):")
    for line in known(gpu, a.ref):
        print("  " + line)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="first_steps.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)  # run's and check's: which seed, how many steps, which records
    common.add_argument("--seed", type=int, default=1)
    common.add_argument("--steps", type=int, default=3)
    common.add_argument("--ref", type=Path, default=REF)
    r = sub.add_parser("run", parents=[common], help="train the first steps here and compare them with the records")
    r.add_argument("--out", default="results/bench/gpu/first-steps")
    k = sub.add_parser("check", parents=[common],
                       help="compare a training run's first steps (its store) with the records")
    k.add_argument("store")
    k.add_argument("--run-prefix", default="baseline")
    c = sub.add_parser("record", help="add a run's first losses from a compact export to the records")
    c.add_argument("export")
    c.add_argument("--gpu", required=True)
    c.add_argument("--commit", required=True)
    c.add_argument("--source", required=True)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--run-prefix", default="baseline")
    c.add_argument("--steps", type=int, default=10)
    c.add_argument("--divergence", type=int, default=None, help="the step this run diverged at (none: not known)")
    c.add_argument("--note", default=None, help="what else is known, e.g. 'not diverged by step 7,610'")
    c.add_argument("--ref", type=Path, default=REF)
    n = sub.add_parser("known", help="what the records say of each seed on this GPU model (or --gpu NAME)")
    n.add_argument("--gpu", default=None)
    n.add_argument("--ref", type=Path, default=REF)
    cs = sub.add_parser("ckpt-start", help="the step a one-lease plan keeps checkpoints from, on this GPU model")
    cs.add_argument("--seeds", default="1337", help='space-separated, e.g. "1337 1" (the earliest divergence wins)')
    cs.add_argument("--gpu", default=None)
    cs.add_argument("--lead", type=int, default=1000, help="steps before the divergence (default 1000)")
    cs.add_argument("--every", type=int, default=250, help="the checkpoint interval (the preset's ckpt_every)")
    cs.add_argument("--ref", type=Path, default=REF)
    a = ap.parse_args(argv)
    if a.cmd in ("record", "check", "known", "ckpt-start") and overrides:
        ap.error(f"{a.cmd} takes no overrides")
    if a.cmd == "record":
        return cmd_record(a)
    if a.cmd == "check":
        return cmd_check(a)
    if a.cmd == "known":
        return cmd_known(a)
    if a.cmd == "ckpt-start":
        return cmd_ckpt_start(a)
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: expected an integer >= 1")
    return cmd_run(a, overrides)


if __name__ == "__main__":
    sys.exit(main())
