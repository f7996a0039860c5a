"""The stabilizers table: each stabilizer's outcome from report folders of forks (and of from-scratch
runs) beside its throughput cost from benchmarks/stabilizers.py.

    flash-forensics stabilizers --reports <forks report> [<scratch report> ...] \\
        --bench results/bench/stabilizers-h200.json [more.json ...] --name stabilizers [--results results]

writes <results>/<name>/stabilizers.md, stabilizers.json and stabilizers.png. Per run row (verdicts.json `runs`):
- stable or not (the run record's verdict), from which step (its fork step, or 0);
- steps gained: its divergence step minus its report's baseline's; a stable run gained at least (its last step -
  the baseline's divergence step), written ">= N"; none when its baseline did not diverge. A report of from-step-0
  runs without a baseline (qk_norm, gated_attn run beside none) takes another report's from-step-0 baseline with
  the same trajectory-deciding overrides (experiment, seeds, lr, no control: RUN_ONLY lists what may differ) and
  the same GPU model (where both records name one: a seed's divergence step holds on one GPU model only), and the
  table says so;
- final and validation loss, and their difference to the fp32 row (of the same report, else of any report);
- throughput cost per benchmark shape: 1 - tokens/s over the baseline's tokens/s (measured; "not measured" when the
  benchmark has no row for it, never a guess), with the route its layers took there;
- needs a model change: its intervention file's model patch sets a parameter-deciding field (fork.MODEL_KEYS), so it
  cannot fork from a baseline checkpoint.

`--only pbar_clamp sfa_guarded ...` keeps those interventions' rows, the baselines (not their controls) and the fp32
reference: the isolation rows and controls a report also holds are left out of the stabilizers' table and plot.
The plot has three panels: steps gained, validation loss over the fp32 reference's (what separates runs that are
all stable), and tokens/s relative to the baseline.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from flash_forensics.orchestrator import interventions, record
from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.errors import ConfigError
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.fork import MODEL_KEYS
from flash_forensics.orchestrator.report.fork_health import JUMP_NATS
from flash_forensics.orchestrator.report.plots import palette

REPO = Path(__file__).resolve().parents[2]
BASELINE, REFERENCE = "baseline", "fp32"


def _finite(x) -> Optional[float]:
    x = record.decode_float(x) if x is not None else None
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def needs_model_change(intervention: str) -> Optional[bool]:
    """Whether the intervention's model patch changes the parameters (None: no such intervention file)."""
    if intervention not in interventions.names():
        return None
    return bool(set(interventions.load(intervention).model.set_fields()) & set(MODEL_KEYS))


def _job_dir(row: Dict[str, Any], report_dir: Optional[Path]) -> Optional[Path]:
    """The run's job folder: where the report found it, else beside the report folder (`<root>/report` reads
    `<root>/<job>`), which is where it is once a lease's report and job folders are copied off the machine."""
    for d in (row.get("job_dir"), report_dir.parent / row["job"] if report_dir and row.get("job") else None):
        if d and record.result_path(Path(d)).is_file():
            return Path(d)
    return None


def _val_loss(row: Dict[str, Any], report_dir: Optional[Path] = None) -> Optional[float]:
    if "val_loss" in row:
        return _finite(row["val_loss"])
    job_dir = _job_dir(row, report_dir)
    if job_dir is not None:
        try:
            return _finite(record.read(job_dir).val_loss)
        except (OSError, ValueError):
            return None
    return None


def _gained(row, base) -> Dict[str, Any]:
    b = base.get("divergence_step") if base else None
    if row.get("observed") == "failed" or b is None:
        return {"steps_gained": None, "steps_gained_at_least": False}
    if row.get("divergence_step") is not None:
        return {"steps_gained": int(row["divergence_step"]) - int(b), "steps_gained_at_least": False}
    return {"steps_gained": int(row.get("steps_done") or 0) - int(b), "steps_gained_at_least": True}


def _repeated(paths) -> Optional[str]:
    """The first path given again (the same file or folder by another spelling), else None."""
    seen = set()
    for p in paths:
        r = Path(p).resolve()
        if r in seen:
            return str(p)
        seen.add(r)
    return None


