#!/usr/bin/env python
"""Grade a folder of student submissions of one notebook with nbgrader, into a CSV gradebook.

    .venv/bin/python scripts/make_course.py                                  # once: results/course/
    .venv/bin/python scripts/grade.py fedavg_noniid submissions/ -o gradebook.csv

submissions/ holds one <student>.ipynb per student (their filled-in student version). Each is executed from the
top in a temporary nbgrader course folder, with every exercise graded even after an earlier one failed; the
gradebook has one row per student: exercise_1 ... exercise_N (1 or 0), score, max_score, status. The submissions
are code and are executed: run this where you would run a student's script. The logic lives in
fedlab_nb/repro/grading.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlab_nb.repro.course import CourseError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", help="the notebook's name, e.g. fedavg_noniid (results/course/autograder/source/NAME/)")
    ap.add_argument("submissions", type=Path, help="folder of <student>.ipynb files")
    ap.add_argument("-o", "--gradebook", type=Path, default=Path("gradebook.csv"), help="CSV to write (default: "
                    "gradebook.csv)")
    ap.add_argument("--course", type=Path, default=ROOT / "results" / "course",
                    help="the course folder scripts/make_course.py wrote (default: results/course)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default: 600)")
    args = ap.parse_args(argv)
    name = Path(args.notebook).stem
    autograder = args.course / "autograder" / "source" / name / f"{name}.ipynb"
    try:
        from fedlab_nb.repro.grading import grade
        if not args.submissions.is_dir():  # before the autograder: the folder is the likelier typo
            raise CourseError(f"grade: the submissions folder {args.submissions} does not exist or is not a folder: "
                              "give a folder holding one <student>.ipynb per student")
        rows = grade(autograder, args.submissions, args.gradebook, timeout=args.timeout, root=ROOT)
    except CourseError as e:
        print(f"grade.py: error: {e}", file=sys.stderr)
        return 2
    for row in rows:
        print(f"{row['student']}: {row['score']:g} / {row['max_score']:g} ({row['status']})")
    print(f"wrote {args.gradebook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
