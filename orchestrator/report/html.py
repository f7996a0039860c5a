"""verdicts.html: the sweep report as one self-contained page (table, header, plots as base64 PNGs, no external
file, font or script), so it opens offline in any browser and inside MLflow's artifact viewer alike.

The content is the markdown report's (orchestrator/report/render.py hands over the same table and header items);
this module only turns it into HTML: verdict cells coloured, run ids linked to the run pages, long notes wrapped.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator.report.rows import counts

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1b1b1b;max-width:1800px}
h1{font-size:22px;margin:0 0 6px} h2{font-size:17px;margin:26px 0 8px}
.summary{font-size:15px;margin:4px 0 10px} ul.meta{margin:0 0 14px;padding-left:20px;color:#333}
code{background:#f3f3f3;padding:1px 4px;border-radius:3px;font-size:12.5px;word-break:break-all}
table{border-collapse:collapse;font-size:12.5px} th,td{border:1px solid #d5d5d5;padding:4px 7px;vertical-align:top}
th{background:#f0f3f7;position:sticky;top:0;text-align:left} tr:nth-child(even) td{background:#fafafa}
td.note{max-width:420px} td.ovr{max-width:360px;word-break:break-word;font-family:monospace;font-size:11.5px}
td.yes{background:#e3f4e6 !important;color:#145a22;font-weight:600}
td.no{background:#fbe4e4 !important;color:#8a1010;font-weight:600}
td.diverged{color:#8a1010} td.stable{color:#145a22} td.failed{color:#8a1010;font-weight:600}
figure{margin:14px 0 24px} figure img{max-width:100%;border:1px solid #e2e2e2}
figcaption{font-size:12px;color:#555}
"""
_COLS = {"matches paper": lambda v: "yes" if v == "yes" else ("no" if v == "NO" else ""),
         "observed": lambda v: v if v in ("diverged", "stable", "failed") else "",
         "vs baseline": lambda v: "note", "overrides": lambda v: "ovr"}


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def _parts(parts: Sequence[Tuple[str, bool]]) -> str:
    return "".join(f"<code>{_esc(t)}</code>" if code else _esc(t) for t, code in parts)


def _img(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _inline_md(line: str) -> str:
    """The markdown of render.py's MLflow lines: `code` and [text](url) only."""
    import re
    out, pos = [], 0
    for m in re.finditer(r"`([^`]*)`|\[([^\]]*)\]\(([^)]*)\)", line):
        out.append(_esc(line[pos:m.start()]))
        out.append(f"<code>{_esc(m.group(1))}</code>" if m.group(1) is not None else
                   f'<a href="{_esc(m.group(3))}" target="_blank" rel="noopener">{_esc(m.group(2))}</a>')
        pos = m.end()
    return "".join(out) + _esc(line[pos:])


def render(sweep: str, rows: Sequence[Dict], table: List[List[str]], meta_items: List, plot_paths: Dict[str, Path],
           urls: Optional[List[Optional[str]]] = None, mlflow_lines: Sequence[str] = (),
           alarm_lines: Sequence[str] = ()) -> str:
    """The page. table: render._table's [head] + body; meta_items: render.meta_items; urls: each
    row's run page or None; alarm_lines: the live-alarm section (report/alarm_view.py: heading, summary, items)."""
    head, body = table[0], table[1:]
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta name="viewport" content="width=device-width, initial-scale=1">',
         f"<title>Verdicts: {_esc(sweep)}</title><style>{_CSS}</style></head><body>",
         f"<h1>Verdicts: {_esc(sweep)}</h1>",
         f'<p class="summary">{_esc(counts(rows))}</p>',
         '<ul class="meta">' + "".join(f"<li>{_parts(p)}</li>" for p in meta_items) + "</ul>",
         '<table id="verdicts"><thead><tr>' + "".join(f"<th>{_esc(c)}</th>" for c in head) + "</tr></thead><tbody>"]
    for i, r in enumerate(body):
        cells = []
        for name, v in zip(head, r):
            cls = _COLS.get(name, lambda _: "")(v)
            text = _esc(v)
            if name == "MLflow run" and urls and urls[i]:
                text = f'<a href="{_esc(urls[i])}" target="_blank" rel="noopener">{text}</a>'
            cells.append(f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>")
        h.append("<tr>" + "".join(cells) + "</tr>")
    h.append("</tbody></table>")
    failed = [r for r in rows if r.get("observed") == "failed"]
    if failed:
        h += ["<h2>Failed runs</h2>", "<ul>"]
        h += [f"<li>job {_esc(r.get('job'))} ({_esc(r.get('intervention'))}): "
              f"<code>{_esc((r.get('error') or '?').strip()[:2000])}</code></li>" for r in failed]
        h.append("</ul>")
    alarm = [x for x in alarm_lines if x.strip()]
    if alarm:
        h += [f"<h2>{_esc(alarm[0].lstrip('# '))}</h2>", f"<p>{_inline_md(alarm[1])}</p>", "<ul>"]
        h += [f"<li>{_inline_md(x[2:])}</li>" for x in alarm[2:]]
        h.append("</ul>")
    if plot_paths:
        h.append("<h2>Plots</h2>")
        for name, p in plot_paths.items():
            h.append(f'<figure><img alt="{_esc(name)}" src="{_img(p)}"><figcaption>{_esc(name)}</figcaption></figure>')
    lines = [x for x in mlflow_lines if x.strip()]
    if lines:
        h.append("<h2>MLflow</h2>")
        h += [f"<p>{_inline_md(x[2:] if x.startswith('- ') else x)}</p>" for x in lines[1:]]
    h.append("</body></html>")
    return "\n".join(h) + "\n"


__all__ = ["render"]
