"""The teacher's workflow (fedlab_nb/repro/grading.py, scripts/grade.py): a folder of sample submissions of a
tiny course notebook (tests/data/course/tiny_course.ipynb: two exercises, one paired by seed) graded by nbgrader
into a CSV gradebook. Submissions: right, wrong (a difference of means where one value per seed is asked, then a
right answer), blank (the student version as handed out), crashing (an answer that raises, then a right one)
and one whose kernel dies. Every exercise is graded even after an earlier one failed."""
from __future__ import annotations

import copy
import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from fedlab_nb.repro import course
from fedlab_nb.repro.course import CourseError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "course" / "tiny_course.ipynb"
UNPAIRED = "gap = float(acc['IID'].mean() - acc['Dir(0.1)'].mean())   # a difference of means"


def _filled(student, answers):
    """The student version with each stub replaced by an answer (None keeps the stub)."""
    nb = copy.deepcopy(student)
    stubs = [c for c in nb.cells if course.STUB_TAG in c.metadata.get("tags", [])]
    assert len(stubs) == len(answers)
    for cell, answer in zip(stubs, answers):
        if answer is not None:
            cell.source = answer
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    pytest.importorskip("nbgrader", reason="pip install -e '.[course]' (bash scripts/setup.sh ...,course)")
    from fedlab_nb.repro.grading import grade
    tmp = tmp_path_factory.mktemp("grading")
    master = nbformat.read(TINY, as_version=4)
    autograder = tmp / "autograder" / "source" / "tiny_course" / "tiny_course.ipynb"
    autograder.parent.mkdir(parents=True)
    nbformat.write(course.autograder_notebook(master), autograder)
    student = course.student_notebook(master)
    solutions = [c.source for c in master.cells if course.is_solution(c) and c.cell_type == "code"]
    submissions = {"right": solutions, "wrong": [UNPAIRED, solutions[1]], "blank": [None, None],
                   "crashing": ["gap = acc['IID'] - acc['dir(0.1)']   # KeyError", solutions[1]],
                   "kernel_dies": [solutions[0], "import os\nos._exit(1)"]}
    folder = tmp / "submissions"
    folder.mkdir()
    for name, answers in submissions.items():
        nbformat.write(_filled(student, answers), folder / f"{name}.ipynb")
    gradebook = tmp / "gradebook.csv"
    rows = grade(autograder, folder, gradebook, timeout=300)
    return rows, gradebook


def test_gradebook_rows_and_scores(graded):
    rows, gradebook = graded
    with open(gradebook, newline="") as f:
        table = {r["student"]: r for r in csv.DictReader(f)}
    assert list(next(csv.reader(open(gradebook)))) == ["student", "exercise_1", "exercise_2", "score", "max_score",
                                                       "status"]
    scores = {s: (float(r["exercise_1"]), float(r["exercise_2"]), float(r["score"])) for s, r in table.items()}
    assert scores == {"blank": (0, 0, 0), "crashing": (0, 1, 1), "kernel_dies": (0, 0, 0), "right": (1, 1, 2),
                      "wrong": (0, 1, 1)}
    assert all(r["max_score"] == "2.0" for r in table.values())
    assert {s for s, r in table.items() if r["status"] == "graded"} == {"blank", "crashing", "right", "wrong"}
    assert table["kernel_dies"]["status"].startswith("not graded (0 points):")
    assert "Kernel died" in table["kernel_dies"]["status"]
    assert [r["student"] for r in rows] == sorted(table)


def test_unpaired_answer_is_refused(capsys, monkeypatch):
    """The paired exercise's check refuses a single number, even one above the bound."""
    import numpy as np
    monkeypatch.setenv(course.EXERCISES_ENV, "lenient")
    acc = {"IID": np.array([0.81, 0.74, 0.86, 0.79, 0.83]), "Dir(0.1)": np.array([0.77, 0.70, 0.83, 0.74, 0.80])}
    assert not course.check_exercise("> 0.02", float(acc["IID"].mean() - acc["Dir(0.1)"].mean()), seeds=5)
    assert "one value per seed" in capsys.readouterr().out
    assert course.check_exercise("> 0.02", acc["IID"] - acc["Dir(0.1)"], seeds=5)
    assert not course.check_exercise("> 0.02", [0.1, 0.2, 0.3], seeds=5)
    with pytest.raises(ValueError, match="seeds= is the number of seeds"):
        course.check_exercise("> 0.02", [0.1, 0.2], seeds=1)


def test_bad_input_names_the_fix(tmp_path):
    from fedlab_nb.repro.grading import grade
    autograder = tmp_path / "a.ipynb"
    nbformat.write(course.autograder_notebook(nbformat.read(TINY, as_version=4)), autograder)
    with pytest.raises(CourseError, match="submissions folder .*does not exist.*one <student>.ipynb per student"):
        grade(autograder, tmp_path / "nowhere", tmp_path / "g.csv")
    (tmp_path / "subs").mkdir()
    with pytest.raises(CourseError, match="holds no .ipynb file"):
        grade(autograder, tmp_path / "subs", tmp_path / "g.csv")
    (tmp_path / "subs" / "two words.ipynb").write_text("{}")
    with pytest.raises(CourseError, match="does not name a student: rename it"):
        grade(autograder, tmp_path / "subs", tmp_path / "g.csv")
    with pytest.raises(CourseError, match="autograder notebook .*does not exist: run scripts/make_course.py"):
        grade(tmp_path / "missing.ipynb", tmp_path / "subs", tmp_path / "g.csv")


def test_grade_script_refuses_a_missing_folder(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "grade.py"), "tiny_course", str(tmp_path / "nope"),
                          "--course", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "does not exist" in run.stderr and "Traceback" not in run.stderr
