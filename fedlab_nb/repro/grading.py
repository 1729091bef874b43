"""Grade a folder of student submissions with nbgrader, into a CSV gradebook (one row per student, one column
per exercise).

    from fedlab_nb.repro.grading import grade
    rows = grade("results/course/autograder/source/fedavg_noniid/fedavg_noniid.ipynb", "submissions/",
                 "gradebook.csv")

`submissions/` holds one `<student>.ipynb` per student (the student version of the notebook, filled in). Each
submission is executed from the top by `nbgrader autograde` in a temporary course folder (deleted afterwards),
with the exercises strict (FEDLAB_NB_EXERCISES=strict: a TRY AGAIN raises) and errors allowed, so every check
cell runs and scores 1 or 0 even when an earlier cell failed; the check cells and every other read-only cell are
put back from the autograder's copy first, so a student cannot edit a check. A submission whose kernel dies or
times out gets 0 everywhere and its reason in the `status` column. The submissions are code and are executed:
grade on a machine (or in a container) you would run a student's script on.
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .course import EXERCISES_ENV, CourseError

STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NBGRADER = "pip install -e '.[course]' (nbgrader), or bash scripts/setup.sh dev,flower,notebooks,browser,course"


def _submissions(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise CourseError(f"grade: the submissions folder {folder} does not exist or is not a folder: give a folder "
                          "holding one <student>.ipynb per student")
    found = {}
    for path in sorted(folder.glob("*.ipynb")):
        if path.is_symlink() or not path.is_file():
            raise CourseError(f"grade: {path} is not a regular file (a link?): copy the submission itself there")
        if not STUDENT_ID.fullmatch(path.stem):
            raise CourseError(f"grade: {path.name!r} does not name a student: rename it <student>.ipynb, the student "
                              "id made of letters, digits, '_', '.' or '-' (at most 64)")
        found[path.stem] = path
    if not found:
        raise CourseError(f"grade: the submissions folder {folder} holds no .ipynb file: put one <student>.ipynb per "
                          "student there")
    return found


def _nbgrader(course: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    return subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)


def _reason(log: str) -> str:
    """The last exception line of an nbgrader log (e.g. 'nbclient.exceptions.DeadKernelError: Kernel died')."""
    lines = [line.strip() for line in log.splitlines() if re.match(r"\s*[\w.]+(Error|Exception|Timeout)\b", line)]
    lines = lines or [line.strip() for line in log.splitlines() if "ERROR" in line] or ["no log"]
    return lines[-1][:200]


def _failure(log: str, student: str) -> str | None:
    """Why nbgrader could not grade this student's submission (its log between the student's first line and
    "error ... for student '<student>'"), or None when it did."""
    lines = log.splitlines()
    end = next((i for i, line in enumerate(lines) if f"for student '{student}'" in line and "ERROR" in line), None)
    if end is None:
        return None
    start = next((i for i, line in enumerate(lines[:end]) if f"/{student}/" in line), 0)
    return _reason("\n".join(lines[start:end + 1]))


def grade(autograder, submissions, gradebook, *, timeout: int = 600, root=None) -> list[dict]:
    """Grade every <student>.ipynb of `submissions` against the autograder's notebook (scripts/make_course.py
    writes it: results/course/autograder/source/<nb>/<nb>.ipynb) and write the CSV `gradebook`: columns student,
    exercise_1 ... exercise_N (1 or 0), score, max_score, status. `timeout`: seconds per cell. `root`: the
    repository the notebooks read papers/ and data from (default: this checkout). Returns the rows."""
    import nbformat
    from .claims import ROOT_ENV, default_root
    from .course import exercise_cells
    autograder, gradebook = Path(autograder), Path(gradebook)
    if not autograder.is_file() or autograder.suffix != ".ipynb":
        raise CourseError(f"grade: the autograder notebook {autograder} does not exist: run scripts/make_course.py, "
                          "which writes results/course/autograder/source/<nb>/<nb>.ipynb")
    if not isinstance(timeout, int) or timeout < 1:
        raise CourseError(f"grade: timeout is seconds per cell, an integer >= 1; got {timeout!r}")
    students = _submissions(Path(submissions))
    exercises = [f"exercise_{k}" for k in range(1, len(exercise_cells(nbformat.read(autograder, as_version=4))) + 1)]
    if not exercises:
        raise CourseError(f"grade: {autograder} has no self-graded exercise (a code cell tagged `solution` followed "
                          "by a check cell); there is nothing to grade")
    try:
        import nbgrader  # noqa: F401
    except ImportError:
        raise CourseError(f"grade: nbgrader is not installed: {NBGRADER}") from None
    name = autograder.stem
    env = {**os.environ, EXERCISES_ENV: "strict", ROOT_ENV: str(Path(root or default_root()).absolute()),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MPLBACKEND": "Agg",
           # nbgrader runs `alembic` (its database migrations) from PATH: this Python's bin/ first
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           # the kernels import this fedlab_nb (the grading runs in a temporary folder: a relative path would miss)
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          *(str(Path(e).absolute()) for e in os.environ.get("PYTHONPATH", "").split(
                                              os.pathsep) if e)])}
    with tempfile.TemporaryDirectory(prefix="fedlab_nb_grading_") as tmp:
        course = Path(tmp)
        (course / "source" / name).mkdir(parents=True)
        shutil.copyfile(autograder, course / "source" / name / autograder.name)
        done = _nbgrader(course, env, "generate_assignment", name, "--force")
        if done.returncode:
            raise CourseError(f"grade: nbgrader could not read {autograder}: {_reason(done.stderr + done.stdout)}")
        for student, path in students.items():
            target = course / "submitted" / student / name
            target.mkdir(parents=True)
            (target / autograder.name).write_bytes(path.read_bytes())
        # one nbgrader run for all (its start-up once); a submission it could not grade is named in its log
        done = _nbgrader(course, env, "autograde", name, "--create", "--force", f"--Execute.timeout={timeout}")
        log = done.stderr + done.stdout
        rows = [_row(course, name, student, exercises, log) for student in students]
    gradebook.parent.mkdir(parents=True, exist_ok=True)
    with open(gradebook, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", *exercises, "score", "max_score", "status"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _row(course: Path, name: str, student: str, exercises: list[str], log: str) -> dict:
    from nbgrader.api import Gradebook, MissingEntry
    row = {"student": student, **{e: 0.0 for e in exercises}, "score": 0.0, "max_score": float(len(exercises))}
    failure = _failure(log, student)
    if failure is not None:  # a dead kernel, a timeout: nbgrader drops the run; 0 everywhere, and why
        return {**row, "status": f"not graded (0 points): {failure}"}
    try:
        with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
            for g in gb.find_submission_notebook(name, name, student).grades:
                if g.name in row:
                    row[g.name] = float(g.score or 0.0)
    except MissingEntry:
        return {**row, "status": f"not graded (0 points): {_reason(log)}"}
    return {**row, "score": sum(row[e] for e in exercises), "status": "graded"}
