"""The reproducibility board: every results/<id>-<scale>.json as REPORT.md and a self-contained index.html."""
from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

from .claims import (CHECK, CONSTRUCT, ERROR, HEADLINE, INCONCLUSIVE, NOT_REPRODUCED, PARTIAL, REPRODUCED, SUPPORTING,
                     beside_text, role_counts)
from .claims import ReproError, default_root, load_paper
from .results import STALE, printable_name, printable_strings, read_result, result_files, safe_figure, stale_result
from .verdicts import DEFAULT_CONFIDENCE, mean_interval, summary_text

COLOURS = {REPRODUCED: "#2e7d32", PARTIAL: "#ef8f00", NOT_REPRODUCED: "#757575", INCONCLUSIVE: "#5c6bc0",
           ERROR: "#c62828", STALE: "#6d4c41"}
PAPER_COLUMNS = ["Paper", "Scale", "Headline claim", "Paper's number", "Ours", "Setting (paper / ours)",
                 "Implementation", "Verdict", "At the paper's scale"]
COLUMNS = ["Paper", "Scale", "Role", "Claim", "Paper's number", "Ours", "Expectation", "Verdict"]
REPORT_COLUMNS = ["Paper", "Scale", "Reported", "Metric", "Ours"]


def load_results(results_dir="results", root=None) -> list[dict]:
    """All results/<id>-<scale>.json, sorted by paper then scale; a corrupt one becomes a stale entry. Each
    result also carries the paper's stored paper-scale result (ROOT/papers/paper_scale/<id>.json), if any."""
    from .files import recover_publishes
    recover_publishes(results_dir)  # a run killed while it published: its old figures go back before they are read
    results, scales_of = [], {}  # each paper's claims file read once
    for path, paper_id, scale in result_files(results_dir):
        data, problem = read_result(path)  # strings as written to REPORT.md / index.html: no terminal escapes
        if paper_id not in scales_of:
            scales_of[paper_id] = _scales(paper_id, root)
        scales = scales_of[paper_id]
        if problem is None and scales and scale not in scales:  # no run of this paper could have written it
            problem = "is at a scale the paper's claims file does not have"
        if problem is not None:
            data = stale_result(paper_id, scale, path, problem, scales)
        results.append({**printable_strings(data), "scale": printable_name(scale)})  # two files, two names
    stored = Path(root or default_root()) / "papers" / "paper_scale"
    for r in results:
        data, problem = read_result(stored / f"{r['paper']}.json")
        own = problem is None and data["paper"] == r["paper"] and data["scale"] == "paper"  # not a renamed file
        r["paper_scale_result"] = printable_strings(data) if own and r["scale"] != "paper" else None
    return sorted(results, key=lambda r: (r["paper"], r["scale"]))


def _scales(paper_id: str, root) -> tuple:
    """The scales a paper's claims file names; none when it cannot be read (then no re-run is advised)."""
    try:
        return tuple(load_paper(paper_id, root or default_root()).scales)
    except ReproError:
        return ()


def paper_scale_text(result: dict) -> str:
    """The stored paper-scale run beside a smoke result: its headline verdict and, per headline claim, ours vs
    the paper's number."""
    stored = result.get("paper_scale_result")
    if not stored:
        return "—"
    heads = [c for c in stored.get("claims") or [] if c.get("role") == HEADLINE]
    pairs = "; ".join(f"{c['id']}{_SMOKE_SIZED if c.get('at_paper_size') is False else ''}: ours {ours(c)} vs "
                      f"paper {_paper_number(c)}" for c in heads)
    label = paper_scale_label(stored)
    return f"{label} ({pairs})" if pairs else label


_SMOKE_SIZED = " [smoke size]"


def paper_scale_label(stored: dict) -> str:
    """A paper-scale result's verdict; when none of its headline claims ran at the paper's own size (the claims
    file's `paper_scale.paper_sized`), it says so: that verdict is the smoke-sized headline's."""
    heads = [c for c in stored.get("claims") or [] if c.get("role") == HEADLINE]
    if heads and all(c.get("at_paper_size") is False for c in heads):
        return f"{verdict_label(stored)} — headline claims at smoke size"
    return verdict_label(stored)


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


