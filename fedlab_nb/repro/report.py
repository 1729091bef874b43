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


def chapter(paper_id: str) -> tuple[int, str]:
    """(order, title) of the course lesson a paper belongs to (docs/syllabus.md), or the end for others."""
    from .course import LESSONS, CourseError, lesson_of
    try:
        lesson = lesson_of(paper_id)
    except CourseError:
        return len(LESSONS), "Other"
    return LESSONS.index(lesson), lesson.title


def summary_counts(results: list[dict]) -> dict:
    """{"papers": {verdict: n}, "claims": {verdict: n}} over all results."""
    papers, claims = {}, {}
    for r in results:
        papers[r["verdict"]] = papers.get(r["verdict"], 0) + 1
        for c in r.get("claims") or []:
            claims[c["verdict"]] = claims.get(c["verdict"], 0) + 1
    return {"papers": papers, "claims": claims}


def summary_lines(results: list[dict]) -> list[str]:
    """A few lines for the terminal and the top of the board: counts of papers and claims per verdict."""
    counts = summary_counts(results)
    line = lambda d: ", ".join(f"{n} {v}" for v, n in sorted(d.items(), key=lambda kv: -kv[1])) or "none"
    return [f"{len(results)} results: {line(counts['papers'])}",
            f"{sum(counts['claims'].values())} claims: {line(counts['claims'])}"]


def references(claim: dict, metrics: dict) -> str:
    """The values of the other metrics a claim's expectation refers to, e.g. 'fedavg_acc = 0.81'."""
    from .expect import ExpectationError, parse_expectation
    try:
        names = sorted(parse_expectation(claim.get("expect") or "").names)
    except ExpectationError:
        return ""
    return "; ".join(f"{n} = {_short(metrics.get(n))}" for n in names if n in (metrics or {}))


def _short(value) -> str:
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return f"{sum(value) / len(value):.4g} (mean of {len(value)})"
    return fmt(value)


def markdown(results: list[dict], results_dir=None) -> str:
    md_cell = md_text
    lines = ["# Reproducibility report", "", *[f"- {md_cell(x)}" for x in summary_lines(results)], ""]
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
        lines += [f"- **{md_cell(c['id'])}** ({md_cell(c['verdict'])}): {md_cell(c['note'])}"
                  for c in r.get("claims") or [] if c.get("note") and c["verdict"] != REPRODUCED]
        figures = _figures(r, results_dir) if results_dir is not None else []
        lines += [""] + [f"![{md_cell(Path(f).stem)}]({quote(Path(f).as_posix())})" for f, _ in figures] + [""]
    return "\n".join(lines)


def _img(figure: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img tabindex="0" alt="{html.escape(figure)}" title="click to enlarge" src="data:image/png;base64,{data}">'


STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:78em;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;width:100%;margin:.5em 0}td,th{border:1px solid #ddd;padding:4px 8px;"
         "text-align:left;vertical-align:top}th{background:#f5f5f5}.v{color:white;font-weight:bold;white-space:nowrap}"
         ".err{color:#c62828;white-space:pre-wrap}.note{color:#555;font-size:.92em;background:#fafafa}"
         ".figs img{width:100%;max-width:60em;cursor:zoom-in;display:block;margin:.5em 0;border:1px solid #eee}"
         ".figs img:focus{max-width:none;cursor:zoom-out;outline:none}.muted{color:#666;font-size:.9em}"
         ".summary td,.summary th{text-align:center}.summary td:first-child{text-align:left}"
         "input.f{display:none}label.f{margin:0 .3em .3em 0;padding:.3em .8em;border:1px solid #bbb;"
         "border-radius:1em;cursor:pointer;display:inline-block}input.f:checked+label.f{background:#333;color:#fff}")


def _filter_css(verdicts: list[str]) -> str:
    """Pure-CSS filter (no script in the page): the checked radio hides every paper of another verdict."""
    return "".join(f"#f{i}:checked~main .paper:not([data-v='{v}']){{display:none}}" for i, v in enumerate(verdicts))


