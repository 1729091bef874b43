"""The reproducibility board: every results/<id>-<scale>.json as REPORT.md and a self-contained index.html."""
from __future__ import annotations

import base64
import html
from pathlib import Path
from urllib.parse import quote

from .claims import ERROR, INCONCLUSIVE, NOT_REPRODUCED, PARTIAL, REPRODUCED
from .results import STALE, read_result, result_files, safe_figure, stale_result
from .verdicts import summary_text

COLOURS = {REPRODUCED: "#2e7d32", PARTIAL: "#ef8f00", NOT_REPRODUCED: "#757575", INCONCLUSIVE: "#5c6bc0",
           ERROR: "#c62828", STALE: "#6d4c41"}
COLUMNS = ["Paper", "Scale", "Claim", "Paper's number", "Ours", "Expectation", "Verdict"]


def load_results(results_dir="results") -> list[dict]:
    """All results/<id>-<scale>.json, sorted by paper then scale; a corrupt one becomes a stale entry."""
    results = []
    for path, paper_id, scale in result_files(results_dir):
        data, problem = read_result(path)
        results.append(data if problem is None else stale_result(paper_id, scale, path, problem))
    return sorted(results, key=lambda r: (r["paper"], r["scale"]))


def fmt(value) -> str:
    """Our number, rounded for reading (the exact value stays in the JSON)."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):  # per-seed values of a claim without an interval (e.g. an error row)
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def ours(claim: dict) -> str:
    """Our number: mean ± half-width (n, confidence) for a seeded claim, else the single value."""
    return summary_text(claim.get("interval")) or fmt(claim.get("ours"))


def _rows(result: dict) -> list[list[str]]:
    if result["verdict"] == STALE:  # one row, so a corrupt result cannot vanish from the table
        return [[result["paper"], result["scale"], "—", "—", "—", "—", f"{STALE}: corrupt result file"]]
    rows = []
    for c in result["claims"]:
        expect = c["expect"] + (f" (partial: {c['partial']})" if c.get("partial") else "")
        verdict = c["verdict"] + (f": {c['reason']}" if c.get("reason") else "")
        paper_value = "—" if c.get("paper_value") is None else str(c["paper_value"])
        rows.append([result["paper"], result["scale"], c["id"], paper_value, ours(c), expect, verdict])
    return rows


def _error_text(result: dict) -> str | None:
    if result.get("stale"):
        return result["stale"]
    e = result.get("error")
    if not isinstance(e, dict):
        return None
    return (f"notebook failed in cell {e.get('cell')} ({result.get('notebook')}): "
            f"{e.get('ename')}: {e.get('evalue')}")


def md_text(s) -> str:
    """Text for REPORT.md: no raw HTML (& and < escaped, as in index.html), no links, one line, no cell breaks."""
    s = str(s).replace("&", "&amp;").replace("<", "&lt;").replace("](", "]\\(").replace("][", "]\\[")
    s = "\\" + s if s.startswith("[") else s  # '[x]: url' at a line start would define a link
    return s.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _figures(result: dict, results_dir) -> list[tuple[str, Path]]:
    """(name, file) of the result's figures that are PNGs inside the results folder; others are skipped."""
    named = result.get("figures")
    named = named if isinstance(named, list) else []
    return [(f, p) for f in named if (p := safe_figure(results_dir, f)) is not None]


def markdown(results: list[dict], results_dir=None) -> str:
    md_cell = md_text
    lines = ["# Reproducibility report", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        lines += ["| " + " | ".join(md_cell(x) for x in row) + " |" for row in _rows(r)]
    lines.append("")
    for r in results:
        lines += [f"## {md_cell(r['paper'])} ({md_cell(r['scale'])}): {md_cell(r['verdict'])}", "",
                  md_cell(f"{r.get('method', '')} — seed {r.get('seed')}, device {r.get('device')}, "
                          f"{r.get('wall_seconds')} s, {r.get('timestamp')}"), ""]
        if _error_text(r):
            lines += [f"**Error:** {md_cell(_error_text(r))}", ""]
        figures = _figures(r, results_dir) if results_dir is not None else []
        lines += [f"![{md_cell(Path(f).stem)}]({quote(Path(f).as_posix())})" for f, _ in figures] + [""]
    return "\n".join(lines)


def _img(figure: str, path: Path) -> str:
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
        for claim, row in zip(r["claims"] or [{"verdict": r["verdict"]}], _rows(r)):
            cells = "".join(f"<td>{e(x)}</td>" for x in row[2:-1])
            colour = COLOURS.get(claim["verdict"], "#000")
            parts.append(f"<tr>{cells}<td class='v' style='background:{colour}'>{e(row[-1])}</td></tr>")
        parts.append("</table>")
        parts.append("<div>" + "".join(_img(f, p) for f, p in _figures(r, results_dir)) + "</div>")
    return "\n".join(parts) + "\n"


def build_report(results_dir="results") -> str:
    """Write REPORT.md and index.html into `results_dir`; returns the markdown."""
    results_dir = Path(results_dir)
    results = load_results(results_dir)
    text = markdown(results, results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "REPORT.md").write_text(text)
    (results_dir / "index.html").write_text(html_page(results, results_dir))
    return text