def reported(row: dict) -> str:
    """A reported number: a per-seed list as mean ± half-width (n, 90 % one-sided), else the value."""
    value = row.get("ours")
    if isinstance(value, list) and len(value) >= 2 and all(isinstance(v, (int, float)) for v in value):
        i = mean_interval(value, DEFAULT_CONFIDENCE)
        return f"{i.mean:.4g} ± {i.half_width:.2g} (n={i.n}, {DEFAULT_CONFIDENCE:.0%} one-sided)"
    return fmt(value)


def verdict_label(result: dict) -> str:
    """The paper's (headline) verdict; a construct's says so, so it never reads as the paper reproduced."""
    verdict = result["verdict"]
    return f"{CONSTRUCT}: {verdict}" if result.get("implementation") == CONSTRUCT else verdict


def beside(result: dict) -> str:
    """What stands beside the headline verdict: 'supporting 4/6 reproduced; checks 5/5 hold; 2 reported'."""
    counts = result.get("counts") or role_counts(result.get("claims") or [])
    return beside_text(counts, len(result.get("report") or []))


def _paper_number(c: dict) -> str:
    if c.get("paper_value") is not None:
        return str(c["paper_value"])
    return f"none: {c['paper_note']}" if c.get("paper_note") else "—"


def _setting(c: dict) -> str:
    s = c.get("setting") if isinstance(c.get("setting"), dict) else {}
    return f"paper: {s.get('paper', '—')} / ours: {s.get('ours', '—')}" if s else "—"


def headline_rows(result: dict) -> list[list[str]]:
    """One row per paper: its headline claims (several joined by ' · '), the paper's number, ours, the two
    settings, what was implemented, and the headline verdict with the supporting and check counts beside it."""
    if result["verdict"] == STALE:
        return [[result["paper"], result["scale"], "—", "—", "—", "—", "—", f"{STALE}: corrupt result file", "—"]]
    heads = [c for c in result.get("claims") or [] if c.get("role") == HEADLINE]
    join = lambda f: " · ".join(f(c) for c in heads) or "—"
    extra = beside(result)
    return [[result["paper"], result["scale"], join(lambda c: f"{c['id']}: {c.get('text', '')} ({c['verdict']})"),
             join(_paper_number), join(ours), join(_setting), str(result.get("implementation") or "—"),
             verdict_label(result) + (f" ({extra})" if extra else ""), paper_scale_text(result)]]


def _rows(result: dict) -> list[list[str]]:
    if result["verdict"] == STALE:  # one row, so a corrupt result cannot vanish from the table
        return [[result["paper"], result["scale"], "—", "—", "—", "—", "—", f"{STALE}: corrupt result file"]]
    rows = []
    for c in by_role(result["claims"]):
        expect = c["expect"] + (f" (partial: {c['partial']})" if c.get("partial") else "")
        verdict = c["verdict"] + (f": {c['reason']}" if c.get("reason") else "")
        rows.append([result["paper"], result["scale"], str(c.get("role") or "—"), c["id"], _paper_number(c), ours(c),
                     expect, verdict])
    return rows


def by_role(claims: list[dict]) -> list[dict]:
    """Headline claims first, then supporting claims, then checks (file order within each)."""
    order = {HEADLINE: 0, SUPPORTING: 1, CHECK: 2}
    return sorted(claims, key=lambda c: order.get(c.get("role"), 1))


def _report_rows(result: dict) -> list[list[str]]:
    return [[result["paper"], result["scale"], f"{r['id']}: {r.get('text', '')}", str(r.get("metric")), reported(r)]
            for r in result.get("report") or [] if isinstance(r, dict)]


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
    """Counts over all results: "papers" (headline verdicts of papers implemented as the paper or its code),
    "constructs" (the same for our constructs), and one {verdict: n} per claim role; "reported" numbers."""
    counts = {"papers": {}, "constructs": {}, HEADLINE: {}, SUPPORTING: {}, CHECK: {}, "reported": 0}
    for r in results:
        which = counts["constructs" if r.get("implementation") == CONSTRUCT else "papers"]
        which[r["verdict"]] = which.get(r["verdict"], 0) + 1
        for role, by in role_counts(r.get("claims") or []).items():
            for verdict, n in by.items():
                counts[role][verdict] = counts[role].get(verdict, 0) + n
        counts["reported"] += len(r.get("report") or [])
    return counts