def load_bench(path) -> Dict[str, Any]:
    """One benchmarks/stabilizers.py JSON, or several merged (a list of paths: e.g. one lease's mini shape and
    another's GPT-2S shape): their rows together, each file under `sources`. A shape in two files is refused, since
    its cost would depend on which file won."""
    if path is None:
        return {}
    if isinstance(path, (list, tuple)):
        twice = _repeated(path)
        if twice:
            raise ValueError(f"--bench {twice!r} is given twice: each file once")
        docs = [(Path(p), load_bench(p)) for p in path]
        if len(docs) == 1:
            return docs[0][1]
        seen: Dict[str, Path] = {}
        for p, d in docs:
            for shape in dict.fromkeys(r.get("shape") for r in d["rows"]):
                if shape in seen:
                    raise ValueError(f"--bench {str(seen[shape])!r} and {str(p)!r} both measured shape {shape!r}: "
                                     "give one file per shape")
                seen[shape] = p
        return {"rows": [r for _, d in docs for r in d["rows"]],
                "sources": [d["sources"][0] | {"path": str(p)} for p, d in docs]}
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--bench={str(path)!r}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:  # missing, a folder, a binary file (an MLflow export's .json.gz)
        why = e.strerror if isinstance(e, OSError) and e.strerror else "not a text file"
        raise ValueError(f"--bench={str(path)!r} is not allowed: {why}; expected a benchmarks/stabilizers.py "
                         "JSON file") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) \
            or not all(isinstance(r, dict) and "variant" in r and "shape" in r for r in doc["rows"]):
        raise ValueError(f"--bench={str(path)!r} is not allowed: expected a benchmarks/stabilizers.py JSON (key rows, "
                         "each row with its shape and variant)")
    missing = doc.get("missing") if isinstance(doc.get("missing"), list) else []
    if not doc["rows"] and not missing:  # a partial file that says what it missed is read: its costs "not measured"
        raise ValueError(f"--bench={str(path)!r} holds no rows: the benchmark measured nothing (see its log)")
    doc["sources"] = [{k: doc.get(k) for k in ("command", "gpu", "torch", "triton", "time")}
                      | {"shapes": list(dict.fromkeys([r.get("shape") for r in doc["rows"]]
                                                      + [m.get("shape") for m in missing if isinstance(m, dict)]))}]
    return doc


def _overrides(run: Dict[str, Any]) -> List[str]:
    ov = run.get("overrides") or []
    if isinstance(ov, str):  # older reports wrote the list's repr
        ov = ov.strip("[]").replace("'", "").split(", ") if ov.strip() else []
    return list(ov)


# Overrides that do not change a run's trajectory up to its end: which run it is, where it records, how long it runs and
# what it keeps, what it monitors. attention.fp32_gemm changes only GEMMs with FP32 operands, which a BF16 baseline has
# none of (seed 1's baseline with and without it logged the same validation losses digit for digit, 2026-12-04/05).
RUN_ONLY = ("intervention", "sweep_name", "tracking.", "hydra.", "train.max_steps", "train.keep_last", "train.ckpt_",
            "train.keep_checkpoints", "train.early_stop", "verdict.", "monitor.", "results_dir", "attention.fp32_gemm")


def _regime(run: Dict[str, Any]) -> frozenset:
    """The run's overrides that decide its trajectory: all but RUN_ONLY's (experiment, seeds, lr, model, a control)."""
    return frozenset(o.lstrip("+~") for o in _overrides(run)
                     if not o.lstrip("+~").split("=", 1)[0].startswith(RUN_ONLY))


def _gpu(run: Dict[str, Any]) -> Optional[str]:
    """The device model the run computed on (its record's setup; None in records older than 2026-12-05)."""
    return (run.get("setup") or {}).get("device.name")


def _baseline_of(runs: Sequence[Dict[str, Any]], all_reports: Sequence[Dict[str, Any]]):
    """(baseline row, the report it came from or None when its own): the report's from-step-0 baseline, else its
    forked baseline, else, for a report of from-step-0 runs that ran none (qk_norm and gated_attn beside a baseline
    already run: it repeats bit for bit on the same GPU model), another report's from-step-0 baseline whose
    trajectory-deciding overrides are the runs' own (the same experiment and seeds, no other lr, no control) and
    whose GPU model is theirs where both records name one. None when no report has one, or when two such baselines
    disagree."""
    base = next((r for r in runs if r.get("intervention") == BASELINE and r.get("fork_step") is None), None) or \
        next((r for r in runs if r.get("intervention") == BASELINE), None)
    if base is not None:
        return base, None
    regimes = {_regime(r) for r in runs}
    if len(regimes) != 1 or not next(iter(regimes)):
        return None, None
    gpus = {_gpu(r) for r in runs} - {None}
    found = [(r, Path(rep["path"])) for rep in all_reports for r in rep["runs"]
             if r.get("intervention") == BASELINE and r.get("fork_step") is None and _regime(r) in regimes
             and not (gpus and _gpu(r) and _gpu(r) not in gpus)]  # a seed repeats on one GPU model only
    if not found or len({r.get("divergence_step") for r, _ in found}) > 1:
        return None, None
    return found[0]


