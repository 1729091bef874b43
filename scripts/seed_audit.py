#!/usr/bin/env python
"""Seed audit: re-run notebooks with only the seed changed and report verdicts that move.

    python scripts/seed_audit.py --all --offsets 10 20
    python scripts/seed_audit.py --papers fedau gas --offsets 10 20 30 --jobs 2 --markdown audit.md

Each run is `run_notebook(id, scale, parameters={"seed": offset})` (what `fedlab-nb run ID -p seed OFFSET`
does) into its own folder (default results-seed-audit/seed-<offset>/, never the board's results/), then
every claim is judged as `reproduce` would. The table has one column per offset beside the stored verdict
(the verdict at the notebook's default seed). A *flip* is a move between reproduced and not reproduced at
this scale: the exit status is 1 when there is one (or a run failed). Moves to / from inconclusive, and
moves involving partially reproduced, are listed separately (`--strict` makes the latter fail too).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fedlab_nb.repro.claims import (ERROR, INCONCLUSIVE, NOT_REPRODUCED, PARTIAL, REPRODUCED,  # noqa: E402
                                    default_root, judge, load_paper, paper_ids)

SHORT = {REPRODUCED: "R", PARTIAL: "P", NOT_REPRODUCED: "N", INCONCLUSIVE: "I", ERROR: "E"}
STORED = "stored"


# ---------------------------------------------------------------------------------------------- table logic
def classify(verdicts: list[str]) -> str:
    """'flip' (reproduced and not reproduced both occur), 'error', 'inconclusive' (a move to / from it),
    'partial' (a move between partially reproduced and a definite verdict), or 'stable'."""
    seen = set(verdicts)
    if {REPRODUCED, NOT_REPRODUCED} <= seen:
        return "flip"
    if ERROR in seen:
        return "error"
    if len(seen) == 1:
        return "stable"
    return "inconclusive" if INCONCLUSIVE in seen else "partial"


def audit_rows(results: dict, offsets: list[int]) -> list[dict]:
    """results[paper][claim] = {"stored": verdict, offset: verdict, ...} -> one row per claim."""
    rows = []
    for paper in sorted(results):
        for claim, by_column in results[paper].items():
            columns = [STORED, *offsets]
            verdicts = [by_column.get(c, ERROR) for c in columns]
            rows.append({"paper": paper, "claim": claim, "verdicts": dict(zip(columns, verdicts)),
                         "status": classify(verdicts)})
    return rows


def table(rows: list[dict], offsets: list[int]) -> str:
    """A markdown table: paper, claim, stored verdict and the verdict at each offset (R/P/N/I/E), status."""
    head = ["paper", "claim", STORED, *(f"seed {o}" for o in offsets), "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["paper"], r["claim"], *(SHORT.get(r["verdicts"][c], "?") for c in [STORED, *offsets])]
        status = {"flip": "**FLIP**", "stable": ""}.get(r["status"], r["status"])
        lines.append("| " + " | ".join([*cells, status]) + " |")
    lines.append("")
    lines.append("R reproduced, P partially reproduced, N not reproduced at this scale, I inconclusive at this "
                 "scale, E error; 'stored' is the claims file's verdict at the default seed.")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict[str, list[str]]:
    """Claim names ('paper/claim') by status, for the lines under the table."""
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["status"], []).append(f"{r['paper']}/{r['claim']}")
    return out


def exit_status(rows: list[dict], strict: bool = False) -> int:
    failing = {"flip", "error"} | ({"partial"} if strict else set())
    return 1 if any(r["status"] in failing for r in rows) else 0


# ---------------------------------------------------------------------------------------------- running
def run_one(paper_id: str, scale: str, offset: int, out_dir: str, root: str) -> tuple[str, int, dict]:
    """{claim id: verdict} of one notebook run at seed `offset` (all ERROR when the notebook fails)."""
    from fedlab_nb.repro.runner import run_notebook
    paper = load_paper(paper_id, Path(root))
    run = run_notebook(paper_id, scale, parameters={"seed": offset}, out_dir=Path(out_dir) / f"seed-{offset}",
                       root=Path(root))
    if run["error"]:
        e = run["error"]
        print(f"  {paper_id} seed {offset}: notebook failed in cell {e['cell']}: {e['ename']}: {e['evalue']}",
              file=sys.stderr)
        return paper_id, offset, {c.id: ERROR for c in paper.claims}
    print(f"  {paper_id} seed {offset}: {run['wall_seconds']} s", file=sys.stderr)
    return paper_id, offset, {c.id: judge(c, run["metrics"])[0] for c in paper.claims}


def has_seed_parameter(paper) -> bool:
    from fedlab_nb.repro.runner import notebook_parameters, notebook_path
    return "seed" in notebook_parameters(notebook_path(paper))


def collect(ids: list[str], offsets: list[int], scale: str, out_dir: Path, root: Path, jobs: int) -> dict:
    results, tasks = {}, []
    for pid in ids:
        paper = load_paper(pid, root)
        if not has_seed_parameter(paper):
            print(f"{pid}: SKIPPED — its notebook has no 'seed' parameter", file=sys.stderr)
            continue
        results[pid] = {c.id: {STORED: c.verdict} for c in paper.claims}
        tasks += [(pid, scale, o, str(out_dir), str(root)) for o in offsets]
    if jobs > 1 and tasks:  # one process per run: a run sets environment variables for its kernel
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(run_one, *zip(*tasks)))
    else:
        runs = [run_one(*task) for task in tasks]
    for pid, offset, verdicts in runs:
        for claim, verdict in verdicts.items():
            results[pid][claim][offset] = verdict
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--papers", nargs="+", help="paper ids (papers/ID.yaml)")
    which.add_argument("--all", action="store_true", help="every papers/*.yaml")
    ap.add_argument("--offsets", nargs="+", type=int, required=True, help="seed values passed as -p seed OFFSET")
    ap.add_argument("--scale", default="smoke")
    ap.add_argument("--root", type=Path, default=None, help="repository root (default: the checkout)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: ROOT/results-seed-audit)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run in parallel")
    ap.add_argument("--markdown", type=Path, help="also write the table to this file")
    ap.add_argument("--strict", action="store_true", help="moves involving partially reproduced fail too")
    args = ap.parse_args(argv)
    root = args.root or default_root()
    out_dir = args.out or root / "results-seed-audit"
    if out_dir.resolve() == (root / "results").resolve():
        ap.error("--out must not be the board's results folder")
    ids = paper_ids(root) if args.all else args.papers
    results = collect(ids, args.offsets, args.scale, out_dir, root, args.jobs)
    rows = audit_rows(results, args.offsets)
    text = table(rows, args.offsets)
    groups = summary(rows)
    moves = [f"{status}: {len(names)} — {', '.join(names)}" for status, names in sorted(groups.items())
             if status != "stable"]
    text = "\n".join([text, "", *moves, f"flips (reproduced <-> not reproduced): {len(groups.get('flip', []))}", ""])
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "audit.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return exit_status(rows, args.strict)


if __name__ == "__main__":
    sys.exit(main())
