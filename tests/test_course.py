"""The course (fedlab_nb/repro/course.py): self-grading checks, the syllabus from the claims files, student and
instructor versions of the notebooks with solution cells."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest

from fedlab_nb import repro
from fedlab_nb.repro import course
from fedlab_nb.repro.claims import paper_ids
from fedlab_nb.repro.course import ExerciseFailed, check_exercise
from fedlab_nb.repro.expect import ExpectationError

ROOT = Path(__file__).resolve().parents[1]
PRIVACY = ("dp_fedavg", "secure_aggregation", "gradient_inversion", "cpa", "fedsvd", "aggregate_responses", "cpda")


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    """As in a student's Jupyter kernel: TRY AGAIN prints and returns False (the harness' strict mode is off)."""
    monkeypatch.setenv(course.EXERCISES_ENV, "lenient")


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------- check_exercise
def test_exported_from_repro():
    assert repro.check_exercise is check_exercise


@pytest.mark.parametrize("expectation, value, ok", [
    ("> 0.9", 0.95, True), ("> 0.9", 0.85, False), ("<= 1e-6", 0.0, True), ("== 3", 3, True),
    ("within 0.02 of 0.5", 0.515, True), ("within 0.02 of 0.5", 0.53, False), ("within 5% of 2", 2.09, True),
    ("between 0.6 and 0.8", 0.7, True), ("between 0.6 and 0.8", 0.81, False), ("== true", True, True),
])
def test_numbers(capsys, expectation, value, ok):
    assert check_exercise(expectation, value) is ok
    line = last_line(capsys)
    assert line.startswith("PASS: " if ok else "TRY AGAIN: ")
    if not ok:
        assert f"got {value:.4g}" in line and f"expected {expectation}" in line


def test_numpy_and_torch_scalars(capsys):
    import torch
    assert check_exercise("> 0.5", np.float32(0.7)) and check_exercise("< 0.5", torch.tensor(0.2))


def test_named_references(capsys):
    assert check_exercise("within 0.02 of other", 0.5, other=0.51)
    assert "other = 0.51" in last_line(capsys)
    assert not check_exercise("< fedavg_acc - 0.05", 0.9, fedavg_acc=0.91)
    line = last_line(capsys)
    assert line.startswith("TRY AGAIN:") and "fedavg_acc = 0.91" in line and "smaller than 0.86" in line
    assert check_exercise("gap > 0.03", gap=0.05)           # the value named on the left
    assert last_line(capsys) == "PASS: gap > 0.03 (got 0.05)"


def test_hint_and_missing_answer(capsys):
    assert not check_exercise("> 0.9", 0.1, hint="train longer")
    assert last_line(capsys).endswith("Hint: train longer")
    assert not check_exercise("> 0.9", ...)                   # the student version's stub
    assert "no answer yet" in last_line(capsys)
    assert not check_exercise("> 0.9", float("nan"))
    assert "got nan" in last_line(capsys)


def test_per_seed_values(capsys):
    assert check_exercise("> 0.01", [0.07, 0.05, 0.08, 0.06, 0.09])
    assert "over 5 seeds" in last_line(capsys)
    assert not check_exercise("> 0", [0.1, -0.2, 0.15, 0.12, -0.1])      # straddles: inconclusive
    assert "inconclusive" in last_line(capsys)
    assert check_exercise("< base", np.array([0.1, 0.2, 0.15]), base=np.array([0.3, 0.4, 0.36]))  # paired


@pytest.mark.parametrize("bad", ["0.9", "> ", "> 1 +", "within x of 2", "approximately 3", "between 1 or 2"])
def test_bad_expectation_names_the_grammar(bad):
    with pytest.raises(ExpectationError, match=r"bad expectation .*within TOL of x.*papers/SCHEMA.md"):
        check_exercise(bad, 1.0)


def test_missing_reference_and_missing_value():
    with pytest.raises(ValueError, match="uses other but got no value for it"):
        check_exercise("> other", 1.0)
    with pytest.raises(ValueError, match="no value to check"):
        check_exercise("> 0.5")


def test_strict_raises_after_printing(monkeypatch, capsys):
    monkeypatch.delenv(course.EXERCISES_ENV)
    monkeypatch.setenv("FEDLAB_NB_RUN_DIR", "/nonexistent")  # what nbval / fedlab-nb give the kernel
    assert check_exercise("> 0.5", 0.6)
    with pytest.raises(ExerciseFailed, match="TRY AGAIN"):
        check_exercise("> 0.5", 0.4)
    assert capsys.readouterr().out.startswith("PASS")


# ---------------------------------------------------------------------------------------------- syllabus
def test_every_claims_file_is_in_the_course():
    order = [p for lesson in course.LESSONS for p in lesson.papers]
    assert len(order) == len(set(order))
    for pid in paper_ids(ROOT):
        assert pid in order, f"papers/{pid}.yaml is not in course.LESSONS"
    assert set(PRIVACY) <= set(course.lesson_of("dp_fedavg").papers)
    assert [lesson.key for lesson in course.LESSONS] == ["basics", "heterogeneity", "weights", "robustness",
                                                          "privacy", "communication", "personalisation", "bilevel", "more",
                                                          "labels", "beyond"]
    course.check_lessons()


def test_a_paper_outside_the_course_is_an_error(tmp_path):
    with pytest.raises(course.CourseError, match="not in the course.*LESSONS"):
        course.lesson_of("brand_new_paper")
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers" / "brand_new_paper.yaml").write_text("id: brand_new_paper\n")
    with pytest.raises(course.CourseError, match="brand_new_paper"):
        course.build_syllabus(tmp_path)


def test_lessons_must_be_consistent():
    twice = (course.Lesson("a", "A", ("x",), (), ()), course.Lesson("b", "B", ("x",), (), ()))
    with pytest.raises(course.CourseError, match="give it one lesson"):
        course.check_lessons(twice)
    with pytest.raises(course.CourseError, match="not earlier lessons"):
        course.check_lessons((course.Lesson("a", "A", (), ("b",), ()), course.Lesson("b", "B", (), (), ())))


def test_syllabus_lists_every_paper_in_lesson_order():
    text = course.build_syllabus(ROOT)
    notebooks = {pid: repro.load_paper(pid, ROOT).notebook for pid in paper_ids(ROOT)}
    positions = [text.find(f"### `{notebooks[p]}`") for lesson in course.LESSONS for p in lesson.papers
                 if p in notebooks]
    assert -1 not in positions and positions == sorted(positions)
    lesson_positions = [text.find(f"\n## {i}. {lesson.title}\n") for i, lesson in enumerate(course.LESSONS, 1)]
    assert -1 not in lesson_positions and lesson_positions == sorted(lesson_positions)
    seconds = sum(repro.load_paper(p, ROOT).scales["smoke"]["seconds"] for p in ("fedavg_noniid", "partitions"))
    assert f"| `fedavg_noniid`, `partitions` | {course._minutes(seconds)} |" in text


def test_committed_syllabus_is_up_to_date():
    path = ROOT / "docs" / "syllabus.md"
    assert path.read_text() == course.build_syllabus(ROOT), "docs/syllabus.md is stale: run scripts/make_course.py"


# ---------------------------------------------------------------------------------------------- student version
def notebooks_with_solutions():
    out = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if any(course.is_solution(c) for c in nb.cells):
            out.append(path)
    return out


def test_the_course_notebooks_have_solutions():
    names = {p.stem for p in notebooks_with_solutions()}
    assert {"fedavg_noniid", "partitions", "fedbn"} <= names


def test_stub_keeps_names_and_signatures():
    stub = course.stub_source("def f(a, b=2):\n    return a\nx, y = 1, 2\nz: int = 3\nx += 1\nprint(x)")
    assert stub.splitlines() == [course.STUB_LINE, "def f(a, b=2):", "    ...", "x = ...", "y = ...", "z = ..."]
    ns = {}
    exec(stub, ns)
    assert ns["x"] is Ellipsis and ns["f"](1) is None


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("course")
    before = {p: p.read_bytes() for p in (ROOT / "notebooks").glob("*.ipynb")}
    result = course.write_course(ROOT, out, syllabus=out / "syllabus.md")
    assert before == {p: p.read_bytes() for p in (ROOT / "notebooks").glob("*.ipynb")}, "notebooks/ was modified"
    return out, result


def test_student_version_has_no_solution_left(written):
    out, result = written
    every = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in result["student"]) == every                  # all notebooks, with or without exercises
    assert sorted(p.name for p in result["autograder"]) == [p.name for p in notebooks_with_solutions()]
    for path in result["autograder"]:
        assert path.parent.name == path.stem and path.parents[1].name == "source"   # nbgrader's source/<assignment>/
    for path in notebooks_with_solutions():
        teacher = nbformat.read(path, as_version=4)
        student = nbformat.read(out / "student" / path.name, as_version=4)
        nbformat.validate(student)
        solutions = [c for c in teacher.cells if course.is_solution(c)]
        stubs = [c for c in student.cells if course.STUB_TAG in c.metadata.get("tags", [])]
        assert not any(course.is_solution(c) for c in student.cells)
        assert len(stubs) == len([c for c in solutions if c.cell_type == "code"])
        for sol, stub in zip([c for c in solutions if c.cell_type == "code"], stubs):
            assert stub.source.startswith(course.STUB_LINE) and not stub.outputs and stub.execution_count is None
            assert all(re.fullmatch(r"(def \w+\(.*\):|    \.\.\.|\w+ = \.\.\.|\.\.\.)", line)
                       for line in stub.source.splitlines()[1:]), f"{path.name}: the stub holds code: {stub.source}"
            assert not any(sol.source in c.source for c in student.cells)
        others = [c.source for c in teacher.cells if not course.is_solution(c)]
        assert others == [c.source for c in student.cells if course.STUB_TAG not in c.metadata.get("tags", [])]
        assert (out / "instructor" / path.name).read_bytes() == path.read_bytes()
        pairs = course.exercise_cells(student)
        marks = [c.metadata["nbgrader"] for c in student.cells]
        assert [m["grade_id"] for m in marks if m["grade"]] == [f"exercise_{k}" for k in range(1, len(pairs) + 1)]
        assert all(m["locked"] != m["solution"] for m in marks) and all(m.get("points", 1) == 1 for m in marks)


def test_every_notebook_is_handed_out_with_two_graded_exercises(written):
    """Issue 44 item 1: every notebook has a student version with at least two self-graded exercises (a stub
    and the check cell after it, each worth a point for nbgrader)."""
    out, result = written
    sources = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in result["student"]) == sources
    few = {name: len(course.exercise_cells(nbformat.read(out / "student" / name, as_version=4))) for name in sources}
    assert not {name: n for name, n in few.items() if n < 2}, "notebooks with fewer than two self-graded exercises"
    plain = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A"), nbformat.v4.new_code_cell("x = 1")])
    student = course.student_notebook(plain)   # a notebook without exercises: the same cells, all read-only
    assert [c.source for c in student.cells] == ["# A", "x = 1"] and all(c.metadata["nbgrader"]["locked"]
                                                                         for c in student.cells)


def check_calls(source: str):
    """The check_exercise calls of a check cell: (expectation, value expression, {keyword: expression})."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "check_exercise":
            yield node