def _is_default(name: str, override: str) -> bool:
    """`intervention.<knob>=<value>` that sets what the intervention's file already sets (sfa's intervention.beta=2):
    the same run as without it, so its label drops it and two such rows of one outcome fold into one."""
    key, _, value = override.partition("=")
    if name not in interventions.names():
        return False
    default = getattr(interventions.load(name), key.split(".", 1)[1], None)
    if isinstance(default, bool):  # bool("false") is True: Hydra's spellings instead
        return value.lower() in ("true", "false") and (value.lower() == "true") == default
    try:
        return default is not None and not isinstance(default, (list, dict)) and type(default)(value) == default
    except (TypeError, ValueError):
        return False


def _label(run: Dict[str, Any]) -> str:
    """The intervention and what tells its rows apart: its own knobs (intervention.beta=4, not a value its file
    already sets) and a control (+control=fa2), not the layer and heads localization chose for every row alike."""
    ov, name = _overrides(run), str(run.get("intervention"))
    keep = [o for o in ov if o.lstrip("+~").split("=", 1)[0] == "control"
            or (o.startswith("intervention.") and not o.startswith(("intervention.layer=", "intervention.heads="))
                and not _is_default(name, o))]
    return " ".join([name, *keep])


def check_only(only: Optional[Sequence[str]]) -> None:
    """--only names interventions that have a file in conf/intervention; a typo would silently empty the table."""
    known = interventions.names()
    bad = [n for n in only or () if n not in known]
    if bad:
        raise ValueError(f"--only {bad[0]!r} is not allowed: expected intervention names, one of: {', '.join(known)}")


def keep_only(rows: List[Dict[str, Any]], only: Optional[Sequence[str]]) -> List[Dict[str, Any]]:
    """The rows of the named interventions, the baselines (a control's baseline row is not one) and the fp32 rows."""
    if not only:
        return rows
    return [r for r in rows if r["intervention"] in only or r["intervention"] == REFERENCE
            or (r["intervention"] == BASELINE and "control=" not in str(r.get("label")))]


def _outcome(row: Dict[str, Any]) -> tuple:
    """What makes two rows of a report the same run twice: label, fork step and outcome to the last digit."""
    return tuple(row[k] for k in ("report", "label", "from_step", "observed", "divergence_step", "final_loss",
                                  "val_loss"))


def _fork_step(run: Dict[str, Any]) -> int:
    """Where a run started: its record's fork step, else (a fork that failed or was cut before its result.json) the
    step of the checkpoint its from_checkpoint override names; 0 for a run from scratch."""
    if run.get("fork_step") is not None:
        return int(run["fork_step"])
    given = [str(o).split("=", 1)[1] for o in run.get("overrides") or [] if str(o).startswith("from_checkpoint=")]
    m = checkpoint.STEP_RE.match(Path(given[-1]).name) if given else None  # Hydra: the last value of a key wins
    return int(m.group(1)) if m else 0


