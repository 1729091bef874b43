"""The reproducibility board: every results/<id>-<scale>.json as REPORT.md and a self-contained index.html."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from .claims import ERROR, NOT_REPRODUCED, PARTIAL, REPRODUCED

COLOURS = {REPRODUCED: "#2e7d32", PARTIAL: "#ef8f00", NOT_REPRODUCED: "#757575", ERROR: "#c62828"}
COLUMNS = ["Paper", "Scale", "Claim", "Paper's number", "Ours", "Expectation", "Verdict"]


def load_results(results_dir="results") -> list[dict]:
    """All result files, sorted by paper then scale; files that are not results are ignored."""
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "paper" in data and "claims" in data:
            results.append(data)
    return sorted(results, key=lambda r: (r["paper"], r["scale"]))


def fmt(value) -> str:
    """Our number, rounded for reading (the exact value stays in the JSON)."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _rows(result: dict) -> list[list[str]]:
    rows = []
    for c in result["claims"]:
        expect = c["expect"] + (f" (partial: {c['partial']})" if c.get("partial") else "")
        verdict = c["verdict"] + (f": {c['reason']}" if c.get("reason") else "")
        paper_value = "—" if c.get("paper_value") is None else str(c["paper_value"])
        rows.append([result["paper"], result["scale"], c["id"], paper_value, fmt(c.get("ours")), expect, verdict])
    return rows


def _error_text(result: dict) -> str | None:
    e = result.get("error")
    if not e:
        return None
    return f"notebook failed in cell {e['cell']} ({result['notebook']}): {e['ename']}: {e['evalue']}"


def markdown(results: list[dict]) -> str:
    md_cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    lines = ["# Reproducibility report", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        lines += ["| " + " | ".join(md_cell(x) for x in row) + " |" for row in _rows(r)]
    lines.append("")
    for r in results:
        lines += [f"## {r['paper']} ({r['scale']}): {r['verdict']}", "",
                  f"{r.get('method', '')} — seed {r.get('seed')}, device {r.get('device')}, "
                  f"{r.get('wall_seconds')} s, {r.get('timestamp')}", ""]
        if _error_text(r):
            lines += [f"**Error:** {md_cell(_error_text(r))}", ""]
        lines += [f"![{Path(f).stem}]({f})" for f in r.get("figures", [])] + [""]
    return "\n".join(lines)


def _img(results_dir: Path, figure: str) -> str:
    path = results_dir / figure
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(figure)}" src="data:image/png;base64,{data}">'


def html_page(results: list[dict], results_dir: Path) -> str:
    e = html.escape
    parts = ["<!doctype html><meta charset='utf-8'><title>fedlab_nb reproducibility report</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}img{max-width:32em;margin:4px}"
             ".v{color:white;font-weight:bold}.err{color:#c62828;white-space:pre-wrap}</style>",
             "<h1>Reproducibility report</h1>"]
    for r in results:
        colour = COLOURS.get(r["verdict"], "#000")
        parts.append(f"<h2>{e(r['paper'])} ({e(r['scale'])}) — "
                     f"<span style='color:{colour}'>{e(r['verdict'])}</span></h2>")
        parts.append(f"<p>{e(str(r.get('method', '')))}<br>seed {e(str(r.get('seed')))}, "
                     f"device {e(str(r.get('device')))}, {e(str(r.get('wall_seconds')))} s, "
                     f"{e(str(r.get('timestamp')))}, commit {e(str(r.get('git_commit')))}</p>")
        if _error_text(r):
            parts.append(f"<p class='err'>{e(_error_text(r))}</p>")
        parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in COLUMNS[2:]) + "</tr>")
        for claim, row in zip(r["claims"], _rows(r)):
            cells = "".join(f"<td>{e(x)}</td>" for x in row[2:-1])
            colour = COLOURS.get(claim["verdict"], "#000")
            parts.append(f"<tr>{cells}<td class='v' style='background:{colour}'>{e(row[-1])}</td></tr>")
        parts.append("</table>")
        parts.append("<div>" + "".join(_img(results_dir, f) for f in r.get("figures", [])) + "</div>")
    return "\n".join(parts) + "\n"


def build_report(results_dir="results") -> str:
    """Write REPORT.md and index.html into `results_dir`; returns the markdown."""
    results_dir = Path(results_dir)
    results = load_results(results_dir)
    text = markdown(results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "REPORT.md").write_text(text)
    (results_dir / "index.html").write_text(html_page(results, results_dir))
    return text