def summary_lines(results: list[dict]) -> list[str]:
    """A few lines for the terminal and the top of the board: papers by headline verdict, constructs apart,
    then claims by role (checks as 'hold'), then how many numbers are only reported. A paper counts once: its
    smoke result (else its first scale's); results at its other scales get a line of their own."""
    first = {}
    for r in sorted(results, key=lambda r: (r["scale"] != "smoke", r["scale"])):
        first.setdefault(r["paper"], r)
    others = [r for r in results if first[r["paper"]] is not r]
    lines = _summary(list(first.values()))
    if others:
        by = {}
        for r in others:
            by[r["verdict"]] = by.get(r["verdict"], 0) + 1
        lines.append(f"{len(others)} more results of the same papers at other scales (not counted above), by headline "
                     "verdict: " + ", ".join(f"{n} {v}" for v, n in sorted(by.items(), key=lambda kv: -kv[1])))
    return lines


def _summary(results: list[dict]) -> list[str]:
    counts = summary_counts(results)
    line = lambda d: ", ".join(f"{n} {v}" for v, n in sorted(d.items(), key=lambda kv: -kv[1])) or "none"
    n_papers, n_constructs = sum(counts["papers"].values()), sum(counts["constructs"].values())
    checks = counts[CHECK]
    lines = [f"{n_papers} papers, by headline verdict: {line(counts['papers'])}"]
    if n_constructs:
        lines.append(f"{n_constructs} constructs (our rule where the paper's could not be read; never counted as the "
                     f"paper reproduced): {line(counts['constructs'])}")
    lines += [f"{sum(counts[HEADLINE].values())} headline claims: {line(counts[HEADLINE])}",
              f"{sum(counts[SUPPORTING].values())} supporting claims: {line(counts[SUPPORTING])}",
              f"{sum(checks.values())} checks of our code: {checks.get(REPRODUCED, 0)} hold"
              + "".join(f", {n} {v}" for v, n in checks.items() if v != REPRODUCED),
              f"{counts['reported']} numbers reported without a verdict"]
    return lines


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


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(md_text(x) for x in row) + " |" for row in rows], ""]


def markdown(results: list[dict], results_dir=None) -> str:
    md_cell = md_text
    lines = ["# Reproducibility report", "", *[f"- {md_cell(x)}" for x in summary_lines(results)], "",
             "## Papers: the headline verdict", ""]
    lines += _md_table(PAPER_COLUMNS, [row for r in results for row in headline_rows(r)])
    lines += ["## Every claim, by role", ""] + _md_table(COLUMNS, [row for r in results for row in _rows(r)])
    lines += ["## Reported numbers (no verdict)", ""]
    lines += _md_table(REPORT_COLUMNS, [row for r in results for row in _report_rows(r)])
    for r in results:
        lines += [f"## {md_cell(r['paper'])} ({md_cell(r['scale'])}): {md_cell(verdict_label(r))}", "",
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
    """A figure linked beside index.html (results/<id>-<scale>/main.png), loaded only when its section opens."""
    src = html.escape(quote(Path(figure).as_posix()))
    return f'<img tabindex="0" loading="lazy" alt="{html.escape(figure)}" title="click to enlarge" src="{src}">'


STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:78em;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;width:100%;margin:.5em 0}td,th{border:1px solid #ddd;padding:4px 8px;"
         "text-align:left;vertical-align:top}th{background:#f5f5f5}.v{color:white;font-weight:bold;white-space:nowrap}"
         ".err{color:#c62828;white-space:pre-wrap}.note{color:#555;font-size:.92em;background:#fafafa}"
         ".figs img{width:100%;max-width:60em;cursor:zoom-in;display:block;margin:.5em 0;border:1px solid #eee}"
         ".figs img:focus{max-width:none;cursor:zoom-out;outline:none}.muted{color:#666;font-size:.9em}"
         "table.papers{font-size:.9em}table.papers td:nth-child(3){min-width:17em}table.papers td:nth-child(4){max-width:11em}"
         ".hv{min-width:9em}.nw{white-space:nowrap}"
         ".summary td,.summary th{text-align:center}.summary td:first-child{text-align:left}"
         "details.paper{border-top:1px solid #ddd;padding:.4em 0}details.paper>summary{cursor:pointer;font-size:1.1em}"
         ".cite{color:#555;font-size:.85em}.controls{position:sticky;top:0;background:#fff;padding:.5em 0;z-index:1}"
         ".controls input{width:22em;padding:.3em}dl{font-size:.9em}dt{font-weight:bold;margin-top:.4em}")


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
    for claim, row in zip(by_role(r["claims"]) or [{"verdict": r["verdict"]}], _rows(r)):
        colour = COLOURS.get(claim["verdict"], "#000")
        what = f"<b>{e(row[3])}</b>" + (f"<br>{e(str(claim['text']))}" if claim.get("text") else "")
        metric = e(str(claim.get("metric") or "—"))
        refs = references(claim, metrics)
        expect = e(row[6]) + (f"<br><span class='muted'>{e(refs)}</span>" if refs else "")
        search = e(f"{claim.get('id', '')} {claim.get('text', '')} {claim.get('metric', '')}".lower())
        out.append(f"<tr class='claim' data-role='{e(row[2])}' data-v='{e(claim['verdict'])}' data-s='{search}'>"
                   f"<td>{e(row[2])}</td><td>{what}</td><td><code>{metric}</code></td><td>{e(row[5])}</td>"
                   f"<td>{e(row[4])}</td><td>{expect}</td><td class='v' style='background:{colour}'>{e(row[7])}</td></tr>")
        if claim.get("note") and claim["verdict"] != REPRODUCED:  # a negative result carries its explanation
            out.append(f"<tr class='noterow'><td class='note' colspan='7'>{e(str(claim['note']))}</td></tr>")
    for row in _report_rows(r):
        out.append(f"<tr class='claim' data-role='reported' data-v='reported' data-s='{e(row[2].lower())}'>"
                   f"<td>reported</td><td>{e(row[2])}</td><td><code>{e(row[3])}</code></td><td>{e(row[4])}</td>"
                   "<td colspan='3' class='muted'>no verdict: a number shown, not a claim</td></tr>")
    return out


