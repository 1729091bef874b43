"""docs/ARCHITECTURE.md stays true: its diagram names every package and root module, its tree lists each chapter's
files, and the files its add-a-method recipe names for the worked example (Ditto) exist and are the ones the
recipe asks for."""
from __future__ import annotations

import re
from pathlib import Path

from fedlab_nb.repro.course import LESSONS

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGE = ROOT / "fedlab_nb"


def section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + len(title))
    return DOC[start:] if end < 0 else DOC[start:end]


def diagram() -> str:
    layers = section("## Layers")
    return layers[layers.index("```"):layers.index("```", layers.index("```") + 3)]


def test_the_diagram_names_every_package_and_root_module():
    names = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | \
            {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    text = diagram()
    missing = [n for n in sorted(names) if not re.search(rf"(?<![\w/]){n}\b", text)]
    assert not missing, f"docs/ARCHITECTURE.md's layer diagram leaves out {missing}"
    for lesson in LESSONS:
        assert f"{lesson.key}/" in text, lesson.key


def test_the_tree_lists_each_chapters_files():
    tree = section("### The tree")
    for lesson in LESSONS:
        files = sorted(p.stem for p in (PACKAGE / "methods" / lesson.key).glob("*.py") if p.stem != "__init__")
        m = re.search(rf"^    {lesson.key}/\s+(.*?)(\d+) files?$", tree, re.S | re.M)
        assert m, f"the tree has no line for methods/{lesson.key}/"
        assert int(m.group(2)) == len(files), f"methods/{lesson.key}/ has {len(files)} files"
        assert m.group(1).split() == files, f"methods/{lesson.key}/: {files}"


def test_the_worked_example_names_the_files_a_paper_touches():
    listed = re.findall(r"^- `([^`]+)`", section("### Worked example"), re.M)
    missing = [p for p in listed if not (ROOT / p).is_file()]
    assert not missing, f"the recipe's worked example names files that do not exist: {missing}"
    keys = {lesson.key for lesson in LESSONS}
    kinds = {
        "method file in its chapter": lambda p: p.startswith("fedlab_nb/methods/") and p.split("/")[2] in keys,
        "test": lambda p: p.startswith("tests/test_"),
        "claims file": lambda p: re.fullmatch(r"papers/\w+\.yaml", p),
        "notebook": lambda p: p.startswith("notebooks/") and p.endswith(".ipynb"),
        "figure reference": lambda p: re.fullmatch(r"papers/figures/\w+\.json", p),
        "lesson table": lambda p: p == "fedlab_nb/repro/course.py",
        "generated syllabus": lambda p: p == "docs/syllabus.md",
    }
    absent = [kind for kind, is_kind in kinds.items() if not any(is_kind(p) for p in listed)]
    assert not absent, f"the worked example lists no {absent}"
    method = next(p for p in listed if kinds["method file in its chapter"](p))
    paper = Path(next(p for p in listed if kinds["claims file"](p))).stem
    assert f'claims="{paper}"' in (ROOT / method).read_text()
    lesson = next(lesson for lesson in LESSONS if paper in lesson.papers)
    assert method.split("/")[2] == lesson.key
    assert f"notebooks/{paper}.ipynb" in listed and f"papers/figures/{paper}.json" in listed
