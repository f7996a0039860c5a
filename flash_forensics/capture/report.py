"""The analysis as Markdown, self-contained HTML (plots as base64 PNG) and JSON; optionally an MLflow run."""
from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from pathlib import Path
from typing import List

import torch

from flash_forensics.orchestrator.tracking.store import get_or_create_experiment, retry


def pct(share: float) -> str:
    """A share of identical elements as a percentage that never reads 100% unless it is exactly 1."""
    if share == 1.0:
        return "100%"
    text = f"{100 * share:.2f}%"
    return text if text != "100.00%" else f"{100 * share:.6f}%"

def _g(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return format(x, spec)


def _finite(x):
    """Strict JSON: a NaN or infinite number (a share of a zero sum, t of a zero spread) becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def to_json(res: dict) -> dict:
    """The result without its tensors (the plots' inputs), NaN and infinities as null."""
    return _finite({k: v for k, v in res.items() if not k.startswith("_")})


def _meta_lines(res: dict) -> List[str]:
    m = res["meta"]
    v = m.get("versions") or {}
    sh = m.get("shape") or {}
    return [f"- file: `{res['file']}`" + (f" ({res['file_bytes'] / 2**20:.2f} MiB)" if res.get("file_bytes") else ""),
            f"- captured: family `{m.get('family')}`, layer {m.get('layer')}, heads {m.get('heads')} of "
            f"{m.get('n_head')}, step {m.get('step')}, implementation `{m.get('implementation') or '-'}`, recipe "
            f"`{m.get('recipe') or '-'}`",
            f"- shape B={sh.get('B')} T={sh.get('T')} D={sh.get('D')}; dtypes {m.get('dtypes')}; device "
            f"`{m.get('device')}`; torch {v.get('torch')}, triton {v.get('triton')}; commit `{m.get('git_commit')}`;"
            f" written {m.get('created_utc')}",
            f"- analysed as `{res['recipe']}`; heads {res['heads']['chosen']} ({res['heads']['how']}; tie rows per "
            f"head in the file: {res['heads']['tie_rows']})"]


def _equivalent(fpr: dict) -> str:
    same = [c["label"] for c in fpr["candidates"] if c.get("o_differ") == 0 and c.get("lse_differ") in (None, 0)]
    if len(same) < 2:
        return ""
    return (f" {len(same)} candidates reproduce it bit for bit, so on this input they cannot be told apart: "
            + ", ".join(f"`{x}`" for x in same[:8]) + (", ..." if len(same) > 8 else "") + ".")


def markdown(res: dict) -> str:
    out = ["# Attention capture analysis", ""] + _meta_lines(res) + [""]
    for n in res["notes"]:
        out.append(f"> {n}")
    if res["notes"]:
        out.append("")
    fpr = res.get("fingerprint") or {}
    if fpr.get("candidates"):
        best = fpr["candidates"][0]
        out += ["## Fingerprint: which recipe reproduces the captured O", "",
                (f"**{best['label']}** reproduces the captured O bit for bit" if fpr["exact"] else
                 f"No candidate reproduces it bit for bit; closest: **{best['label']}** "
                 f"({pct(best['o_identical'])} of O elements identical: {best.get('o_differ')} of "
                 f"{best.get('o_elements')} differ; mean |diff| "
                 f"{best['o_mean_abs_diff']:.3g}): the nearest emulated computation, not proof of what the kernel "
                 "does (candidates marked refined combine variants greedily)") + f" (heads {fpr['heads']}"
                + (f"; heads {fpr['unchecked_heads']} NOT checked" if fpr.get("unchecked_heads") else "")
                + f", {len(fpr['candidates'])} "
                "candidates from flash_forensics.kernels.recipes.RECIPES and the knob table)." + _equivalent(fpr), "",
                "| rank | candidate | O identical | lse identical | mean abs diff | max abs diff |",
                "|---:|---|---:|---:|---:|---:|"]
        for i, c in enumerate(fpr["candidates"][:15], 1):
            lse = "-" if c["lse_identical"] is None else pct(c["lse_identical"])
            mark = " (the file says)" if c.get("is_base") else " (refined)" if c.get("refined") else ""
            out.append(f"| {i} | `{c['label']}`{mark} | "
                       f"{pct(c['o_identical'])} | {lse} | "
                       f"{c['o_mean_abs_diff']:.3g} | {c['o_max_abs_diff']:.3g} |")
        if len(fpr["candidates"]) > 15:
            out.append(f"| | ({len(fpr['candidates']) - 15} more in the JSON) | | | | |")
        out.append("")
        if fpr.get("backward"):
            out += ["The kernel's own backward against the emulator's under the best candidate (from the captured O, "
                    "dO): " + ", ".join(f"{n} {pct(x)} identical" for n, x in fpr["backward"].items()) + ".", ""]
    out += ["## Per head: ties and the delta error against FP64", "",
            "| head | rows | tie rows | exact in FP32 | created by rounding | P̄=1 tie rows | delta err mean | t | "
            "tie share (signed) | tie share (abs) | dQ rel err | dK rel err | dQ rel err from delta | "
            "cos(dQ err, from delta) | W_Q proj | W_Q proj from delta |", "|" + "---:|" * 16]
    for r in res["per_head"]:
        d = r.get("delta") or {}
        out.append(f"| {r['head']} | {r['rows']} | {r['tie_rows']} | {r['tie_exact']} | {r['tie_bf16']} | "
                   f"{r['pbar1_rows']} | {_g(d.get('mean'))} | {_g(d.get('t'), '.2f')} | "
                   f"{_g(d.get('tie_share_signed'), '.2f')} | {_g(d.get('tie_share_abs'), '.2f')} | "
                   f"{_g(r.get('dq_rel_err'))} | {_g(r.get('dk_rel_err'))} | {_g(r.get('dq_rel_err_from_delta'))} "
                   f"| {_g(r.get('dq_err_cos_delta'), '.2f')} | {_g(r.get('wq_err_proj'))} | "
                   f"{_g(r.get('wq_err_proj_from_delta'))} |")
    out += ["", "W_Q proj: u1^T E v1 of the W_Q gradient error E on W_Q's top singular pair (negative: the error "
            "grows sigma_1 under descent).", ""]
    att = res.get("attribution")
    if att:
        b = att["base"]
        out += ["## Attribution per rounding point", "", f"**{att['sentence']}**", "",
                f"Base as captured (`{b['label']}`): mean {b['mean']:.3g}, t {b['t']:.2f}; fp32 (nothing "
                f"rounded): mean {att['fp32']['mean']:.3g}, t {att['fp32']['t']:.2f}. Delta error over the "
                f"analysed heads together; dQ rel err per head.", "",
                "| head | delta err mean | t | p | p (Holm over the heads) | significant |",
                "|---:|---:|---:|---:|---:|---|"]
        for h in att.get("head_tests") or []:
            out.append(f"| {h['head']} | {_g(h['mean'])} | {_g(h['t'], '.2f')} | {_g(h['p'], '.2g')} | "
                       f"{_g(h['p_holm'], '.2g')} | {'yes' if h['significant'] else 'no'} |")
        out += ["",
                "| point | lifted alone: mean | t | dQ rel err | rounded alone (rest FP32): mean | t | dQ rel err |",
                "|---|---:|---:|---|---:|---:|---|"]
        for r in att["points"]:
            cells = []
            for kind in ("lift", "round"):
                s = r[kind]
                if s.get("state") != "run":
                    cells += [f"n/a ({s.get('why', '')[:60]})", "", ""]
                else:
                    cells += [_g(s["mean"]), _g(s["t"], ".2f"), ", ".join(_g(x) for x in s["dq_rel_err"])]
            out.append(f"| `{r['point']}`{' (backward only)' if r['backward_only'] else ''} | " + " | ".join(cells)
                       + " |")
        out.append("")
    tm = res.get("timing") or {}
    out += ["Timing (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in tm.items()) + "."]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ plots
def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(res: dict) -> List[tuple]:
    """(title, base64 PNG) for each plot the result supports."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    e, tie = res.get("_e"), res.get("_tie")
    if e is not None:
        fig, axes = plt.subplots(1, e.shape[1], figsize=(4.5 * e.shape[1], 3), squeeze=False)
        for j, ax in enumerate(axes[0]):
            ej, tj = e[:, j].reshape(-1).float(), tie[:, j].reshape(-1)
            ax.plot(torch.cumsum(ej, 0).numpy(), lw=1, label="all rows")
            ax.plot(torch.cumsum(torch.where(tj, ej, torch.zeros_like(ej)), 0).numpy(), lw=1, label="tie rows")
            ax.set_title(f"head {res['per_head'][j]['head']}: cumulative delta error")
            ax.set_xlabel("row (batch-major)")
            ax.legend(fontsize=7)
        out.append(("Cumulative delta error (recipe - FP64) over rows; the tie rows' part", _png(fig)))
    att = res.get("attribution")
    if att:
        pts = [r["point"] for r in att["points"]]
        lift = [r["lift"]["t"] if r["lift"].get("state") == "run" else float("nan") for r in att["points"]]
        rnd = [r["round"]["t"] if r["round"].get("state") == "run" else float("nan") for r in att["points"]]
        fig, ax = plt.subplots(figsize=(9, 3.2))
        xs = range(len(pts))
        ax.bar([x - 0.2 for x in xs], lift, 0.4, label="lifted alone")
        ax.bar([x + 0.2 for x in xs], rnd, 0.4, label="rounded alone (rest FP32)")
        ax.axhline(att["base"]["t"], color="k", lw=0.8, ls="--", label="base")
        ax.set_xticks(list(xs), pts, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("t of the delta error")
        ax.legend(fontsize=7)
        out.append(("Attribution: the delta error's t per rounding point", _png(fig)))
    fpr = (res.get("fingerprint") or {}).get("candidates") or []
    if fpr:
        top = fpr[:15][::-1]
        fig, ax = plt.subplots(figsize=(7, 0.28 * len(top) + 1))
        ax.barh([c["label"] for c in top], [100 * c["o_identical"] for c in top])
        ax.set_xlabel("% of O elements identical")
        ax.tick_params(axis="y", labelsize=7)
        out.append(("Fingerprint: candidates by identical O elements", _png(fig)))
    return out


def _md_to_html(md: str) -> str:
    """A small Markdown subset (headings, tables, lists, quotes, paragraphs) to HTML."""
    import re
    lines, out, table = md.splitlines(), [], []

    def inline(s):
        s = html.escape(s)
        s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", s)

    def close_table():
        if table:
            rows = [r for r in table if not re.fullmatch(r"\|[-:|]+\|?", r.replace(" ", ""))]
            cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in cells[0]) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in cells[1:])
                       + "</table>")
            table.clear()
    for ln in lines:
        if ln.startswith("|"):
            table.append(ln)
            continue
        close_table()
        if ln.startswith("#"):
            n = len(ln) - len(ln.lstrip("#"))
            out.append(f"<h{n}>{inline(ln[n:].strip())}</h{n}>")
        elif ln.startswith("- "):
            out.append(f"<li>{inline(ln[2:])}</li>")
        elif ln.startswith("> "):
            out.append(f"<blockquote>{inline(ln[2:])}</blockquote>")
        elif ln.strip():
            out.append(f"<p>{inline(ln)}</p>")
    close_table()
    return "\n".join(out)


def html_page(res: dict) -> str:
    body = _md_to_html(markdown(res))
    figs = "".join(f"<h3>{html.escape(t)}</h3><img alt='{html.escape(t)}' src='data:image/png;base64,{b}'>"
                   for t, b in plots(res))
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;font-size:14px}table{border-collapse:"
             "collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
             "th{background:#f3f3f3}code{background:#f6f6f6}blockquote{color:#555;border-left:3px solid #ccc;"
             "margin:0.5em 0;padding-left:1em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>flash-forensics capture analysis</title>"
            f"<style>{style}</style></head><body>{body}<h2>Plots</h2>{figs}</body></html>")


def write_all(res: dict, out_dir, stem: str) -> dict:
    """<out_dir>/<stem>.md, .html, .json; returns the paths by kind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / f"{stem}.md", "html": out_dir / f"{stem}.html", "json": out_dir / f"{stem}.json"}
    paths["md"].write_text(markdown(res))
    paths["html"].write_text(html_page(res))
    paths["json"].write_text(json.dumps(to_json(res), indent=2, default=str, allow_nan=False) + "\n")
    return paths


def log_mlflow(res: dict, uri: str, client, paths: dict, experiment: str = "flash-forensics-capture") -> str:
    """One MLflow run: the headline numbers as metrics, the recipe and file as params, the three reports as
    artifacts. The experiment is a model-training one (not MLflow's GenAI mode) with its artifacts beside a sqlite
    store (not ./mlruns of the current folder). Returns the run id."""
    from mlflow.entities import Metric, Param

    exp_id = get_or_create_experiment(client, experiment, uri)
    run = retry(client.create_run, exp_id, run_name=f"capture {Path(res['file']).name}")
    run_id = run.info.run_id
    m = res["meta"]
    params = {"file": res["file"], "recipe": res["recipe"], "family": m.get("family"), "layer": m.get("layer"),
              "heads": ",".join(map(str, res["heads"]["chosen"])),
              "fingerprint_best": (res.get("fingerprint") or {}).get("best")}
    metrics = {}
    for r in res["per_head"]:
        h = r["head"]
        metrics[f"tie_rows/H{h}"] = r["tie_rows"]
        if r.get("delta"):
            metrics[f"delta_err_mean/H{h}"] = r["delta"]["mean"]
            metrics[f"delta_err_t/H{h}"] = r["delta"]["t"]
    fpr = (res.get("fingerprint") or {}).get("candidates") or []
    if fpr:
        metrics["fingerprint_o_identical"] = fpr[0]["o_identical"]
    now = int(time.time() * 1000)
    retry(client.log_batch, run_id, params=[Param(k, str(v)) for k, v in params.items()],
          metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()
                   if v is not None and math.isfinite(float(v))])
    for p in paths.values():
        retry(client.log_artifact, run_id, str(p))
    retry(client.set_terminated, run_id, "FINISHED")
    return run_id


__all__ = ["markdown", "html_page", "plots", "write_all", "to_json", "log_mlflow"]
