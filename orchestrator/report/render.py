"""The sweep report as a reader sees it: the terminal table, verdicts.md (on disk and in MLflow's artifact viewer),
verdicts.html (one self-contained page, orchestrator/report/html.py) and the plots.

orchestrator/report/sweep.py builds and compares the rows; this module only renders them. Two markdown copies, because
an image path means different things in the two places: on disk the images are `plots/x.png` beside verdicts.md;
in MLflow, report/verdicts.md is shown inside the UI page, whose markdown viewer draws no images: its plots are
links to the artifact viewer, its run links the UI's own routes. Run ids link to the run pages in both.
Over 400 lines because the terminal table, verdicts.md, verdicts.json and the parent run's description render the
same rows and must say the same thing; the HTML page is report/html.py.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import (
    alarm_view,
    fork_health,
    links,
    plots,
    probe_table,
    readback,
    rejudge,
    verdict_view,
)
from flash_forensics.orchestrator.report import html as report_html
from flash_forensics.orchestrator.report import rows as R
from flash_forensics.orchestrator.tracking.run_fields import git_info
from flash_forensics.orchestrator.tracking.tracker import (
    MAX_TAG_VAL_LENGTH,
    make_client,
    resolve_uri,
    retry,
    source_tags,
)

RUN_COL = 11  # the "MLflow run" column of _table
NOTE_COL = 10  # the "vs baseline" column: on its own line in the terminal




def run_meta(tracking_uri: Optional[str] = None, **extra) -> Dict[str, Any]:
    """Command, commit, hardware, versions and time: what a reader needs to reproduce the table."""
    import torch
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("mlflow", "hydra", "omegaconf"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            pass
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "git": git_info(), "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "hardware": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                         "cpu_count": os.cpu_count(), "gpus": gpus},
            "versions": versions, "tracking_uri": tracking_uri, **extra}


def _summary_tags(summary):
    from mlflow.entities import RunTag  # lazy: mlflow costs ~1 s to import; only a parent run needs it
    return [RunTag(f"sweep.{k}", str(v)) for k, v in summary.items()]


def _finite(x):
    """NaN/Inf (a diverged run's final loss) become null: verdicts.json stays strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _fmt(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if math.isfinite(x) else str(x)
    return str(x)


def _table(rows: Sequence[Dict]) -> List[List[str]]:
    head = ["job", "intervention", "overrides", "expected", "observed", "div. step", "cause", "final loss",
            "peak σ(W_Q)", "matches paper", "vs baseline", "MLflow run"]
    body = []
    common = R._common_overrides(rows)
    for r in rows:
        peak = _fmt(R._num(r.get("peak_wq_norm")), 2) + (f" ({r['peak_wq_where']})" if r.get("peak_wq_where")
                                                          else "")
        body.append([_fmt(r.get("job")), _fmt(r.get("intervention")),
                     " ".join(sorted(R._other_overrides(r) - common)) or "-",
                     _fmt(r.get("expected")), _fmt(r.get("observed")), _fmt(r.get("divergence_step")),
                     _fmt(r.get("cause")), _fmt(R._num(r.get("final_loss"))), peak,
                     "void" if r.get("paper_void") else "-" if r.get("observed") == "failed" else
                     _fmt(r.get("matches_paper")),
                     r.get("vs_baseline") or "-", (r.get("mlflow_run_id") or "-")[:12]])
    return [head] + body


def format_table(rows: Sequence[Dict]) -> str:
    """Plain-text table for the terminal."""
    t = _table(rows)
    cols = [c for c in range(len(t[0])) if c != NOTE_COL]  # the note goes on its own line
    widths = {c: max(len(r[c]) for r in t) for c in cols}
    lines = ["  ".join(r[c].ljust(widths[c]) for c in cols) for r in t]
    out = [lines[0], "-" * len(lines[0])]
    for line, r in zip(lines[1:], t[1:]):
        out.append(line)
        if r[NOTE_COL] != "-":
            out.append("    " + r[NOTE_COL])
    return "\n".join(out)


_META_SHOWN = ("command", "git", "time_utc", "hardware", "versions", "tracking_uri", "parent_run_id", "experiment_id",
               "ui_url", "share_key", "compare_ids")
Parts = List[Tuple[str, bool]]  # (text, is code)


def meta_items(rows, meta) -> List[Parts]:
    """The report's header bullets as (text, is-code) parts, shared by the markdown and the HTML page."""
    git = meta.get("git", {})
    if not isinstance(git, dict):  # given as text (--meta git=...), e.g. for a run made on another machine
        git = {"git.commit": git, "git.dirty": "see commit"}
    hw = meta.get("hardware", {})
    hw_line = (hw if isinstance(hw, str) else
               f"{hw.get('platform')}, {hw.get('cpu_count')} CPUs, GPUs: {', '.join(hw.get('gpus') or []) or 'none'}")
    versions = meta.get("versions", {})
    v_line = versions if isinstance(versions, str) else ", ".join(f"{k} {v}" for k, v in versions.items())
    common = sorted(R._common_overrides(rows))
    items: List[Parts] = [[("overrides shared by every run: ", False), (" ".join(common), True)] if common
                          else [("no shared overrides", False)]]
    items += [[(line[2:], False)] for line in _fork_lines(rows)]
    items += [[("command: ", False), (str(meta.get("command")), True)],
              [("commit: ", False), (str(git.get("git.commit")), True), (f" (dirty: {git.get('git.dirty')})", False)],
              [(f"time (UTC): {meta.get('time_utc')}", False)],
              [(f"hardware: {hw_line}", False)],
              [(f"versions: {v_line}", False)]]
    items += [[(f"{k}: {v}", False)] for k, v in meta.items()
              if k not in _META_SHOWN and isinstance(v, (str, int, float))]
    return items


def _md_parts(parts: Parts) -> str:
    return "".join(f"`{t}`" if code else t for t, code in parts)


def _md_link(text: str, url: Optional[str]) -> str:
    return f"[{text}]({url})" if url else text


def run_urls(rows, experiments: Dict[str, str], base: Optional[str]) -> List[Optional[str]]:
    """Per row: its run page (base None: the UI's relative route, for pages shown inside the UI)."""
    out = []
    for r in rows:
        rid = r.get("mlflow_run_id")
        exp = experiments.get(rid) if rid else None
        out.append(None if exp is None else (f"{base}/" if base else "") + links.run_route(exp, rid))
    return out


CAUSE_HEADING = "## Cause"


def cause_lines(cause: Optional[Dict], out_dir: Path, plot_line=None) -> List[str]:
    """verdicts.md's Cause section: the rounding stage's verdict and outcome table (orchestrator/analysis/localize/
    rounding_io.cause: {verdict, lines, plot}); its plot by its path relative to out_dir, or plot_line(name, path)."""
    if not cause:
        return []
    out = [CAUSE_HEADING, "", *cause["lines"]]
    if cause.get("plot"):
        p = Path(cause["plot"])
        out += ["", plot_line("rounding points", p) if plot_line
                else f"![rounding points]({os.path.relpath(p, out_dir)})"]
    return out + [""]


def insert_cause(md: str, cause: Dict, out_dir: Path) -> str:
    """An existing verdicts.md with its Cause section put (or replaced) right under the summary line."""
    lines = md.split("\n")
    if CAUSE_HEADING in lines:  # drop the old section: up to the next heading
        i = lines.index(CAUSE_HEADING)
        j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
        lines[i:j] = []
    at = next((k + 1 for k, line in enumerate(lines) if " runs; " in line and "match the paper" in line), 1)
    lines[at:at] = [""] + cause_lines(cause, out_dir)[:-1]
    return "\n".join(lines)


def _markdown(rows, meta, plot_paths, out_dir: Path, sweep: str, urls: Optional[List[Optional[str]]] = None,
              plot_line=None, cause: Optional[Dict] = None) -> str:
    """verdicts.md. urls: each row's run page (None: plain ids); plot_line(name, path): a plot's line (default: the
    image by its path relative to out_dir, for the copy on disk); cause: the Cause section (cause_lines)."""
    t = _table(rows)
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    failed = [r for r in rows if r["observed"] == "failed"]
    md = [f"# Verdicts: {sweep}", "", R.counts(rows), ""]
    md += cause_lines(cause, out_dir, plot_line)
    md += ["- " + _md_parts(p) for p in meta_items(rows, meta)]
    md += ["", "| " + " | ".join(t[0]) + " |", "|" + "---|" * len(t[0])]
    for i, r in enumerate(t[1:]):
        cells = [esc(c) for c in r]
        cells[RUN_COL] = _md_link(cells[RUN_COL], (urls or [None] * len(rows))[i])
        md.append("| " + " | ".join(cells) + " |")
    if failed:
        md += ["", "## Failed runs", ""]
        for r in failed:
            md.append(f"- job {r.get('job')} ({r.get('intervention')}): `{(r.get('error') or '?').strip()[:2000]}`")
    alarm = alarm_view.lines(rows)
    if alarm:
        md += [""] + alarm[:-1]
    if plot_paths:
        md += ["", "## Plots", ""]
        for name, p in plot_paths.items():
            md += [plot_line(name, p) if plot_line else f"![{name}]({os.path.relpath(p, out_dir)})", ""]
    md += _mlflow_lines(meta)
    return "\n".join(md) + "\n"


def _mlflow_plot_line(name: str, path, experiment_id, run_id: str, folder: str = "plots") -> str:
    """MLflow's markdown viewer draws no images: a link that opens the plot in the artifact viewer instead."""
    route = links.artifact_view_route(experiment_id, run_id, f"{folder}/{Path(path).name}")
    return f"- [{name}]({route}): opens in the artifact viewer; every plot inline: `verdicts.html`"


def _mlflow_lines(meta) -> List[str]:
    uri = meta.get("tracking_uri")
    if not uri:
        return []
    out = ["", "## MLflow", ""]
    base = links.ui_base(uri, meta.get("ui_url"))
    cmd = links.mlflow_ui_command(uri, base)
    out.append(f"`{cmd}`, then open {base}" if cmd else f"Server: {base}")
    exp, parent = meta.get("experiment_id"), meta.get("parent_run_id")
    if exp is not None:
        out.append("")
        if meta.get("share_key"):
            out.append(f"- [verdicts]({base}/{links.view_route(exp, meta['share_key'])}): the runs table with "
                       f"the verdict columns")
        if len(meta.get("compare_ids") or ()) > 1:
            out.append(f"- [compare the runs]({base}/{links.compare_route(exp, meta['compare_ids'])})")
        if not meta.get("share_key"):
            out += [f"- [runs table]({base}/{links.experiment_route(exp)}) (experiment `{exp}`)"]
        if parent:
            out.append(f"- [parent run]({base}/{links.run_route(exp, parent)}) (`{parent}`)")
    elif parent:
        out.append(f"(parent run `{parent}`)")
    return out


def _fork_lines(rows) -> List[str]:
    """Forked runs (orchestrator/job/fork.py) start at their checkpoint's step: say so, once per source checkpoint."""
    forks = sorted({(r.get("forked_from"), r.get("fork_step")) for r in rows if r.get("fork_step") is not None},
                   key=str)
    return [f"- forked from `{path}` at step {step}: metrics and verdicts from step {step} on" for path, step in forks]


def _paper_words(r) -> str:
    if r.get("paper_void"):
        return "void: its baseline did not diverge"
    return "matches the paper" if r.get("matches_paper") else "does not match the paper"


def parent_note(sweep: str, rows, urls: List[Optional[str]], view: Optional[str] = None,
                compare: Optional[str] = None) -> str:
    """The sweep's parent run description (markdown on its run page): the counts, then one line per run (its
    verdict with the control; lines, not a table, so the UI's preview shows every run), the verdicts view and
    compare links."""
    out = [f"**{sweep}**: {R.counts(rows)} Full report: `verdicts.html` (artifacts)."]
    links_line = " · ".join(x for x in ((f"[verdicts table]({view})" if view else None),
                                          (f"[compare the runs]({compare})" if compare else None)) if x)
    if links_line:
        out.append(links_line)
    out += [" ".join(f"{i + 1}. {_md_link(_fmt(r.get('job')), url)} **{_fmt(r.get('intervention'))}**: "
                     f"{r.get('verdict') or _fmt(r.get('observed'))}"
                     f" ({_paper_words(r)})".split())
            for i, (r, url) in enumerate(zip(rows, urls, strict=True))]
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------ plots
def _fork_window(rows) -> Optional[int]:
    """The first fork step: the plots start there (the baseline's first steps are the same in every run)."""
    steps = [r["fork_step"] for r in rows if isinstance(r.get("fork_step"), int)]
    return min(steps) if steps else None


def _delay_items(rows, labels: Sequence[str]):
    """(label, observed, divergence step, last step, its baseline's divergence step) for the delay chart."""
    out = []
    for r, label in zip(rows, labels):
        if r.get("intervention") == R.BASELINE and R.control_of(r) is None:
            continue
        base = R._peer(r, rows, R.BASELINE)
        bd = base.get("divergence_step") if base is not None and base["observed"] == "diverged" else None
        steps = r.get("steps_done")
        out.append((label, r["observed"], r.get("divergence_step"), steps - 1 if isinstance(steps, int) else None,
                    bd))
    return out


def verdict_heads(rows) -> List[Tuple[int, int]]:
    """The (layer, head)s the rows' verdicts name: each run's peak W_Q head (peak_wq_where), first seen first."""
    out: List[Tuple[int, int]] = []
    for r in rows:
        where = record.parse_where(r.get("peak_wq_where"))
        if where is not None and where not in out:
            out.append(where)
    return out


def make_plots(rows, histories: Dict[str, Dict], pdir: Path) -> Dict[str, Path]:
    shared, note = R.shared_overrides(rows)  # said once in each plot, not in every label
    labels = [R._label(r, shared) for r in rows]
    labelled = [(lab, histories.get(r.get("mlflow_run_id"), {})) for lab, r in zip(labels, rows)]
    div = {lab: r.get("divergence_step") for lab, r in zip(labels, rows)}
    window = _fork_window(rows)
    made = (("loss_curves", plots.loss_curves(labelled, pdir / "loss_curves.png", div, window=window, note=note)),
            ("wq_spectral_norm", plots.wq_spectral_norms(labelled, pdir / "wq_spectral_norm.png", window=window,
                                                         named=verdict_heads(rows), note=note)),
            ("repeated_maxima", plots.repeated_maxima(labelled, pdir / "repeated_maxima.png", window=window,
                                                      note=note)),
            ("probes", plots.probes(labelled, pdir / "probes.png", note=note)),
            ("delays", plots.delays(_delay_items(rows, labels), pdir / "delays.png", note=note)))
    return {name: p for name, p in made if p is not None}


# ------------------------------------------------------------------------------------------------ write
def _experiments(uri: Optional[str], rows, parent_run_id: Optional[str]) -> Dict[str, str]:
    """{run id: experiment id} of the rows' runs and the parent (for links); runs MLflow does not have are left out."""
    if not uri:
        return {}
    ids = [r["mlflow_run_id"] for r in rows if r.get("mlflow_run_id")] + ([parent_run_id] if parent_run_id else [])
    if not ids:
        return {}
    out = {}
    try:
        client = readback.client_for(uri)  # reading: never creates a store
    except Exception as e:
        print(f"[report] no run links: {uri} not readable ({e})")
        return {}
    for rid in ids:
        try:
            out[rid] = retry(client.get_run, rid).info.experiment_id
        except Exception:
            pass
    return out


def write_report(rows: List[Dict], out_dir: os.PathLike, tracking_uri: Optional[str] = None,
                 meta: Optional[Dict] = None, parent_run_id: Optional[str] = None, sweep: Optional[str] = None,
                 histories: Optional[Dict[str, Dict]] = None, echo: bool = True,
                 cause: Optional[Dict] = None, offline: bool = False, fork_rule: str = "recorded"
                 ) -> Dict[str, Path]:
    """Write verdicts.md, verdicts.html, verdicts.json and plots/*.png into out_dir; log them to the parent run if
    given (report/verdicts.{md,json}, plots/, verdicts.html at the root). cause: the localization's verdict
    (orchestrator/analysis/localize/rounding_io.cause), rendered as the Cause section, its files logged under report/.
    offline: open no MLflow store (histories come from a compact export: report --histories).
    fork_rule: "recorded" (each fork's verdict as its run gave it) or "source" (forks that ran with a fresh detector
    re-judged from the histories as verdict.fork_baseline=source would: orchestrator/report/rejudge.py).
    Returns {'md', 'json', 'html', <plot name>...: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = sweep or out_dir.name
    uri = None if offline else resolve_uri(tracking_uri) if tracking_uri is not None or any(
        r.get("mlflow_run_id") for r in rows) else None
    if fork_rule not in rejudge.RULES:
        raise ValueError(f"fork_rule={fork_rule!r} is not allowed: expected one of {', '.join(rejudge.RULES)}")
    rows = [dict(r) for r in rows]
    if histories is None:
        try:
            histories = readback.load_histories(uri, rows) if uri else {}
        except Exception as e:  # the table is still worth writing without curves
            print(f"[report] could not read metric histories from {uri}: {e}")
            histories = {}
    if fork_rule == "source":
        rejudge.source_verdicts(rows, histories)
    rows = R.compare(rows)
    for r in rows:
        if note := rejudge.note(r):
            r["vs_baseline"] = "; ".join(x for x in (r.get("vs_baseline"), note) if x)
    meta = {**run_meta(uri), **(meta or {})}
    if fork_rule == "source":
        kept = [r for r in rows if str(r.get("fork_rule", "")).startswith("fresh (")]
        forks = [r for r in rows if isinstance(r.get("fork_step"), int)]
        meta["fork_rule"] = ("source: each fork judged from its source's detector at the fork step (re-judged from "
                             "the histories where it ran fresh)"
                             + (f"; NOT applied to {len(kept)} of {len(forks)} fork(s), which keep their own "
                                f"verdict: {kept[0]['fork_rule'][len('fresh ('):-1]}" if kept else "")
                             if forks else "source: no fork among the runs, nothing re-judged")
        if not forks:  # the flag did nothing: said, not left to read as if it had re-judged something
            print("[report] --fork-baseline source: no fork among the runs (no fork_step); nothing was re-judged")
        if kept:
            print(f"[report] --fork-baseline source: {len(kept)} of {len(forks)} fork(s) keep their own verdict "
                  f"({kept[0]['fork_rule']}); give the histories (--tracking-uri or --histories)")
        for r in kept:  # said in the row too, where the table is read
            r["vs_baseline"] = "; ".join(x for x in (r.get("vs_baseline"), f"not re-judged: {r['fork_rule']}") if x)
    if parent_run_id:
        meta["parent_run_id"] = parent_run_id
    fork_health.annotate(rows, histories, lambda r: R._peer(r, rows, R.BASELINE),
                         lambda r: R._peer(r, rows, R.REFERENCE))
    experiments = _experiments(uri, rows, parent_run_id)
    if meta.get("experiment_id") is None:
        meta["experiment_id"] = experiments.get(parent_run_id) or next(iter(experiments.values()), None)
    if uri and experiments:  # every run's judged verdict and colour; a sweep's verdicts view
        try:
            meta["share_key"] = verdict_view.publish(make_client(uri), rows, experiments, parent_run_id)
            meta["compare_ids"] = [r["mlflow_run_id"] for r in rows if r.get("mlflow_run_id") in experiments]
        except Exception as e:  # the report is still worth writing
            print(f"[report] verdict tags not written to {uri}: {type(e).__name__}: {e}")
    plot_paths = make_plots(rows, histories, out_dir / "plots")
    paths = {"md": out_dir / "verdicts.md", "json": out_dir / "verdicts.json", "html": out_dir / "verdicts.html",
             **plot_paths}
    probes_md = probe_table.write(rows, histories, out_dir)  # the mechanism per layer before the divergence
    if probes_md is not None:
        paths["probes_md"] = probes_md
    doc = {"sweep": sweep, "meta": meta, "runs": [{k: r.get(k) for k in R.ROW_KEYS} for r in rows],
           "summary": {"runs": len(rows), "matches_paper": sum(1 for r in rows if r["matches_paper"]),
                       "void": sum(1 for r in rows if r.get("paper_void")),
                       "failed": sum(1 for r in rows if r["observed"] == "failed")},
           "plots": {k: str(p) for k, p in plot_paths.items()}}
    if cause:
        doc["cause"] = cause["verdict"]
    paths["json"].write_text(json.dumps(_finite(doc), indent=2, default=str, allow_nan=False))
    base = links.ui_base(uri, meta.get("ui_url")) if uri else None
    urls = run_urls(rows, experiments, base) if uri else None
    paths["md"].write_text(_markdown(rows, meta, plot_paths, out_dir, sweep, urls, cause=cause))
    items = ([[("Cause: ", False), (cause["verdict"], False)]] if cause else []) + meta_items(rows, meta)
    html_plots = {**plot_paths, **({"rounding points": Path(cause["plot"])} if cause and cause.get("plot") else {})}
    paths["html"].write_text(report_html.render(sweep, rows, _table(rows), items, html_plots, urls,
                                                _mlflow_lines(meta), alarm_view.lines(rows)))
    if parent_run_id and uri:
        client = make_client(uri)
        with tempfile.TemporaryDirectory() as tmp:  # the copy for MLflow's viewer: UI routes, not disk paths
            md = Path(tmp) / "verdicts.md"
            exp = experiments.get(parent_run_id) or meta.get("experiment_id")
            md.write_text(_markdown(
                rows, meta, plot_paths, out_dir, sweep, run_urls(rows, experiments, None),
                plot_line=lambda name, p: _mlflow_plot_line(name, p, exp, parent_run_id,
                                                            "report" if cause and p == cause.get("plot") else "plots"),
                cause=cause))
            retry(client.log_artifact, parent_run_id, str(md), "report")
        for f in (cause or {}).get("files", ()):
            retry(client.log_artifact, parent_run_id, str(f), "report")
        retry(client.log_artifact, parent_run_id, str(paths["json"]), "report")
        if "probes_md" in paths:
            retry(client.log_artifact, parent_run_id, str(paths["probes_md"]), "report")
        retry(client.log_artifact, parent_run_id, str(paths["html"]))
        for name in plot_paths:
            retry(client.log_artifact, parent_run_id, str(paths[name]), "plots")
        from mlflow.entities import RunTag
        key = meta.get("share_key")
        view = links.view_route(exp, key) if key else None
        ids = meta.get("compare_ids") or []
        cmp = links.compare_route(exp, ids) if len(ids) > 1 else None
        std = {**source_tags(), "mlflow.note.content": parent_note(sweep, rows, run_urls(rows, experiments, None),
                                                                   view, cmp)}
        retry(client.log_batch, parent_run_id, tags=_summary_tags(doc["summary"]) +
               [RunTag(k, str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in std.items()])
    if echo:
        print(format_table(rows))
        print(f"\nReport: {paths['md']}\n        {paths['html']} (one page, opens offline)"
              + (f"\n        {paths['probes_md']} (the mechanism probes per layer)" if "probes_md" in paths else ""))
        if uri:
            single = parent_run_id is None and len(experiments) == 1
            print("\n".join(links.link_lines(uri, meta.get("experiment_id"),
                                             parent_run_id or (next(iter(experiments)) if single else None),
                                             "parent run" if parent_run_id else "run", meta.get("ui_url"),
                                             meta.get("share_key"), meta.get("compare_ids") or ())))
    return paths


__all__ = ["write_report", "format_table", "make_plots", "meta_items", "run_urls"]
