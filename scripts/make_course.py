#!/usr/bin/env python
"""Write the course: docs/syllabus.md from the claims files, a student and an instructor version of every notebook,
and the autograder's notebook (nbgrader) of every notebook with self-graded exercises.

    .venv/bin/python scripts/make_course.py                 # docs/syllabus.md, results/course/{student,instructor,autograder}/
    .venv/bin/python scripts/make_course.py --check         # exit 1 when docs/syllabus.md is out of date

Student version (results/course/student/<nb>.ipynb): each solution cell's source becomes a stub that assigns
`...` to every name the solution defined (functions keep their signature, body `...`), so "Run All" still reaches
the end and each check cell prints "TRY AGAIN: ... no answer yet" instead of stopping at a NotImplementedError;
markdown cells tagged `solution` are dropped; cells carry nbgrader's metadata (answer cells are solution cells,
check cells autograded tests worth 1 point, the rest read-only). Instructor version (results/course/instructor/):
an unchanged copy. Autograder (results/course/autograder/source/<nb>/<nb>.ipynb): the master with its solutions,
marked the same way; scripts/grade.py grades a folder of submissions against it. notebooks/ is never modified.
The logic lives in fedlab_nb/repro/course.py (write_course).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlab_nb.repro.course import build_syllabus, write_course  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    ap.add_argument("--out", type=Path, default=None, help="folder of the two versions (default: results/course)")
    ap.add_argument("--check", action="store_true", help="only check that docs/syllabus.md is up to date")
    args = ap.parse_args(argv)
    if args.check:
        path = args.root / "docs" / "syllabus.md"
        if not path.exists() or path.read_text() != build_syllabus(args.root):
            print(f"{path} is out of date: run scripts/make_course.py", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    written = write_course(args.root, args.out)
    print(f"wrote {written['syllabus']}")
    out = written["student"][0].parents[1] if written["student"] else args.out
    print(f"wrote {len(written['student'])} student notebooks to {out / 'student'}, the instructor copies to "
          f"{out / 'instructor'} and {len(written['autograder'])} autograder notebooks (nbgrader's source/) to "
          f"{out / 'autograder'}; grade with scripts/grade.py NOTEBOOK SUBMISSIONS/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