def _summary_table(results: list[dict]) -> str:
    """Chapters × verdicts: how many papers of each lesson got each verdict, with links to the papers."""
    e, verdicts = html.escape, [REPRODUCED, PARTIAL, INCONCLUSIVE, NOT_REPRODUCED, ERROR, STALE]
    rows, by_chapter = [], {}
    for r in results:
        by_chapter.setdefault(chapter(r["paper"]), []).append(r)
    head = "".join(f"<th style='color:{COLOURS[v]}'>{e(v)}</th>" for v in verdicts)
    for (_, title), group in sorted(by_chapter.items()):
        cells = "".join(f"<td>{sum(r['verdict'] == v for r in group) or ''}</td>" for v in verdicts)
        links = ", ".join(f"<a href='#{e(r['paper'])}-{e(r['scale'])}'>{e(r['paper'])}</a>" for r in group)
        rows.append(f"<tr><td><b>{e(title)}</b><br><span class='muted'>{links}</span></td>{cells}</tr>")
    return f"<table class='summary'><tr><th>chapter</th>{head}</tr>{''.join(rows)}</table>"


def _claim_rows(r: dict) -> list[str]:
    e, out = html.escape, []
    metrics = r.get("metrics") or {}
    for claim, row in zip(r["claims"] or [{"verdict": r["verdict"]}], _rows(r)):
        colour = COLOURS.get(claim["verdict"], "#000")
        what = f"<b>{e(row[2])}</b>" + (f"<br>{e(str(claim['text']))}" if claim.get("text") else "")
        metric = e(str(claim.get("metric") or "—"))
        refs = references(claim, metrics)
        expect = e(row[5]) + (f"<br><span class='muted'>{e(refs)}</span>" if refs else "")
        out.append(f"<tr><td>{what}</td><td><code>{metric}</code></td><td>{e(row[4])}</td><td>{e(row[3])}</td>"
                   f"<td>{expect}</td><td class='v' style='background:{colour}'>{e(row[6])}</td></tr>")
        if claim.get("note") and claim["verdict"] != REPRODUCED:  # a negative result carries its explanation
            out.append(f"<tr><td class='note' colspan='6'>{e(str(claim['note']))}</td></tr>")
    return out


def html_page(results: list[dict], results_dir: Path) -> str:
    e = html.escape
    present = [v for v in COLOURS if any(r["verdict"] == v for r in results)]
    radios = "".join(f"<input class='f' type='radio' name='f' id='f{i}'><label class='f' for='f{i}'>{e(v)}</label>"
                     for i, v in enumerate(present))
    parts = ["<!doctype html><meta charset='utf-8'><title>fedlab_nb reproducibility report</title>",
             f"<style>{STYLE}{_filter_css(present)}</style>",
             "<h1>Reproducibility report</h1>",
             "<p>" + "<br>".join(e(x) for x in summary_lines(results)) + "</p>",
             _summary_table(results),
             "show: <input class='f' type='radio' name='f' id='fall' checked><label class='f' for='fall'>all</label>"
             + radios, "<main>"]
    for r in sorted(results, key=lambda r: (chapter(r["paper"]), r["paper"], r["scale"])):
        colour = COLOURS.get(r["verdict"], "#000")
        parts.append(f"<section class='paper' id='{e(r['paper'])}-{e(r['scale'])}' data-v='{e(r['verdict'])}'>")
        parts.append(f"<h2>{e(r['paper'])} ({e(r['scale'])}) — "
                     f"<span style='color:{colour}'>{e(r['verdict'])}</span></h2>")
        notebook = r.get("notebook")
        link = (f" · <a href='{e(quote(notebook))}'>executed notebook</a>"
                if isinstance(notebook, str) and not Path(notebook).is_absolute() and ".." not in Path(notebook).parts
                else "")
        parts.append(f"<p>{e(str(r.get('method', '')))}<br><span class='muted'>seed {e(str(r.get('seed')))}, "
                     f"device {e(str(r.get('device')))}, {e(str(r.get('wall_seconds')))} s, "
                     f"{e(str(r.get('timestamp')))}, commit {e(str(r.get('git_commit')))}{link}</span></p>")
        if _error_text(r):
            parts.append(f"<p class='err'>{e(_error_text(r))}</p>")
        head = ["Claim", "Metric", "Ours", "Paper's number", "Expectation", "Verdict"]
        parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in head) + "</tr>")
        parts += _claim_rows(r)
        parts.append("</table>")
        parts.append("<div class='figs'>" + "".join(_img(f, p) for f, p in _figures(r, results_dir)) + "</div>")
        parts.append("</section>")
    parts.append("</main>")
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
