"""The rounding stage's input and output: rows from a report or sweep folder, <out>/rounding.{json,png}, the Cause
section of verdicts.md, and MLflow tags (ff.cause.*) on the baseline runs and the report's parent run.

    flash-forensics localize rounding REPORT_OR_SWEEP_DIR [--out DIR] [--tracking-uri URI] [--min-delay N]

for a report already made (orchestrator/analysis/isolate.py runs the stage itself when its sweeps include
rounding_points). The rules: orchestrator/analysis/localize/rounding.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize import rounding
from flash_forensics.orchestrator.analysis.localize.plot import rounding as plot_rounding
from flash_forensics.orchestrator.analysis.localize.rounding import RoundingResult
from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.report.render import insert_cause
from flash_forensics.orchestrator.report.rows import rows_from_dirs
from flash_forensics.orchestrator.tracking.tracker import (
    MAX_TAG_VAL_LENGTH,
    _truncate,
    find_parent,
    make_client,
    resolve_uri,
    retry,
)

JSON_FILE, PLOT_FILE = "rounding.json", "rounding.png"
TAG = "ff.cause."  # the MLflow tags this stage sets: ff.cause.point, ff.cause.verdict, ...


def load(source: Path) -> Tuple[List[Dict], Dict, Path]:
    """(rows, the report's meta, the report folder) of a report dir (verdicts.json), a sweep dir (its run records,
    report in <sweep>/report) or several job folders' parent."""
    source = Path(source)
    f = source / "verdicts.json"
    if f.is_file():
        try:
            doc = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"source {str(source)!r}: {f} is not valid JSON ({e})") from None
        runs = doc.get("runs") if isinstance(doc, dict) else None
        # no runs: a table of nothing with exit 0 would read as "no rounding-point forks ran"
        if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
            raise ValueError(f"source {str(source)!r} is not allowed: {f} holds no runs (expected a report's "
                             "verdicts.json with its runs, each an object)")
        return runs, dict(doc.get("meta") or {}), source
    if not source.is_dir():
        raise ValueError(f"{source}: not a report dir (verdicts.json) or a sweep dir")
    meta: Dict = {}
    parent = find_parent(source)
    if parent:
        meta = {"tracking_uri": parent.get("tracking_uri"), "parent_run_id": parent.get("run_id")}
    return rows_from_dirs([source]), meta, source / record.REPORT_DIR


def localization_target(out_dir: Path) -> Optional[Dict]:
    """The layer/heads stage's target from <out>/localize.json, when that stage ran
    (orchestrator/analysis/isolate.py)."""
    f = Path(out_dir) / "localize.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("target")
    except (OSError, ValueError) as e:
        print(f"[rounding] {f} unreadable, the verdict goes without layer/heads: {e}", file=sys.stderr)
        return None