def _headline_cells(r: dict) -> str:
    """Claim, paper's number, ours and setting cells: one line per headline claim, the long texts as tooltips."""
    e = html.escape
    heads = [c for c in r.get("claims") or [] if c.get("role") == HEADLINE]
    claim = "<br>".join(f"<span title='{e(str(c.get('text', '')))}'><b>{_breakable(c['id'])}</b>: "
                        f"<span style='color:{COLOURS.get(c['verdict'], '#000')}'>{e(c['verdict'])}</span></span>"
                        for c in heads)
    number = "<br>".join(e(str(c["paper_value"])) if c.get("paper_value") is not None
                         else f"<span class='muted' title='{e(str(c.get('paper_note') or ''))}'>none (why: hover)</span>"
                         for c in heads)
    settings = " · ".join(dict.fromkeys(_setting(c) for c in heads))  # one paper setting usually serves all
    setting = f"<span title='{e(settings)}'>{e(settings[:60])}{'…' if len(settings) > 60 else ''}</span>"
    return (f"<td>{claim or '—'}</td><td>{number or '—'}</td><td>{'<br>'.join(_ours_short(c) for c in heads) or '—'}"
            f"</td><td>{setting if heads else '—'}</td>")


def _breakable(name: str) -> str:
    """An id that may wrap after its underscores (a long claim id would otherwise widen the whole table)."""
    return html.escape(name).replace("_", "_<wbr>")


def _ours_short(claim: dict) -> str:
    """The first table's 'Ours': mean ± half-width on one line; n, confidence and the paired margin as a tooltip."""
    i = claim.get("interval")
    short = f"{i['mean']:.4g} ± {i['half_width']:.2g}" if i else fmt(claim.get("ours"))
    return f"<span class='nw' title='{html.escape(ours(claim))}'>{html.escape(short)}</span>"


def _paper_scale_cell(result: dict) -> str:
    """The stored paper-scale verdict in a few words; ours vs the paper's number per headline claim as a tooltip
    (and in full in the paper's section)."""
    stored = result.get("paper_scale_result")
    if not stored:
        return "<td>—</td>"
    e = html.escape
    return (f"<td><span title='{e(paper_scale_text(result))}'>{e(paper_scale_label(stored))}</span>"
            "<br><span class='muted'>ours vs the paper's: hover</span></td>")