def test_wrong_answer_in_the_student_version_says_try_again(written, capsys):
    """Fill each stub with a wrong answer and run the cell after it (the check) with check_exercise itself."""
    out, _ = written
    for path in notebooks_with_solutions():
        cells = nbformat.read(out / "student" / path.name, as_version=4).cells
        for i, cell in enumerate(cells):
            if course.STUB_TAG not in cell.metadata.get("tags", []):
                continue
            check = cells[i + 1].source
            names = re.findall(r"^(\w+) = \.\.\.$", cell.source, re.M)
            # references other than the answer come from the notebook's earlier cells: give them neutral values
            calls = list(check_calls(check))
            assert calls, f"{path.name}: the cell after a stub must call repro.check_exercise"
            for call in calls:
                expectation = ast.literal_eval(call.args[0])
                kwargs = {k.arg: 1e-9 for k in call.keywords if k.arg not in ("hint", "seeds")}
                assert isinstance(call.args[1], ast.Name) and call.args[1].id in names
                ns = {}
                exec(cell.source, ns)                    # the untouched stub: no answer yet
                assert not check_exercise(expectation, ns[call.args[1].id], **kwargs)
                assert "no answer yet" in last_line(capsys)
                for wrong in ("-1e6", "1e6"):           # any bound fails on one side at least
                    filled = {}
                    exec(cell.source.replace(" = ...", f" = {wrong}"), filled)   # the student's wrong answer
                    if not check_exercise(expectation, filled[call.args[1].id], **kwargs):
                        break
                assert last_line(capsys).startswith("TRY AGAIN:"), f"{path.name}: {expectation}"


# ---------------------------------------------------------------------------------------------- chapters
def test_chapter_folders_are_the_lessons():
    """fedlab_nb/methods/<chapter>/ exists for each lesson key of LESSONS and names no other."""
    methods = Path(__file__).resolve().parents[1] / "fedlab_nb" / "methods"
    folders = {p.name for p in methods.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {lesson.key for lesson in course.LESSONS}


def test_each_method_file_sits_in_its_lesson_chapter():
    """A registered entry under fedlab_nb.methods lives in the chapter folder of its paper's lesson."""
    import fedlab_nb.methods  # noqa: F401  (imports every chapter: the registry is complete)
    from fedlab_nb.core.registry import REGISTRY
    lesson = {p: lesson.key for lesson in course.LESSONS for p in lesson.papers}
    wrong = [f"{e.key}: {e.module} (paper {e.claims}, lesson {lesson[e.claims]})" for e in REGISTRY.values()
             if e.module.startswith("fedlab_nb.methods.") and e.claims in lesson
             and e.module.split(".")[2] != lesson[e.claims]]
    assert not wrong, wrong
