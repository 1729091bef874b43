#!/usr/bin/env python
"""Committed notebooks a reader can trust: the only stored outputs are those nbval compares (the cell that
starts with `# NBVAL_CHECK_OUTPUT`), and they say that they are the expected output, not a run's result.
Each notebook's claims cell is followed by its headline cell, `repro.headline(ID)`: the paper's verdict as
its claims file states it, stored here from that file (so the notebook's stated verdict cannot drift from it).

    .venv/bin/python scripts/expected_outputs.py            # rewrite notebooks/*.ipynb in that form
    .venv/bin/python scripts/expected_outputs.py --check    # exit 1 naming every notebook not in that form

Every other code cell has no outputs and no execution count; the checked cell's first output begins with
HEADER (its execution count stays 1: nbval refuses a reference cell with outputs and no count). notebooks/sanitize.cfg removes that line before nbval compares, so a fresh
run (which does not print it) still matches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedlab_nb.repro.claims import headline_lines, load_paper, paper_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADER = "Expected output, stored with the notebook for the tests; run this cell to compute yours:\n"
MARK = "# NBVAL_CHECK_OUTPUT"
CLAIMS_CALL = "repro.check_claims("


def headline_source(paper_id: str) -> str:
    return f"{MARK}\nrepro.headline(\"{paper_id}\")  # as papers/{paper_id}.yaml states it; the cell above checks this run"


def _headline_index(nb, paper_id: str) -> tuple[int | None, int | None]:
    """(index of the claims cell, index of the headline cell or None)."""
    claims = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and CLAIMS_CALL in c.source), None)
    head = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source == headline_source(paper_id)),
                None)
    return claims, head


def headline_problems(nb, paper_id: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the notebook's headline cell: missing, misplaced, or its stored verdict not the file's."""
    claims, head = _headline_index(nb, paper_id)
    if claims is None:
        return [f"no claims cell ({CLAIMS_CALL}...)"]
    if head != claims + 1:
        return [f"no headline cell right after the claims cell (repro.headline(\"{paper_id}\"))"]
    want = HEADER + "\n".join(headline_lines(load_paper(paper_id, root))) + "\n"
    outputs = nb.cells[head].get("outputs") or [{}]
    if outputs[0].get("text") != want:
        return [f"the headline cell's stored verdict differs from papers/{paper_id}.yaml"]
    return []


def put_headline(nb, paper_id: str, root: Path = ROOT):
    """Insert (or refresh) the headline cell after the claims cell, its output written from the claims file."""
    claims, head = _headline_index(nb, paper_id)
    if head is None:
        head = claims + 1
        nb.cells.insert(head, nbformat.v4.new_code_cell(headline_source(paper_id)))
    text = HEADER + "\n".join(headline_lines(load_paper(paper_id, root))) + "\n"
    nb.cells[head].outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    nb.cells[head].execution_count = 1
    return nb


def notebook_papers(root: Path = ROOT) -> dict:
    """{notebook path: paper id} from the claims files."""
    return {(root / load_paper(pid, root).notebook).resolve(): pid for pid in paper_ids(root)}


def expected_form(nb) -> list[str]:
    """What is wrong with a notebook's stored outputs (empty: it is in the expected form)."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if not cell.source.startswith(MARK):
            if cell.get("outputs") or cell.get("execution_count") is not None:
                problems.append(f"cell {i} has stored outputs or an execution count but nbval does not check it")
            continue
        if cell.get("execution_count") is None:
            problems.append(f"cell {i} ({MARK}) has no execution count: nbval would refuse its stored output")
        first = cell.outputs[0] if cell.get("outputs") else None
        if first is None or first.get("output_type") != "stream" or not first.text.startswith(HEADER):
            problems.append(f"cell {i} ({MARK}): its stored output does not start with the expected-output line")
    return problems


def mark(nb):
    """The notebook in the expected form (in place): other outputs cleared, the header on the checked cell."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if not cell.source.startswith(MARK):
            cell.outputs, cell.execution_count = [], None
            continue
        cell.execution_count = 1  # nbval compares only reference cells that have a count
        if cell.outputs and cell.outputs[0].get("output_type") == "stream" and not cell.outputs[0].text.startswith(HEADER):
            cell.outputs[0].text = HEADER + cell.outputs[0].text
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report notebooks not in the expected form")
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    args = ap.parse_args(argv)
    status, papers = 0, notebook_papers()
    for path in args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        pid = papers.get(Path(path).resolve())
        problems = expected_form(nb) + (headline_problems(nb, pid) if pid else [])
        if args.check:
            for problem in problems:
                print(f"{path.name}: {problem}", file=sys.stderr)
                status = 1
        elif problems:
            nbformat.write(mark(put_headline(nb, pid) if pid else nb), str(path))
            print(f"rewrote {path.name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