def _paper_table(results: list[dict]) -> str:
    """The board's first table: one row per paper, a line per headline claim (its verdict, the paper's number,
    ours, the two settings; long texts as tooltips, in full in the paper's section), the implementation and the
    paper's headline verdict with the supporting claims and checks beside it."""
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in PAPER_COLUMNS)
    rows = []
    for r in results:
        colour = COLOURS.get(r["verdict"], "#000")
        link = f"<a href='#{e(r['paper'])}-{e(r['scale'])}'>{_breakable(r['paper'])}</a>"
        extra = beside(r)
        verdict = (f"<td class='hv' style='border-left:6px solid {colour}'><b style='color:{colour}'>"
                   f"{e(verdict_label(r))}</b>" + (f"<br><span class='muted'>{e(extra)}</span>" if extra else "")
                   + "</td>")
        rows.append(f"<tr data-v='{e(r['verdict'])}' data-id='{e(r['paper'])}-{e(r['scale'])}'><td>{link}</td><td>{e(r['scale'])}</td>{_headline_cells(r)}"
                    f"<td>{e(str(r.get('implementation') or '—'))}</td>{verdict}{_paper_scale_cell(r)}</tr>")
    return f"<table class='papers'><tr>{head}</tr>{''.join(rows)}</table>"


LEGEND = (
    ("headline", "what the paper's abstract or introduction claims; the paper's verdict comes from these alone"),
    ("supporting", "other results of the paper, ablations and our diagnostics, counted beside the verdict"),
    ("check", "an identity, exact special case or byte count: it tests our code, not the paper (single run, exact)"),
    ("reported", "a number shown without a verdict (it could not fail, so it is not a claim)"),
    ("construct", "our own rule where the paper's could not be read: its verdict never counts as the paper reproduced"),
    (REPRODUCED, "the expectation holds; for a seeded claim, the one-sided interval lies on the expected side"),
    (NOT_REPRODUCED, "the expectation fails at our (small) scale: a finding at this scale, not a verdict on the paper "
                     "at its own"),
    (INCONCLUSIVE, "the seed interval straddles the bound: more seeds or a larger scale would decide it"),
    (PARTIAL, "the expectation fails but its stated weaker form holds"),
    ("n=5, 90% one-sided", "mean ± half-width over n seeds; each side is a 90 % one-sided confidence bound"),
    ("paired margin", "metric minus its bound taken seed by seed (the shared seed cancels), with its interval"),
    ("at this scale", "smoke scale: the paper's idea on small data in about 90 s; see the paper-scale column"),
    ("paper scale", "the paper's own setting run on this CPU and stored (docs/paper_scale.md)"),
    (STALE, "a result file that could not be read; reproduce the paper again"),
    (ERROR, "the notebook failed or a metric was not recorded"),
)

SCRIPT = """<script>
function applyFilters(){
  const q=document.getElementById('q').value.trim().toLowerCase();
  const role=document.getElementById('role').value, v=document.getElementById('verdict').value;
  const active=q||role||v;
  document.querySelectorAll('details.paper').forEach(d=>{
    let shown=0;
    d.querySelectorAll('tr.claim').forEach(tr=>{
      const ok=(!role||tr.dataset.role===role)&&(!v||tr.dataset.v===v)&&
               (!q||tr.dataset.s.includes(q)||d.dataset.s.includes(q));
      tr.hidden=!ok; const note=tr.nextElementSibling;
      if(note&&note.classList.contains('noterow')) note.hidden=!ok;
      if(ok) shown++;
    });
    d.hidden=active&&!shown; if(active&&shown) d.open=true;
  });
  document.querySelectorAll('table.papers tr[data-v]').forEach(tr=>{
    const d=document.getElementById(tr.dataset.id); tr.hidden=d?d.hidden:false;
  });
  document.getElementById('count').textContent=
    document.querySelectorAll('details.paper:not([hidden])').length+' papers shown';
}
</script>"""