def table_rows(reports: Sequence[Dict[str, Any]], bench: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per run of every report (a report: {"path", "runs"}), in report order; a run that repeats another of
    its report (the same label, fork step and outcome to the last digit: e.g. the baseline fork each sweep of an
    isolate carries) is folded into the first, its job listed under `repeats`."""
    all_runs = [r for rep in reports for r in rep["runs"]]
    ref_any = next((r for r in all_runs if r.get("intervention") == REFERENCE), None)
    brows = [r for r in bench.get("rows", []) if "error" not in r]
    shapes = list(dict.fromkeys(r["shape"] for r in bench.get("rows", [])))
    out = []
    for rep in reports:
        runs = rep["runs"]
        base, base_rep = _baseline_of(runs, reports)
        ref = next((r for r in runs if r.get("intervention") == REFERENCE), None) or ref_any
        ref_rep = next((Path(x["path"]) for x in reports if any(r is ref for r in x["runs"])), None)
        ref_final, ref_val = (_finite(ref.get("final_loss")), _val_loss(ref, ref_rep)) if ref else (None, None)
        for run in runs:
            name = run.get("intervention")
            final, val = _finite(run.get("final_loss")), _val_loss(run, Path(rep["path"]))
            row = dict(report=str(rep["path"]), job=run.get("job"), intervention=name, label=_label(run),
                       fork_jump=_finite(run.get("fork_jump")), observed=run.get("observed"),
                       stable=run.get("observed") == "stable", from_step=_fork_step(run),
                       divergence_step=run.get("divergence_step"), steps_done=run.get("steps_done"),
                       **_gained(run, base), final_loss=final, val_loss=val,
                       final_vs_fp32=None if final is None or ref_final is None else final - ref_final,
                       val_vs_fp32=None if val is None or ref_val is None else val - ref_val,
                       needs_model_change=needs_model_change(name), cost={}, route={}, error=run.get("error"),
                       baseline_from=str(base_rep) if base_rep else None)
            control = "control=" in row["label"]  # _label keeps a control's override, whatever its form
            for shape in shapes:
                b = next((r for r in brows if r["shape"] == shape and r["variant"] == BASELINE), None)
                # a control (+control=fa2) runs the baseline intervention on other attention: not the baseline's cost
                mine = None if control else next((r for r in brows if r["shape"] == shape and r["variant"] == name),
                                                 None)
                ok = b and mine and b.get("tokens_per_s") and mine.get("tokens_per_s")
                row["cost"][shape] = 1 - mine["tokens_per_s"] / b["tokens_per_s"] if ok else None
                row["route"][shape] = mine.get("route_set") if mine else None
            first = next((o for o in out if _outcome(o) == _outcome(row)), None)
            if first is not None and row["final_loss"] is not None:
                first.setdefault("repeats", []).append(row["job"])
                continue
            out.append(row)
    return out


# ------------------------------------------------------------------------------------------------ writing
def _f(x, fmt="{:.3f}", signed=False) -> str:
    if x is None:
        return "-"
    return ("{:+.3f}" if signed else fmt).format(x)


def _gain_text(r) -> str:
    if r["steps_gained"] is None:
        return "-"
    return (">= " if r["steps_gained_at_least"] else "") + f"{r['steps_gained']:+d}"


def _report_names(rows: List[Dict[str, Any]]) -> Dict[str, str]:
    """Each report folder's shortest distinguishing name (the last path parts that tell them apart)."""
    paths = list(dict.fromkeys(r["report"] for r in rows))
    for depth in range(1, 6):
        names = {p: "/".join(Path(p).parts[-depth:]) for p in paths}
        if len(set(names.values())) == len(paths):
            return names
    return {p: p for p in paths}


def markdown(rows: List[Dict[str, Any]], bench: Dict[str, Any], shapes: Sequence[str]) -> str:
    names = _report_names(rows)
    several = len(names) > 1  # rows of several reports (e.g. seeds): each row names its report
    head = [*(["report"] if several else []), "intervention", "from step", "verdict", "diverged at", "steps gained",
            "final loss", "vs fp32", "val loss", "vs fp32", *[f"cost {s}" for s in shapes], "jump at fork",
            "needs model change"]
    lines = ["# Stabilizers side by side", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = str(r.get("label") or r["intervention"])
        if r.get("repeats"):
            label += f" (x{1 + len(r['repeats'])}: one outcome)"
        cells = [*([names[r["report"]]] if several else []), label, str(r["from_step"]), str(r["observed"]),
                 "-" if r["divergence_step"] is None else str(r["divergence_step"]), _gain_text(r),
                 _f(r["final_loss"]), _f(r["final_vs_fp32"], signed=True), _f(r["val_loss"]),
                 _f(r["val_vs_fp32"], signed=True),
                 *[("not measured" if r["cost"].get(s) is None else f"{100 * r['cost'][s]:+.1f}%") for s in shapes],
                 _f(r.get("fork_jump"), signed=True) + (" (not like-for-like)" if abs(r.get("fork_jump") or 0)
                                                        > JUMP_NATS else ""),
                 {True: "yes", False: "no", None: "?"}[r["needs_model_change"]]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "- steps gained: divergence step minus the report's baseline's; `>= N`: stable to its last step.",
              f"- jump at fork: a fork's first loss minus its baseline's on the same weights and batch (the report's "
              f"fork_jump); beyond {JUMP_NATS} nats the intervention changed the trained model's function at the fork, "
              f"so its verdict is not a like-for-like continuation.",
              "- cost: 1 - training tokens/s over the baseline's, per benchmark shape (positive: slower)."]
    borrowed = {(names[r["report"]], names.get(r["baseline_from"], r["baseline_from"])) for r in rows
                if r.get("baseline_from")}
    lines += [f"- {rep}: it ran no baseline; its steps gained are against the from-step-0 baseline of {src}, whose "
              f"overrides that decide the trajectory are its runs' own (a baseline run is deterministic)"
              for rep, src in sorted(borrowed)]
    if any(r.get("repeats") for r in rows):
        lines.append("- (xN: one outcome): N runs of the same intervention from the same step ended identically (e.g. "
                     "the baseline fork in each sweep); one row, their jobs under `repeats` in the JSON.")
    if bench:
        for src in bench["sources"]:
            lines.append(f"- throughput ({', '.join(map(str, src['shapes']))}): `{src.get('command')}` on "
                         f"{src.get('gpu')} (torch {src.get('torch')}, triton {src.get('triton')}, {src.get('time')}).")
        routes = {(r["intervention"], s): r["route"].get(s) for r in rows for s in shapes if r["route"].get(s)}
        if routes:
            lines += ["", "Routes in the benchmark (per shape):", ""]
            lines += [f"- {iv} @ {s}: {', '.join(v)}" for (iv, s), v in routes.items()]
        lines += [f"- benchmark {r['variant']} @ {r['shape']} failed (not measured): {r['error']}"
                  for r in bench.get("rows", []) if "error" in r]
    else:
        lines.append("- throughput: no benchmark given (--bench): not measured.")
    failed = [r for r in rows if r["observed"] == "failed"]
    lines += [f"- {r['intervention']} ({r['job']}) failed: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def plot(rows: List[Dict[str, Any]], shapes: Sequence[str], path: Path) -> Optional[Path]:
    """Left: steps gained per run (hatched: stable, a lower bound); middle: validation loss over the fp32
    reference's (grey: the fork's first loss jumped, not a like-for-like continuation); right: tokens/s relative to
    the baseline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["intervention"] != BASELINE]
    if not runs:
        return None
    starts = {r["from_step"] for r in runs}
    one_start = len(starts) == 1  # the same fork step on every bar: said once, in the title
    labels = [(r.get("label") or r["intervention"]) + ("" if one_start else f" (from {r['from_step']})")
              for r in runs]
    fig, (a, m, b) = plt.subplots(1, 3, figsize=(17, 0.45 * len(runs) + 2), sharey=True,
                                  gridspec_kw={"width_ratios": [1, 0.8, 1]})
    y = list(range(len(runs)))
    gains = [r["steps_gained"] or 0 for r in runs]
    colors = ["tab:green" if r["stable"] else "tab:red" if r["observed"] == "diverged" else "tab:gray" for r in runs]
    bars = a.barh(y, gains, color=colors)
    for bar, r in zip(bars, runs):
        if r["steps_gained_at_least"]:
            bar.set_hatch("//")
    a.axvline(0, color="black", lw=0.8)
    a.set_yticks(y, labels)
    a.invert_yaxis()
    a.set_xlabel("steps gained over the baseline's divergence (hatched: stable, at least)")
    gaps = [r.get("val_vs_fp32") for r in runs]
    jumped = [abs(r.get("fork_jump") or 0) > JUMP_NATS for r in runs]
    m.barh(y, [g or 0 for g in gaps], color=["0.6" if j else "tab:blue" for j in jumped])
    for v, g, j in zip(y, gaps, jumped):  # no value said in words; a jumped fork said so beside its bar
        if g is None:
            m.text(0.01, v, "no val loss", va="center", fontsize=8, color="0.4", transform=m.get_yaxis_transform())
        elif j:
            m.text(g, v, " not like-for-like", va="center", ha="left" if g >= 0 else "right", fontsize=7,
                   color="0.3")
    m.axvline(0, color="black", lw=0.8)
    m.set_xlabel("validation loss minus the fp32 reference's (nats; lower is better)")
    width = 0.8 / max(1, len(shapes))
    for i, (s, c) in enumerate(zip(shapes, palette(len(shapes)))):
        vals = [1 - r["cost"][s] if r["cost"].get(s) is not None else 0 for r in runs]
        b.barh([v + (i - (len(shapes) - 1) / 2) * width for v in y], vals, height=width, color=c, label=s)
    for v, r in zip(y, runs):  # an empty row said in words, not left for the reader to decode as a zero
        if shapes and all(r["cost"].get(s) is None for s in shapes):
            b.text(0.01, v, "not measured", va="center", fontsize=8, color="0.4", transform=b.get_yaxis_transform())
    b.axvline(1, color="black", lw=0.8)
    b.set_xlabel("training tokens/s relative to the baseline (1: as fast)")
    if shapes:  # above the bars, not over the last one
        b.legend(title="benchmark shape", loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(shapes),
                 frameon=False, fontsize=9)
    fig.suptitle("Stabilizers: steps gained, loss against the fp32 reference, throughput"
                 + (f" (every run forked at step {next(iter(starts))})" if one_start else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report_dirs: Sequence[Path], bench_path, name: str,
          results: Path = REPO / "results", only: Optional[Sequence[str]] = None) -> Dict[str, Path]:
    check_only(only)
    twice = _repeated(report_dirs)
    if twice:  # its rows would fold into the first copy's, each read as a run repeated ("x2: one outcome")
        raise ValueError(f"--reports {twice!r} is given twice: each report folder once")
    reports = []
    for d in report_dirs:
        f = Path(d) / "verdicts.json"
        if not f.is_file():
            raise ValueError(f"--reports {str(d)!r} is not allowed: expected a report folder with verdicts.json")
        try:
            doc = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--reports {str(d)!r}: {f} is not valid JSON ({e})") from None
        runs = doc.get("runs") if isinstance(doc, dict) else None
        if isinstance(runs, list) and not all(isinstance(r, dict) for r in runs):
            raise ValueError(f"--reports {str(d)!r} is not allowed: {f} is not a report's verdicts.json (its runs are "
                             "not objects)")
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"--reports {str(d)!r} is not allowed: {f} holds no runs (expected a report's "
                             "verdicts.json, with its runs)")
        reports.append({"path": Path(d), "runs": runs})
    bench = load_bench(bench_path)
    shapes = list(dict.fromkeys(r["shape"] for r in bench.get("rows", [])))
    rows = keep_only(table_rows(reports, bench), only)
    out = Path(results) / name
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "stabilizers.md", "json": out / "stabilizers.json"}
    paths["md"].write_text(markdown(rows, bench, shapes))
    benches = [str(b) for b in (bench_path if isinstance(bench_path, (list, tuple)) else [bench_path]) if b]
    meta = {"reports": [str(d) for d in report_dirs], "bench": benches[0] if len(benches) == 1 else benches or None,
            "bench_sources": bench.get("sources", []), "shapes": shapes, "only": list(only) if only else None}
    paths["json"].write_text(record.dumps({"meta": meta, "rows": rows}))
    png = plot(rows, shapes, out / "stabilizers.png")
    if png:
        paths["png"] = png
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics stabilizers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", nargs="+", type=Path, required=True, help="report folders (verdicts.json)")
    ap.add_argument("--bench", type=Path, nargs="+", default=None,
                    help="benchmarks/stabilizers.py JSON(s): several merge, one file per shape (default: none, cost "
                         "not measured)")
    ap.add_argument("--only", nargs="+", default=None, metavar="INTERVENTION",
                    help="keep these interventions' rows, the baselines and the fp32 reference (default: every run of "
                         "every report, isolation rows and controls included)")
    ap.add_argument("--name", default="stabilizers", help="the folder under --results (a plain name)")
    ap.add_argument("--results", type=Path, default=REPO / "results",
                    help=f"where the --name folder goes (default: {REPO / 'results'})")
    a = ap.parse_args(argv)
    if not a.name or Path(a.name).name != a.name or a.name in (".", ".."):
        ap.error(f"--name={a.name!r} is not allowed: expected a plain folder name (no path), made under --results")
    try:  # a file where the table goes: said naming the flag, before any report is read
        check_folder("--results", str(a.results), "the --name folder goes there")
        check_folder("--name", a.name, "stabilizers.{md,json,png} go there, under --results", base=a.results)
    except ConfigError as e:
        ap.error(str(e))
    try:
        paths = write(a.reports, a.bench, a.name, a.results, only=a.only)
    except (OSError, ValueError) as e:
        print(f"[stabilizers] {e}", file=sys.stderr)
        return 1
    for p in paths.values():
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
