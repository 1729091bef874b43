#!/usr/bin/env python
"""Committed notebooks a reader can trust: the only stored outputs are those nbval compares (the cell that
starts with `# NBVAL_CHECK_OUTPUT`), and they say that they are the expected output, not a run's result.

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

ROOT = Path(__file__).resolve().parents[1]
HEADER = "Expected output, stored with the notebook for the tests; run this cell to compute yours:\n"
MARK = "# NBVAL_CHECK_OUTPUT"


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
    status = 0
    for path in args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        if args.check:
            for problem in expected_form(nb):
                print(f"{path.name}: {problem}", file=sys.stderr)
                status = 1
        elif expected_form(nb):
            nbformat.write(mark(nb), str(path))
            print(f"rewrote {path.name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