def _controls(results: list[dict]) -> str:
    """Search box, role and verdict filters (claim level), and the legend of every term on the board."""
    e = html.escape
    verdicts = sorted({c["verdict"] for r in results for c in r.get("claims") or []} | {"reported"})
    options = lambda values: "<option value=''>all</option>" + "".join(f"<option>{e(v)}</option>" for v in values)
    legend = "".join(f"<dt>{e(term)}</dt><dd>{e(text)}</dd>" for term, text in LEGEND)
    return ("<div class='controls'><input id='q' type='search' placeholder='search papers and claims' "
            "oninput='applyFilters()'> role <select id='role' onchange='applyFilters()'>"
            f"{options([HEADLINE, SUPPORTING, CHECK, 'reported'])}</select> verdict <select id='verdict' "
            f"onchange='applyFilters()'>{options(verdicts)}</select> <span id='count' class='muted'></span></div>"
            f"<details class='legend'><summary>How to read this board</summary><dl>{legend}</dl></details>")


def _citation(r: dict) -> str:
    e, c = html.escape, r.get("citation") if isinstance(r.get("citation"), dict) else {}
    title = e(str(r.get("title") or r.get("method") or ""))
    url = c.get("url")
    if isinstance(url, str) and url.startswith(("https://", "http://")):
        title = f"<a href='{e(url)}'>{title}</a>"
    who = ", ".join(e(str(c[k])) for k in ("authors", "venue", "year") if c.get(k))
    return f"<span class='cite'>{title}{' — ' + who if who else ''}</span>"


def html_page(results: list[dict], results_dir: Path) -> str:
    e = html.escape
    parts = ["<!doctype html><meta charset='utf-8'><title>fedlab_nb reproducibility report</title>",
             f"<style>{STYLE}</style>", SCRIPT,
             "<h1>Reproducibility report</h1>",
             "<p>" + "<br>".join(e(x) for x in summary_lines(results)) + "</p>",
             _controls(results),
             "<h2>Papers: the headline verdict</h2>", _paper_table(results),
             "<h2>By chapter</h2>", _summary_table(results), "<h2>Every paper (click to open)</h2>", "<main>"]
    for r in sorted(results, key=lambda r: (chapter(r["paper"]), r["paper"], r["scale"])):
        colour = COLOURS.get(r["verdict"], "#000")
        search = e(f"{r['paper']} {r.get('title') or ''} {r.get('method') or ''}".lower())
        parts.append(f"<details class='paper' id='{e(r['paper'])}-{e(r['scale'])}' data-v='{e(r['verdict'])}' "
                     f"data-s='{search}'><summary><b>{e(r['paper'])}</b> ({e(r['scale'])}) — "
                     f"<span style='color:{colour}'>{e(verdict_label(r))}</span> · {_citation(r)}</summary>")
        notebook = r.get("notebook")
        link = (f" · <a href='{e(quote(notebook))}'>executed notebook</a>"
                if isinstance(notebook, str) and not Path(notebook).is_absolute() and ".." not in Path(notebook).parts
                else "")
        parts.append(f"<p>{e(str(r.get('method', '')))}<br><span class='muted'>seed {e(str(r.get('seed')))}, "
                     f"device {e(str(r.get('device')))}, {e(str(r.get('wall_seconds')))} s, "
                     f"{e(str(r.get('timestamp')))}, commit {e(str(r.get('git_commit')))}{link}</span></p>")
        if r.get("paper_scale_result"):
            parts.append(f"<p><b>At the paper's scale</b> (stored run): {e(paper_scale_text(r))}</p>")
        if _error_text(r):
            parts.append(f"<p class='err'>{e(_error_text(r))}</p>")
        head = ["Role", "Claim", "Metric", "Ours", "Paper's number", "Expectation", "Verdict"]
        parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in head) + "</tr>")
        parts += _claim_rows(r)
        parts.append("</table>")
        parts.append("<div class='figs'>" + "".join(_img(f, p) for f, p in _figures(r, results_dir)) + "</div>")
        parts.append("</details>")
    parts.append("</main><script>applyFilters()</script>")
    return "\n".join(parts) + "\n"


def build_report(results_dir="results", root=None) -> str:
    """Write REPORT.md and index.html into `results_dir`; returns the markdown. `root`: the repository whose
    papers/paper_scale/ holds the stored paper-scale results (default: the package's)."""
    results_dir = Path(results_dir)
    results = load_results(results_dir, root)
    text = markdown(results, results_dir)
    from .files import make_folder, write_atomic
    make_folder(results_dir)
    page = html_page(results, results_dir)
    write_atomic(results_dir / "REPORT.md", text)  # a link there is refused (symbolic) or replaced (hard), never
    write_atomic(results_dir / "index.html", page)  # written through to its target
    return text