def write(result: RoundingResult, out_dir: Path) -> Dict[str, Path]:
    """<out>/rounding.json and <out>/rounding.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_FILE).write_text(record.dumps(result.to_dict()))
    return {"json": out_dir / JSON_FILE, "plot": plot_rounding(result, out_dir / PLOT_FILE)}


def cause(result: RoundingResult, paths: Dict[str, Path]) -> Dict:
    """What the report renders (orchestrator/report/render.py: the Cause section) and logs beside verdicts.md."""
    return {"verdict": result.verdict(), "lines": result.markdown(), "plot": paths.get("plot"),
            "files": [p for p in paths.values() if p is not None]}


def tags(result: RoundingResult) -> Dict[str, str]:
    """ff.cause.*: the point(s) named, the verdict, and each list the verdict is made of ('none' when empty)."""
    join = lambda xs: ",".join(xs) or "none"  # noqa: E731
    out = {"point": join(result.cause_points), "needs_bf16": join(result.needs_bf16),
           "prevents": join(result.prevents), "reproduces": join(result.reproduces),
           "delays": join(f"{p}:+{n}" for p, n in result.delays.items()),
           "verdict": _truncate(result.verdict(), MAX_TAG_VAL_LENGTH)}
    t = result.localization or {}
    if t.get("layer") is not None:
        out["layer"] = str(t["layer"])
        out["heads"] = join(str(h) for h in t.get("heads") or [])
    return {TAG + k: v for k, v in out.items()}


def baseline_run_ids(result: RoundingResult) -> List[str]:
    return [r["mlflow_run_id"] for r in result.baseline.get("runs", []) if r.get("mlflow_run_id")]


def tag_runs(uri: str, run_ids: Iterable[str], tag_map: Dict[str, str], artifacts: Sequence[Path] = (),
             artifact_run: Optional[str] = None) -> List[str]:
    """Set tag_map on each run (and log artifacts under report/ to artifact_run); returns the runs tagged. A store
    that cannot be reached raises: the caller says so (the files on disk stand)."""
    from mlflow.entities import RunTag

    client = make_client(resolve_uri(uri))
    done = []
    for rid in dict.fromkeys(run_ids):
        retry(client.log_batch, rid, tags=[RunTag(k, v) for k, v in tag_map.items()])
        done.append(rid)
    for path in artifacts if artifact_run else ():
        retry(client.log_artifact, artifact_run, str(path), record.REPORT_DIR)
    return done


def _insert_into_report(out_dir: Path, c: Dict) -> List[Path]:
    """An existing report gets the Cause section (verdicts.md) and the verdict (verdicts.json's "cause")."""
    changed = []
    md, js = out_dir / "verdicts.md", out_dir / "verdicts.json"
    if md.is_file():
        md.write_text(insert_cause(md.read_text(), c, out_dir))
        changed.append(md)
    if js.is_file():
        doc = json.loads(js.read_text())
        doc["cause"] = c["verdict"]
        js.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False))
        changed.append(js)
    return changed


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="flash-forensics localize rounding",
                                description="Which rounding point the divergence needs in BF16, from a report's "
                                            "lift_<point> / bf16_only_<point> forks (rules: "
                                            "orchestrator/analysis/localize/rounding.py).")
    p.add_argument("source", type=Path, help="a report dir (verdicts.json) or a sweep dir (job folders)")
    p.add_argument("--out", type=Path, help="where rounding.{json,png} go (default: the report dir; a sweep dir's "
                                            "is <sweep>/report)")
    p.add_argument("--tracking-uri", help="MLflow store of the runs (default: the report's own)")
    p.add_argument("--min-delay", type=int, default=1, help="steps a lift must gain to count as a delay")
    p.add_argument("--no-tags", action="store_true", help="write the files only; set no MLflow tags")
    a = p.parse_args(argv)
    if a.min_delay < 1:
        p.error(f"--min-delay={a.min_delay} is not allowed: expected an integer >= 1 (steps)")
    try:
        if a.out is not None:  # a file there failed after the analysis with FileExistsError, naming no flag
            check_folder("--out", str(a.out), "rounding.{json,png} go there")
        rows, meta, report = load(a.source)
        out = a.out or report
        result = rounding.analyze(rows, localization_target(out), str(a.source), a.min_delay)
    except (OSError, ValueError) as e:
        print(f"localize rounding: {e}", file=sys.stderr)
        return 2
    if not result.points:  # else an empty rounding table, a "Cause" in the report and ff.cause.* tags, with exit 0
        print(f"localize rounding: source {str(a.source)!r} is not allowed: its {len(rows)} runs hold no "
              "rounding-point fork (intervention lift_<point> or bf16_only_<point>); expected the report or sweep "
              "folder of a rounding-point sweep (flash-forensics rounding-sweep)", file=sys.stderr)
        return 2
    print(result.format())
    paths = write(result, out)
    c = cause(result, paths)
    changed = _insert_into_report(out, c)
    print("\nwrote " + ", ".join(str(x) for x in [*paths.values(), *changed]))
    uri = a.tracking_uri or meta.get("tracking_uri")
    ids = baseline_run_ids(result)
    if a.no_tags:
        return 0
    if not uri or not (ids or meta.get("parent_run_id")):
        print("no MLflow tags set: " + ("no tracking uri (give --tracking-uri)" if not uri
                                         else "no baseline run id in the rows and no parent run"))
        return 0
    parent = meta.get("parent_run_id")
    try:
        done = tag_runs(uri, ids + ([parent] if parent else []), tags(result), c["files"], parent)
    except Exception as e:  # the files on disk stand; the tags are said to be missing, not silently skipped
        print(f"localize rounding: MLflow tags not set in {uri}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"tagged {TAG}* on run(s) {', '.join(done)} in {uri}")
    return 0


__all__ = ["load", "localization_target", "write", "cause", "tags", "tag_runs", "baseline_run_ids", "main",
           "JSON_FILE", "PLOT_FILE", "TAG"]
